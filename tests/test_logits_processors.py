"""Logits processors: penalties' arithmetic, min_tokens, and how the Sampler applies them."""

import numpy as np
import pytest

from refserve.backends import NumpyBackend
from refserve.logits_processors import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    bad_words_token_ids,
)
from refserve.sampling import Sampler, SamplingParams, make_generator


def sampler() -> Sampler:
    """The Sampler on the reference backend."""
    return Sampler(NumpyBackend())

ROW = np.array([2.0, -2.0, 1.0, 0.5, -0.5, 3.0], dtype=np.float32)


def penalised(prompt, output, **kw):
    return apply_penalties(ROW.copy(), SamplingParams(**kw), prompt, output)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # Seen: 0 (prompt), 1 and 4 (output). Unseen tokens keep their logits.
    got = penalised([0], [1, 4, 1], repetition_penalty=2.0)
    np.testing.assert_array_equal(got, [1.0, -4.0, 1.0, 0.5, -1.0, 3.0])


def test_repetition_penalty_below_one_rewards_seen_tokens():
    got = penalised([5], [1], repetition_penalty=0.5)
    np.testing.assert_array_equal(got, [2.0, -1.0, 1.0, 0.5, -0.5, 6.0])


def test_frequency_and_presence_penalties_count_output_tokens_only():
    # Output: token 2 twice, token 3 once; token 0 only in the prompt is not penalised.
    got = penalised([0, 0], [2, 3, 2], frequency_penalty=0.5, presence_penalty=0.25)
    np.testing.assert_allclose(got, [2.0, -2.0, 1.0 - 2 * 0.5 - 0.25, 0.5 - 0.5 - 0.25,
                                     -0.5, 3.0])


def test_negative_frequency_penalty_encourages_repetition():
    got = penalised([], [4, 4], frequency_penalty=-1.0)
    assert got[4] == -0.5 + 2.0


def test_all_penalties_in_vllm_order():
    # repetition first (on the raw logit), then frequency and presence.
    got = penalised([], [0, 0], repetition_penalty=2.0, frequency_penalty=0.5,
                    presence_penalty=0.5)
    assert got[0] == 2.0 / 2.0 - 2 * 0.5 - 0.5


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    params = SamplingParams(min_tokens=3, stop_token_ids=[2, 99])
    for n_out in range(3):
        got = apply_min_tokens(ROW.copy(), params, n_out, eos_token_id=5)
        assert got[5] == -np.inf and got[2] == -np.inf
        np.testing.assert_array_equal(np.delete(got, [2, 5]), np.delete(ROW, [2, 5]))
    np.testing.assert_array_equal(apply_min_tokens(ROW.copy(), params, 3, 5), ROW)


def test_min_tokens_with_ignore_eos_leaves_eos_alone():
    got = apply_min_tokens(ROW.copy(), SamplingParams(min_tokens=2, ignore_eos=True), 0, 5)
    np.testing.assert_array_equal(got, ROW)


def test_sampler_greedy_respects_min_tokens_then_lets_eos_through():
    eos = 5                               # token 5 has the largest logit
    params = [SamplingParams(temperature=0.0, min_tokens=2)] * 3
    out = sampler().sample(np.stack([ROW] * 3), params, [make_generator(0)] * 3,
                           output_token_ids=[[], [7], [7, 7]], eos_token_id=eos)
    assert out == [0, 0, 5]


def test_sampler_never_draws_a_banned_eos():
    rows = np.stack([ROW] * 200)
    params = [SamplingParams(temperature=2.0, min_tokens=1, stop_token_ids=[0])] * 200
    out = sampler().sample(rows, params, [make_generator(i) for i in range(200)],
                           output_token_ids=[[]] * 200, eos_token_id=5)
    assert 5 not in out and 0 not in out


def test_sampler_penalties_change_greedy_choice_and_leave_logits_untouched():
    logits = np.stack([ROW, ROW])
    before = logits.copy()
    params = [SamplingParams(temperature=0.0, repetition_penalty=4.0), SamplingParams(
        temperature=0.0)]
    out = sampler().sample(logits, params, [make_generator(0)] * 2,
                           prompt_token_ids=[[5], [5]], output_token_ids=[[], []])
    assert out == [0, 5]          # 3.0 / 4 < 2.0: token 0 wins once token 5 is penalised
    np.testing.assert_array_equal(logits, before)


