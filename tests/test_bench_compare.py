"""`bench compare`: the workloads both engines get, the summary arithmetic, the /metrics
reading that works for refserve's and vLLM's names, and (slow) a whole run with a second
refserve as the peer: the control, with no vLLM needed."""

from __future__ import annotations

import argparse
import json

import pytest

from refserve.bench import main
from refserve.bench.compare import apply_quick, make_requests, summarise
from refserve.bench.servers import Target


def _args(**kw):
    a = argparse.Namespace(num_requests=8, mean_output=20, decode_requests=2, decode_tokens=9,
                           prefix_requests=5, prefix_tokens=40, prefix_output=3)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_workloads_are_reproducible_token_ids_and_differ_by_seed():
    args = _args()
    for w in ("throughput", "decode", "shared-prefix"):
        a, ca = make_requests(w, args, 3, 49152)
        b, cb = make_requests(w, args, 3, 49152)
        c, _ = make_requests(w, args, 4, 49152)
        assert a == b and ca == cb
        assert [r["prompt"] for r in a] != [r["prompt"] for r in c]
        assert all(1000 <= t < 49152 for r in a for t in r["prompt"])


def test_decode_is_one_at_a_time_and_shared_prefix_shares_exactly_its_prefix():
    args = _args()
    reqs, concurrency = make_requests("decode", args, 0, 49152)
    assert concurrency == 1 and len(reqs) == 2
    assert all(r["max_tokens"] == 9 and len(r["prompt"]) == 32 for r in reqs)
    reqs, concurrency = make_requests("shared-prefix", args, 0, 49152)
    assert concurrency == 0 and len(reqs) == 5           # 0: all at once
    prefix = reqs[0]["prompt"][:40]
    assert all(r["prompt"][:40] == prefix and len(r["prompt"]) == 56 for r in reqs)
    assert len({tuple(r["prompt"][40:]) for r in reqs}) == 5   # each its own question
    reqs, concurrency = make_requests("throughput", args, 0, 49152)
    assert concurrency == 0 and len(reqs) == 8 and all(r["max_tokens"] >= 2 for r in reqs)


def test_workloads_of_one_round_share_no_tokens():
    """The decode prompts are not the shared prefix's first tokens (one random stream for
    both made the prefix hit the decode prompts' cached blocks)."""
    args = _args()
    decode, _ = make_requests("decode", args, 0, 49152)
    shared, _ = make_requests("shared-prefix", args, 0, 49152)
    prefix = shared[0]["prompt"][:40]
    for r in decode:
        assert r["prompt"][:16] != prefix[:16]


def test_summary_is_the_median_per_engine_and_the_ratio_refserve_over_peer():
    rows = [{"workload": "decode", "engine": e, "throughput_tok_s": t, "tpot_p50_ms": p,
             "ttft_p50_ms": 10.0, "seconds": s, "prefix_hit_tokens": 0}
            for e, t, p, s in (("refserve", 10.0, 100.0, 4.0), ("vllm", 20.0, 50.0, 2.0),
                               ("refserve", 30.0, 40.0, 3.0), ("vllm", 20.0, 70.0, 5.0),
                               ("refserve", 20.0, 60.0, 1.0))]
    summary = summarise(rows, ("refserve", "vllm"))
    mine, peer, ratio = summary
    assert mine["rounds"] == 3 and peer["rounds"] == 2
    assert mine["throughput_tok_s"] == 20.0 and mine["tpot_p50_ms"] == 60.0
    assert peer["tpot_p50_ms"] == 60.0 and peer["seconds"] == 3.5
    assert ratio["engine"] == "refserve / vllm"
    assert ratio["throughput_tok_s"] == 1.0 and ratio["tpot_p50_ms"] == 1.0
    assert ratio["seconds"] == pytest.approx(3.0 / 3.5)


