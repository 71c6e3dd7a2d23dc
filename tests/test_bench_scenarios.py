"""Every `python -m refserve.bench` scenario runs end to end with --quick, and its JSON has
every field with sane values: ratios positive, counts conserved, no NaN. Speed is never
asserted (the machines are noisy); counts and the accounting the scenarios rest on are."""

from __future__ import annotations

import json

import numpy as np
import pytest

from refserve.bench import main
from refserve.bench.common import non_finite, percentiles
from refserve.bench.corpus import passage
from refserve.bench.roofline import model_costs, step_cost
from refserve.bench.workloads import poisson_arrivals


def run_quick(tmp_path, scenario: str, *extra: str) -> dict:
    out, png = tmp_path / f"{scenario}.json", tmp_path / f"{scenario}.png"
    assert main([scenario, "--quick", "--json", str(out), "--plot", str(png), *extra]) == 0
    data = json.loads(out.read_text())
    assert data["scenario"] == scenario and data["quick"] is True
    assert data["command"].startswith(f"python -m refserve.bench {scenario} --quick")
    assert data["machine"]["cpu_count"] >= 1 and "blas" in data["machine"]
    assert non_finite(data) == []
    assert png.stat().st_size > 1000
    return data


# ---- fast: the pieces ---------------------------------------------------------------------

def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["prefix", "--scale", "0"])
    assert e.value.code == 2 and "--scale must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["nonsense"])
    assert e.value.code == 2


def test_poisson_arrivals_have_the_asked_rate_and_are_reproducible():
    a = poisson_arrivals(4000, rate=2.0, seed=3)
    assert a == poisson_arrivals(4000, rate=2.0, seed=3)
    gaps = np.diff([0.0, *a])
    assert np.all(gaps > 0)
    # mean gap 1/rate = 0.5 s; std of the mean is 0.5/sqrt(4000) ≈ 0.008
    assert abs(gaps.mean() - 0.5) < 0.03
    # exponential: std == mean (a uniform or fixed spacing would fail this)
    assert abs(gaps.std() - 0.5) < 0.05


def test_percentiles_and_non_finite():
    p = percentiles([1.0, 2.0, 3.0, None, 4.0])
    assert p["p50"] == 2.5 and p["p99"] <= 4.0
    assert percentiles([])["p50"] is None
    assert non_finite({"a": [1.0, float("nan")], "b": {"c": float("inf")}}) == [".a[1]", ".b.c"]


def test_roofline_cost_model_by_hand():
    class C:  # a toy Llama: 2 layers, hidden 4, 2 heads of 2, 1 KV head, MLP 8, vocab 10
        num_attention_heads, num_key_value_heads, head_dim = 2, 1, 2
        hidden_size, intermediate_size, num_hidden_layers, vocab_size = 4, 8, 2, 10

    costs = model_costs(C)
    # per layer: q 4x4 + k,v 4x2 each + o 4x4 + MLP 3x4x8 = 16 + 16 + 16 + 96 = 144
    assert costs["layer_params"] == 2 * 144 and costs["unembed_params"] == 40
    assert costs["kv_bytes_per_token"] == 2 * 2 * 2 * 4    # K and V, 2 layers, width 2, fp32
    flops, nbytes = step_cost(costs, q_lens=[3], ctx_lens=[3], sampled=1)
    assert flops == 2 * 3 * 288 + 2 * 1 * 40 + 4 * 2 * 4 * (3 * 3)
    assert nbytes == 4 * (288 + 40) + 32 * (3 + 3)
    # decode re-reads every weight for one token: far lower intensity than prefill
    pf = step_cost(costs, [64], [64], 1)
    dc = step_cost(costs, [1], [64], 1)
    assert pf[0] / pf[1] > 10 * dc[0] / dc[1]


def test_passage_has_exactly_the_asked_tokens(hf_tokenizer):
    text = passage(hf_tokenizer, 300, seed=1)
    assert text == passage(hf_tokenizer, 300, seed=1)
    assert text != passage(hf_tokenizer, 300, seed=2)
    assert abs(len(hf_tokenizer.encode(text, add_special_tokens=False)) - 300) <= 2


# ---- slow: every scenario, --quick, on the embedded model ---------------------------------

