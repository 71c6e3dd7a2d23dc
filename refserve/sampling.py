"""Sampling: what a request asks for (`SamplingParams`) and how a token is drawn (`Sampler`).

The sampler turns one row of logits into one token id:

    greedy (temperature == 0):  argmax(logits)
    otherwise:                  p = softmax(logits / temperature)
                                keep the top_k most likely tokens (top_k = -1: all),
                                keep the smallest set whose mass reaches top_p (nucleus),
                                renormalise, draw one token with the sequence's generator.

Randomness is per sequence: each sequence owns a `numpy.random.Generator` seeded from its
request's seed (child i of a parallel-sampling request uses seed + i), and draws exactly one
uniform per sampled token. So a seeded request produces the same tokens whatever else is
in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SamplingParams:
    """Per-request generation settings; names follow vLLM's `SamplingParams`.

    Invalid values raise `ValueError` naming the field, at construction time.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", "must be a non-negative integer or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
