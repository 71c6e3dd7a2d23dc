"""The simulated engine: the real control plane, a virtual clock, the real engine's metrics."""

import ast
import inspect
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refserve
from refserve.config import EngineConfig
from refserve.kv_cache.kv_cache_manager import KVCacheManager
from refserve.metrics import RunSummary
from refserve.scheduler.scheduler import Scheduler
from refserve.scheduler.scheduling_policy import LongestPrefixMatch
from refserve.scheduler.static import StaticScheduler
from refserve.simulator import (
    CostModel,
    SimRequest,
    SimulatedEngine,
    StepComposition,
    load_gpu,
    load_model,
    make_workload,
)

MODEL = load_model("llama-3-8b")
H100 = load_gpu("h100-80gb")


def small_engine(**config):
    config.setdefault("max_model_len", 512)
    config.setdefault("num_gpu_blocks_override", 64)
    config.setdefault("block_size", 16)
    return SimulatedEngine(MODEL, H100, EngineConfig(**config))


def test_the_simulator_runs_the_real_scheduler_and_kv_cache_manager():
    engine = small_engine()
    assert type(engine.scheduler) is Scheduler
    assert type(engine.kv_cache_manager) is KVCacheManager
    assert engine.scheduler.kv_cache_manager is engine.kv_cache_manager
    assert type(small_engine(batching="static").scheduler) is StaticScheduler
    # ... and the simulator package defines no scheduler or KV manager of its own.
    import refserve.simulator as sim

    for path in Path(sim.__file__).parent.glob("*.py"):
        module = __import__(f"refserve.simulator.{path.stem}", fromlist=["x"])
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                assert not issubclass(cls, (Scheduler, KVCacheManager)), cls


def test_the_simulator_runs_the_configs_cache_and_scheduling_policies():
    """The same policies as the real engine (scheduler/factory.py), not the defaults."""
    engine = small_engine(prefix_caching_policy="radix", scheduling_policy="lpm")
    assert engine.kv_cache_manager.radix_tree is not None
    assert isinstance(engine.scheduler.policy, LongestPrefixMatch)
    assert small_engine().kv_cache_manager.radix_tree is None
    requests = [SimRequest(f"r{i}", 0.1 * i, [7] * 40 + [i], [5] * 4) for i in range(6)]
    summary = engine.run(requests).summary
    assert summary.num_requests == 6 and summary.prefix_hit_rate > 0.5
    with pytest.raises(ValueError, match="simulator prices no host"):
        small_engine(preemption_mode="swap")


def test_nothing_below_the_top_floor_imports_the_simulator():
    """The simulator sits beside the command lines: only they (the bench and the war
    stories among them) import it (generate and serve for --trace's recorder)."""
    root = Path(refserve.__file__).parent
    allowed = ("refserve/simulator/", "refserve/simulate.py", "refserve/plan.py",
               "refserve/bench/", "refserve/generate.py", "refserve/serve.py",
               "refserve/war_stories.py", "refserve/war_story_spec.py")
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).as_posix()
        if rel.startswith(allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith(("refserve.simulator", "refserve.simulate",
                                         "refserve.plan")) for n in names), rel


def test_one_request_alone_costs_one_prefill_then_its_decodes():
    """The virtual clock by hand: the prefill step, then one decode step per token at its
    context. vLLM's profile processes a step's outputs while the next step runs, so a
    token reaches the client when the step after its own ends (the last one, with no
    step after it, its output lane later)."""
    engine = small_engine(max_num_batched_tokens=512)
    prompt, out = list(range(1000, 1100)), list(range(2000, 2005))
    result = engine.run([SimRequest("a", 3.0, prompt, out)])
    cm = engine.cost_model
    prefill = cm.time(StepComposition.from_rows([(100, 100, 1)]))
    decodes = [cm.time(StepComposition.from_rows([(1, 100 + k, 1)])) for k in range(1, 5)]
    lane = cm.output_lane(StepComposition.from_rows([(1, 104, 1)]))
    assert lane > 0 and cm.async_output
    m = result.metrics["a"]
    assert m.arrival_time == 3.0
    assert m.ttft == pytest.approx(prefill + decodes[0])
    assert m.finish_time == pytest.approx(3.0 + prefill + sum(decodes) + lane)
    assert m.tpot == pytest.approx((sum(decodes[1:]) + lane) / 4)
    assert m.num_output_tokens == 5 and m.num_target_passes == 5
    assert result.num_steps == 5
    # inter-token latencies: one per later token, each the step that delivered it
    assert list(result.itl) == pytest.approx([*decodes[1:], lane])


