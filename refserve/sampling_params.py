"""`SamplingParams`: what one request asks for. Names, defaults and meanings are vLLM's.

| field | default | meaning |
| --- | --- | --- |
| n | 1 | samples per prompt (children share the prompt's blocks, copy-on-write) |
| max_tokens | 16 | most output tokens; None: up to max_model_len |
| min_tokens | 0 | EOS and stop_token_ids are suppressed until this many output tokens |
| temperature | 1.0 | logits / T before softmax; 0 (below 1e-5) means greedy (argmax) |
| top_k | 0 | keep the k most likely tokens; 0 or -1: off (-1 is stored as 0) |
| top_p | 1.0 | keep the smallest most-likely set whose mass reaches top_p (nucleus) |
| min_p | 0.0 | keep tokens with p >= min_p * max(p) |
| repetition_penalty | 1.0 | HF/vLLM: tokens seen in prompt or output: logit / r if > 0, else * r |
| presence_penalty | 0.0 | OpenAI: subtract once from every token seen in the output |
| frequency_penalty | 0.0 | OpenAI: subtract per occurrence in the output |
| seed | None | per-request random stream; -1 means None |
| stop | [] | stop strings (a single string is accepted) |
| stop_token_ids | [] | token ids that end the sequence (besides EOS) |
| include_stop_str_in_output | False | keep the matched stop string in the text |
| ignore_eos | False | EOS does not end the sequence |
| logprobs | None | per output token: top-N logprobs plus the sampled token's (N <= 20; -1: all) |
| prompt_logprobs | None | per prompt token: top-N logprobs plus that token's (N <= 20; -1: all) |
| logit_bias | None | {token_id: bias}: added to that token's logit every step (before penalties) |
| allowed_token_ids | None | only these token ids can be generated (every other logit is -inf) |
| bad_words | None | words never generated: the token that would complete one gets logit -inf |
| truncate_prompt_tokens | None | keep only the last k prompt tokens (k >= 1; -1: max_model_len) |
| skip_special_tokens | True | special tokens (EOS, chat markers) add no text to the output |
| spaces_between_special_tokens | True | False: no space between two adjacent special tokens |
| detokenize | True | False: no output text at all (token ids only; stop strings then refused) |

-1 for logprobs means every vocabulary entry at every position (a dict of V entries each
step: costly, asked for explicitly). The logits processors (logit_bias, allowed_token_ids,
bad_words, min_tokens, penalties) are in refserve/logits_processors.py; the three text
options in refserve/sequence.py (its incremental detokenizer). Token
ids are checked against the model's vocabulary when the request is added (the engine knows
it, these params do not), with the same `SamplingParams.<field>=` message.

Every field is checked for its type (TypeError) and its range (ValueError) at construction,
with a message that starts `SamplingParams.<field>=<value>:`. Integers may be Python or NumPy
integers, floats any real number; bools are not numbers here (`n=True` is a mistake), and
strings are never parsed (`temperature="0.5"` is a mistake). Accepted values are stored as
plain Python `int` / `float` / `list`, so the rest of the engine never sees NumPy scalars.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

GREEDY_BELOW = 1e-5     # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
# Most top tokens one position may report: vLLM's default max_logprobs. Each one is a dict
# entry per generated token, so an unbounded N (say 10**6) would build a vocabulary-sized
# dict every step.
MAX_LOGPROBS = 20

# Field name -> (kind, allows None). kind: "int" | "float" | "bool".
_SCALARS = {
    "n": ("int", False), "max_tokens": ("int", True), "min_tokens": ("int", False),
    "temperature": ("float", False), "top_k": ("int", False), "top_p": ("float", False),
    "min_p": ("float", False), "repetition_penalty": ("float", False),
    "presence_penalty": ("float", False), "frequency_penalty": ("float", False),
    "seed": ("int", True), "logprobs": ("int", True), "prompt_logprobs": ("int", True),
    "ignore_eos": ("bool", False), "include_stop_str_in_output": ("bool", False),
    "truncate_prompt_tokens": ("int", True), "skip_special_tokens": ("bool", False),
    "spaces_between_special_tokens": ("bool", False), "detokenize": ("bool", False),
}
ALL_VOCAB = -1          # logprobs / prompt_logprobs = -1: every token of the vocabulary


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


@dataclass
class SamplingParams:
    """Per-request generation settings (see the module docstring for each field)."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def _error(self, exc: type[Exception], name: str, why: str) -> Exception:
        return exc(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

    def validate(self) -> None:
        """Check and normalise every field, raising TypeError / ValueError naming the field,
        then derive what the sampler asks of every row (call it again after changing a
        field):

            greedy           temperature < 1e-5 (vLLM's cut-off): argmax, no random draw
            has_penalties    a repetition / presence / frequency penalty changes the logits
            rewrites_logits  a logits processor other than min_tokens changes the logits at
                             every step (penalties, logit_bias, allowed_token_ids,
                             bad_words): such rows never speculate (the verify step does
                             not apply processors)
        """
        self._check_types()
        if self.seed == -1:
            self.seed = None        # vLLM: -1 means "no seed"
        if self.top_k == -1:
            self.top_k = 0          # vLLM: 0 and -1 both mean "off"; one spelling inside

        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise self._error(ValueError, name, why)

        check(self.n >= 1, "n", "must be an integer >= 1")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
              "must be an integer >= 1, or None for 'up to max_model_len'")
        check(self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be <= max_tokens={self.max_tokens}")
        check(np.isfinite(self.temperature) and self.temperature >= 0, "temperature",
              "must be a finite number >= 0 (0 means greedy)")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(self.top_k >= 0, "top_k", "must be 0 or -1 (off) or an integer >= 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(np.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
              "repetition_penalty", "must be a finite number > 0 (1 means off)")
        for name in ("presence_penalty", "frequency_penalty"):
            check(-2.0 <= getattr(self, name) <= 2.0, name, "must be in [-2, 2] (0 means off)")
        check(self.seed is None or self.seed >= 0, "seed",
              "must be an integer >= 0, or None / -1 for an unseeded request")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or value == ALL_VOCAB or 0 <= value <= MAX_LOGPROBS, name,
                  f"must be None, an integer in 0..{MAX_LOGPROBS} (how many top tokens to "
                  "report; vLLM's max_logprobs) or -1 (the whole vocabulary)")
        check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "token ids must be >= 0")
        check(self.detokenize or not self.stop, "detokenize",
              "stop strings need the text: detokenize=False cannot be used with stop "
              "(vLLM's rule); use stop_token_ids instead")
        check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1
              or self.truncate_prompt_tokens == -1, "truncate_prompt_tokens",
              "must be None, an integer >= 1 (keep the last k prompt tokens) or -1 (the last "
              "max_model_len)")
        check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
              "allowed_token_ids", "must be None or a non-empty list (an empty one would "
              "allow no token at all)")
        for name in ("allowed_token_ids", "logit_bias"):
            ids = getattr(self, name) or ()
            check(all(t >= 0 for t in ids), name, "token ids must be >= 0")
        check(all(np.isfinite(b) for b in (self.logit_bias or {}).values()), "logit_bias",
              "biases must be finite numbers (-100 bans a token in practice, +100 forces it)")
        check(all(w.strip() for w in self.bad_words or ()), "bad_words",
              "bad words must be non-empty, non-blank strings")
        self.greedy = self.temperature < GREEDY_BELOW
        self.has_penalties = (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                              or self.frequency_penalty != 0.0)
        self.rewrites_logits = (self.has_penalties or bool(self.logit_bias)
                                or self.allowed_token_ids is not None or bool(self.bad_words))

    def check_vocab(self, vocab_size: int) -> None:
        """The token-id fields against the model's vocabulary (0..vocab_size-1), as vLLM's
        input processor checks them; ValueError naming the field."""
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            bad = sorted(t for t in getattr(self, name) or () if t >= vocab_size)
            if bad:
                raise self._error(ValueError, name, f"token id {bad[0]} is outside the "
                                  f"vocabulary (valid ids are 0..{vocab_size - 1})")

    def _check_types(self) -> None:
        for name, (kind, nullable) in _SCALARS.items():
            value = getattr(self, name)
            if value is None and nullable:
                continue
            if kind == "bool":
                if not isinstance(value, (bool, np.bool_)):
                    raise self._error(TypeError, name, f"must be True or False, got "
                                      f"{type(value).__name__}")
                setattr(self, name, bool(value))
            elif kind == "int":
                if not _is_int(value):
                    what = "an integer" + (" or None" if nullable else "")
                    raise self._error(TypeError, name,
                                      f"must be {what}, got {type(value).__name__}")
                setattr(self, name, int(value))
            else:
                if not _is_real(value):
                    raise self._error(TypeError, name,
                                      f"must be a number, got {type(value).__name__}")
                setattr(self, name, float(value))
        # stop: None, one string, or a sequence of strings.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop = list(self.stop)
        else:
            raise self._error(TypeError, "stop", "must be a string, a list of strings or None")
        # stop_token_ids: None or a sequence of integers (a NumPy array included).
        ids = self.stop_token_ids
        if ids is None:
            self.stop_token_ids = []
        elif (isinstance(ids, (list, tuple, np.ndarray)) and np.ndim(ids) == 1
              and all(_is_int(t) for t in ids)):
            self.stop_token_ids = [int(t) for t in ids]
        else:
            raise self._error(TypeError, "stop_token_ids",
                              "must be a list of integer token ids or None")
        ids = self.allowed_token_ids
        if ids is not None:
            if not (isinstance(ids, (list, tuple, set, frozenset, np.ndarray))
                    and np.ndim(list(ids)) == 1 and all(_is_int(t) for t in ids)):
                raise self._error(TypeError, "allowed_token_ids",
                                  "must be a list of integer token ids or None")
            self.allowed_token_ids = sorted({int(t) for t in ids})
        bias = self.logit_bias
        if bias is not None:
            if not (isinstance(bias, dict) and all(_is_int(t) for t in bias)
                    and all(_is_real(b) for b in bias.values())):
                raise self._error(TypeError, "logit_bias",
                                  "must be a dict {token_id (int): bias (number)} or None")
            self.logit_bias = {int(t): float(b) for t, b in bias.items()}
        words = self.bad_words
        if words is not None:
            if not (isinstance(words, (list, tuple)) and all(isinstance(w, str) for w in words)):
                raise self._error(TypeError, "bad_words", "must be a list of strings or None")
            self.bad_words = list(words)

    def max_output_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """How many tokens this request may generate: max_tokens, capped by what is left of
        max_model_len after the prompt (max_tokens=None: all of it)."""
        room = max(max_model_len - num_prompt_tokens, 0)
        return room if self.max_tokens is None else min(self.max_tokens, room)
