"""`python -m refserve.simulate` and `python -m refserve.plan` as a user runs them: one
`error:` line and exit 2 for each mistake, found before any simulation; files written."""

import json
import subprocess
import sys

import pytest


def run(module, *args, cwd=None):
    return subprocess.run([sys.executable, "-m", f"refserve.{module}", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def assert_one_error_line(result, *needles):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "summary:" not in result.stdout  # nothing was simulated


@pytest.mark.parametrize("args, needles", [
    (["--gpu", "tpu-v9"], ["unknown GPU 'tpu-v9'", "h100-80gb", "--hardware"]),
    (["--model", "gpt-17"], ["neither a preset", "llama-3-8b"]),
    (["--rate", "0"], ["--rate", "must be > 0"]),
    (["--rate", "fast"], ["--rate", "not a number"]),
    (["--num-requests", "0"], ["--num-requests"]),
    (["--workload", "poetry"], ["--workload", "invalid choice"]),
    (["--replay", "/nonexistent/trace.jsonl"], ["cannot read trace"]),
    (["--json", "/nonexistent/dir/out.json"], ["--json", "does not exist"]),
    (["--trace", "/nonexistent/dir/t.json"], ["--trace", "does not exist"]),
    (["--gpu-set", "bandwidth"], ["FIELD=NUMBER"]),
    (["--gpu-set", "warp_speed=9"], ["cannot override 'warp_speed'"]),
    (["--gpu-set", "flops_efficiency=1.5"], ["flops_efficiency", "(0, 1]"]),
    (["--model", "llama-3-70b", "--gpu", "l4"], ["do not fit", "--tensor-parallel-size"]),
    (["--max-num-seqs", "0"], ["max_num_seqs"]),
    (["--dtype", "float16", "--gpu", "a100-80gb", "--num-gpu-blocks-override", "3"],
     ["max_model_len"]),
    (["--tensor-parallel-size", "0"], ["tensor_parallel_size"]),
    (["--hardware", "/nonexistent/gpus.toml"], ["does not exist"]),
])
def test_simulate_mistakes_are_one_error_line(args, needles):
    assert_one_error_line(run("simulate", *args, "--no-progress"), *needles)


def test_a_bad_trace_line_is_named(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "prompt_tokens": 10, "output_tokens": 3}\n{oops\n')
    assert_one_error_line(run("simulate", "--replay", str(trace)), "line 2", "not JSON")


def test_a_bad_hardware_file_is_named(tmp_path):
    hw = tmp_path / "gpus.toml"
    hw.write_text('[my-gpu]\nname = "mine"\nmemory_bytes = 1e9\n')
    assert_one_error_line(run("simulate", "--hardware", str(hw), "--gpu", "my-gpu"),
                          "my-gpu", "lacks")


def test_simulate_writes_json_plot_and_trace(tmp_path):
    result = run("simulate", "--num-requests", "40", "--rate", "20", "--json", "--plot",
                 "--trace", "--slo-ttft", "1", "--slo-tpot", "0.05", "--no-progress",
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for needle in ("NVIDIA H100", "datasheet", "summary: 40 requests", "TTFT p50",
                   "goodput:", "per 1M output tokens", "steps/s"):
        assert needle in out
    report = json.loads((tmp_path / "simulate.json").read_text())
    assert report["summary"]["num_requests"] == 40 and len(report["requests"]) == 40
    assert report["gpu"]["source"]["memory_bandwidth"]
    assert (tmp_path / "simulate.png").stat().st_size > 10_000
    trace = json.loads((tmp_path / "simulate.trace.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])


def test_simulate_replays_a_trace_and_takes_overrides(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 0.1, "prompt_tokens": 100,
                                         "output_tokens": 10, "prefix_id": "sys",
                                         "prefix_tokens": 64}) + "\n" for i in range(20)))
    result = run("simulate", "--replay", str(trace), "--gpu", "l4", "--gpu-set",
                 "memory_bandwidth=1e12", "--usd-per-hour", "1.25", "--no-progress",
                 "--json", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr
    assert "1000 GB/s (given by the user)" in result.stdout
    assert "$1.25/hour" in result.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["summary"]["num_requests"] == 20
    assert report["summary"]["prefix_hit_rate"] > 0.4  # the shared 64-token prefix


@pytest.mark.parametrize("args, needles", [
    ([], ["--slo-ttft-p99"]),
    (["--slo-ttft-p99", "soon", "--slo-tpot-p99", "100ms"], ["soon", "duration"]),
    (["--slo-ttft-p99", "2s", "--slo-tpot-p99", "100ms", "--tensor-parallel-size", "1,x"],
     ["comma-separated"]),
    (["--slo-ttft-p99", "2s", "--slo-tpot-p99", "100ms", "--enable-prefix-caching", "maybe"],
     ["on/off"]),
    (["--slo-ttft-p99", "2s", "--slo-tpot-p99", "100ms", "--gpu-memory-utilization", "1.5"],
     ["(0, 1]"]),
    (["--slo-ttft-p99", "2s", "--slo-tpot-p99", "100ms", "--num-requests", "3"], ["p99"]),
    (["--slo-ttft-p99", "2s", "--slo-tpot-p99", "100ms", "--gpu", "nope"], ["unknown GPU"]),
])
def test_plan_mistakes_are_one_error_line(args, needles):
    assert_one_error_line(run("plan", *args, "--no-progress"), *needles)


def test_plan_prints_the_table_and_the_vllm_command():
    result = run("plan", "--slo-ttft-p99", "2s", "--slo-tpot-p99", "100ms", "--num-requests",
                 "60", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048",
                 "--block-size", "16", "--gpu-memory-utilization", "0.9",
                 "--enable-prefix-caching", "on", "--gpu", "a100-80gb", "--max-model-len",
                 "2048", "--target-rate", "100", "--no-progress")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "plan req/s" in out and "$/1M tok" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("vllm serve"))
    for flag in ("--max-num-seqs 32", "--max-num-batched-tokens 2048", "--block-size 16",
                 "--gpu-memory-utilization 0.9", "--enable-prefix-caching",
                 "--tensor-parallel-size 1", "--max-model-len 2048"):
        assert flag in line
    assert "replica(s)" in out and "simulations in" in out
