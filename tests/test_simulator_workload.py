"""Workloads: deterministic from a seed, the rate moves only arrival times, real shared
prefixes, trace replay with clear errors."""

import functools
import json
import math

import numpy as np
import pytest

from refserve.simulator.workload import (
    SYSTEM_PROMPT_TOKENS,
    WORKLOADS,
    arrival_times,
    load_trace,
    make_workload,
)

VOCAB, MAX_LEN = 128256, 8192


def wl(name, n=200, rate=10.0, seed=0, **kw):
    return make_workload(name, n, rate, vocab_size=VOCAB, max_model_len=kw.pop(
        "max_model_len", MAX_LEN), seed=seed, **kw)


@pytest.mark.parametrize("name", WORKLOADS)
def test_deterministic_and_within_max_model_len(name, tmp_path):
    make = wl
    if name == "dataset":  # lengths from a vLLM benchmark result on disk
        path = tmp_path / "result.json"
        path.write_text(json.dumps({"input_lens": [8 * i + 1 for i in range(50)],
                                    "output_lens": [i % 17 + 1 for i in range(50)]}))
        make = functools.partial(wl, dataset_path=path)
    a, b = make(name), make(name)
    assert [(r.arrival_time, r.prompt_token_ids, r.output_token_ids) for r in a] == \
           [(r.arrival_time, r.prompt_token_ids, r.output_token_ids) for r in b]
    assert len(a) == 200
    assert all(r.num_prompt_tokens + r.num_output_tokens <= MAX_LEN for r in a)
    assert all(1000 <= t < VOCAB for r in a for t in r.prompt_token_ids + r.output_token_ids)
    assert [r.arrival_time for r in a] == sorted(r.arrival_time for r in a)
    assert make(name, seed=1)[0].prompt_token_ids != a[0].prompt_token_ids
    short = make(name, n=20, max_model_len=300)
    assert all(r.num_prompt_tokens + r.num_output_tokens <= 300 for r in short)


def test_the_rate_scales_only_the_arrival_times():
    slow, fast = wl("chat", rate=4.0), wl("chat", rate=8.0)
    assert [r.prompt_token_ids for r in slow] == [r.prompt_token_ids for r in fast]
    assert [r.output_token_ids for r in slow] == [r.output_token_ids for r in fast]
    assert np.allclose([2 * r.arrival_time for r in fast], [r.arrival_time for r in slow])
    assert all(r.arrival_time == 0 for r in wl("chat", rate=math.inf))


def test_chat_lengths_are_the_benchs_long_tail():
    requests = wl("chat", n=5000)
    out = np.array([r.num_output_tokens for r in requests])
    prompt = np.array([r.num_prompt_tokens for r in requests])
    assert 16 <= out.min() and out.max() <= 512
    assert abs(out.mean() - 120) < 8               # lognormal of mean 120 (a little clipped)
    assert np.median(out) < 0.85 * out.mean()      # long tail: median below the mean
    assert 16 <= prompt.min() and prompt.max() <= 128


def test_poisson_and_bursty_gaps():
    rng = np.random.default_rng(0)
    gaps = np.diff(arrival_times(20000, 5.0, rng))
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)   # exponential: cv 1
    bursty = np.diff(arrival_times(20000, 5.0, rng, "bursty", burstiness=3.0))
    assert bursty.mean() == pytest.approx(0.2, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(3.0, rel=0.15)
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, 0.0, rng)
    with pytest.raises(ValueError, match="arrival"):
        arrival_times(3, 1.0, rng, "weekly")


def test_system_prompt_is_one_real_shared_prefix():
    requests = wl("system-prompt", n=50)
    head = requests[0].prompt_token_ids[:SYSTEM_PROMPT_TOKENS]
    assert all(r.prompt_token_ids[:SYSTEM_PROMPT_TOKENS] == head for r in requests)
    assert len({tuple(r.prompt_token_ids[SYSTEM_PROMPT_TOKENS:]) for r in requests}) == 50


def test_multi_turn_follow_ups_contain_the_previous_answer():
    requests = wl("multi-turn", n=300)
    by_prompt = {tuple(r.prompt_token_ids + r.output_token_ids): r for r in requests}
    follow_ups = 0
    for r in requests:
        for cut in range(len(r.prompt_token_ids) - 1, 0, -1):
            earlier = by_prompt.get(tuple(r.prompt_token_ids[:cut]))
            if earlier is not None:
                assert earlier.arrival_time <= r.arrival_time
                follow_ups += 1
                break
    assert follow_ups > 100  # most requests continue an earlier turn


def test_branching_requests_share_a_tree_of_prefixes():
    requests = wl("branching", n=60)
    shared = [max(_common(a.prompt_token_ids, b.prompt_token_ids)
                  for b in requests if b is not a) for a in requests]
    # Every leaf shares at least its tree's root document (but perhaps the one leaf of a
    # last tree cut short by n).
    assert sum(s < 512 for s in shared) <= 1
    assert max(shared) > 600       # and siblings share a branch on top of it


def _common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_trace_replay(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [{"timestamp": 10.0, "prompt_tokens": 50, "output_tokens": 5},
             {"timestamp": 12.0, "prompt_token_ids": [1, 2, 3], "output_tokens": 2,
              "request_id": "x"},
             {"timestamp": 11.0, "prompt_tokens": 300, "output_tokens": 7, "prefix_id": "sys",
              "prefix_tokens": 200},
             {"timestamp": 14.0, "prompt_tokens": 250, "output_tokens": 1, "prefix_id": "sys",
              "prefix_tokens": 200}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    requests = load_trace(path, vocab_size=VOCAB, max_model_len=MAX_LEN)
    assert [r.arrival_time for r in requests] == [0.0, 1.0, 2.0, 4.0]
    assert [r.num_output_tokens for r in requests] == [5, 7, 2, 1]
    assert requests[2].request_id == "x" and requests[2].prompt_token_ids == [1, 2, 3]
    assert requests[1].prompt_token_ids[:200] == requests[3].prompt_token_ids[:200]
    assert requests[1].prompt_token_ids[200:250] != requests[3].prompt_token_ids[200:250]
    faster = load_trace(path, vocab_size=VOCAB, max_model_len=MAX_LEN, rate=3.0)
    assert faster[-1].arrival_time == pytest.approx(1.0)  # 3 gaps at 3 req/s


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1: not JSON"),
    ('{"prompt_tokens": 5, "output_tokens": 1}', "line 1: needs a numeric \"timestamp\""),
    ('{"timestamp": 0, "prompt_tokens": 5}', "output_tokens"),
    ('{"timestamp": 0, "output_tokens": 3}', "prompt_tokens"),
    ('{"timestamp": 0, "prompt_token_ids": [999999], "output_tokens": 3}', "ids in 0.."),
    ('{"timestamp": 0, "prompt_tokens": 5, "output_tokens": 1, "prefix_id": "a", '
     '"prefix_tokens": 9}', "prefix_tokens"),
    ("[1, 2]", "a JSON object"),
])
def test_bad_trace_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_trace(path, vocab_size=VOCAB, max_model_len=MAX_LEN)


def test_missing_or_empty_trace(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl", vocab_size=VOCAB, max_model_len=MAX_LEN)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl", vocab_size=VOCAB, max_model_len=MAX_LEN)


def test_unknown_workload_is_named():
    with pytest.raises(ValueError, match="unknown workload 'poetry'"):
        wl("poetry")
