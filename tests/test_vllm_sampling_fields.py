"""vLLM's SamplingParams fields beyond the basics, each against the plain behaviour: the same
request without the field, on the tiny text model (a real byte-level BPE tokenizer)."""

import numpy as np
import pytest

from refserve import LLM, SamplingParams
from refserve.sequence import IncrementalDetokenizer

PROMPT = "The engine keeps a pool of blocks."


def greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 10), **kw)


def run(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params)[0]


def test_logit_bias_moves_greedy_choice_and_nothing_else(offline):
    plain = run(offline, greedy()).outputs[0]
    first = plain.token_ids[0]
    banned = run(offline, greedy(logit_bias={first: -100.0})).outputs[0]
    assert banned.token_ids[0] != first and first not in banned.token_ids
    forced = run(offline, greedy(logit_bias={7: 100.0}, ignore_eos=True)).outputs[0]
    assert forced.token_ids == [7] * 10
    # A zero bias is no bias: the plain output, token for token.
    assert run(offline, greedy(logit_bias={first: 0.0})).outputs[0].token_ids == plain.token_ids
    # Logprobs stay the model's own (vLLM's raw_logprobs): the bias does not show in them.
    lp_plain = run(offline, greedy(max_tokens=1, logprobs=0)).outputs[0].logprobs[0][first]
    lp_biased = run(offline, greedy(max_tokens=1, logprobs=0, logit_bias={7: 100.0},
                                    ignore_eos=True)).outputs[0].logprobs[0]
    assert 7 in lp_biased and lp_biased[7].logprob < lp_plain.logprob


def test_allowed_token_ids_bound_every_sampled_token(offline):
    allowed = [40, 41, 42, 43]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    plain = run(offline, params).outputs[0].token_ids
    assert not set(plain) <= set(allowed)       # the plain sample leaves the set...
    params.allowed_token_ids = allowed
    params.validate()
    got = run(offline, params).outputs[0].token_ids
    assert len(got) == 40 and set(got) <= set(allowed)    # ... the restricted one never


def _two_token_word(tok, ids):
    """The first (i, word): ids[i:i+2] decodes to a word with no leading space that
    encodes back to exactly those two tokens."""
    for i in range(len(ids) - 1):
        word = tok.decode(ids[i:i + 2])
        if (word.strip() and word == word.lstrip() and "\ufffd" not in word
                and tok.encode(word, add_special_tokens=False) == ids[i:i + 2]):
            return i, word
    pytest.skip("the greedy output holds no re-encodable two-token word")


def test_bad_words_change_the_output_exactly_where_the_word_would_complete(offline):
    tok = offline.llm_engine.tokenizer
    plain = run(offline, greedy(max_tokens=24, ignore_eos=True)).outputs[0].token_ids
    i, word = _two_token_word(tok, plain)
    got = run(offline, greedy(max_tokens=24, ignore_eos=True, bad_words=[word])
              ).outputs[0].token_ids
    assert got[:i + 1] == plain[:i + 1]           # its first token alone is allowed
    assert got[i + 1] != plain[i + 1]             # the token that completes it is not
    for j in range(len(got) - 1):
        assert got[j:j + 2] != plain[i:i + 2]


def test_bad_words_need_a_tokenizer(tiny_llama):
    llm = LLM(model=str(tiny_llama), block_size=4, num_gpu_blocks_override=64, progress=False)
    with pytest.raises(ValueError, match=r"^prompt 0: SamplingParams\.bad_words=.*no tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams(bad_words=["x"]))


def test_truncate_prompt_tokens_keeps_the_last_k(offline):
    ids = offline.llm_engine.encode(PROMPT)
    out = run(offline, greedy(truncate_prompt_tokens=3))
    assert out.prompt_token_ids == ids[-3:]
    assert out.outputs[0].token_ids == run(offline, greedy(), ids[-3:]).outputs[0].token_ids
    assert run(offline, greedy(truncate_prompt_tokens=-1)).prompt_token_ids == ids
    assert run(offline, greedy(truncate_prompt_tokens=100)).prompt_token_ids == ids


def test_detokenize_false_gives_the_same_tokens_and_no_text(offline):
    plain = run(offline, greedy()).outputs[0]
    bare = run(offline, greedy(detokenize=False)).outputs[0]
    assert plain.text and bare.text == "" and bare.token_ids == plain.token_ids


def test_skip_special_tokens_false_shows_them(offline):
    tok = offline.llm_engine.tokenizer
    special = dict(allowed_token_ids=[1, 2], ignore_eos=True, max_tokens=4)
    hidden = run(offline, greedy(**special)).outputs[0]
    shown = run(offline, greedy(skip_special_tokens=False, **special)).outputs[0]
    assert hidden.token_ids == shown.token_ids and hidden.text == ""
    assert shown.text == tok.decode(shown.token_ids, skip_special_tokens=False)
    assert shown.text.startswith("<|im_")


class _SpacedTokenizer:
    """Decodes with a space between every two tokens (as a WordPiece decoder does); ids 0
    and 1 are added special tokens."""
    words = ["<s>", "</s>", "a", "b"]
    added_tokens_decoder = {0: "<s>", 1: "</s>"}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[t] for t in ids if not (skip_special_tokens and t < 2))