def test_metric_total_sums_one_counter_under_either_engines_prefix_and_labels():
    t = Target("x", "http://127.0.0.1:1", "bench")
    vllm = {'vllm:prefix_cache_hits_total{engine="0",model_name="bench"}': 896.0,
            'vllm:prefix_cache_hits_total{engine="1",model_name="bench"}': 128.0,
            'vllm:prefix_cache_queries_total{engine="0",model_name="bench"}': 5000.0,
            'vllm:external_prefix_cache_hits_total{engine="0"}': 7.0}
    assert t.metric_total("prefix_cache_hits_total", vllm) == 1024.0
    assert t.metric_total("prefix_cache_hits_total",
                          {"refserve:prefix_cache_hits_total": 992.0}) == 992.0
    assert t.metric_total("prefix_cache_hits_total", {"refserve:num_steps_total": 3.0}) is None


def test_vllm_peer_without_its_python_is_one_error_line_before_anything_starts(capsys):
    assert main(["compare", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --peer vllm needs --peer-python")
    assert main(["compare", "--quick", "--peer-python", "/no/such/python"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_quick_shrinks_every_workload():
    args = _args(repeats=2)
    apply_quick(args)
    assert args.repeats == 1 and args.prefix_tokens < 100 and args.num_requests <= 4


@pytest.mark.slow
def test_compare_two_refserves_end_to_end(tmp_path, smollm2_dir):
    """The control: refserve against a second refserve. Every request finishes on both, both
    compute the same tokens, and the servers' own prefix-cache counters (read from /metrics)
    count the shared prefix's lookups and at most its hits."""
    out = tmp_path / "compare.json"
    assert main(["compare", "--quick", "--peer", "refserve", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["engines"] == ["refserve", "refserve-peer"]
    rows = data["rows"]
    assert len(rows) == 6 and all(r["finished"] == r["sent"] for r in rows)
    for w in ("throughput", "decode", "shared-prefix"):
        a, b = (r for r in rows if r["workload"] == w)
        assert a["output_tokens"] == b["output_tokens"] > 0
        assert a["throughput_tok_s"] > 0 and a["ttft_p50_ms"] > 0
    for r in rows:
        if r["workload"] == "shared-prefix":
            # 4 requests sharing a 64-token prefix (4 blocks of 16). Those admitted in the
            # first step with the first compute it themselves (how many depends on when
            # each arrives over HTTP); each later one hits the 4 blocks. Nothing else in
            # the run shares a token with the prefix.
            assert r["prefix_queried_tokens"] >= 4 * 64
            assert r["prefix_hit_tokens"] in (0, 64, 128, 192)
        else:
            assert r["prefix_hit_tokens"] == 0      # random prompts share nothing
    ratios = [r for r in data["summary"] if "rounds" not in r]
    assert len(ratios) == 3 and all(r["throughput_tok_s"] > 0 for r in ratios)
    assert any(n.startswith("refserve: refserve: ") for n in data["engine_notes"])
    assert all(len(data["load_average"][k]) == 3 for k in ("before", "after"))


def test_in_process_takes_a_python_not_a_url(capsys):
    assert main(["compare", "--quick", "--in-process", "--peer-url", "http://x:1"]) == 2
    assert "--in-process" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_two_refserves_in_process(tmp_path, smollm2_dir):
    """The offline control: each refserve's LLM.generate in a worker process of its own.
    Both compute the same tokens on every workload; the decode workload's ms per token is
    its seconds over its tokens."""
    out = tmp_path / "compare.json"
    assert main(["compare", "--quick", "--in-process", "--peer", "refserve",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["mode"] == "in-process" and data["engines"] == ["refserve", "refserve-peer"]
    rows = data["rows"]
    assert len(rows) == 6
    for w in ("throughput", "decode", "shared-prefix"):
        a, b = (r for r in rows if r["workload"] == w)
        assert a["output_tokens"] == b["output_tokens"] > 0
        assert a["ms_per_token"] == pytest.approx(1000 * a["seconds"] / a["output_tokens"])
