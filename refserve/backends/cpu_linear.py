"""The tuned CPU backend's linear, compiled: `x · Wᵀ` over a weight packed once at load into
panels, each panel streamed from memory once per call for all rows of x.

WHY. A decode or verify step multiplies a handful of activation rows x [M, in] by every
weight of the model: it reads all of them (538 MB for SmolLM2-135M) and, at a few rows,
does little arithmetic, so an M-row step should cost about what a 1-row step costs, the
time to stream the weights. OpenBLAS does not see it that way: above one row it runs its
matrix-matrix kernel, which copies ("packs") the weight into its own layout at every call;
a 5-row product cost twice a 1-row one. vLLM's CPU build packs once, at load (oneDNN). So
does this file.

THE LAYOUT. W [out, in] is stored as panels of PANEL = 4 x LANES output rows (64 on an
AVX-512 CPU), each panel transposed so that the PANEL weights of one input column are
consecutive:

    panels[t, k, c] = W[t · PANEL + c, k]          [ceil(out / PANEL), in, PANEL]

(out is padded with zero rows to a whole panel). A panel is one contiguous stream of
in x PANEL floats, read front to back.

THE LOOP NEST (cpu_simd.py's vectors; LANES floats each):

    for each panel t, split between the threads:
        for each block of up to 4 rows of x:
            acc[r][v] = 0                        4 rows x 4 vectors: 16 registers
            for k in 0 .. in-1:
                w_v = panels[t, k, v·LANES : (v+1)·LANES]       4 loads, the weight
                for each row r:  acc[r][v] += x[r, k] · w_v     a broadcast, 4 fmas
            out[rows, t · PANEL : (t+1) · PANEL] = acc

Each weight vector loaded from memory feeds 4 rows' multiply-adds in the same iteration, so
the memory stream and the arithmetic overlap, and no running sum ever leaves its register
until its row is done: no horizontal sums. Blocks of 2 and 1 rows finish M mod 4. The first
row block streams the panel from memory; the others find it in cache.

Measured on the 2-core development machine (AMD EPYC, AVX-512, one thread, every weight of
SmolLM2-135M once, ms; load 2):

    rows                          1      2      4      8     16     32     64
    this kernel                20.6   25.1   20.1   32.7   49.2   86.5  162.3
    OpenBLAS, best of its forms  39    42     50     62     63    108    218

EQUALITY. Each output is Σ_k x[m, k] · W[j, k] summed in k order with fused multiply-adds:
within the float32 rounding bound of a dot product (tests/test_cpu_kernels.py checks every
model shape and row count), and bitwise the same for a row whatever else is in the batch
(every block sums in k order).
"""

from __future__ import annotations

import numpy as np

from refserve.backends.compiled import jit, prange
from refserve.backends.cpu_simd import LANES, vfma, vload, vsplat, vstore, vzero

PANEL = 4 * LANES   # output rows per panel: 4 vectors per row of x


@jit(inline=True)
def _rows4(x, panels, out, m, t, width):
    """out rows m..m+3, panel t's PANEL columns (flat arrays; `width` out's row length)."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = vzero()
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = vzero()
    for k in range(x.shape[1]):
        w0, w1, w2, w3 = _weights(panels, t, k, x.shape[1])
        x0, x1 = vsplat(x[m, k]), vsplat(x[m + 1, k])
        x2, x3 = vsplat(x[m + 2, k]), vsplat(x[m + 3, k])
        a00, a01, a02, a03 = _madd(w0, w1, w2, w3, x0, a00, a01, a02, a03)
        a10, a11, a12, a13 = _madd(w0, w1, w2, w3, x1, a10, a11, a12, a13)
        a20, a21, a22, a23 = _madd(w0, w1, w2, w3, x2, a20, a21, a22, a23)
        a30, a31, a32, a33 = _madd(w0, w1, w2, w3, x3, a30, a31, a32, a33)
    _store(out, m * width + t * PANEL, a00, a01, a02, a03)
    _store(out, (m + 1) * width + t * PANEL, a10, a11, a12, a13)
    _store(out, (m + 2) * width + t * PANEL, a20, a21, a22, a23)
    _store(out, (m + 3) * width + t * PANEL, a30, a31, a32, a33)


@jit(inline=True)
def _rows2(x, panels, out, m, t, width):
    """out rows m, m+1 of panel t."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = vzero()
    for k in range(x.shape[1]):
        w0, w1, w2, w3 = _weights(panels, t, k, x.shape[1])
        x0, x1 = vsplat(x[m, k]), vsplat(x[m + 1, k])
        a00, a01, a02, a03 = _madd(w0, w1, w2, w3, x0, a00, a01, a02, a03)
        a10, a11, a12, a13 = _madd(w0, w1, w2, w3, x1, a10, a11, a12, a13)
    _store(out, m * width + t * PANEL, a00, a01, a02, a03)
    _store(out, (m + 1) * width + t * PANEL, a10, a11, a12, a13)