@pytest.mark.parametrize("spaces,want", [(True, "a <s> </s> <s> b"), (False, "a <s></s><s> b")])
def test_spaces_between_special_tokens(spaces, want):
    ids = [2, 0, 1, 0, 3]
    detok = IncrementalDetokenizer(_SpacedTokenizer(), skip_special_tokens=False,
                                   spaces_between_special_tokens=spaces)
    for end in range(1, len(ids) + 1):            # token by token, as the engine grows it
        detok.update(ids[:end])
    assert detok.text == want
    assert detok.copy().decode(ids) == want       # a forked child keeps the options
    # With special tokens skipped the option has nothing to separate (vLLM's rule).
    skip = IncrementalDetokenizer(_SpacedTokenizer(), spaces_between_special_tokens=spaces)
    skip.update(ids)
    assert skip.text == "a b"


def test_logprobs_minus_one_is_the_whole_vocabulary(offline):
    vocab = offline.llm_engine.model.config.vocab_size
    out = run(offline, greedy(max_tokens=3, logprobs=-1, prompt_logprobs=-1))
    for position in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
        assert len(position) == vocab
        assert np.isclose(sum(np.exp(lp.logprob) for lp in position.values()), 1.0, atol=1e-4)
        ranks = sorted(lp.rank for lp in position.values())
        assert ranks[0] == 1 and ranks[-1] == vocab
    top5 = run(offline, greedy(max_tokens=3, logprobs=5)).outputs[0].logprobs
    for full, five in zip(out.outputs[0].logprobs, top5):
        for t, lp in five.items():
            assert full[t].logprob == lp.logprob and full[t].rank == lp.rank


def test_rows_that_rewrite_logits_do_not_speculate(tiny_chat_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    kw = dict(model=str(tiny_chat_llama), block_size=4, num_gpu_blocks_override=256, progress=False)
    plain, spec_llm = LLM(**kw), LLM(speculative_config=spec, **kw)
    for extra in ({"logit_bias": {40: 3.0}}, {"allowed_token_ids": list(range(30, 90))},
                  {"bad_words": ["pool"]}):
        params = greedy(max_tokens=16, ignore_eos=True, **extra)
        want = run(plain, params).outputs[0].token_ids
        assert run(spec_llm, params).outputs[0].token_ids == want, extra
    assert spec_llm.llm_engine.speculator.adaptive is not None


def test_bad_words_hold_for_every_parallel_sample(offline):
    """n > 1: the children forked from the parent carry its bad-word sequences too."""
    tok = offline.llm_engine.tokenizer
    params = dict(temperature=0.0, max_tokens=16, ignore_eos=True, n=3)
    plain = run(offline, SamplingParams(**params)).outputs
    ids = plain[0].token_ids
    word = next((tok.decode([t]) for t in ids[2:] if tok.decode([t]).strip()
                 and tok.decode([t]) == tok.decode([t]).lstrip()
                 and tok.encode(tok.decode([t]), add_special_tokens=False) == [t]), None)
    if word is None:
        pytest.skip("the greedy output holds no re-encodable one-token word")
    banned = set(offline.llm_engine.bad_words_token_ids(SamplingParams(bad_words=[word]))[0])
    got = run(offline, SamplingParams(bad_words=[word], **params)).outputs
    assert len(got) == 3
    for child in got:
        assert not banned & set(child.token_ids)
        assert child.token_ids == got[0].token_ids         # greedy: all alike, as plain
