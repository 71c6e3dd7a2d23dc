"""Speculative decoding inside the engine, on a tiny random Llama (fast): configuration
errors, the proposal stage's k cap, rollback of rejected drafts' blocks, n > 1, the adaptive
rule switching a bad proposer off, metrics, and generator restore on a failed verify."""

import json

import pytest
from model_utils import save_tiny_hf_model

from refserve import LLM, SamplingParams
from refserve.capacity import blocks_for_tokens
from refserve.config import EngineConfig
from refserve.engine import EngineStepError, LLMEngine
from refserve.scheduler import Proposal
from refserve.spec_decode.proposer import Proposer
from refserve.spec_decode.registry import resolve as resolve_proposer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8],
           [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 10, 11]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _ = save_tiny_hf_model(tmp_path_factory.mktemp("spec"))
    return folder


def make_llm(folder, spec=None, **kw):
    kw.setdefault("block_size", 2)
    return LLM(model=str(folder), backend="numpy", progress=False, speculative_config=spec,
               **kw)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


class WrongProposer(Proposer):
    """Always proposes k tokens the greedy target never picks here (they are rejected),
    and records what it was asked for."""

    def __init__(self, engine):
        self.engine = engine
        self.asked: list[tuple[int, int, int]] = []  # (num_drafts, num_tokens, outputs)

    def propose(self, seqs, num_drafts):
        out = []
        for seq, n in zip(seqs, num_drafts):
            self.asked.append((n, seq.num_tokens, seq.num_output_tokens))
            out.append(Proposal([96] * n))
        return out


class OracleProposer(WrongProposer):
    """Proposes the target's own greedy continuation (every draft is accepted)."""

    def __init__(self, engine, continuation: dict[tuple, list[int]]):
        super().__init__(engine)
        self.continuation = continuation

    def propose(self, seqs, num_drafts):
        out = []
        for seq, n in zip(seqs, num_drafts):
            self.asked.append((n, seq.num_tokens, seq.num_output_tokens))
            full = self.continuation[tuple(seq.prompt_token_ids)]
            out.append(Proposal(full[seq.num_output_tokens:seq.num_output_tokens + n]))
        return out


# ---- configuration --------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method='medusa'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram"}, "num_speculative_tokens=None"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "self"}, "model applies"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "self"},
     "num_draft_layers"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/x",
      "num_draft_layers": 2}, "num_draft_layers applies"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown key"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_is_a_clear_error(spec, message):
    """The keys every method shares are checked by EngineConfig, the method and its options
    by the registry, as an engine or a simulation starts (before anything loads)."""
    with pytest.raises(ValueError, match="speculative_config") as e:
        config = EngineConfig(speculative_config=spec)
        resolve_proposer(config.speculative_config, config)
    assert message in str(e.value)


def test_a_new_proposer_is_one_class_and_one_registry_entry(tiny, monkeypatch):
    """The engine and the simulator name no method: a proposer registered under a new name
    (here a repeat-the-last-token proposer with one option) serves both."""
    from refserve.simulator import SimulatedEngine, load_gpu, load_model
    from refserve.spec_decode import registry

    class RepeatLast(Proposer):
        method = "repeat_last"
        options = {"times": 1}

        @classmethod
        def create(cls, spec, loaded, backend, num_blocks, block_size):
            proposer = cls()
            proposer.times = spec.options["times"]
            return proposer

        def propose(self, seqs, num_drafts):
            return [Proposal([seq.token_ids[-1]] * min(n, self.times)) for seq, n in
                    zip(seqs, num_drafts)]

    monkeypatch.setitem(registry.PROPOSERS, "repeat_last", RepeatLast)
    spec = {"method": "repeat_last", "num_speculative_tokens": 3, "times": 2,
            "adaptive": False}
    plain = make_llm(tiny, None).generate([[5, 6, 7]], SamplingParams(max_tokens=8,
                                                                       temperature=0.0))
    llm = make_llm(tiny, spec)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0))
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert out[0].metrics.num_spec_proposed > 0  # it really proposed
    sim = SimulatedEngine(load_model("llama-3-8b"), load_gpu("h100-80gb"),
                          EngineConfig(speculative_config=spec))
    assert "repeat_last" in sim.describe()
    with pytest.raises(ValueError, match="speculative_config: unknown key 'k'"):
        resolve_proposer(EngineConfig(speculative_config={**spec, "k": 1}).speculative_config)


