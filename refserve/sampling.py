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


def make_generator(seed: int | None, child_index: int = 0) -> np.random.Generator:
    """The random stream of one sequence: child i of a seeded request uses seed + i, so
    `SamplingParams(n=4, seed=s)` child i draws exactly what `SamplingParams(seed=s + i)` does."""
    return np.random.default_rng(None if seed is None else seed + child_index)


def sample_from_logits(logits: np.ndarray, params: SamplingParams,
                       generator: np.random.Generator) -> int:
    """Draw one token id from one row of logits (see the module docstring for the rule)."""
    if params.greedy:
        return int(np.argmax(logits))
    probs = probabilities(logits, params)
    # One uniform per token, inverse-CDF: the smallest token whose cumulative mass exceeds u.
    u = generator.random()
    cdf = np.cumsum(probs, dtype=np.float64)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1))


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from: softmax(logits / T) restricted to top-k and then
    to the top-p nucleus, renormalised. Tokens outside get probability 0."""
    x = np.asarray(logits, dtype=np.float64) / max(params.temperature, 1e-8)
    if params.top_k != -1 and params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        # Keep a token if the mass strictly before it is < top_p: the smallest such set.
        keep_sorted = (np.cumsum(sorted_probs) - sorted_probs) < params.top_p
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[keep_sorted]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


class Sampler:
    """Samples one token per row of logits, each row with its own sequence's params and
    generator. Greedy rows are one vectorised argmax."""

    def sample(self, logits: np.ndarray, params: list[SamplingParams],
               generators: list[np.random.Generator]) -> list[int]:
        tokens = np.argmax(logits, axis=-1).tolist() if len(logits) else []
        for i, (p, g) in enumerate(zip(params, generators)):
            if not p.greedy:
                tokens[i] = sample_from_logits(logits[i], p, g)
        return tokens
