"""Speculative decoding in the simulator: the real Speculator and scheduler bookkeeping, an
accepted run drawn per verify row with the request's alpha. The mean tokens a verify row
emits match (1 - a^(k+1)) / (1 - a) within the sampling error, and the same statistic
rejects the formulas of plausible mistakes (no truncation at k, another alpha)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from refserve.config import EngineConfig
from refserve.metrics import expected_tokens_per_pass
from refserve.simulate import main as simulate_main
from refserve.simulator import SimRequest, SimulatedEngine, load_gpu, load_model, make_workload
from refserve.simulator.outputs import SimulatedSpeculation, accepted_drafts
from refserve.spec_decode.speculator import Speculator

MODEL = load_model("llama-3-8b")
GPU = load_gpu("h100-80gb")


def spec_config(k=4, method="ngram", adaptive=False, **extra):
    return {"method": method, "num_speculative_tokens": k, "adaptive": adaptive, **extra}


def engine_with(spec, alpha=0.6, **config):
    fields = dict(max_num_seqs=64, max_model_len=2048, speculative_config=spec)
    fields.update(config)
    return SimulatedEngine(MODEL, GPU, EngineConfig(**fields), spec_alpha=alpha, spec_seed=1)


def record_rows(engine) -> list[tuple[int, int]]:
    """Wrap the engine's sample(): (drafts in the row, tokens emitted) per verify row."""
    sample, rows = engine.outputs.sample, []

    def recording(row, request):
        tokens = sample(row, request)
        if row.draft_token_ids:
            rows.append((len(row.draft_token_ids), len(tokens)))
        return tokens

    engine.outputs.sample = recording
    return rows


def emitted_distribution(alpha: float, k: int) -> np.ndarray:
    """P(emitted = j + 1) for j accepted drafts, truncated at k."""
    p = np.array([alpha**j * (1 - alpha) for j in range(k)] + [alpha**k])
    return p


def long_requests(n, out_len=400, alpha=None, seed=0):
    rng = np.random.default_rng(seed)
    return [SimRequest(f"r{i}", 0.01 * i, rng.integers(1, 1000, 32).tolist(),
                       rng.integers(1, 1000, out_len).tolist(), alpha) for i in range(n)]


def test_it_runs_the_real_speculator_and_scheduler():
    from refserve.kv_cache import KVCacheManager
    from refserve.scheduler import Scheduler

    engine = engine_with(spec_config())
    assert isinstance(engine.outputs, SimulatedSpeculation)
    assert type(engine.outputs.speculator) is Speculator
    assert type(engine.scheduler) is Scheduler
    assert type(engine.kv_cache_manager) is KVCacheManager


def test_accepted_drafts_follow_the_truncated_geometric():
    rng = np.random.default_rng(0)
    alpha, k, n = 0.7, 3, 40_000
    draws = np.array([accepted_drafts(rng, alpha, k) for _ in range(n)])
    freq = np.bincount(draws, minlength=k + 1) / n
    expected = emitted_distribution(alpha, k)
    assert np.abs(freq - expected).max() < 4 * math.sqrt(0.25 / n)
    assert accepted_drafts(rng, 1.0, 5) == 5 and accepted_drafts(rng, 0.0, 5) == 0
    with pytest.raises(ValueError, match="spec_alpha"):
        accepted_drafts(rng, 1.2, 3)


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.85])
def test_mean_accepted_length_is_the_closed_form(alpha):
    k = 4
    engine = engine_with(spec_config(k), alpha)
    rows = record_rows(engine)
    result = engine.run(long_requests(40), check_invariants=True)
    full = np.array([emitted for n, emitted in rows if n == k])
    assert len(full) > 2000
    p = emitted_distribution(alpha, k)
    values = np.arange(1, k + 2)
    mean, var = (p * values).sum(), (p * values**2).sum() - (p * values).sum() ** 2
    closed = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert mean == pytest.approx(closed) == pytest.approx(expected_tokens_per_pass(alpha, k))
    tolerance = 4 * math.sqrt(var / len(full))
    assert abs(full.mean() - closed) < tolerance
    # Negative controls: the same statistic rejects the closed form at a neighbouring
    # alpha and, where truncation matters (a^k not tiny), an untruncated geometric.
    if alpha >= 0.6:
        assert abs(full.mean() - 1 / (1 - alpha)) > tolerance
    assert abs(full.mean() - expected_tokens_per_pass(alpha - 0.1, k)) > tolerance
    # The run summary counts the same thing (rows trimmed below k included).
    s = result.summary
    assert s.speculative_method == "ngram"
    assert s.num_spec_verify_steps == len(rows)
    assert s.mean_accepted_length == pytest.approx(np.mean([e for _, e in rows]))