def test_draft_model_errors_name_the_problem(tiny, tmp_path):
    with pytest.raises(ValueError, match="the target has 2 layers"):
        make_llm(tiny, {"method": "draft_model", "num_speculative_tokens": 2,
                        "model": "self", "num_draft_layers": 3})
    with pytest.raises(ValueError, match="no such folder"):
        make_llm(tiny, {"method": "draft_model", "num_speculative_tokens": 2,
                        "model": str(tmp_path / "nope")})
    import torch
    import transformers
    torch.manual_seed(0)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128))
    other.save_pretrained(tmp_path / "other", safe_serialization=True)
    with pytest.raises(ValueError, match="vocabulary has 101 tokens, the target's 97"):
        make_llm(tiny, {"method": "draft_model", "num_speculative_tokens": 2,
                        "model": str(tmp_path / "other")})


def test_cli_bad_json_and_bad_config_exit_2(capsys):
    from refserve.generate import main
    for arg in ("{bad", "[1]", '{"method": "x", "num_speculative_tokens": 2}'):
        try:
            rc = main(["--speculative-config", arg, "hi"])
        except SystemExit as e:  # argparse's own exit
            rc = e.code
        assert rc == 2
        assert "error:" in capsys.readouterr().err


# ---- the proposal stage -----------------------------------------------------------------

@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    {"method": "draft_model", "num_speculative_tokens": 3, "model": "self",
     "num_draft_layers": 1},
])
def test_greedy_output_identical_and_metrics_add_up(tiny, spec):
    base = tokens(make_llm(tiny).generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = make_llm(tiny, {**spec, "adaptive": False})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outs) == base
    for o in outs:
        m = o.metrics
        assert m.num_spec_proposed > 0 and 0 <= m.num_spec_accepted <= m.num_spec_proposed
        # each target pass emits its accepted drafts + 1 token (nothing cut: k is capped)
        assert m.num_output_tokens == m.num_target_passes + m.num_spec_accepted
        assert m.mean_accepted_length == pytest.approx(
            (m.num_spec_accepted + m.num_spec_verify_steps) / m.num_spec_verify_steps)
    s = llm.last_summary
    assert s.num_spec_proposed == sum(o.metrics.num_spec_proposed for o in outs)
    assert s.target_passes_per_output_token < 1.0
    assert f"spec {spec['method']}: draft acceptance rate" in s.format()
    d = json.loads(json.dumps(s.to_dict()))
    assert d["speculative_method"] == spec["method"] and 0 <= d["acceptance_rate"] <= 1
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_held_blocks == 0  # everything returned, drafts included
    if spec["method"] == "draft_model":
        draft_kv = llm.llm_engine.speculator.proposer.kv_cache_manager
        llm.llm_engine.propose()  # nothing runs any more: the shadows are released
        assert draft_kv.num_held_blocks == 0


