"""Few-row dense products on the CPU: `linear(x, W) = x · Wᵀ` for 2-64 rows at the bandwidth floor.

The tuned CPU backend's `linear` (cpu_backend.py); the reference computes `x @ W.T`.

WHY. A decode or verify step multiplies a handful of activation rows by every weight of the
model. It reads all the weights (538 MB for SmolLM2-135M) and does little arithmetic (a 5-row
step is 1.35 GFLOP), so a 5-row step should cost about what a 1-row step costs. OpenBLAS does
not see it that way: 1 row goes to its matrix-vector kernel (gemv), 2-32 rows to its packed
matrix-matrix kernel (sgemm), which first copies ("packs") the weight into panels and reaches
only 7-12 GFLOP/s at 2 rows. Measured on the 2-core development machine (AMD EPYC, OpenBLAS
0.3.31), lm_head 49152×576, one BLAS thread, `time.thread_time`, forms interleaved, median
of 7, ms (load average 4 for the SkylakeX rows, 13 for the Haswell ones):

    form                      kernel       M=1    M=2    M=5    M=8    M=16   M=32
    plain      (W @ xᵀ)ᵀ      SkylakeX     9.8   17.7   22.5   22.2   24.5   33.8
    chunked    (below)        SkylakeX      -     9.0   13.4   15.6   13.0   23.5
    transposed x @ Wᵀ-copy    SkylakeX     5.8   26.3   33.3   31.4   34.6   45.0
    plain                     Haswell     10.0   18.3   24.5   22.9   33.2   56.3
    chunked                   Haswell       -    15.6   20.5   19.2   31.2   46.9
    transposed                Haswell      5.5   12.4   15.3   15.3   23.3   40.8

The best form depends on the kernel OpenBLAS picked for the machine (SkylakeX on AVX-512
CPUs, Haswell where `OPENBLAS_CORETYPE=Haswell` pins it, as CI does), so it is measured, not
assumed: a short calibration per weight shape when the backend prepares the first weight of
that shape, as the model loads (below).

THE FORMS. Each computes x · Wᵀ for x [M, in] and returns an [M, out] array (a transposed
view, which every later op accepts); they differ only in which BLAS kernel runs.
  plain       (W @ xᵀ)ᵀ with W stored [out, in] (Hugging Face's layout): gemv at 1 row, one
              packed sgemm above. Prefill chunks (hundreds of rows) always use this.
  chunked     W in blocks of R rows with R · M · in <= 10⁶, each block @ xᵀ into its slice of
              a preallocated output. Under that size OpenBLAS's SkylakeX build multiplies with
              its small-matrix kernel, which skips packing (OpenBLAS kernel/x86_64/
              sgemm_small_kernel_permit_skylakex.c: M·N·K <= 100³). Builds without one
              (Haswell) run ordinary sgemm on each block: no gain there.
  chunked2    chunked, the blocks split between two threads (NumPy releases the GIL inside
              matmul): the small-matrix kernel is single-threaded, gemv uses both cores.
              On the loaded 2-core development machine it always lost to chunked (its
              helper thread waits for a core: 2-20x slower); on idle cores it may win,
              and calibration keeps it only where it does, by more than MARGIN.
  transposed  x @ Wt with Wt = Wᵀ stored C-contiguous [in, out]. OpenBLAS then streams Wt
              row by row; the best form measured with the Haswell kernel.

LAYOUT. A weight is stored once, [out, in] (plain, chunked, chunked2) or [in, out]
(transposed), so no form costs memory. 1 row is always the layout's gemv (plain or
transposed) and more than MAX_FEW_ROWS rows its sgemm; in between, the calibrated form.

CALIBRATION (`plan_for`, once per weight shape and dtype per process, float32 NumPy only).
Each form runs at each of CALIBRATION_ROWS, REPEATS times, forms interleaved, on blocks
of at most PROBE_BYTES shaped like row blocks of the weight (every form works row block by
row block, so a block ranks them as the whole weight does). Each timing takes the next block
of a cycle through POOL_BYTES, so, as in a forward, the weights come from memory: timed on
one block that sits in cache, the Haswell kernel's transposed form looked no better than
plain, while read from memory it is 1.4-1.6x faster.
Wall clock (the two-thread form must be timed as it runs); a form's time is its minimum.
The layout whose best forms are closest to the best of all is kept (the median over the
row counts), [out, in] unless [in, out] beats it by more than MARGIN (on a SkylakeX machine
the two time within a few percent while the model loads, and noise must not flip the layout
from one start-up to the next); each row count then takes the fastest form of that layout
measured at the largest calibrated row count not above it, a simpler form within MARGIN of
the fastest winning (noise must not pick the two-thread form). About 7 x 4 x 3 timings of
0.2-1 ms: tens of milliseconds per shape.
`REFSERVE_MATMUL=auto|plain|chunked|chunked2|transposed` forces one form for 2..MAX_FEW_ROWS
rows (plain: one gemv / sgemm per product).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

ENV = "REFSERVE_MATMUL"
OUT_IN, IN_OUT = "out_in", "in_out"
LAYOUT_OF = {"plain": OUT_IN, "chunked": OUT_IN, "chunked2": OUT_IN, "transposed": IN_OUT}
FORMS = tuple(LAYOUT_OF)
CHOICES = ("auto", *FORMS)
MAX_FEW_ROWS = 64          # above: one sgemm (chunked lost to it at 64-128 rows, measured)
SMALL_KERNEL_MNK = 10**6   # OpenBLAS's small-matrix kernel takes M·N·K up to this
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)
PROBE_BYTES = 2 << 20      # calibrate on blocks of at most this many bytes of the weights
POOL_BYTES = 40 << 20      # ... cycling through this many bytes of them (more than the L3)
REPEATS = 3                # timings per form and row count; the minimum counts
DROP_SLOWER = 3.0          # after two rounds this many times the best: no more rounds
MARGIN = 0.1               # a simpler form (or layout) within 10% of the fastest is kept

_helper: ThreadPoolExecutor | None = None   # the second thread of chunked2, made on first use


def _plain(w, x):
    return (w @ x.T).T


def _transposed(wt, x):
    return x @ wt


def _block_rows(x) -> int:
    """Rows of W per block so that block · xᵀ stays in the small-matrix kernel."""
    m, k = x.shape
    return max(1, SMALL_KERNEL_MNK // (m * k))


def _blocks(w, xt, out, start: int, stop: int, step: int) -> None:
    for s in range(start, stop, step):
        e = min(s + step, stop)
        np.matmul(w[s:e], xt, out=out[s:e])


def _chunked(w, x):
    out = np.empty((w.shape[0], x.shape[0]), dtype=np.result_type(w, x))
    _blocks(w, np.ascontiguousarray(x.T), out, 0, w.shape[0], _block_rows(x))
    return out.T


def _chunked2(w, x):
    global _helper
    n, step = w.shape[0], _block_rows(x)
    if n <= step:                   # one block: nothing to split
        return _chunked(w, x)
    out = np.empty((n, x.shape[0]), dtype=np.result_type(w, x))
    xt = np.ascontiguousarray(x.T)
    half = -(-n // (2 * step)) * step       # a block boundary near the middle
    if _helper is None:
        _helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refserve-matmul")
    other = _helper.submit(_blocks, w, xt, out, half, n, step)
    _blocks(w, xt, out, 0, half, step)
    other.result()
    return out.T


_FUNCTIONS = {"plain": _plain, "chunked": _chunked, "chunked2": _chunked2,
              "transposed": _transposed}
_GEMM = {OUT_IN: "plain", IN_OUT: "transposed"}   # the layout's form at 1 row and for prefill


def apply(form: str, data, x):
    """x · Wᵀ by `form`, `data` being W in that form's layout (W for [out, in], Wᵀ for
    [in, out])."""
    return _FUNCTIONS[form](data, x)


@dataclass(frozen=True)
class Plan:
    """How the products of one weight shape are computed: the stored layout and the form per
    row count (index M - 1 for M = 1..MAX_FEW_ROWS; more rows: the layout's sgemm).
    `seconds[(form, rows)]`: the calibration's times (minimums; empty if forced)."""

    layout: str
    few: tuple[str, ...]
    seconds: dict = field(default_factory=dict, compare=False)
    source: str = "auto"

    def form(self, rows: int) -> str:
        """The form for `rows` rows: the layout's gemv / sgemm outside 2..MAX_FEW_ROWS (an
        empty product too: a step whose rows all skip the logits)."""
        return self.few[rows - 1] if 2 <= rows <= MAX_FEW_ROWS else _GEMM[self.layout]

    def describe(self) -> str:
        """e.g. 'out_in: 1 plain, 2-48 chunked, 49-64 plain, >64 plain' (runs of forms)."""
        runs: list[list] = []
        for rows, form in enumerate(self.few, start=1):
            if runs and runs[-1][2] == form:
                runs[-1][1] = rows
            else:
                runs.append([rows, rows, form])
        parts = [f"{a}{'' if a == b else f'-{b}'} {f}" for a, b, f in runs]
        return f"{self.layout}: {', '.join(parts)}, >{MAX_FEW_ROWS} {_GEMM[self.layout]}"


def forced_form() -> str:
    """The form REFSERVE_MATMUL asks for, or 'auto' (unset or empty: calibrate)."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: choose one of {', '.join(CHOICES)}")
    return value


def fixed_plan(form: str) -> Plan:
    """`form` for 2..MAX_FEW_ROWS rows, its layout's gemv / sgemm for the rest."""
    layout = LAYOUT_OF[form]
    return Plan(layout, (_GEMM[layout],) + (form,) * (MAX_FEW_ROWS - 1), source="forced")


PLAIN = Plan(OUT_IN, ("plain",) * MAX_FEW_ROWS, source="plain")
_PLANS: dict[tuple, Plan] = {}   # (shape, dtype, REFSERVE_MATMUL) -> plan, per process


def plan_for(w) -> Plan:
    """The plan for weight `w` [out, in]: cached per (shape, dtype, REFSERVE_MATMUL). Only
    float32 NumPy weights are calibrated (OpenBLAS's sgemm); others keep `plain`."""
    choice = forced_form()
    if not isinstance(w, np.ndarray) or w.dtype != np.float32:
        return PLAIN
    key = (w.shape, w.dtype.str, choice)
    if key not in _PLANS:
        _PLANS[key] = fixed_plan(choice) if choice != "auto" else calibrate(w.shape)
    return _PLANS[key]


def candidate_forms() -> tuple[str, ...]:
    """The forms calibration tries: chunked2 only where two CPUs can run it."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return FORMS if (cpus or 1) >= 2 else tuple(f for f in FORMS if f != "chunked2")


def probe_blocks(shape, block_bytes: int = PROBE_BYTES, total_bytes: int = POOL_BYTES):
    """Blocks for timing products with a weight of `shape` [out, in]: as many as fit in
    `total_bytes`, each with the rows of at most `block_bytes` of the weight, carved from one
    buffer (filled, so every page is real memory; the values do not change the time). Timed
    one after another, each block is read from memory (the cycle is longer than the L3), as
    a forward reads its weights. Returns (rows per block, flat blocks); a block reshaped to
    [rows, in] is an [out, in] block, to [in, rows] an [in, out] one."""
    n, k = shape
    step = max(1, min(n, block_bytes // (4 * k)))
    count = max(1, total_bytes // (4 * k * step))
    buffer = np.full(count * step * k, 0.5, dtype=np.float32)
    return step, [buffer[i * step * k:(i + 1) * step * k] for i in range(count)]


def calibrate(shape, rows=CALIBRATION_ROWS, forms=None, repeats: int = REPEATS) -> Plan:
    """Measure the forms for a float32 weight of `shape` (see the module docstring and
    `probe_blocks`) and return the plan. Every timing takes the next block, so none finds
    its weights in cache; a form's time is its minimum over `repeats` (a shared machine
    only ever adds time). After two rounds, a form DROP_SLOWER times slower than the best is
    not timed again at that row count, and after two such row counts in a row not at all:
    on a loaded machine a two-thread BLAS call can take a whole scheduler slice, and
    calibration must stay short."""
    forms = tuple(forms or candidate_forms())
    k = shape[1]
    step, blocks = probe_blocks(shape)
    rng = np.random.default_rng(0)
    seconds: dict[tuple[str, int], float] = {}
    dropped = dict.fromkeys(forms, 0)          # consecutive row counts a form was dropped
    turn = 0

    def timed(f, x):
        nonlocal turn
        block = blocks[turn % len(blocks)]
        turn += 1
        data = block.reshape(step, k) if LAYOUT_OF[f] == OUT_IN else block.reshape(k, step)
        t0 = time.perf_counter()
        apply(f, data, x)
        return time.perf_counter() - t0

    for m in rows:
        x = rng.standard_normal((m, k), dtype=np.float32)
        tried = [f for f in forms if dropped[f] < 2 and (m > 1 or f == _GEMM[LAYOUT_OF[f]])]
        times: dict[str, list[float]] = {f: [] for f in tried}
        for r in range(repeats):                     # interleaved, order rotated per round
            if r == 2:
                best = min(min(t) for t in times.values())
                for f in tried:
                    dropped[f] = dropped[f] + 1 if min(times[f]) > DROP_SLOWER * best else 0
                tried = [f for f in tried if not dropped[f]]
            for f in tried[r % len(tried):] + tried[:r % len(tried)]:
                times[f].append(timed(f, x))
        seconds.update({(f, m): min(t) for f, t in times.items()})
    return choose(seconds, rows)


def choose(seconds: dict[tuple[str, int], float], rows=CALIBRATION_ROWS) -> Plan:
    """The plan from measured seconds[(form, rows)]. The layout: the one whose best form is
    the least slower than the best of all, as the median over the row counts (one timing
    spike must not move a weight), and [out, in] unless [in, out] is more than MARGIN less
    slow: within that the two tie, and a tie settled by timing noise would change the
    forward from one start-up to the next. Per measured row count, that layout's
    fastest form, except that a simpler form (order of FORMS) within MARGIN of it is kept
    (timing noise must not pick the two-thread form). Unmeasured row counts take the choice
    at the largest measured row count below them."""
    def best(m, layout=None):
        return min(t for (f, r), t in seconds.items()
                   if r == m and (layout is None or LAYOUT_OF[f] == layout))

    layouts = [lay for lay in (OUT_IN, IN_OUT)
               if all(any(r == m and LAYOUT_OF[f] == lay for f, r in seconds) for m in rows)]
    slowdown = {lay: np.median([best(m, lay) / best(m) for m in rows]) for lay in layouts}
    layout = min(layouts, key=lambda lay: slowdown[lay])
    if OUT_IN in slowdown and slowdown[OUT_IN] <= (1 + MARGIN) * slowdown[layout]:
        layout = OUT_IN
    chosen = {}
    for m in rows:
        mine = [f for f in FORMS if LAYOUT_OF[f] == layout and (f, m) in seconds]
        chosen[m] = next(f for f in mine if seconds[(f, m)] <= (1 + MARGIN) * best(m, layout))
    few = []
    for m in range(1, MAX_FEW_ROWS + 1):
        measured = max((r for r in rows if r <= m), default=None)
        few.append(_GEMM[layout] if m == 1 or measured is None else chosen[measured])
    return Plan(layout, tuple(few), dict(seconds))


class DenseWeight:
    """One weight W [out, in] of `linear(x, W) = x · Wᵀ`, stored in the layout of its plan.
    Calling it computes the product with the plan's form for the number of rows of x."""

    def __init__(self, w, plan: Plan | None = None) -> None:
        self.plan = plan or plan_for(w)
        self.shape = tuple(w.shape)            # always (out, in), whatever the layout
        self.dtype = w.dtype
        self.data = w if self.plan.layout == OUT_IN else np.ascontiguousarray(w.T)

    @property
    def out_in(self):
        """W as [out, in]: the stored array, or a transposed view of it (no copy)."""
        return self.data if self.plan.layout == OUT_IN else self.data.T

    def __call__(self, x, threads: int | None = None):
        """x · Wᵀ by the plan's form for x's rows; with `threads` < 2 the two-thread form
        runs as its one-thread self (chunked), since no second CPU is free for it."""
        form = self.plan.form(x.shape[0])
        if form == "chunked2" and threads is not None and threads < 2:
            form = "chunked"
        return apply(form, self.data, x)

    def __repr__(self) -> str:
        return f"DenseWeight({self.shape[0]}x{self.shape[1]}, {self.plan.describe()})"
