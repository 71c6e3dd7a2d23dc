"""Deterministic workloads: everything a scenario sends is a function of its seed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_requests: int, seed: int, vocab_size: int, prompt_range=(16, 128),
                  mean_output=120, output_range=(16, 512)) -> Workload:
    """Chat-like traffic: short prompts, long-tailed outputs.

    Output lengths are lognormal with mean `mean_output` (sigma 0.8, so the median is about
    0.73 x the mean and a few requests run 3-4x longer), clipped to `output_range`. Prompt
    tokens are drawn from the ordinary part of the vocabulary (ids >= 1000, skipping the
    special tokens)."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    mu = np.log(mean_output) - sigma**2 / 2          # E[lognormal] = exp(mu + sigma²/2)
    lens = np.clip(np.round(rng.lognormal(mu, sigma, num_requests)), *output_range)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, num_requests)
    low = min(1000, vocab_size // 2)
    prompts = [rng.integers(low, vocab_size, size=int(n)).tolist() for n in prompt_lens]
    return Workload(prompts, [int(x) for x in lens])


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s from start) of a Poisson process of `rate` requests/s: the gaps are
    independent exponentials with mean 1/rate."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, num_requests)).tolist()
