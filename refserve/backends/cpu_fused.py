"""The elementwise steps of a Llama layer as compiled loops, fused where that saves a pass.

WHY. Between its products a layer runs RMSNorm twice, RoPE, the KV write and SiLU-and-
multiply. In NumPy each is a chain of whole-array calls (RMSNorm alone: square, mean, add,
sqrt, divide, two multiplies), each a pass over the activations and a few microseconds of
dispatch: about 40 calls per layer, 1,200 per step, several milliseconds of a 25 ms batch-1
step. Here each step is one loop over the rows, fused with its neighbour where the two
touch the same data:

    add_rms_norm      h += delta (the residual), then x = RMSNorm(h)   one pass
    rope_write_kv     rotate q and k (RoPE), write k and v into their cache slots, q into
                      its own array                                    one pass over qkv
    silu_mul          silu(gate) * up, exp by cpu_exp.exp32 (vectorised)

The formulas are the reference's (refserve/models/llama.py's docstring):

    RMSNorm(x) = x · (1 / sqrt(mean(x²) + eps)) · weight
    RoPE: each pair (x_i, x_{i+d/2}) at position p becomes
          (x_i cos θ_i − x_{i+d/2} sin θ_i,  x_{i+d/2} cos θ_i + x_i sin θ_i)
    silu(x) = x / (1 + exp(-x))

in float32, sums in another order and multiply-adds fused: float rounding only
(tests/test_cpu_kernels.py checks each against the reference's NumPy).

Rows are few at decode and a few hundred at prefill: one thread runs each (the work is a
few microseconds, less than waking a second thread costs).
"""

from __future__ import annotations

import numpy as np

from refserve.backends.compiled import jit
from refserve.backends.cpu_exp import exp32


@jit(inline=True)
def _rms_norm_row(h, m, weight, eps, out):
    """out[m] = RMSNorm(h[m])."""
    total = np.float32(0)
    for i in range(h.shape[1]):
        total += h[m, i] * h[m, i]
    inv = np.float32(1) / np.sqrt(total / np.float32(h.shape[1]) + eps)
    for i in range(h.shape[1]):
        out[m, i] = h[m, i] * inv * weight[i]


@jit()
def rms_norm(h, weight, eps, out):
    """out [T, hidden] = RMSNorm(h [T, hidden]) with `weight` [hidden], eps float32."""
    for m in range(h.shape[0]):
        _rms_norm_row(h, m, weight, eps, out)


@jit()
def add_rms_norm(h, delta, weight, eps, out):
    """h += delta (in place: the residual stream), then out = RMSNorm(h); all [T, hidden]."""
    for m in range(h.shape[0]):
        for i in range(h.shape[1]):
            h[m, i] += delta[m, i]
        _rms_norm_row(h, m, weight, eps, out)


@jit()
def rope_write_kv(qkv, positions, cos, sin, num_heads, k_cache, v_cache, slot_mapping, q):
    """RoPE and the KV write of one layer, from its fused projection qkv [T, (H + 2 Hkv) D]
    (q heads, then k heads, then v heads).

    q [T, H, D] receives the rotated queries. Token t's rotated keys and its values go to
    flat slot s = slot_mapping[t] of the caches [num_blocks, block_size, Hkv, D], that is
    block s // block_size, offset s % block_size; a token with s < 0 writes nothing.
    cos, sin [max_positions, D / 2]: the rope tables at every position."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    half = head_dim // 2
    for t in range(qkv.shape[0]):
        p = positions[t]
        for h in range(num_heads):
            base = h * head_dim
            for i in range(half):
                x1, x2 = qkv[t, base + i], qkv[t, base + half + i]
                q[t, h, i] = x1 * cos[p, i] - x2 * sin[p, i]
                q[t, h, half + i] = x2 * cos[p, i] + x1 * sin[p, i]
        slot = slot_mapping[t]
        if slot < 0:
            continue
        block, off = slot // block_size, slot % block_size
        for h in range(num_kv_heads):
            base = (num_heads + h) * head_dim
            vbase = (num_heads + num_kv_heads + h) * head_dim
            for i in range(half):
                x1, x2 = qkv[t, base + i], qkv[t, base + half + i]
                k_cache[block, off, h, i] = x1 * cos[p, i] - x2 * sin[p, i]
                k_cache[block, off, h, half + i] = x2 * cos[p, i] + x1 * sin[p, i]
            for i in range(head_dim):
                v_cache[block, off, h, i] = qkv[t, vbase + i]


@jit()
def silu_mul(gate_up, out):
    """out [T, I] = silu(gate) · up for gate_up [T, 2I] = [gate | up]."""
    inter = out.shape[1]
    for m in range(gate_up.shape[0]):
        for i in range(inter):
            x = gate_up[m, i]
            out[m, i] = x / (np.float32(1) + exp32(-x)) * gate_up[m, inter + i]