def test_sampler_asks_for_the_token_history_it_needs():
    with pytest.raises(ValueError, match="output_token_ids"):
        sampler().sample(ROW[None], [SamplingParams(presence_penalty=1.0)], [make_generator(0)])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sampler().sample(ROW[None], [SamplingParams(repetition_penalty=1.2)],
                         [make_generator(0)], output_token_ids=[[1]])


# ---- vLLM's allowed_token_ids, bad_words, logit_bias --------------------------------------

def test_allowed_token_ids_keep_only_those_logits():
    got = apply_allowed_token_ids(ROW.copy(), SamplingParams(allowed_token_ids=[1, 3]))
    np.testing.assert_array_equal(got[[1, 3]], ROW[[1, 3]])
    assert np.all(np.isneginf(np.delete(got, [1, 3])))


def test_logit_bias_adds_to_those_logits_only():
    got = apply_logit_bias(ROW.copy(), SamplingParams(logit_bias={0: -1.5, 4: 2.0}))
    np.testing.assert_array_equal(got, ROW + np.array([-1.5, 0, 0, 0, 2.0, 0], np.float32))


@pytest.mark.parametrize("output,banned", [
    ([], {5}),                 # a one-token word is banned everywhere
    ([7], {5}),                # [3, 1]'s head 3 is not the last token: 1 stays
    ([7, 3], {5, 1}),          # ... now it is: 1 would complete [3, 1]
    ([3, 7], {5}),             # the head must be the LAST tokens
    ([2, 3], {5, 1, 4}),       # [2, 3, 4]: heads of length 2 too
    ([9, 3], {5, 1}),
])
def test_bad_words_ban_only_the_completing_token(output, banned):
    got = apply_bad_words(ROW.copy(), [[5], [3, 1], [2, 3, 4]], output)
    assert set(np.flatnonzero(np.isneginf(got)).tolist()) == banned
    keep = [t for t in range(len(ROW)) if t not in banned]
    np.testing.assert_array_equal(got[keep], ROW[keep])


class _WordTokenizer:
    """A fixed table of encodings, as a BPE tokenizer would give them."""
    table = {"bad": [0], " bad": [1],           # a word-initial variant: a second sequence
             "ok": [2], " ok": [3, 4],          # the spaced form splits: not a variant
             "d": [5], " d": [5]}               # the same first token: nothing new

    def encode(self, text, add_special_tokens=False):
        assert not add_special_tokens
        return self.table[text]


def test_bad_words_token_ids_cover_the_word_with_and_without_its_space():
    assert bad_words_token_ids(["bad", "  ok", "d"], _WordTokenizer()) == [[0], [1], [2], [5]]


def test_sampler_applies_the_vllm_processors_in_order_and_greedy_follows():
    # ROW's argmax is 5 (3.0); then 0 (2.0), then 2 (1.0).
    greedy = SamplingParams(temperature=0.0)
    cases = [(dict(logit_bias={5: -1.5}), 0),             # 3.0 - 1.5 < 2.0
             (dict(logit_bias={2: 2.5}), 2),              # 1.0 + 2.5 > 3.0
             (dict(allowed_token_ids=[1, 3]), 3),
             (dict(allowed_token_ids=[1, 3], logit_bias={1: 5.0}), 1),
             (dict(allowed_token_ids=[0, 2], logit_bias={4: 100.0}), 0),   # not allowed
             (dict(bad_words=["x"]), 0),
             ({}, 5)]
    for kw, want in cases:
        params = SamplingParams(temperature=0.0, **kw)
        out = sampler().sample(np.stack([ROW, ROW]), [params, greedy], [make_generator(0)] * 2,
                               output_token_ids=[[], []], bad_words_token_ids=[[[5]], []])
        assert out == [want, 5], kw          # the plain row beside it is untouched


def test_sampler_never_draws_outside_allowed_token_ids():
    params = [SamplingParams(temperature=5.0, allowed_token_ids=[1, 4])] * 300
    out = sampler().sample(np.stack([ROW] * 300), params, [make_generator(i) for i in range(300)])
    assert set(out) == {1, 4}


def test_sampler_asks_for_the_bad_words_token_ids():
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        sampler().sample(ROW[None], [SamplingParams(bad_words=["x"])], [make_generator(0)],
                         output_token_ids=[[]])
