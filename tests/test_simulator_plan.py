"""The planner: its chosen configuration keeps its SLOs on a workload it never saw."""

import numpy as np
import pytest

from refserve.config import EngineConfig
from refserve.plan import parse_duration, vllm_command
from refserve.simulator import load_gpu, load_model, make_workload
from refserve.simulator.search import SLO, Candidate, Planner

MODEL = load_model("llama-3-8b")
GPU = load_gpu("h100-80gb")


def requests(rate, seed, num_requests):
    """Chat traffic with answers cut to 24 tokens: a short W keeps the test quick."""
    reqs = make_workload("chat", num_requests, rate, vocab_size=MODEL.vocab_size,
                         max_model_len=2048, seed=seed)
    for r in reqs:
        del r.output_token_ids[24:]
    return reqs


def test_the_p99_early_stop_is_certain_and_not_early():
    """After violations_allowed(n) + 1 values above the SLO the p99 is above it, whatever
    the other values; with violations_allowed(n) it can still be within (so stopping then
    would be early)."""
    rng = np.random.default_rng(0)
    for n in (10, 99, 100, 101, 600, 1000):
        k = SLO(1.0, 1.0).violations_allowed(n)
        for _ in range(20):
            low = rng.uniform(0, 0.5, n - k - 1)
            assert np.percentile(np.concatenate([low, rng.uniform(1.01, 2, k + 1)]), 99) > 1
        # k values just above the SLO: the interpolated p99 stays at or below it
        assert np.percentile(np.concatenate([np.zeros(n - k), np.full(k, 1 + 1e-9)]), 99) <= 1


def test_chosen_configuration_meets_its_slos_on_another_seed():
    # a tight TPOT (vLLM V0 pays a ~9 ms scheduler call per step): the batch size matters
    slo = SLO(ttft_p99=1.0, tpot_p99=0.022)
    planner = Planner(MODEL, GPU, requests, slo, num_requests=120, seed=0, tolerance=0.05)
    start = Candidate(EngineConfig(max_model_len=2048, max_num_seqs=256), 1)
    best, best_ev, tried = planner.search(start, {"max_num_seqs": [32, 128, 256],
                                                  "max_num_batched_tokens": [2048, 8192]})
    assert best_ev is not None and best_ev.ok and len(tried) >= 3
    if best_ev.bound == "SLO":  # the edge: a little faster and the SLO is lost
        assert not planner.evaluate(best, best_ev.rate * (1 + 3 * planner.tolerance)).ok
    planned = planner.planned_rate(best, best_ev.rate, headroom=0.1, seeds=(1, 2))
    assert planned is not None and planned.rate <= 0.9 * best_ev.rate + 1e-9
    # A workload the search never saw, at the planned rate: still within the SLOs.
    again = planner.evaluate(best, planned.rate, seed=7)
    assert again.ok, again
    assert again.ttft_p99 <= slo.ttft_p99 and again.tpot_p99 <= slo.tpot_p99


def test_saturation_throughput_grows_with_seats_until_the_roofline():
    planner = Planner(MODEL, GPU, requests, SLO(2, 0.1), num_requests=100)
    mu = {s: planner.saturation(Candidate(EngineConfig(max_model_len=2048, max_num_seqs=s),
                                          1)).mu for s in (8, 32, 128)}
    assert mu[8] < mu[32] < mu[128]
    assert mu[32] < 4 * mu[8]  # bigger batches read the same weights: sublinear, not more


def test_parse_duration():
    assert parse_duration("2s") == 2.0
    assert parse_duration("100ms") == pytest.approx(0.1)
    assert parse_duration("0.5") == 0.5
    assert parse_duration("250us") == pytest.approx(250e-6)
    for bad in ("fast", "-1s", "0ms", "2 min"):
        with pytest.raises(Exception, match="duration|> 0"):
            parse_duration(bad)


def test_vllm_command_uses_vllms_flag_names():
    cand = Candidate(EngineConfig(max_num_seqs=128, max_num_batched_tokens=4096, block_size=32,
                                  gpu_memory_utilization=0.95, enable_prefix_caching=False), 2)
    line = vllm_command(MODEL, cand, 8192, "bfloat16")
    assert line.startswith("vllm serve meta-llama/Meta-Llama-3-8B-Instruct ")
    for flag in ("--tensor-parallel-size 2", "--max-num-seqs 128",
                 "--max-num-batched-tokens 4096", "--block-size 32",
                 "--gpu-memory-utilization 0.95", "--no-enable-prefix-caching",
                 "--max-model-len 8192", "--dtype bfloat16"):
        assert flag in line


