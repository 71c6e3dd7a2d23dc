"""The engine on a tiny random model: prefix caching, copy-on-write parallel sampling, seeded
sampling, bad input, aborts and a failing step. (The real-model engine tests are in
test_engine_smollm2.py.)"""

import numpy as np
import pytest

from refserve import LLM, SamplingParams
from refserve.engine import EngineStepError, LLMEngine
from refserve.sequence import SequenceStatus

VOCAB = 97


def make_llm(folder, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_gpu_blocks_override", 256)
    return LLM(model=str(folder), progress=False, **kw)


def prompts(n, rng, lo=3, hi=40):
    return [rng.integers(3, VOCAB, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_prefix_cache_computes_only_the_remainder(tiny_llama):
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, VOCAB, size=12).tolist()          # 3 full blocks of 4
    tail = rng.integers(3, VOCAB, size=5).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    uncached = make_llm(tiny_llama, enable_prefix_caching=False).generate(
        [prefix + tail], params)[0]
    llm.generate([prefix + [7, 8, 9]], params)                 # warms the 3 prefix blocks
    computed = []
    original = engine.runner.prepare

    def counting_prepare(out):
        inputs = original(out)
        computed.append(len(inputs.input_ids))
        return inputs

    engine.runner.prepare = counting_prepare
    out = llm.generate([prefix + tail], params)[0]
    assert out.metrics.num_cached_tokens == 12
    # Prefill computed only the 5 tail tokens, then 5 decode steps of one token each.
    assert computed == [5, 1, 1, 1, 1, 1]
    assert out.outputs[0].token_ids == uncached.outputs[0].token_ids
    assert llm.last_summary.prefix_hit_rate == pytest.approx(12 / 17)


def test_parallel_sampling_shares_prompt_blocks_and_matches_single_runs(tiny_llama):
    llm = make_llm(tiny_llama, enable_prefix_caching=False)
    prompt = np.random.default_rng(1).integers(3, VOCAB, size=10).tolist()  # 2.5 blocks
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    computed, copies = [], []
    runner = llm.llm_engine.runner
    original_prepare, original_copy = runner.prepare, runner.copy_blocks

    def spy_prepare(out):
        inputs = original_prepare(out)
        computed.append(len(inputs.input_ids))
        return inputs

    def spy_copy(block_copies, *swaps):
        copies.extend(block_copies)
        return original_copy(block_copies, *swaps)

    runner.prepare, runner.copy_blocks = spy_prepare, spy_copy
    out = llm.generate([prompt], params)[0]
    assert computed[0] == 10          # the prompt is computed once, not four times
    assert len(copies) == 3           # the shared partial last block: 3 copies, last in place
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    runner.prepare, runner.copy_blocks = original_prepare, original_copy
    for i, child in enumerate(out.outputs):
        alone = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0,
                                                      seed=123 + i, ignore_eos=True))[0]
        assert alone.outputs[0].token_ids == child.token_ids, f"child {i}"
    kv = llm.llm_engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_held_blocks == 0


def test_seeded_sampling_independent_of_batch(tiny_llama):
    llm = make_llm(tiny_llama)
    rng = np.random.default_rng(2)
    target = prompts(1, rng)[0]
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=7,
                            ignore_eos=True)
    alone = llm.generate([target], params)[0].outputs[0].token_ids
    others = prompts(6, rng)
    mixed = llm.generate(others[:3] + [target] + others[3:],
                         [SamplingParams(max_tokens=int(m), temperature=1.0, ignore_eos=True)
                          for m in (3, 12, 5)] + [params] +
                         [SamplingParams(max_tokens=4, temperature=0.0)] * 3)
    assert mixed[3].outputs[0].token_ids == alone


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{match}="):
        SamplingParams(**kwargs)


def test_bad_requests_are_rejected_and_engine_keeps_serving(tiny_llama):
    llm = make_llm(tiny_llama, num_gpu_blocks_override=20, max_model_len=64)
    engine = llm.llm_engine
    good = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("ok-1", [5, 6, 7], good)
    cases = [
        ([], "empty"),
        ([1, 2, VOCAB], "unknown token id"),
        ([-1, 2], "unknown token id"),
        (list(range(3, 68)), "max_model_len"),
        ("text", "no tokenizer"),
    ]
    for prompt, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.add_request(None, prompt, good)
    # A pool too small for one max_model_len sequence is refused at start-up.
    with pytest.raises(ValueError, match="lower max_model_len to at most 16"):
        make_llm(tiny_llama, num_gpu_blocks_override=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"SamplingParams\.n=9 is more than max_num_seqs"):
        make_llm(tiny_llama, max_num_seqs=8).llm_engine.add_request(
            None, [5, 6], SamplingParams(n=9))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok-1", [5], good)
    with pytest.raises(ValueError, match="prompt 1: .*unknown token id"):
        llm.generate([[5, 6], [1000]], good)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["ok-1"]
    expect = make_llm(tiny_llama).generate([[5, 6, 7]], good)[0].outputs[0].token_ids
    assert outs[-1].outputs[0].token_ids == expect


