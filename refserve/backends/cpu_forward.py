"""The Llama forward of the tuned CPU backend: the reference's layers, in fused compiled steps.

refserve/models/llama.py is the forward students read: every step a line of NumPy. This is
the same computation, step for step, with the elementwise steps replaced by the compiled
loops of cpu_fused.py and the products and attention by the backend's own kernels, so a
decode layer is eight calls instead of about fifty:

    x = RMSNorm(h)                                   (the first layer's input norm)
    for each layer:
        qkv = x · Wqkvᵀ                              backend.linear
        q, cache <- RoPE(qkv), write k, v            cpu_fused.rope_write_kv
        o = attention(q, cache) · Woᵀ                backend.paged_attention, linear
        h += o;  x = RMSNorm(h)                      cpu_fused.add_rms_norm
        a = silu(x · Wgateᵀ) * (x · Wupᵀ)            linear, cpu_fused.silu_mul
        h += a · Wdownᵀ;  x = RMSNorm(h)             linear, add_rms_norm (the next
                                                     layer's input norm; after the last:
                                                     h += only)
    logits = RMSNorm(h[rows that sample]) · Wlm_headᵀ

Biases (Qwen2's q/k/v, attention_bias's o) are added as in the reference. Equal to
`LlamaModel.forward` on the same backend up to float rounding
(tests/test_backend_equality_cpu.py compares the logits; greedy tokens of the real model
are compared in tests/test_default_model.py).
"""

from __future__ import annotations

import numpy as np

from refserve.backends.cpu_fused import add_rms_norm, rms_norm, rope_write_kv, silu_mul


def fused_forward(model, input_ids, positions, attn, kv_caches, logits_indices=None):
    """`LlamaModel.forward` (same arguments, same result up to rounding) on the tuned CPU
    backend's fused kernels (module docstring). Returns float32 logits
    [len(logits_indices), vocab]."""
    c, backend = model.config, model.backend
    heads, head_dim = c.num_attention_heads, c.head_dim
    positions = np.asarray(positions, dtype=np.int64)
    slot_mapping = np.asarray(attn.slot_mapping, dtype=np.int64)
    h = model.embed_tokens[input_ids]                        # [T, hidden], a copy
    x = np.empty_like(h)
    q = np.empty((len(h), heads, head_dim), dtype=h.dtype)
    act = np.empty((len(h), c.intermediate_size), dtype=h.dtype)
    layers = model.layers
    if layers:
        rms_norm(h, layers[0].input_norm, model.eps, x)
    for i, (block, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches)):
        w = block.attention
        qkv = backend.linear(x, w.w_qkv)
        if w.b_qkv is not None:
            qkv += w.b_qkv
        rope_write_kv(qkv, positions, model.rope_cos, model.rope_sin, heads, k_cache,
                      v_cache, slot_mapping, q)
        o = backend.paged_attention(q, k_cache, v_cache, attn, model.scale)
        o = backend.linear(o.reshape(len(h), heads * head_dim), w.w_o)
        if w.b_o is not None:
            o += w.b_o
        add_rms_norm(h, o, block.post_attention_norm, model.eps, x)
        silu_mul(backend.linear(x, block.mlp.w_gate_up), act)
        down = backend.linear(act, block.mlp.w_down)
        if i + 1 < len(layers):
            add_rms_norm(h, down, layers[i + 1].input_norm, model.eps, x)
        else:
            h += down
    if logits_indices is not None:
        h = h[logits_indices]
    x = np.empty_like(h)
    rms_norm(h, model.final_norm, model.eps, x)
    return backend.linear(x, model.lm_head).astype(np.float32, copy=False)
