"""The trace: valid Chrome trace-event JSON whose per-request spans tile each request's
life, so they add up to its latency."""

import json
from collections import defaultdict

import pytest

from refserve.config import EngineConfig
from refserve.simulator import SimulatedEngine, TraceRecorder, load_gpu, load_model, make_workload
from refserve.simulator.trace import STATES

MODEL = load_model("llama-3-8b")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    # Small pool and budget: chunked prefills, stalls and preemptions all happen. An engine
    # that processes its outputs in the step (not vLLM's asynchronous way): a token reaches
    # its client when its step ends, where the spans end.
    engine = SimulatedEngine(MODEL, load_gpu("h100-80gb"), EngineConfig(
        num_gpu_blocks_override=40, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=512), engine="sglang")
    requests = make_workload("chat", 40, 200.0, vocab_size=MODEL.vocab_size,
                             max_model_len=512, seed=3)
    recorder = TraceRecorder()
    result = engine.run(requests, recorder=recorder)
    path = tmp_path_factory.mktemp("trace") / "run.trace.json"
    recorder.write(path)
    return result, recorder, json.loads(path.read_text())


def test_it_is_chrome_trace_event_json(traced):
    result, _, doc = traced
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in ("X", "C", "M") and isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], float | int) and e["dur"] >= 0 and "tid" in e
        if e["ph"] == "C":
            assert all(isinstance(v, int | float) for v in e["args"].values())
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(result.metrics) <= names
    steps = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    assert len(steps) == result.num_steps
    assert sum(e["args"]["tokens"] for e in steps) > 0


def test_request_spans_add_up_to_the_latency(traced):
    result, recorder, doc = traced
    tid_of = {e["args"]["name"]: e["tid"] for e in doc["traceEvents"]
              if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    spans = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == 1:
            spans[e["tid"]].append(e)
    states_seen = set()
    for rid, m in result.metrics.items():
        mine = sorted(spans[tid_of[rid]], key=lambda e: e["ts"])
        latency_us = (m.finish_time - m.arrival_time) * 1e6
        assert sum(e["dur"] for e in mine) == pytest.approx(latency_us, abs=1e-3)
        assert mine[0]["ts"] == pytest.approx(m.arrival_time * 1e6, abs=1e-3)
        for a, b in zip(mine, mine[1:]):  # contiguous, no overlap
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=1e-3)
        assert {e["name"] for e in mine} <= set(STATES)
        assert mine[-1]["name"] == "decode" or m.num_output_tokens == 1
        # the time to the end of the first sampling step is TTFT
        states_seen |= {e["name"] for e in mine}
        # the recorder's own view agrees with the file
        assert len(recorder.spans(rid)) == len(mine)
    assert {"waiting", "prefill", "decode", "preempted"} <= states_seen
    chunked = [rid for rid in result.metrics
               if sum(e["name"] == "prefill" for e in spans[tid_of[rid]]) > 1]
    assert chunked, "some prompt should have been prefilled in several chunks"


def test_ttft_ends_the_prefill_chunk_that_reached_the_prompts_end(traced):
    """That chunk's step sampled the first token; its span ends with the step (whatever
    the request does next: decode, stall, be preempted or finish)."""
    result, recorder, _ = traced
    for rid, m in result.metrics.items():
        ends = [b for state, _, b, args in recorder.spans(rid, with_args=True)
                if state == "prefill" and args["positions"].endswith(f", {m.num_prompt_tokens})")]
        assert ends[0] == pytest.approx(m.first_token_time, abs=1e-12)


def test_recorder_refuses_double_events():
    rec = TraceRecorder()
    rec.arrive("a", 0.0)
    with pytest.raises(ValueError, match="twice"):
        rec.arrive("a", 1.0)
    rec.finish("a", 2.0)
    with pytest.raises(ValueError, match="twice"):
        rec.finish("a", 3.0)
    assert rec.spans("a") == [("waiting", 0.0, 2.0)]
