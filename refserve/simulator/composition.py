"""What one engine step computes, as the handful of sums the cost model prices.

A step is rows of "q query tokens at the end of a context of c tokens" (a prefill chunk, a
decode: q = 1, a speculative verify: q = k + 1); l of a row's positions need logits. Its
composition (`StepComposition`):

    R = number of rows                    T = sum q      (query tokens)
    S = sum l      (logits rows)          C = sum c      (KV tokens read)
    A = sum (q c - q (q - 1) / 2)         query-key pairs: query j of a row attends the
                                          c - q + j + 1 keys up to itself (causal)
    N = rows that sample (l > 0)          P = rows with query tokens that need no logits

and, for a GPU's tiled attention kernel (FlashAttention and its kin compute attention in
tiles of ATTENTION_TILE queries x ATTENTION_TILE keys, the causal diagonal tiles in full):

    D = sum c over rows with q = 1        the decodes' query-key pairs (no tiles)
    K = tile iterations of the rows with q >= 2: query tile j of a row runs over every key
        tile up to its last query, ceil((c - q + min((j + 1) B, q)) / B) of them
    Q = query tiles of the rows with q >= 2: ceil(q / B) each (each pays a fixed prologue
        and epilogue, cost_model.TILE_OVERHEAD)

`scheduled` is 1 when the scheduler ran before the step and 0 for a step that continues a
multi-step round (vLLM V0's --num-scheduler-steps: one scheduler call, then n forward
passes of the same batch), so the host's per-call work is priced once per call.

`CompositionArrays` holds the same sums for many steps as NumPy arrays: the cost model's
formulas take either, so a whole simulated run is priced in one vectorized call (the fit
of refserve/simulator/world_fit.py prices every step of every row many times).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from refserve.scheduler import SchedulerOutput

# Queries and keys per tile of the GPU's attention kernel: FlashAttention-2 runs its forward
# pass in blocks of 128 x 128 for head dimension 128 on Ampere and Hopper (Dao 2023, §3.3:
# block sizes {64, 128} x {64, 128}, chosen per head dimension).
ATTENTION_TILE = 128


def tile_counts(q: int, c: int, tile: int = ATTENTION_TILE) -> tuple[int, int]:
    """(K, Q) of one row with q >= 2 queries ending at context c (module docstring).

    Query tile j < J - 1 covers queries up to position c - q + (j + 1) B, so it runs over
    ceil((c - q) / B) + j + 1 key tiles; the last one runs over all ceil(c / B)."""
    num_query_tiles = -(-q // tile)
    before = -(-(c - q) // tile)
    full = num_query_tiles - 1
    iterations = full * before + full * (full + 1) // 2 + -(-c // tile)
    return iterations, num_query_tiles


@dataclass(frozen=True)
class StepComposition:
    """The sums of a step (see the module docstring)."""

    num_rows: int = 0
    num_tokens: int = 0
    num_logits: int = 0
    context_tokens: int = 0
    attention_pairs: int = 0

    num_sampling_rows: int = 0   # N: rows that sample (l > 0)
    num_prefill_rows: int = 0    # P: rows with query tokens that need no logits (q > l)

    decode_pairs: int = 0        # D
    attention_tiles: int = 0     # K
    query_tiles: int = 0         # Q
    scheduled: int = 1           # 1: the scheduler ran before this step

    @classmethod
    def from_rows(cls, rows, scheduled: bool = True) -> StepComposition:
        """rows: (q query tokens, c context length after the step, l logits rows) each."""
        r = t = s = c = a = n = p = d = k = qt = 0
        for q, ctx, logits in rows:
            if not 1 <= q <= ctx or not 0 <= logits <= q:
                raise ValueError(f"a row needs 1 <= q <= c and 0 <= l <= q, got "
                                 f"(q={q}, c={ctx}, l={logits})")
            r += 1
            t += q
            s += logits
            c += ctx
            a += q * ctx - q * (q - 1) // 2
            n += logits > 0
            p += q > logits
            if q == 1:
                d += ctx
            else:
                iterations, tiles = tile_counts(q, ctx)
                k += iterations
                qt += tiles
        return cls(num_rows=r, num_tokens=t, num_logits=s, context_tokens=c,
                   attention_pairs=a, num_sampling_rows=n, num_prefill_rows=p,
                   decode_pairs=d, attention_tiles=k, query_tiles=qt,
                   scheduled=int(scheduled))

    @classmethod
    def of(cls, out: SchedulerOutput, scheduled: bool = True) -> StepComposition:
        """The composition of a scheduler step: a row computes [start, end), its
        num_scheduled_tokens; static batching's padding rows cost what a decode row costs."""
        return cls.from_rows(((row.num_scheduled_tokens, row.end, row.num_logits)
                              for row in out.scheduled + out.padding), scheduled)


FIELDS = tuple(f.name for f in dataclasses.fields(StepComposition))


class CompositionArrays:
    """The sums of many steps, one NumPy array per field of StepComposition (float64), so
    that `CostModel.terms` prices them all at once."""

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        for name in FIELDS:
            setattr(self, name, np.asarray(columns[name], dtype=float))

    @classmethod
    def of(cls, steps: list[StepComposition]) -> CompositionArrays:
        table = np.array([dataclasses.astuple(s) for s in steps], dtype=float).reshape(
            len(steps), len(FIELDS))
        return cls({name: table[:, j] for j, name in enumerate(FIELDS)})

    def __len__(self) -> int:
        return len(self.num_rows)


__all__ = ["ATTENTION_TILE", "CompositionArrays", "StepComposition", "tile_counts"]
