"""The tuned CPU backend's linear, compiled: `x · Wᵀ` with every weight streamed once per call.

WHY. A decode or verify step multiplies a handful of activation rows x [M, in] by every
weight of the model: it reads all of them (538 MB for SmolLM2-135M) and, at a few rows,
does little arithmetic, so an M-row step should cost about what a 1-row step costs: the
time to stream the weights from memory. OpenBLAS does not see it that way: above one row it
runs its matrix-matrix kernel, which first copies ("packs") the weight into panels at every
call, and a 5-row product cost about twice a 1-row one.

THE LOOP NEST. The weight stays as loaded, W [out, in] row-major, so row j of W is `in`
consecutive floats and the dot product x[m] · W[j] a vector loop over them. The output is
cut into tiles of TILE_OUT weight rows; the tiles are split between the threads (prange),
and for each tile

    for every block of TILE_ROWS rows of x:            (x, a few KB per row, stays in cache)
        TILE_ROWS x TILE_OUT dot products in one pass over k = 0 .. in-1

so the tile's weights (TILE_OUT rows, 9 KB at in = 576) come from memory once and are then
reused from the L1 cache by every row of x: the weight is streamed once per call, whatever
M. The 16 running sums of a 4 x 4 block are 16 vector registers (the compiler vectorises
the k loop over them), and each step of k loads 8 vectors for 16 multiply-adds, which keeps
the FMA units busy: measured on the 2-core development machine (AMD EPYC, AVX-512), one
thread reaches 95 GFLOP/s on a weight in cache, what OpenBLAS's sgemm reaches on large
square matrices, and a 1-row pass over all 538 MB takes 23 ms (23 GB/s, the memory's copy
bandwidth). Rows of x left over (M mod 4) run as 1 x 4 tiles, weight rows left over
(out mod 4) one at a time.

No packing is needed: the dot-product form reads W in the layout it was loaded in. The
weight is only made C-contiguous float32 once, at load (`prepare_weight`).

EQUALITY. The same products as x @ W.T, each dot product summed in another order (vector
lanes, then a horizontal sum) and with fused multiply-adds: within the float32 rounding
bound of a dot product of `in` terms, which tests/test_backend_equality_cpu_matmul.py
checks for every model shape and row count.
"""

from __future__ import annotations

import numpy as np

from refserve.backends.compiled import jit, prange

TILE = 16   # weight rows per tile: what a thread takes at a time


@jit(inline=True)
def _block_4x4(x, w, out, m, j):
    """out[m:m+4, j:j+4] = x[m:m+4] · W[j:j+4]ᵀ in one pass over k: 16 running sums, 8
    loads per 16 multiply-adds."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0)
    for k in range(x.shape[1]):
        w0, w1, w2, w3 = w[j, k], w[j + 1, k], w[j + 2, k], w[j + 3, k]
        x0, x1, x2, x3 = x[m, k], x[m + 1, k], x[m + 2, k], x[m + 3, k]
        a00 += x0 * w0
        a01 += x0 * w1
        a02 += x0 * w2
        a03 += x0 * w3
        a10 += x1 * w0
        a11 += x1 * w1
        a12 += x1 * w2
        a13 += x1 * w3
        a20 += x2 * w0
        a21 += x2 * w1
        a22 += x2 * w2
        a23 += x2 * w3
        a30 += x3 * w0
        a31 += x3 * w1
        a32 += x3 * w2
        a33 += x3 * w3
    out[m, j], out[m, j + 1], out[m, j + 2], out[m, j + 3] = a00, a01, a02, a03
    out[m + 1, j], out[m + 1, j + 1], out[m + 1, j + 2], out[m + 1, j + 3] = a10, a11, a12, a13
    out[m + 2, j], out[m + 2, j + 1], out[m + 2, j + 2], out[m + 2, j + 3] = a20, a21, a22, a23
    out[m + 3, j], out[m + 3, j + 1], out[m + 3, j + 2], out[m + 3, j + 3] = a30, a31, a32, a33


@jit(inline=True)
def _block_2x8(x, w, out, m, j):
    """out[m:m+2, j:j+8] = x[m:m+2] · W[j:j+8]ᵀ in one pass over k: 16 running sums, 10
    loads per 16 multiply-adds, 8 weight rows streamed at once."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0)
    for k in range(x.shape[1]):
        x0, x1 = x[m, k], x[m + 1, k]
        w0, w1, w2, w3 = w[j, k], w[j + 1, k], w[j + 2, k], w[j + 3, k]
        w4, w5, w6, w7 = w[j + 4, k], w[j + 5, k], w[j + 6, k], w[j + 7, k]
        a0 += x0 * w0
        a1 += x0 * w1
        a2 += x0 * w2
        a3 += x0 * w3
        a4 += x0 * w4
        a5 += x0 * w5
        a6 += x0 * w6
        a7 += x0 * w7
        b0 += x1 * w0
        b1 += x1 * w1
        b2 += x1 * w2
        b3 += x1 * w3
        b4 += x1 * w4
        b5 += x1 * w5
        b6 += x1 * w6
        b7 += x1 * w7
    out[m, j], out[m, j + 1], out[m, j + 2], out[m, j + 3] = a0, a1, a2, a3
    out[m, j + 4], out[m, j + 5], out[m, j + 6], out[m, j + 7] = a4, a5, a6, a7
    out[m + 1, j], out[m + 1, j + 1], out[m + 1, j + 2], out[m + 1, j + 3] = b0, b1, b2, b3
    out[m + 1, j + 4], out[m + 1, j + 5], out[m + 1, j + 6], out[m + 1, j + 7] = b4, b5, b6, b7