def test_itl_includes_the_wait_of_a_stalled_or_preempted_request():
    """A request that sat out steps waits for more than one step between its tokens."""
    engine = small_engine(num_gpu_blocks_override=12, block_size=16, max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=192)
    reqs = [SimRequest(f"r{i}", 0.0, [1000 + i] * 40, [1] * 100) for i in range(4)]
    result = engine.run(reqs, check_invariants=True)
    assert result.summary.num_preemptions > 0
    steps = [b - a for a, b in zip(result.timeline["t"], result.timeline["t_end"])]
    assert len(result.itl) == sum(m.num_output_tokens - 1 for m in result.metrics.values())
    assert max(result.itl) > 2 * max(steps)  # a preempted request waited several steps
    assert sum(result.itl) == pytest.approx(sum(m.decode_time for m in
                                                 result.metrics.values()))


def test_the_clock_jumps_over_idle_time():
    engine = small_engine()
    reqs = [SimRequest("a", 0.0, [1000] * 20, [1] * 3), SimRequest("b", 100.0, [1001] * 20,
                                                                    [2] * 3)]
    result = engine.run(reqs)
    assert result.metrics["b"].ttft == pytest.approx(result.metrics["a"].ttft)
    assert result.metrics["b"].finish_time < 101.0


def test_every_request_gets_exactly_its_tokens_and_the_real_summary():
    requests = make_workload("chat", 40, 50.0, vocab_size=MODEL.vocab_size,
                             max_model_len=512, seed=1)
    engine = small_engine(num_gpu_blocks_override=200, max_num_seqs=8)
    seen = {}

    def on_step(eng, t0, t1, out, retired):
        for seq in retired:
            seen[seq.request_id] = list(seq.output_token_ids)

    result = engine.run(requests, on_step=on_step, check_invariants=True)
    assert seen == {r.request_id: r.output_token_ids for r in requests}
    assert isinstance(result.summary, RunSummary)
    assert result.summary.num_requests == 40
    assert result.summary.num_output_tokens == sum(r.num_output_tokens for r in requests)
    assert result.summary.kv_blocks_total == 200
    for r in requests:
        m = result.metrics[r.request_id]
        assert r.arrival_time <= m.first_token_time <= m.finish_time
    assert "TTFT p50" in result.summary.format()


def test_a_short_pool_preempts_and_the_pool_stays_consistent():
    requests = make_workload("chat", 30, float("inf"), vocab_size=MODEL.vocab_size,
                             max_model_len=256, seed=2)
    engine = small_engine(num_gpu_blocks_override=20, max_model_len=256, max_num_seqs=16)
    result = engine.run(requests, check_invariants=True)
    assert result.summary.num_preemptions > 0
    assert result.summary.kv_blocks_peak <= 20
    assert all(m.finish_time is not None for m in result.metrics.values())


def test_shared_system_prompt_hits_the_prefix_cache_for_real():
    def run(caching):
        requests = make_workload("system-prompt", 30, 2.0, vocab_size=MODEL.vocab_size,
                                 max_model_len=4096, seed=0)
        return small_engine(num_gpu_blocks_override=2000, max_model_len=4096,
                            enable_prefix_caching=caching).run(requests).summary

    on, off = run(True), run(False)
    assert on.prefix_hit_rate > 0.8
    assert off.prefix_hit_rate is None
    # caching spares most of the shared 1500-token prefill (~35 ms on an H100)
    assert off.ttft_p50 - on.ttft_p50 > 0.02


def test_same_seed_same_run_other_seed_other_run():
    def run(seed):
        reqs = make_workload("chat", 30, 20.0, vocab_size=MODEL.vocab_size,
                             max_model_len=512, seed=seed)
        return small_engine(num_gpu_blocks_override=300).run(reqs).summary

    assert run(0) == run(0)
    assert run(0) != run(1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_requests=st.integers(1, 12), blocks=st.integers(8, 40),
       block_size=st.sampled_from([4, 8, 16]), budget=st.integers(8, 96),
       seqs=st.integers(1, 6), caching=st.booleans(), seed=st.integers(0, 1000),
       workload=st.sampled_from(["chat", "multi-turn"]))
