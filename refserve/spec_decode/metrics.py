"""How well speculation pays: counts per request or per run, and the expected-value formula.

Per verify step a request proposes n draft tokens and gets back `num_accepted` accepted ones
plus one recovered or bonus token. Over many steps:

    proposed                  Σ n                    draft tokens sent to the target
    accepted                  Σ num_accepted         draft tokens kept
    acceptance rate           accepted / proposed    (vLLM's "draft acceptance rate")
    mean accepted length      (accepted + verify_steps) / verify_steps
                              tokens emitted per target pass, the recovered or bonus token
                              included (vLLM's "mean acceptance length")
    α estimate                accepted / (accepted + rejections)

The acceptance rate is not α: drafts after a rejection count as proposed but were never
tested. If each draft is accepted independently with probability α (Leviathan et al.), a step
with k drafts emits on average

    E[tokens per target pass] = 1 + α + α² + ... + α^k = (1 - α^(k+1)) / (1 - α)

while accepted / proposed = α (1 - α^k) / (k (1 - α)). α itself is estimated from the tests
actually run: every accepted draft is one passed test and every rejection one failed test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """(1 - α^(k+1)) / (1 - α): tokens one verify step emits on average (k + 1 when α = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r}: must be in [0, 1]")
    if k < 0:
        raise ValueError(f"k={k!r}: must be >= 0")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class SpecDecodeStats:
    """Running counts for one request or one run; `add` takes one batch of verify results."""

    verify_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0

    def add(self, num_draft: np.ndarray, num_accepted: np.ndarray) -> None:
        """Record verify steps with `num_draft[b]` proposed and `num_accepted[b]` accepted.
        Rows with no drafts are plain decode steps and are not counted."""
        num_draft = np.asarray(num_draft)
        num_accepted = np.asarray(num_accepted)
        if np.any(num_accepted > num_draft) or np.any(num_accepted < 0):
            raise ValueError("num_accepted must lie in [0, num_draft] for every row")
        speculated = num_draft > 0
        self.verify_steps += int(speculated.sum())
        self.proposed += int(num_draft[speculated].sum())
        self.accepted += int(num_accepted[speculated].sum())
        self.rejections += int((num_accepted < num_draft).sum())

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per target pass, the recovered or bonus token included."""
        if not self.verify_steps:
            return None
        return (self.accepted + self.verify_steps) / self.verify_steps

    @property
    def alpha_estimate(self) -> float | None:
        tests = self.accepted + self.rejections
        return self.accepted / tests if tests else None
