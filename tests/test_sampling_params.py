"""SamplingParams: vLLM's names and defaults, and a clear error for every wrong type or range."""

import numpy as np
import pytest

from refserve.sampling import SamplingParams


def test_vllm_defaults_and_spellings():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0,
                                                                              0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and not p.include_stop_str_in_output
    assert SamplingParams(top_k=-1).top_k == 0          # both mean "off"
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(seed=-1).seed is None         # -1 means "no seed"
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    # vLLM's other fields and their defaults: every one off.
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words, p.truncate_prompt_tokens) == (
        None, None, None, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.rewrites_logits
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1   # whole vocabulary
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1


def test_vllm_fields_are_normalised():
    p = SamplingParams(logit_bias={np.int64(3): np.float32(1.5), 4: -100},
                       allowed_token_ids=np.array([9, 2, 9]), bad_words=("no",))
    assert p.logit_bias == {3: 1.5, 4: -100.0}
    assert all(type(t) is int for t in p.logit_bias)
    assert all(type(b) is float for b in p.logit_bias.values())
    assert p.allowed_token_ids == [2, 9] and p.bad_words == ["no"]
    assert p.rewrites_logits
    for kw in ({"logit_bias": {1: 0.5}}, {"allowed_token_ids": [1]}, {"bad_words": ["x"]}):
        assert SamplingParams(**kw).rewrites_logits, kw


def test_token_ids_are_checked_against_the_vocabulary():
    SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[9], stop_token_ids=[9]).check_vocab(10)
    for kw, field in (({"logit_bias": {10: 1.0}}, "logit_bias"),
                      ({"allowed_token_ids": [3, 10]}, "allowed_token_ids"),
                      ({"stop_token_ids": [12]}, "stop_token_ids")):
        with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}=.*token id 1[02] is "
                                             r"outside the vocabulary \(valid ids are 0\.\.9\)"):
            SamplingParams(**kw).check_vocab(10)


def test_numpy_numbers_are_numbers_and_stored_as_python():
    p = SamplingParams(max_tokens=np.int64(8), temperature=np.float32(0.5), top_k=np.int32(4),
                       stop_token_ids=np.array([3, 4]), ignore_eos=np.bool_(True), top_p=1)
    assert p.max_tokens == 8 and type(p.max_tokens) is int
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.top_p) is float
    assert p.stop_token_ids == [3, 4] and all(type(t) is int for t in p.stop_token_ids)
    assert p.ignore_eos is True


def test_validate_is_idempotent():
    p = SamplingParams(top_k=-1, seed=-1)
    p.validate()
    assert (p.top_k, p.seed) == (0, None)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": "0.9"}, "top_p"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"n": True}, "n"),
    ({"n": 2.0}, "n"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"max_tokens": 8.0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": 1.0}, "seed"),
    ({"min_tokens": None}, "min_tokens"),
    ({"logprobs": 1.0}, "logprobs"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"min_p": None}, "min_p"),
    ({"repetition_penalty": "1.1"}, "repetition_penalty"),
    ({"presence_penalty": None}, "presence_penalty"),
    ({"frequency_penalty": [0.1]}, "frequency_penalty"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"stop_token_ids": 7}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": None}, "spaces_between_special_tokens"),
    ({"detokenize": "false"}, "detokenize"),
    ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
    ({"logit_bias": [(1, 2.0)]}, "logit_bias"),
    ({"logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"logit_bias": {1: "2"}}, "logit_bias"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.0]}, "allowed_token_ids"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": ["ok", 3]}, "bad_words"),
])
def test_wrong_types_are_type_errors_naming_the_field(kwargs, field):
    with pytest.raises(TypeError, match=rf"^SamplingParams\.{field}="):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"seed": -2}, "seed"),
    ({"logprobs": -2}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -3}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: float("inf")}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"detokenize": False, "stop": ["x"]}, "detokenize"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_out_of_range_values_are_value_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}="):
        SamplingParams(**kwargs)


def test_unknown_field_is_rejected():
    with pytest.raises(TypeError, match="best_of_wrong"):
        SamplingParams(best_of_wrong=2)


def test_max_output_tokens():
    assert SamplingParams(max_tokens=None).max_output_tokens(10, 64) == 54
    assert SamplingParams(max_tokens=8).max_output_tokens(10, 64) == 8
    assert SamplingParams(max_tokens=80).max_output_tokens(10, 64) == 54
    assert SamplingParams(max_tokens=None).max_output_tokens(70, 64) == 0


def test_greedy_flag_follows_vllm_cutoff():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-3).greedy
