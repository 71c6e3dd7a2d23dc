"""Regression tests for bugs found while hardening the core, each on the tiny random model
(and the real tokenizer for incremental detokenization). Each one failed on the code before
its fix."""

import numpy as np
import pytest

from refserve import LLM, SamplingParams
from refserve.detokenizer import IncrementalDetokenizer
from refserve.engine import EngineStepError


def make_llm(folder, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_gpu_blocks", 256)
    return LLM(model=str(folder), progress=False, **kw)


class LetterTokenizer:
    """Token id t decodes to one letter, chr(97 + t % 26): enough to test stop strings."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def run_to_end(engine):
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


def test_failed_step_then_abort_recovers(tiny_folder):
    # Step 2 has copy-on-write copies for both forked requests and fails in the forward;
    # aborting one request frees its private copy. The engine must then keep serving.
    llm = make_llm(tiny_folder, enable_prefix_caching=False)
    engine = llm.engine
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
    fresh = make_llm(tiny_folder, enable_prefix_caching=False).generate(
        [[11, 12, 13, 14, 15, 16]], params)[0]
    assert [c.token_ids for c in done["b"].outputs] == [c.token_ids for c in fresh.outputs]


def test_stop_string_completed_by_the_last_token(tiny_folder):
    llm = make_llm(tiny_folder)
    llm.engine.tokenizer = LetterTokenizer()
    for seed in range(50):  # a seeded run whose last two letters occur only at the end
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
        base = llm.generate([[5, 6, 7]], params)[0].outputs[0]
        stop = base.text[-2:]  # completed by the 6th (last allowed) token
        if base.text.find(stop) == 4:
            break
    assert base.finish_reason == "length" and base.text.find(stop) == 4
    params.stop = [stop]
    out = llm.generate([[5, 6, 7]], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[:4]


def test_sampling_failure_leaves_no_children_and_retry_is_reproducible(tiny_folder):
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=11, ignore_eos=True)
    expected = make_llm(tiny_folder).generate([[5, 6, 7, 8]], params)[0]
    llm = make_llm(tiny_folder)
    engine = llm.engine
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


def test_kv_peak_is_measured_before_retiring(tiny_folder):
    llm = make_llm(tiny_folder)
    llm.generate([[5, 6, 7, 8, 9]] * 1 + [[10 + i, 11] for i in range(7)],
                 SamplingParams(max_tokens=1, temperature=0.0))
    # 1 request of 5 (+1) tokens -> 2 blocks of 4, 7 of 2 (+1) -> 1 block each, same step.
    assert llm.last_summary.kv_blocks_peak == 2 + 7


def test_sequence_ids_are_per_engine(tiny_folder):
    ids = []
    for _ in range(2):
        engine = make_llm(tiny_folder).engine
        engine.add_request("x", [5, 6, 7], SamplingParams(n=2, max_tokens=3, seed=1))
        engine.add_request("y", [8, 9], SamplingParams(max_tokens=3))
        engine.step()
        ids.append(sorted(s.seq_id for r in engine.requests.values() for s in r.seqs))
    assert ids[0] == ids[1] == [0, 1, 2]


@pytest.mark.slow
def test_incremental_detokenization_equals_a_full_decode(hf_tokenizer):
    text = ("Paris est la capitale 🇫🇷 de la France. 東京は日本の首都です。 "
            "def f(x):\n    return x ** 2  # naïve café — ok?")
    ids = hf_tokenizer.encode(text, add_special_tokens=False) + [hf_tokenizer.eos_token_id]
    rng = np.random.default_rng(0)
    detok = IncrementalDetokenizer(hf_tokenizer)
    end = 0
    while end < len(ids):  # grow by 1..3 tokens, as plain and speculative steps do
        end = min(len(ids), end + int(rng.integers(1, 4)))
        detok.update(ids[:end])
        assert hf_tokenizer.decode(ids[:end], skip_special_tokens=True).startswith(detok.text)
    assert detok.text == hf_tokenizer.decode(ids, skip_special_tokens=True)