@jit(inline=True)
def _block_1x16(x, w, out, m, j):
    """out[m, j:j+16] = x[m] · W[j:j+16]ᵀ in one pass over k: one row of x against 16
    weight rows streamed at once (the more streams in flight, the closer a single row gets
    to the memory's bandwidth: 16 rows measured 1.35x faster than 4 on one thread)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0)
    a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = np.float32(0)
    for k in range(x.shape[1]):
        xk = x[m, k]
        a0 += xk * w[j, k]
        a1 += xk * w[j + 1, k]
        a2 += xk * w[j + 2, k]
        a3 += xk * w[j + 3, k]
        a4 += xk * w[j + 4, k]
        a5 += xk * w[j + 5, k]
        a6 += xk * w[j + 6, k]
        a7 += xk * w[j + 7, k]
        a8 += xk * w[j + 8, k]
        a9 += xk * w[j + 9, k]
        a10 += xk * w[j + 10, k]
        a11 += xk * w[j + 11, k]
        a12 += xk * w[j + 12, k]
        a13 += xk * w[j + 13, k]
        a14 += xk * w[j + 14, k]
        a15 += xk * w[j + 15, k]
    out[m, j], out[m, j + 1], out[m, j + 2], out[m, j + 3] = a0, a1, a2, a3
    out[m, j + 4], out[m, j + 5], out[m, j + 6], out[m, j + 7] = a4, a5, a6, a7
    out[m, j + 8], out[m, j + 9], out[m, j + 10], out[m, j + 11] = a8, a9, a10, a11
    out[m, j + 12], out[m, j + 13], out[m, j + 14], out[m, j + 15] = a12, a13, a14, a15


@jit(inline=True)
def _dot(x, w, out, m, j):
    """out[m, j] = x[m] · W[j]."""
    total = np.float32(0)
    for k in range(x.shape[1]):
        total += x[m, k] * w[j, k]
    out[m, j] = total


@jit(parallel=True)
def linear_kernel(x, w, out):
    """out [M, out] = x [M, in] · W [out, in]ᵀ, float32, all C-contiguous (module
    docstring): tiles of TILE weight rows split between the threads; per tile, the rows of
    x four at a time (4 x 4 blocks), then a pair (2 x 8), then a last row (1 x 16)."""
    rows, n = x.shape[0], w.shape[0]
    fours = rows - rows % 4
    for tile in prange((n + TILE - 1) // TILE):
        j = tile * TILE
        if j + TILE > n:                        # the last, partial tile: plain dots
            for jj in range(j, n):
                for m in range(rows):
                    _dot(x, w, out, m, jj)
            continue
        for s in range(j, j + TILE, 4):         # 4 weight rows at a time, reused by all x
            for m in range(0, fours, 4):
                _block_4x4(x, w, out, m, s)
        m = fours
        if rows - m >= 2:
            _block_2x8(x, w, out, m, j)
            _block_2x8(x, w, out, m, j + 8)
            m += 2
        if m < rows:
            _block_1x16(x, w, out, m, j)


class CompiledWeight:
    """One weight W [out, in] of `linear(x, W) = x · Wᵀ`, kept C-contiguous float32 (made so
    once, at load). Calling it runs `linear_kernel`."""

    def __init__(self, w: np.ndarray) -> None:
        self.data = np.ascontiguousarray(w, dtype=np.float32)
        self.shape = self.data.shape
        self.dtype = self.data.dtype

    @property
    def out_in(self) -> np.ndarray:
        """W [out, in]: the stored array itself."""
        return self.data

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [M, in] · Wᵀ -> [M, out] float32, C-contiguous."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        if x.shape[0]:
            linear_kernel(x, self.data, out)
        return out

    def __repr__(self) -> str:
        return f"CompiledWeight({self.shape[0]}x{self.shape[1]})"