def test_pool_invariants_hold_after_every_simulated_step(num_requests, blocks, block_size,
                                                         budget, seqs, caching, seed,
                                                         workload):
    max_model_len = blocks * block_size
    engine = SimulatedEngine(MODEL, H100, EngineConfig(
        num_gpu_blocks_override=blocks, block_size=block_size, max_num_batched_tokens=budget,
        max_num_seqs=seqs, enable_prefix_caching=caching, max_model_len=max_model_len))
    requests = make_workload(workload, num_requests, 5.0, vocab_size=MODEL.vocab_size,
                             max_model_len=max_model_len, seed=seed)
    result = engine.run(requests, check_invariants=True)  # asserts after every step
    kv = engine.kv_cache_manager
    assert kv.num_held_blocks == 0  # everything retired gave its blocks back
    for r in requests:
        assert result.metrics[r.request_id].num_output_tokens == min(
            r.num_output_tokens, max_model_len - r.num_prompt_tokens)


def test_the_simulated_pool_is_one_gpus_share_of_the_profiles_memory():
    """The arithmetic is engine_setup.size_kv_pool's (tested in test_engine_sizing.py and
    tests/test_simulator_engine_rules.py); here, what the simulator feeds it."""
    one = SimulatedEngine(MODEL, H100, EngineConfig())
    assert "gpu_memory_utilization=0.9" in one.pool_sized_by
    assert "weights 14.96 GiB per GPU" in one.pool_sized_by
    # Two GPUs: half the weights and half the KV heads on each, so more than 2x the blocks.
    two = SimulatedEngine(MODEL, H100, EngineConfig(), tensor_parallel_size=2)
    assert two.num_blocks > 2 * one.num_blocks
    # fp8 weights leave more memory; an fp8 cache holds twice the blocks in the same bytes.
    fp8 = SimulatedEngine(MODEL, H100, EngineConfig(), quantization="fp8")
    assert fp8.num_blocks > one.num_blocks
    kv8 = SimulatedEngine(MODEL, H100, EngineConfig(), kv_cache_dtype="fp8")
    assert kv8.num_blocks // 2 == one.num_blocks  # floor(2m / b) // 2 = floor(m / b)
    with pytest.raises(ValueError, match="llama-3-70b on 1 x .*do not fit.*more GPUs"):
        SimulatedEngine(load_model("llama-3-70b"), H100, EngineConfig())
    with pytest.raises(ValueError, match="max_model_len"):
        SimulatedEngine(MODEL, H100, EngineConfig(num_gpu_blocks_override=10))
    # The host profile sizes the pool by kv_cache_memory_bytes, as the CPU backends do.
    from refserve.simulator.hardware import host_profile

    host = host_profile({"peak_flops": 1e11, "bandwidth_bytes_per_s": 1e10})
    tiny = load_model("smollm2-135m")
    small = SimulatedEngine(tiny, host, EngineConfig(kv_cache_memory_bytes=2**30))
    big = SimulatedEngine(tiny, host, EngineConfig(kv_cache_memory_bytes=2**31))
    assert small.pool_sized_by == f"kv_cache_memory_bytes={2**30}"
    assert big.num_blocks == 2 * small.num_blocks


def test_bad_requests_are_refused_before_anything_runs():
    engine = small_engine(num_gpu_blocks_override=8, max_model_len=128)
    with pytest.raises(ValueError, match="'big'.*max_model_len"):
        engine.run([SimRequest("ok", 0.0, [1000] * 10, [1] * 2),
                    SimRequest("big", 0.0, [1000] * 200, [1] * 2)])
    assert engine.scheduler.num_steps == 0
    with pytest.raises(ValueError, match="twice"):
        engine.run([SimRequest("a", 0.0, [1000], [1]), SimRequest("a", 1.0, [1000], [1])])
    with pytest.raises(ValueError, match="spec_alpha"):
        SimulatedEngine(MODEL, H100, EngineConfig(
            speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
            spec_alpha=-0.1)


def test_a_roofline_cost_model_is_the_default():
    engine = small_engine()
    assert isinstance(engine.cost_model, CostModel)
    assert engine.cost_model.gpu is H100 and engine.dtype == "bfloat16"