def test_rejected_drafts_blocks_are_freed_every_step(tiny):
    llm = make_llm(tiny, {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    engine = llm.llm_engine
    engine.speculator.proposer = WrongProposer(engine)
    base = tokens(make_llm(tiny).generate(PROMPTS, GREEDY, use_tqdm=False))
    ids = [engine.add_request(None, p, GREEDY) for p in PROMPTS]
    kv, done = engine.kv_cache_manager, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        kv.check_invariants()
        for seq in engine.scheduler.running:
            # 4 rejected drafts every step would leave 1-2 blocks of 2 past the tokens
            held = len(kv.get_block_ids(seq.seq_id))
            assert blocks_for_tokens(seq.num_computed_tokens, 2) <= held \
                <= blocks_for_tokens(seq.num_tokens, 2)
    assert [[c.token_ids for c in done[i].outputs] for i in ids] == base
    assert all(done[i].metrics.num_spec_accepted == 0 for i in ids)
    assert kv.num_held_blocks == 0


@pytest.mark.parametrize("max_tokens, max_model_len", [(7, 128), (None, 30)])
def test_k_is_capped_by_max_tokens_and_max_model_len(tiny, max_tokens, max_model_len):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref = make_llm(tiny, max_model_len=max_model_len).generate(PROMPTS, params,
                                                                use_tqdm=False)
    llm = make_llm(tiny, {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False},
                   max_model_len=max_model_len)
    oracle = OracleProposer(llm.llm_engine, {tuple(o.prompt_token_ids): o.outputs[0].token_ids
                                         for o in ref})
    llm.llm_engine.speculator.proposer = oracle
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(outs) == tokens(ref)
    limit = max_tokens or max_model_len
    for o in outs:
        n = len(o.outputs[0].token_ids)
        assert n == (limit if max_tokens else max_model_len - len(o.prompt_token_ids))
        # every draft was accepted and nothing was cut
        assert o.metrics.num_output_tokens == o.metrics.num_target_passes \
            + o.metrics.num_spec_accepted
    for k, num_tokens, num_outputs in oracle.asked:
        room = min((max_tokens or max_model_len) - num_outputs, max_model_len - num_tokens) - 1
        assert 1 <= k <= min(5, room)
    assert any(k == 5 for k, *_ in oracle.asked)


def test_parallel_sampling_with_speculation(tiny):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "adaptive": False}
    greedy = SamplingParams(n=2, max_tokens=16, temperature=0.0, ignore_eos=True)
    assert tokens(make_llm(tiny, spec).generate(PROMPTS, greedy, use_tqdm=False)) == \
        tokens(make_llm(tiny).generate(PROMPTS, greedy, use_tqdm=False))
    sampled = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    a = make_llm(tiny, spec).generate(PROMPTS, sampled, use_tqdm=False)
    b = make_llm(tiny, spec).generate(PROMPTS, sampled, use_tqdm=False)
    assert tokens(a) == tokens(b)  # seeded: reproducible with speculation too
    for o in a:
        assert [len(c.token_ids) for c in o.outputs] == [16, 16, 16]
        assert len({tuple(c.token_ids) for c in o.outputs}) > 1
    assert sum(o.metrics.num_spec_proposed for o in a) > 0


def test_adaptive_rule_stops_a_hopeless_proposer(tiny):
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    runs = {}
    for adaptive in (False, True):
        llm = make_llm(tiny, {"method": "ngram", "num_speculative_tokens": 4,
                              "adaptive": adaptive})
        llm.llm_engine.speculator.proposer = WrongProposer(llm.llm_engine)
        (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
        runs[adaptive] = out.metrics
    # without the rule every decode verifies (all but the prefill and the last token,
    # which has no room for a draft)
    assert runs[False].num_spec_verify_steps == runs[False].num_target_passes - 2
    # with the rule: a few verify steps, then only rare probes
    assert runs[True].num_spec_verify_steps <= 15
    assert runs[True].num_spec_proposed < runs[False].num_spec_proposed / 4


def test_failed_verify_restores_the_generators(tiny):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "adaptive": False}
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    expected = tokens(make_llm(tiny, spec).generate(PROMPTS, params, use_tqdm=False))
    engine: LLMEngine = make_llm(tiny, spec).llm_engine
    ids = [engine.add_request(None, p, params) for p in PROMPTS]
    real, calls = engine.backend.rejection_sample, [0]

    def flaky(*args):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected failure")
        return real(*args)

    engine.backend.rejection_sample = flaky
    done, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except EngineStepError:
            failures += 1
            continue
        done.update({o.request_id: o for o in outs if o.finished})
    assert failures == 1
    assert [[c.token_ids for c in done[i].outputs] for i in ids] == expected


def test_failed_proposal_stage_is_an_engine_step_error_and_leaves_no_drafts(tiny):
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": "self",
            "num_draft_layers": 1, "adaptive": False}
    expected = tokens(make_llm(tiny, spec).generate(PROMPTS, GREEDY, use_tqdm=False))
    engine = make_llm(tiny, spec).llm_engine
    ids = [engine.add_request(None, p, GREEDY) for p in PROMPTS]
    real, calls = engine.speculator.proposer.runner.forward, [0]

    def flaky(inputs):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("injected draft failure")
        return real(inputs)

    engine.speculator.proposer.runner.forward = flaky
    done, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except EngineStepError as e:
            failures += 1
            assert "proposal stage" in str(e)
            # drafts are values of one step: a schedule() now sees none of them (the
            # next step() redoes that unapplied schedule, as after any failed step)
            assert all(not r.draft_token_ids for r in engine.scheduler.schedule().scheduled)
            continue
        done.update({o.request_id: o for o in outs if o.finished})
    assert failures == 1
    assert [[c.token_ids for c in done[i].outputs] for i in ids] == expected