def test_every_request_gets_its_tokens_and_passes_plus_accepted_add_up():
    # A small pool, budget and many sequences: chunked prefills, preemptions, trimmed
    # drafts, the rollback of rejected drafts; KV invariants checked after every step.
    engine = engine_with(spec_config(5), 0.7, num_gpu_blocks_override=60, block_size=16,
                         max_num_seqs=12, max_num_batched_tokens=48, max_model_len=512)
    requests = make_workload("chat", 60, 50.0, vocab_size=MODEL.vocab_size,
                             max_model_len=512, seed=4)
    result = engine.run(requests, check_invariants=True)
    assert result.summary.num_preemptions > 0
    assert engine.kv_cache_manager.num_held_blocks == 0
    for r in requests:
        m = result.metrics[r.request_id]
        assert m.num_output_tokens == r.num_output_tokens
        assert m.num_output_tokens == m.num_target_passes + m.num_spec_accepted
        assert m.num_spec_accepted <= m.num_spec_proposed
    assert result.summary.num_spec_accepted > 0


def test_a_requests_own_alpha_wins_over_the_default():
    requests = long_requests(4, 60, alpha=0.0) + [
        SimRequest(f"sure{i}", 0.0, [5, 6, 7], list(range(1, 61)), 1.0) for i in range(4)]
    engine = engine_with(spec_config(3), alpha=0.5)
    result = engine.run(requests, check_invariants=True)
    for rid, m in result.metrics.items():
        if rid.startswith("sure"):
            assert m.num_spec_accepted == m.num_spec_proposed > 0
        else:
            assert m.num_spec_accepted == 0 and m.num_spec_proposed > 0


def test_speculation_speeds_decoding_by_its_acceptance():
    requests = long_requests(8, 300)
    tpot = {}
    for alpha in (0.3, 0.8):
        tpot[alpha] = engine_with(spec_config(4), alpha).run(requests).summary.tpot_p50
    plain = SimulatedEngine(MODEL, GPU, EngineConfig(max_num_seqs=64, max_model_len=2048))
    tpot["off"] = plain.run(requests).summary.tpot_p50
    # a verify row costs about a decode at this batch (weight-bound): tokens per pass win
    assert tpot[0.8] < tpot[0.3] < tpot["off"]


def test_a_draft_model_costs_time_and_kv_blocks():
    requests = long_requests(8, 200)
    big = dict(max_num_seqs=256, max_model_len=8192)  # a pool not capped by max_num_seqs
    ngram = engine_with(spec_config(4), 0.8, **big)
    draft = engine_with(spec_config(4, "draft_model", model="self", num_draft_layers=8), 0.8,
                        **big)
    assert draft.num_blocks < ngram.num_blocks  # the draft's KV takes its share
    assert draft.run(requests).summary.elapsed > ngram.run(requests).summary.elapsed
    with pytest.raises(ValueError, match="num_draft_layers"):
        engine_with(spec_config(4, "draft_model", model="self", num_draft_layers=99))


def test_adaptive_stops_speculating_when_drafts_fail():
    requests = long_requests(4, 300, alpha=0.0)
    on = engine_with(spec_config(4, adaptive=True)).run(requests).summary
    off = engine_with(spec_config(4, adaptive=False)).run(requests).summary
    assert on.num_spec_proposed < off.num_spec_proposed / 4


@pytest.mark.parametrize("alpha", [0.1, 0.5])
def test_adaptive_with_a_draft_model_never_costs_a_busy_batch_its_speed(alpha):
    """Requests keep arriving (each fresh one is optimistic) and acceptance is low: the
    batch's draft passes are priced for the batch and the stopped sequences probe
    together, so TPOT stays within 5% of plain decoding. Priced per sequence, with probes
    staggered, it was 1.39x (alpha 0.1) and 1.56x (alpha 0.5) plain."""
    rng = np.random.default_rng(0)
    requests = [SimRequest(f"r{i}", 0.05 * i, rng.integers(1, 1000, 32).tolist(),
                           rng.integers(1, 1000, 100).tolist()) for i in range(60)]
    spec = spec_config(4, "draft_model", adaptive=True, model="self", num_draft_layers=8)
    on = engine_with(spec, alpha).run(requests).summary
    plain = SimulatedEngine(MODEL, GPU, EngineConfig(max_num_seqs=64, max_model_len=2048))
    assert on.num_spec_proposed > 0
    assert on.tpot_p50 <= 1.05 * plain.run(requests).summary.tpot_p50


def test_simulate_cli_prints_the_acceptance(capsys):
    assert simulate_main(["--num-requests", "30", "--rate", "20", "--no-progress",
                          "--speculative-config", '{"method": "ngram", '
                          '"num_speculative_tokens": 3}', "--spec-alpha", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "spec ngram: draft acceptance rate" in out and "acceptance probability α 0.5" in out
    assert simulate_main(["--num-requests", "3", "--no-progress", "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 3}',
                          "--spec-alpha", "1.5"]) == 2
    assert capsys.readouterr().err.startswith("error: spec_alpha=1.5")
