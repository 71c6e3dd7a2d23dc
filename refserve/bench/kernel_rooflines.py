"""`roofline`'s kernel rows: each compiled kernel of the tuned CPU backend against the ceilings.

Per kernel, at 1, 5, 16 and 64 rows (ROWS), what one step of the model asks of it, timed on
its own (best of REPEATS, after a warm-up), as achieved GFLOP/s and GB/s beside the measured
peak and bandwidth:

    linear      every dense product of a forward: 2 M N_params flops, the 4 N_params bytes
                of the weights read once (cpu_linear.py; a step's products read every
                weight, from memory)
    attention   M decode rows each over `context` keys, every layer: 4 H D ctx flops and
                the K and V read, 2 Hkv D 4 bytes per key (cpu_attention_kernel.py; one
                cache per layer, so the keys come from memory as in a step)
    fused       the elementwise steps of every layer for M rows (two RMSNorms with the
                residual add, RoPE with the KV write, SiLU-and-multiply; cpu_fused.py):
                the activations they read and write

Only where the backend runs compiled kernels; the NumPy forms have no rows here.
"""

from __future__ import annotations

import time

import numpy as np

ROWS = (1, 5, 16, 64)
REPEATS = 5


def best_seconds(fn, repeats: int = REPEATS) -> float:
    """The shortest of `repeats` timings of fn(), after one untimed call (page faults,
    first-call costs)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def kernel_rows(model, context: int, rows=ROWS) -> list[dict]:
    """The kernel rows for `model` on the compiled CPU backend (module docstring); [] on
    any other backend."""
    backend = model.backend
    if not getattr(backend, "compiled", False):
        return []
    from refserve.backends import compiled
    from refserve.spec_decode.cost_probe import dense_weights

    compiled.set_threads(backend.threads.threads())
    weights = dense_weights(model)
    params = sum(w.shape[0] * w.shape[1] for w in weights)
    rng = np.random.default_rng(0)
    out = []
    for m in rows:
        xs = {k: rng.standard_normal((m, k), dtype=np.float32)
              for k in {w.shape[1] for w in weights}}
        t = best_seconds(lambda xs=xs: [backend.linear(xs[w.shape[1]], w) for w in weights])
        out.append({"kernel": "linear", "rows": m, "seconds": t, "flops": 2 * m * params,
                    "bytes": 4 * params})

    for m in rows:
        out.append({"kernel": "attention", "rows": m, **_attention(model, m, context)})

    for m in rows:
        out.append({"kernel": "fused", "rows": m, **_fused(model, m, rng)})
    return out


def _attention(model, rows: int, context: int) -> dict:
    """Decode attention of `rows` sequences over `context` keys, every layer, each layer's
    cache its own (so keys come from memory)."""
    from refserve.kv_cache.block_table import blocks_for_tokens
    from refserve.model_runner import build_attention_metadata

    c, backend = model.config, model.backend
    block_size = 16
    per_seq = blocks_for_tokens(context + 1, block_size)
    caches = backend.allocate_kv_cache(c.num_hidden_layers, rows * per_seq, block_size,
                                       c.num_key_value_heads, c.head_dim)
    rng = np.random.default_rng(1)
    for k_cache, v_cache in caches:
        k_cache[:] = rng.standard_normal(k_cache.shape[1:], dtype=np.float32)
        v_cache[:] = k_cache
    tables = np.arange(rows * per_seq, dtype=np.int32).reshape(rows, per_seq)
    attn = build_attention_metadata(np.full(rows, -1, dtype=np.int64),
                                    np.arange(rows + 1, dtype=np.int32),
                                    np.full(rows, context, dtype=np.int32), tables)
    q = rng.standard_normal((rows, c.num_attention_heads, c.head_dim), dtype=np.float32)
    t = best_seconds(lambda: [backend.paged_attention(q, k, v, attn, model.scale)
                       for k, v in caches])
    layers, width = c.num_hidden_layers, c.num_attention_heads * c.head_dim
    kv_bytes = 2 * c.num_key_value_heads * c.head_dim * 4
    return {"seconds": t, "flops": layers * rows * 4 * width * context,
            "bytes": layers * rows * context * kv_bytes}


def _fused(model, rows: int, rng) -> dict:
    """The elementwise steps of every layer for `rows` rows, on random activations."""
    from refserve.backends import cpu_fused

    c = model.config
    h, hkv, d, hidden, inter = (c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                c.hidden_size, c.intermediate_size)
    h_, delta, x = (rng.standard_normal((rows, hidden), dtype=np.float32) for _ in range(3))
    gate_up = rng.standard_normal((rows, 2 * inter), dtype=np.float32)
    act = np.empty((rows, inter), dtype=np.float32)
    qkv = rng.standard_normal((rows, (h + 2 * hkv) * d), dtype=np.float32)
    q = np.empty((rows, h, d), dtype=np.float32)
    k_cache = np.zeros((rows, 1, hkv, d), dtype=np.float32)
    v_cache = np.zeros_like(k_cache)
    positions = slots = np.arange(rows)

    def layer_steps():
        for _ in range(c.num_hidden_layers):
            cpu_fused.add_rms_norm(h_, delta, model.final_norm, model.eps, x)
            cpu_fused.rope_write_kv(qkv, positions, model.rope_cos, model.rope_sin, h,
                                    k_cache, v_cache, slots, q)
            cpu_fused.add_rms_norm(h_, delta, model.final_norm, model.eps, x)
            cpu_fused.silu_mul(gate_up, act)

    touched = 4 * rows * (2 * 4 * hidden + 2 * (h + 2 * hkv) * d + 3 * inter)
    return {"seconds": best_seconds(layer_steps),
            "flops": c.num_hidden_layers * rows * (8 * hidden + 6 * (h + hkv) * d + 20 * inter),
            "bytes": c.num_hidden_layers * touched}
