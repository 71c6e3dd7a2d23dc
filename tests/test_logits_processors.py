"""Logits processors: penalties' arithmetic, min_tokens, and how the Sampler applies them."""

import numpy as np
import pytest

from refserve.logits_processors import apply_min_tokens, apply_penalties
from refserve.sampling import Sampler, SamplingParams, make_generator

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
    sampler, eos = Sampler(), 5           # token 5 has the largest logit
    params = [SamplingParams(temperature=0.0, min_tokens=2)] * 3
    out = sampler.sample(np.stack([ROW] * 3), params, [make_generator(0)] * 3,
                         output_token_ids=[[], [7], [7, 7]], eos_token_id=eos)
    assert out == [0, 0, 5]


def test_sampler_never_draws_a_banned_eos():
    rows = np.stack([ROW] * 200)
    params = [SamplingParams(temperature=2.0, min_tokens=1, stop_token_ids=[0])] * 200
    out = Sampler().sample(rows, params, [make_generator(i) for i in range(200)],
                           output_token_ids=[[]] * 200, eos_token_id=5)
    assert 5 not in out and 0 not in out


def test_sampler_penalties_change_greedy_choice_and_leave_logits_untouched():
    logits = np.stack([ROW, ROW])
    before = logits.copy()
    params = [SamplingParams(temperature=0.0, repetition_penalty=4.0), SamplingParams(
        temperature=0.0)]
    out = Sampler().sample(logits, params, [make_generator(0)] * 2,
                           prompt_token_ids=[[5], [5]], output_token_ids=[[], []])
    assert out == [0, 5]          # 3.0 / 4 < 2.0: token 0 wins once token 5 is penalised
    np.testing.assert_array_equal(logits, before)


def test_sampler_asks_for_the_token_history_it_needs():
    with pytest.raises(ValueError, match="output_token_ids"):
        Sampler().sample(ROW[None], [SamplingParams(presence_penalty=1.0)], [make_generator(0)])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sampler().sample(ROW[None], [SamplingParams(repetition_penalty=1.2)],
                         [make_generator(0)], output_token_ids=[[1]])