@pytest.mark.parametrize("when", ["waiting", "running", "preempted"])
def test_abort_frees_blocks_at_once(tiny_llama, when):
    llm = make_llm(tiny_llama, num_gpu_blocks_override=12, max_num_batched_tokens=64,
                   max_model_len=48)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 15)), params)
    engine.add_request("b", list(range(20, 32)), params)
    if when == "waiting":
        engine.scheduler.max_num_seqs = 1
        engine.step()
        seq = engine.requests["b"].seqs[0]
        assert seq.status is SequenceStatus.WAITING
    elif when == "running":
        engine.step()
        seq = engine.requests["b"].seqs[0]
        assert kv.get_block_ids(seq.seq_id)
    else:
        for _ in range(40):
            engine.step()
            seq = engine.requests["b"].seqs[0]
            if seq.num_preemptions and seq.status is SequenceStatus.WAITING:
                break
        assert seq.num_preemptions > 0
    engine.abort_request("b")
    assert not kv.has_sequence(seq.seq_id)
    kv.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.num_held_blocks == 0


def test_failing_step_names_requests_and_keeps_pool_consistent(tiny_llama):
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request("r1", [4, 5, 6, 7, 8], params)
    engine.add_request("r2", [9, 10, 11], params)
    original = engine.runner.forward

    def boom(*a, **k):
        raise RuntimeError("injected model failure")

    engine.runner.forward = boom
    with pytest.raises(EngineStepError, match=r"\['r1', 'r2'\].*injected") as info:
        engine.step()
    assert info.value.request_ids == ["r1", "r2"]
    engine.kv_cache_manager.check_invariants()
    engine.runner.forward = original
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    fresh = make_llm(tiny_llama).generate([[4, 5, 6, 7, 8], [9, 10, 11]], params)
    assert done == {"r1": fresh[0].outputs[0].token_ids, "r2": fresh[1].outputs[0].token_ids}


def test_stop_token_ids_and_finish_reasons(tiny_llama):
    llm = make_llm(tiny_llama)
    base = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0.0,
                                                    ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    stop_at = base.token_ids[3]
    first = base.token_ids.index(stop_at)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0.0,
                                                   ignore_eos=True,
                                                   stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first + 1]