# vLLM's `vllm serve --help` (the engine arguments of vLLM >= 0.9: docs.vllm.ai, "Engine
# Arguments"): every flag the planned line may use, with the values it accepts.
VLLM_SERVE_FLAGS = {
    "--dtype": {"auto", "half", "float16", "bfloat16", "float", "float32"},
    "--tensor-parallel-size": int, "--max-model-len": int, "--max-num-seqs": int,
    "--max-num-batched-tokens": int, "--block-size": {"1", "8", "16", "32", "64", "128"},
    "--gpu-memory-utilization": float,
    "--enable-prefix-caching": None, "--no-enable-prefix-caching": None,
    "--enable-chunked-prefill": None, "--no-enable-chunked-prefill": None,
    "--quantization": {"fp8"}, "--kv-cache-dtype": {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"},
    "--enforce-eager": None,
}


def check_against_vllm_flags(line: str) -> None:
    words = line.split()
    assert words[:2] == ["vllm", "serve"] and not words[2].startswith("--")
    i = 3
    while i < len(words):
        flag = words[i]
        assert flag in VLLM_SERVE_FLAGS, f"{flag} is not a documented vllm serve flag"
        kind = VLLM_SERVE_FLAGS[flag]
        if kind is None:
            i += 1
            continue
        value = words[i + 1]
        if isinstance(kind, set):
            assert value in kind, f"{flag} {value}"
        else:
            kind(value)
        i += 2


def test_vllm_command_precision_and_schedule_flags():
    cand = Candidate(EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=8192,
                                  enforce_eager=True), 4,
                     quantization="fp8", kv_cache_dtype="fp8")
    line = vllm_command(MODEL, cand, 8192, "bfloat16")
    for flag in ("--no-enable-chunked-prefill", "--quantization fp8", "--kv-cache-dtype fp8",
                 "--enforce-eager"):
        assert f" {flag}" in line
    check_against_vllm_flags(line)
    plain = vllm_command(MODEL, Candidate(EngineConfig(max_num_batched_tokens=8192), 1), 8192,
                         "bfloat16")
    assert "--quantization" not in plain and "--kv-cache-dtype" not in plain
    assert " --enable-chunked-prefill" in plain
    check_against_vllm_flags(plain)


def test_vllm_command_parses_with_vllms_own_parser():
    # vLLM is no dependency of refserve: with it installed, its own parser reads the line.
    reason = ("vllm is not installed: the line is checked against VLLM_SERVE_FLAGS (vLLM's "
              "documented CLI) instead")
    arg_utils = pytest.importorskip("vllm.engine.arg_utils", reason=reason)
    utils = pytest.importorskip("vllm.utils", reason=reason)
    AsyncEngineArgs, FlexibleArgumentParser = arg_utils.AsyncEngineArgs, \
        utils.FlexibleArgumentParser
    cand = Candidate(EngineConfig(max_num_batched_tokens=8192), 2, quantization="fp8",
                     kv_cache_dtype="fp8")
    words = vllm_command(MODEL, cand, 8192, "bfloat16").split()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", words[2], *words[3:]])
    assert args.tensor_parallel_size == 2 and args.quantization == "fp8"
    assert args.kv_cache_dtype == "fp8" and args.enable_chunked_prefill is True


def test_plan_prints_an_fp8_vllm_serve_line(capsys):
    from refserve.plan import main

    assert main(["--model", "llama-3-8b", "--gpu", "h100-80gb", "--workload", "random",
                 "--input-len", "256", "--output-len", "16", "--slo-ttft-p99", "2s",
                 "--slo-tpot-p99", "50ms", "--max-model-len", "2048", "--num-requests", "60",
                 "--max-num-seqs", "64", "--max-num-batched-tokens", "4096",
                 "--block-size", "16", "--gpu-memory-utilization", "0.9",
                 "--enable-prefix-caching", "off", "--quantization", "fp8",
                 "--kv-cache-dtype", "fp8", "--tolerance", "0.2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    line = next(x.strip() for x in out.splitlines() if x.strip().startswith("vllm serve"))
    assert "--quantization fp8 --kv-cache-dtype fp8" in line
    check_against_vllm_flags(line)
