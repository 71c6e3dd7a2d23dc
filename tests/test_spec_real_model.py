"""Speculative decoding on the embedded SmolLM2-135M: greedy output is token-identical to
plain decoding (n-gram and self-draft, with chunked prefill and preemption forced by a tiny
pool), and sampled output has the same distribution (two-sample chi-square)."""

import json

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from refserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

QUOTE = ("Repeat this passage exactly: The old lighthouse keeper climbed the stairs every "
         "night, counting each step, and lit the lamp for the ships at sea. Passage: The old")
CREATIVE = "Write a short poem about a fox in the snow:"
EDIT = ("Fix the typo and repeat: 'The quick brown fox jumpd over the lazy dog near the "
        "river bank.' Corrected: 'The quick brown fox")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
SELF = {"method": "draft_model", "num_speculative_tokens": 3, "model": "self",
        "num_draft_layers": 10}


def make(smollm2_dir, spec=None, **kw):
    """On the tuned CPU backend: these tests exercise speculation's control (proposals,
    accept / residual, roll back) over hundreds of sampled rows, and float32 on every
    machine (a GPU's "auto" would be float16); the reference's data plane is proven equal
    to it in tests/test_backend_equality_cpu.py."""
    return LLM(model=str(smollm2_dir), backend="cpu", progress=False,
               speculative_config=spec, **kw)


# 6 blocks of 16 for 4 sequences of ~15-30 prompt + 24 output tokens (3-4 blocks each):
# the 32-token budget admits three at once (chunked prefill), and their growth preempts the
# newest (recompute).
TIGHT = dict(block_size=16, num_gpu_blocks_override=6, max_model_len=96,
             max_num_batched_tokens=32, enable_prefix_caching=True)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [QUOTE, EDIT, CREATIVE, "List the days of the week: Monday, Tuesday,"]


@pytest.fixture(scope="module")
def plain_greedy(smollm2_dir):
    llm = make(smollm2_dir, **TIGHT)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.last_summary.num_preemptions > 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec", [NGRAM, SELF], ids=["ngram", "self-draft"])
def test_greedy_identity_with_chunked_prefill_and_preemption(smollm2_dir, plain_greedy, spec):
    llm = make(smollm2_dir, {**spec, "adaptive": False}, **TIGHT)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_greedy
    s = llm.last_summary
    assert s.num_preemptions > 0
    assert s.num_spec_accepted > 0 and s.target_passes_per_output_token < 1.0
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_held_blocks == 0


def _two_token_counts(llm, prompt, samples, seeds):
    """Counts of the first two generated tokens over `samples` sequences (n per request)."""
    per = samples // len(seeds)
    params = [SamplingParams(n=per, max_tokens=3, temperature=1.0, seed=s, ignore_eos=True)
              for s in seeds]
    outs = llm.generate([prompt] * len(seeds), params, use_tqdm=False)
    counts = {}
    for o in outs:
        for c in o.outputs:
            key = tuple(c.token_ids[:2])
            counts[key] = counts.get(key, 0) + 1
    return counts, outs


def _chi_square_p(a: dict, b: dict, min_expected: float = 5.0) -> float:
    """Two-sample chi-square over the outcomes frequent in the pooled sample; the rest are
    lumped into one 'other' cell."""
    keys = set(a) | set(b)
    total_a, total_b = sum(a.values()), sum(b.values())
    frequent = [k for k in keys
                if (a.get(k, 0) + b.get(k, 0)) * min(total_a, total_b) / (total_a + total_b)
                >= min_expected]
    table = [[a.get(k, 0) for k in frequent], [b.get(k, 0) for k in frequent]]
    table[0].append(total_a - sum(table[0]))
    table[1].append(total_b - sum(table[1]))
    table = np.array(table)
    table = table[:, table.sum(axis=0) > 0]
    assert table.shape[1] >= 4, f"too few frequent outcomes for a test: {table}"
    return chi2_contingency(table)[1]


def test_sampled_first_two_tokens_keep_the_distribution(smollm2_dir):
    # max_tokens=3 so that the step after the first token may verify 1 draft (k is capped
    # to leave room for the recovered / bonus token): tokens 1 and 2 then come from the
    # accept / residual step, which is what is tested. The prompt repeats itself so the
    # n-gram proposer has drafts, and the distribution is spread over many outcomes.
    prompt = "one two three four one two three four one two three four one two"
    seeds, samples = [0, 1000, 2000], 720
    common = dict(block_size=4, max_num_seqs=256)
    plain, _ = _two_token_counts(make(smollm2_dir, **common), prompt, samples, seeds)
    for spec in (NGRAM, SELF):
        llm = make(smollm2_dir, {**spec, "adaptive": False}, **common)
        counts, outs = _two_token_counts(llm, prompt, samples, [s + 7 for s in seeds])
        proposed = sum(o.metrics.num_spec_proposed for o in outs)
        accepted = sum(o.metrics.num_spec_accepted for o in outs)
        assert proposed >= samples // 2 and 0 < accepted < proposed, (proposed, accepted)
        p = _chi_square_p(plain, counts)
        assert p > 1e-3, f"{spec['method']}: p = {p:.2e}, {sorted(counts.items())[:10]}"


def test_generate_cli_prints_acceptance(smollm2_dir, capsys):
    from refserve.generate import main
    rc = main(["--model", str(smollm2_dir), "--backend", "cpu", "--max-tokens", "12",
               "--speculative-config", json.dumps(NGRAM), "--ignore-eos", QUOTE])
    assert rc == 0
    err = capsys.readouterr().err
    assert "spec ngram: draft acceptance rate" in err and "mean accepted length" in err


def test_a_self_draft_of_every_layer_is_always_accepted(smollm2_dir):
    """The control for the weak drafts above: with all 30 layers the draft IS the target, so
    under greedy decoding every draft must be accepted. The near-zero acceptance of an
    8-layer self-draft (bench spec, the speculation war story) is then the shallow model's,
    not a bookkeeping bug (a draft reading the wrong positions or layers fails here)."""
    layers = make(smollm2_dir).llm_engine.model.config.num_hidden_layers
    spec = {"method": "draft_model", "model": "self", "num_draft_layers": layers,
            "num_speculative_tokens": 4, "adaptive": False}
    llm = make(smollm2_dir, spec)
    out = llm.generate([CREATIVE], GREEDY, use_tqdm=False)[0]
    m = out.metrics
    assert m.num_spec_proposed >= 16 and m.num_spec_accepted == m.num_spec_proposed