@jit(inline=True)
def _rows1(x, panels, out, m, t, width):
    """out row m of panel t."""
    a0 = a1 = a2 = a3 = vzero()
    for k in range(x.shape[1]):
        w0, w1, w2, w3 = _weights(panels, t, k, x.shape[1])
        a0, a1, a2, a3 = _madd(w0, w1, w2, w3, vsplat(x[m, k]), a0, a1, a2, a3)
    _store(out, m * width + t * PANEL, a0, a1, a2, a3)


@jit(inline=True)
def _weights(panels, t, k, inner):
    """Panel t's 4 vectors at input column k (flat panels, `inner` columns a panel)."""
    p = (t * inner + k) * PANEL
    return (vload(panels, p), vload(panels, p + LANES), vload(panels, p + 2 * LANES),
            vload(panels, p + 3 * LANES))


@jit(inline=True)
def _madd(w0, w1, w2, w3, xk, a0, a1, a2, a3):
    """One row's 4 running sums += its x value (broadcast) times the panel's 4 vectors."""
    return vfma(w0, xk, a0), vfma(w1, xk, a1), vfma(w2, xk, a2), vfma(w3, xk, a3)


@jit(inline=True)
def _store(out, at, v0, v1, v2, v3):
    vstore(out, at, v0)
    vstore(out, at + LANES, v1)
    vstore(out, at + 2 * LANES, v2)
    vstore(out, at + 3 * LANES, v3)


@jit(parallel=True)
def linear_kernel(x, panels, out):
    """out [M, T · PANEL] = x [M, in] · Wᵀ for W packed as panels [T, in, PANEL] (module
    docstring); all C-contiguous float32. Panels are split between the threads."""
    rows = x.shape[0]
    width = out.shape[1]
    flat_panels, flat_out = panels.reshape(-1), out.reshape(-1)
    fours = rows - rows % 4
    for t in prange(panels.shape[0]):
        for m in range(0, fours, 4):
            _rows4(x, flat_panels, flat_out, m, t, width)
        m = fours
        if rows - m >= 2:
            _rows2(x, flat_panels, flat_out, m, t, width)
            m += 2
        if m < rows:
            _rows1(x, flat_panels, flat_out, m, t, width)


def pack(w: np.ndarray) -> np.ndarray:
    """W [out, in] as panels [ceil(out / PANEL), in, PANEL] float32 (module docstring)."""
    out, inner = w.shape
    count = -(-out // PANEL)
    panels = np.zeros((count, inner, PANEL), dtype=np.float32)
    for t in range(count):
        block = w[t * PANEL:(t + 1) * PANEL]
        panels[t, :, :len(block)] = block.T
    return panels


class PackedRows:
    """W [out, in] read from its panels: rows by index (`rows[ids]`, what a tied embedding
    looks up) and the whole matrix (`np.asarray(rows)`, a copy). The table stays stored
    once, as panels."""

    def __init__(self, panels: np.ndarray, shape: tuple[int, int]) -> None:
        self.panels, self.shape, self.dtype = panels, shape, panels.dtype

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        return self.panels[ids // PANEL, :, ids % PANEL]          # [len(ids), in]

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out, inner = self.shape
        full = self.panels.transpose(0, 2, 1).reshape(-1, inner)[:out]
        return full if dtype is None else full.astype(dtype)


class PackedWeight:
    """One weight W [out, in] of `linear(x, W) = x · Wᵀ`, packed into panels once, at load.
    Calling it runs `linear_kernel`."""

    def __init__(self, w: np.ndarray) -> None:
        w = np.asarray(w, dtype=np.float32)
        self.shape = tuple(w.shape)
        self.dtype = np.dtype(np.float32)
        self.panels = pack(w)
        self.rows = PackedRows(self.panels, self.shape)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [M, in] · Wᵀ -> [M, out] float32 (a view of a wider array when out is not a
        whole number of panels)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.panels.shape[0] * PANEL), dtype=np.float32)
        if x.shape[0]:
            linear_kernel(x, self.panels, out)
        return out if out.shape[1] == self.shape[0] else out[:, :self.shape[0]]

    def __repr__(self) -> str:
        return f"PackedWeight({self.shape[0]}x{self.shape[1]}, panels of {PANEL})"
