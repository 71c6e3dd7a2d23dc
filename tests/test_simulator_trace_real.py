"""`--trace` on the real engine: LLMEngine.observer feeds the simulator's TraceRecorder with
time.perf_counter() times. The file is Chrome trace-event JSON and each request's spans tile
[arrival, finish], so they add up to its latency, in a run that preempts."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest

from refserve.engine import LLMEngine
from refserve.generate import main as generate_main
from refserve.sampling_params import SamplingParams
from refserve.simulator.trace import STATES, EngineTrace


def spans_by_request(doc, requests_pid=1) -> dict[str, list[dict]]:
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == requests_pid}
    spans = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == requests_pid:
            spans[names[e["tid"]]].append(e)
    return {rid: sorted(s, key=lambda e: e["ts"]) for rid, s in spans.items()}


def assert_tiles(spans: list[dict], arrival_us: float, finish_us: float) -> None:
    assert spans[0]["ts"] == pytest.approx(arrival_us, abs=1e-3)
    for a, b in zip(spans, spans[1:]):  # contiguous, no overlap
        assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=1e-3)
    assert sum(e["dur"] for e in spans) == pytest.approx(finish_us - arrival_us, abs=1e-3)
    assert {e["name"] for e in spans} <= set(STATES)


def test_real_run_with_preemption_tiles_each_request(tiny_llama, tmp_path):
    # 12 blocks of 4 tokens for 4 sequences that grow to 40 tokens each: preemptions.
    engine = LLMEngine(model=str(tiny_llama), block_size=4, num_gpu_blocks_override=12,
                       max_model_len=48, max_num_seqs=4, max_num_batched_tokens=32,
                       progress=False)
    trace = EngineTrace()
    trace.attach(engine, "tiny")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(f"r{i}", [(7 * i + j) % 90 + 1 for j in range(16)], params)
           for i in range(6)]
    metrics = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                metrics[o.request_id] = o.metrics
    assert engine.scheduler.num_preemptions > 0, "the pool should have been too small"
    path = tmp_path / "real.trace.json"
    trace.write(path)
    doc = json.loads(path.read_text())
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "engine: tiny", 1: "requests: tiny"}
    steps = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    assert len(steps) == engine.scheduler.num_steps
    spans = spans_by_request(doc)
    assert set(spans) == set(ids) == set(metrics)
    origin = min(m.arrival_time for m in metrics.values())
    seen = set()
    for rid, m in metrics.items():
        assert_tiles(spans[rid], (m.arrival_time - origin) * 1e6,
                     (m.finish_time - origin) * 1e6)
        seen |= {e["name"] for e in spans[rid]}
        if m.num_preemptions:
            assert "preempted" in {e["name"] for e in spans[rid]}
    assert {"waiting", "prefill", "decode", "preempted"} <= seen


def test_two_engines_share_one_file_and_one_time_axis(tiny_llama, tmp_path):
    trace = EngineTrace()
    engines = [trace.attach(LLMEngine(model=str(tiny_llama), block_size=4, progress=False,
                                      num_gpu_blocks_override=64), label)
               for label in ("a", "b")]
    for engine in engines:
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    # a reused id after its request finished keeps both tracks
    engines[1].add_request("x", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    while engines[1].has_unfinished_requests():
        engines[1].step()
    trace.write(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    a, b = spans_by_request(doc, 1), spans_by_request(doc, 3)
    assert set(a) == {"x"} and set(b) == {"x", "x #1"}
    # engine b ran after engine a on the shared clock, which starts at a's first arrival
    a_end = a["x"][-1]["ts"] + a["x"][-1]["dur"]
    assert a["x"][0]["ts"] == 0.0
    first, second = b["x #1"], b["x"]  # the earlier track of a reused id gets the "#1"
    assert a_end <= first[0]["ts"] < a_end + 60e6
    assert second[0]["ts"] >= first[-1]["ts"] + first[-1]["dur"]


def test_a_request_added_before_the_trace_starts_when_first_seen(tiny_llama, tmp_path):
    engine = LLMEngine(model=str(tiny_llama), block_size=4, progress=False,
                       num_gpu_blocks_override=64)
    engine.add_request("early", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    trace = EngineTrace()
    trace.attach(engine)
    while engine.has_unfinished_requests():
        engine.step()
    trace.write(tmp_path / "t.json")
    spans = spans_by_request(json.loads((tmp_path / "t.json").read_text()))["early"]
    assert spans[0]["name"] == "prefill" and spans[-1]["name"] == "decode"


def test_an_aborted_request_ends_where_it_was_aborted(tiny_llama, tmp_path):
    engine = LLMEngine(model=str(tiny_llama), block_size=4, progress=False,
                       num_gpu_blocks_override=64)
    trace = EngineTrace()
    trace.attach(engine)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("left", [1, 2, 3], params)
    engine.add_request("stayed", [4, 5, 6], params)
    for _ in range(3):
        engine.step()
    assert engine.abort_request("left")
    assert not engine.abort_request("left")          # a second abort changes nothing
    while engine.has_unfinished_requests():
        engine.step()
    trace.write(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    spans = spans_by_request(doc)
    left_end = spans["left"][-1]["ts"] + spans["left"][-1]["dur"]
    stayed_end = spans["stayed"][-1]["ts"] + spans["stayed"][-1]["dur"]
    assert spans["left"][-1]["name"] == "decode" and left_end < stayed_end
    marks = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert [(m["name"], m["ts"]) for m in marks] == [("aborted", pytest.approx(left_end))]


def test_a_simulation_is_drawn_beside_its_real_run(tiny_llama, tmp_path):
    """add_simulation: the simulated requests' t = 0 is the real run's start on the file's
    axis, so a real run and its simulation line up (bench sim-fidelity --trace)."""
    import time

    from refserve.simulator import SimRequest, SimulatedEngine, load_gpu, load_model

    trace = EngineTrace()
    engine = trace.attach(LLMEngine(model=str(tiny_llama), block_size=4, progress=False,
                                    num_gpu_blocks_override=64), "real")
    start = time.perf_counter() - 0.5  # the run started 0.5 s ago; its request comes now
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True),
                       arrival_time=start + 0.5)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    sim = SimulatedEngine(load_model(str(tiny_llama)), load_gpu("h100-80gb"),
                          dtype="float32", block_size=4, num_gpu_blocks_override=64)
    sim.run([SimRequest("x", 0.5, [1, 2, 3], list(out.outputs[0].token_ids))],
            recorder=trace.add_simulation("simulated", start))
    trace.write(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    real, simulated = spans_by_request(doc, 1)["x"], spans_by_request(doc, 3)["x"]
    assert real[0]["ts"] == pytest.approx(0.0) and simulated[0]["ts"] == pytest.approx(0.0)


def test_generate_trace_flag_writes_the_timeline(tiny_llama, tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt_token_ids": [i + 1, i + 2, i + 3]}) + "\n"
                                for i in range(5)))
    out, path = tmp_path / "out.json", tmp_path / "gen.trace.json"
    assert generate_main(["--model", str(tiny_llama), "--file", str(requests), "--quiet",
                          "--max-tokens", "6", "--ignore-eos", "--max-num-seqs", "2",
                          "--json", str(out), "--trace", str(path)]) == 0
    records = json.loads(out.read_text())["outputs"]
    spans = spans_by_request(json.loads(path.read_text()))
    assert len(spans) == 5
    for rec in records:
        m = rec["metrics"]
        s = spans[rec["request_id"]]
        total = sum(e["dur"] for e in s)
        assert total == pytest.approx((m["finish_time"] - m["arrival_time"]) * 1e6, abs=1e-3)
    # max_num_seqs 2 of 5: some request waited first
    assert any(s[0]["name"] == "waiting" for s in spans.values())


def test_trace_path_is_checked_before_the_model_loads(tiny_llama, tmp_path, capsys):
    bad = tmp_path / "missing" / "t.json"
    assert generate_main(["--model", str(tiny_llama), "--trace", str(bad), "hi"]) == 2
    err = capsys.readouterr().err
    assert "--trace" in err and "does not exist" in err and "refserve:" not in err


def test_bench_trace_flag_is_checked_first(capsys):
    from refserve.bench import main as bench_main

    with pytest.raises(SystemExit) as e:
        bench_main(["prefix", "--trace", "/nonexistent-folder/t.json"])
    assert e.value.code == 2 and "--trace" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_trace_is_written_on_shutdown(tiny_chat_llama, tmp_path):
    from serve_utils import ServerProcess

    path = tmp_path / "serve.trace.json"
    proc = ServerProcess([str(tiny_chat_llama), "--served-model-name", "tiny", "--block-size", "4",
                          "--trace", str(path)], tmp_path)
    try:
        proc.wait_healthy()
        for i in range(3):
            r = httpx.post(proc.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": f"hello {i}", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
    finally:
        assert proc.stop() == 0, proc.output()
    spans = spans_by_request(json.loads(path.read_text()))
    assert len(spans) == 3 and all(s[-1]["name"] == "decode" for s in spans.values())