def test_static_and_continuous_agree(tiny_llama):
    rng = np.random.default_rng(5)
    ps = prompts(8, rng)
    params = [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True)
              for m in rng.integers(2, 30, size=8)]
    cont = make_llm(tiny_llama, max_num_seqs=4)
    stat = make_llm(tiny_llama, max_num_seqs=4, batching="static")
    a = cont.generate(ps, params)
    b = stat.generate(ps, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert cont.last_summary.num_steps < stat.last_summary.num_steps
    assert cont.last_summary.slot_steps_wasted == 0 < stat.last_summary.slot_steps_wasted


def test_contiguous_layout_matches_paged(tiny_llama):
    rng = np.random.default_rng(6)
    ps = prompts(5, rng)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    paged = make_llm(tiny_llama).generate(ps, params)
    contiguous = LLM(model=str(tiny_llama), progress=False, kv_cache_layout="contiguous",
                     max_model_len=64, kv_cache_memory_bytes=1 << 20)
    assert contiguous.llm_engine.block_size == 64
    out = contiguous.generate(ps, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in paged]


def test_engine_config_errors(tiny_llama):
    with pytest.raises(ValueError, match="block_size=0"):
        LLMEngine(model=str(tiny_llama), block_size=0, progress=False)
    with pytest.raises(ValueError, match="batching='dynamic'"):
        LLMEngine(model=str(tiny_llama), batching="dynamic", progress=False)
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds"):
        LLMEngine(model=str(tiny_llama), max_model_len=4096, progress=False)
    with pytest.raises(ValueError, match="holds 0 blocks.*kv_cache_memory_bytes=10"):
        LLMEngine(model=str(tiny_llama), kv_cache_memory_bytes=10, progress=False)


def test_gpu_pool_sized_from_total_memory(tiny_llama, monkeypatch):
    """vLLM's gpu_memory_utilization: the instance may use util × TOTAL device memory; what
    is in use already (total - free) and one step's activations come off, the rest is KV."""
    import refserve.engine as engine_module
    from refserve.backends.numpy_backend import NumpyBackend

    class FakeDevice(NumpyBackend):
        def free_device_memory(self):
            return 3_000_000           # 1 MB of the 4 MB device is in use (weights, context)

        def total_device_memory(self):
            return 4_000_000

    monkeypatch.setattr(engine_module, "get_backend", lambda name, **options: FakeDevice())
    def pool(utilization):
        return LLMEngine(model=str(tiny_llama), block_size=4, max_num_batched_tokens=64,
                         gpu_memory_utilization=utilization, progress=False).num_blocks

    bytes_per_block = 4 * (2 * 2 * 2 * 12 * 4)   # block_size × 2·layers·kv_heads·head_dim·4
    activations = 64 * (4 * 48 + 2 * 96) * 4 + 64 * 97 * 4   # hidden/MLP + logits rows
    # 0.5 × 4 MB total - 1 MB in use - activations; the old "0.5 × free" would be 1.5 MB.
    assert pool(0.5) == (2_000_000 - 1_000_000 - activations) // bytes_per_block
    assert pool(0.3) == (1_200_000 - 1_000_000 - activations) // bytes_per_block
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2: .* in use already"):
        LLMEngine(model=str(tiny_llama), block_size=4, gpu_memory_utilization=0.2,
                  progress=False)


# ---- failed steps, the KV peak, sequence ids --------------------------------------------


def run_to_end(engine):
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


def test_failed_step_then_abort_recovers(tiny_llama):
    # Step 2 has copy-on-write copies for both forked requests and fails in the forward;
    # aborting one request frees its private copy. The engine must then keep serving.
    llm = make_llm(tiny_llama, enable_prefix_caching=False)
    engine = llm.llm_engine
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    engine.add_request("a", [5, 6, 7, 8, 9, 10], params)
    engine.add_request("b", [11, 12, 13, 14, 15, 16], params)
    engine.step()  # prefill both, fork the children
    original = engine.runner.forward
    engine.runner.forward = lambda inputs: (_ for _ in ()).throw(RuntimeError("injected"))
    with pytest.raises(EngineStepError, match="injected"):
        engine.step()
    engine.runner.forward = original
    engine.abort_request("a")
    engine.kv_cache_manager.check_invariants()
    done = run_to_end(engine)
    kv = engine.kv_cache_manager
    assert kv.num_held_blocks == 0
    fresh = make_llm(tiny_llama, enable_prefix_caching=False).generate(
        [[11, 12, 13, 14, 15, 16]], params)[0]
    assert [c.token_ids for c in done["b"].outputs] == [c.token_ids for c in fresh.outputs]


def test_sampling_failure_leaves_no_children_and_retry_is_reproducible(tiny_llama):
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    expected = make_llm(tiny_llama).generate([[5, 6, 7, 8]], params)[0]
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    engine.add_request("r", [5, 6, 7, 8], params)
    original = engine.sampler.sample
    calls = []

    def fail_on_second_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the parent drew its token; the first child's draw fails
            raise RuntimeError("injected sampling failure")
        return original(*args, **kwargs)

    engine.sampler.sample = fail_on_second_call
    with pytest.raises(EngineStepError, match="injected sampling failure"):
        engine.step()
    engine.sampler.sample = original
    req = engine.requests["r"]
    assert len(req.seqs) == 1 and engine.scheduler.num_running == 1
    done = run_to_end(engine)
    assert [c.token_ids for c in done["r"].outputs] == \
        [c.token_ids for c in expected.outputs]


def test_kv_peak_is_measured_before_retiring(tiny_llama):
    llm = make_llm(tiny_llama)
    llm.generate([[5, 6, 7, 8, 9]] * 1 + [[10 + i, 11] for i in range(7)],
                 SamplingParams(max_tokens=1, temperature=0.0))
    # 1 request of 5 (+1) tokens -> 2 blocks of 4, 7 of 2 (+1) -> 1 block each, same step.
    assert llm.last_summary.kv_blocks_peak == 2 + 7


def test_sequence_ids_are_per_engine(tiny_llama):
    ids = []
    for _ in range(2):
        engine = make_llm(tiny_llama).llm_engine
        engine.add_request("x", [5, 6, 7], SamplingParams(n=2, max_tokens=3, seed=1))
        engine.add_request("y", [8, 9], SamplingParams(max_tokens=3))
        engine.step()
        ids.append(sorted(s.seq_id for r in engine.requests.values() for s in r.seqs))
    assert ids[0] == ids[1] == [0, 1, 2]