@pytest.mark.slow
def test_prefix_quick(tmp_path, smollm2_dir):
    trace = tmp_path / "prefix.trace.json"
    data = run_quick(tmp_path, "prefix", "--trace", str(trace))
    # --trace: every engine of the run (4 workloads x 5 configurations) in one file
    doc = json.loads(trace.read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert len(names) == 2 * 4 * 5
    assert {"engine: few-shot: off", "requests: agent loop: radix + lpm, shuffled arrivals"
            } <= names
    # --quick answers one token per request: every engine step there is a prefill
    assert any(e["ph"] == "X" and e["name"] == "prefill" for e in doc["traceEvents"])
    rows = {(r["workload"], r["config"]): r for r in data["rows"]}
    assert len(rows) == 4 * 5
    for workload in ("few-shot", "multi-turn", "branches", "agent loop"):
        off = rows[(workload, "off")]
        assert off["cached_tokens"] == 0 and off["hit_rate"] == 0
        for config in ("hash", "radix", "radix + fcfs", "radix + lpm"):
            r = rows[(workload, config)]
            assert r["prompt_tokens"] == off["prompt_tokens"] > 0  # same requests
            assert r["prefill_tokens_computed"] == r["prompt_tokens"] - r["cached_tokens"]
        assert rows[(workload, "radix")]["cached_tokens"] >= rows[(workload, "hash")][
            "cached_tokens"] > 0
    assert all(data["same_outputs"].values())


@pytest.mark.slow
def test_chunked_quick(tmp_path, smollm2_dir):
    data = run_quick(tmp_path, "chunked")
    on, off = data["rows"]
    assert (on["chunked_prefill"], off["chunked_prefill"]) == ("on", "off")
    assert off["steps"] == 1                      # the whole prompt in one step
    assert on["steps"] >= 256 // 64               # split over budget-sized chunks
    # each decode got one token per step while the prompt was chunked
    assert on["decode_tokens"] >= on["steps"] - 1 and off["decode_tokens"] >= 1
    assert 0 < on["itl_p50_ms"] <= on["itl_p99_ms"] <= on["itl_max_ms"]
    assert data["itl_p99_ratio_off_over_on"] > 0


@pytest.mark.slow
def test_memory_quick(tmp_path, smollm2_dir):
    data = run_quick(tmp_path, "memory")
    rows = {r["layout"]: r for r in data["rows"]}
    paged, naive = rows["paged, n=1"], rows["naive max_model_len, n=1"]
    cow, no_cow = rows["paged + copy-on-write, n=4"], rows["paged without CoW, n=4"]
    for r in data["rows"]:
        assert 0 < r["slots_used_peak"] <= r["slots_reserved_peak"]
        assert 0 <= r["waste_over_run"] < 1
    assert paged["waste_over_run"] < naive["waste_over_run"]
    # paged waste is at most the last block of each sequence
    bs = data["block_size"]
    assert paged["slots_reserved_peak"] - paged["slots_used_peak"] < 4 * bs
    assert cow["slots_reserved_peak"] < no_cow["slots_reserved_peak"]
    assert 0 < data["cow_peak_saving"] < 1


@pytest.mark.slow
def test_capacity_quick(tmp_path, smollm2_dir):
    data = run_quick(tmp_path, "capacity")
    assert len(data["rows"]) == 2
    for r in data["rows"]:
        assert r["predicted"] == r["pool_blocks"] // r["blocks_per_sequence"]
        assert r["requests_sent"] > r["predicted"] and r["preemptions"] > 0
        assert r["peak_running"] > r["measured"] >= 1
    # The block accounting is deterministic, so the formula's claim is checked exactly.
    assert data["max_abs_error"] <= 1


@pytest.mark.slow
def test_roofline_quick(tmp_path, smollm2_dir):
    data = run_quick(tmp_path, "roofline")
    assert data["ceilings"]["peak_flops"] > 1e8 and data["ceilings"]["bandwidth_bytes_per_s"] > 1e8
    rows = data["rows"]
    assert [r["step"] for r in rows] == ["prefill 128 tokens", "decode batch 1",
                                         "decode batch 8"]
    assert all(r["seconds"] > 0 and r["intensity"] > 0 for r in rows)
    assert rows[0]["intensity"] > rows[2]["intensity"] > rows[1]["intensity"]
    assert rows[1]["bound"] == "bandwidth"
    # A row per compiled kernel (the default CPU backend where numba loads) at 1 and 5 rows:
    # the linear reads the weights once whatever the rows, so its flops grow and bytes not.
    from refserve.backends import compiled

    kernels = data["kernels"]
    if compiled.available():
        assert [(k["kernel"], k["rows"]) for k in kernels] == [
            (name, m) for name in ("linear", "attention", "fused") for m in (1, 5)]
        linear = [k for k in kernels if k["kernel"] == "linear"]
        assert linear[1]["flops"] == 5 * linear[0]["flops"]
        assert linear[1]["bytes"] == linear[0]["bytes"]
        assert all(k["seconds"] > 0 and k["achieved_gb_per_s"] > 0 for k in kernels)


@pytest.mark.slow
def test_loadtest_quick(tmp_path, smollm2_dir):
    trace = tmp_path / "server.trace.json"
    data = run_quick(tmp_path, "loadtest", "--trace", str(trace))
    assert [r["rate"] for r in data["rows"]] == [1.0, 4.0]
    # the server's timeline: one track per request it was sent (the bench's ids are its own)
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events
              if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    assert len(tracks) == sum(r["finished"] for r in data["rows"])
    for r in data["rows"]:
        assert r["finished"] + r["rejected"] + r["failed"] == r["sent"] == 4
        assert r["failed"] == 0, r.get("errors")
        assert r["finished"] >= 1 and r["throughput_tok_s"] > 0
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"]
        assert 0 <= r["slo_attained"] <= 1 and r["usd_per_1m_output_tokens"] > 0


@pytest.mark.slow
def test_paged_quick(tmp_path, smollm2_dir):
    data = run_quick(tmp_path, "paged")
    paged, contiguous = data["rows"]
    assert paged["useful_tokens"] == contiguous["useful_tokens"]
    assert paged["kv_slots_peak"] < contiguous["kv_slots_peak"]
    assert data["wall_ratio"] > 0 and data["forward_ratio"] > 0


@pytest.mark.slow
def test_preemption_quick(tmp_path, smollm2_dir):
    data = run_quick(tmp_path, "preemption")
    rows = {(r["context"], r["mode"]): r for r in data["rows"]}
    for context in {r["context"] for r in data["rows"]}:
        rec, swap = rows[(context, "recompute")], rows[(context, "swap")]
        assert rec["preemptions"] > 0 and rec["recomputed_tokens"] > 0
        assert rec["swap_bytes"] == 0
        assert swap["preemptions"] > 0 and swap["recomputed_tokens"] == 0
        assert swap["swap_bytes"] > 0 and swap["fallbacks"] == 0
    assert all(data["same_outputs"].values())
