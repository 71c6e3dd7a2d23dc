"""The Llama-family transformer, one forward pass over a flat batch of tokens.

Llama, SmolLM, Mistral and Qwen2 share one shape; the differences are config values
(grouped-query heads, rope theta, tied embeddings) and Qwen2's biases on q/k/v.

    h = embed(input_ids)
    cos, sin = rope tables at this step's positions         (once per step, not per layer)
    for each layer:
        a = rms_norm(h) @ [Wq | Wk | Wv]ᵀ        (+ bias: Qwen2, attention_bias)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        write k, v into the paged KV cache at slot_mapping     ← backend.write_kv
        o = attention(q, cached K/V of each sequence)         ← backend.paged_attention
        h = h + o @ Woᵀ
        h = h + (silu(x @ Wgateᵀ) * (x @ Wupᵀ)) @ Wdownᵀ,  x = rms_norm(h)
    logits = rms_norm(h)[rows that sample] @ Wlm_headᵀ

    rms_norm(x) = x / sqrt(mean(x²) + eps) * weight
    rope: the "rotate half" form; each pair (x_i, x_{i+d/2}) at position p, θ_i = p·theta^(-2i/d),
          becomes (x_i cos θ_i − x_{i+d/2} sin θ_i,  x_{i+d/2} cos θ_i + x_i sin θ_i)

Every dense product `x @ Wᵀ` above is `backend.linear(x, W)`, for a weight W [out, in]
(Hugging Face's layout) that `backend.prepare_weight` put in the backend's form when the
model loaded; the reference computes exactly `x @ W.T` (refserve/backends/base.py).

The batch is flat: T tokens from any number of sequences, prefill chunks and decodes mixed;
the attention metadata (see docs/architecture.md) tells the attention which token belongs
to which sequence. The rest of the math is written against `xp` (numpy or cupy), in the
model's dtype (the backend's: float32 on the CPU backends, float16 by default on CuPy); only
the logits are upcast to float32. Activations stay 2-D [T, hidden]: a 3-D (T, 1, D) @ W
product would run as T separate products.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refserve.models.config import LlamaConfig


@dataclass
class _Layer:
    input_norm: object
    post_attention_norm: object
    w_qkv: object           # [(H + 2·Hkv)·head_dim, hidden]: q, k, v projections fused
    b_qkv: object | None
    w_o: object             # [hidden, H·head_dim]
    b_o: object | None
    w_gate_up: object       # [2·intermediate, hidden]: gate and up fused
    w_down: object          # [hidden, intermediate]


class LlamaModel:
    """Weights plus the forward pass. Weights keep HF's [out, in] layout, with the q/k/v and
    gate/up projections fused, so each is one 2-D product `backend.linear(x, W)` per layer."""

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], backend,
                 dtype=np.float32) -> None:
        self.config = config
        self.backend = backend
        self.xp = backend.xp
        self.dtype = np.dtype(dtype)
        c = config

        def dev(a):
            return backend.to_device(np.ascontiguousarray(a, dtype=self.dtype))

        def dense(a):       # a weight of `linear`, in the backend's form
            return backend.prepare_weight(dev(a))

        embed = dev(weights["model.embed_tokens.weight"])             # [vocab, hidden]
        self.final_norm = dev(weights["model.norm.weight"])
        self.lm_head = (backend.prepare_weight(embed) if c.tie_word_embeddings
                        else dense(weights["lm_head.weight"]))
        # Tied: the embedding rows are the lm_head's, stored once.
        self.embed_tokens = (backend.weight_matrix(self.lm_head) if c.tie_word_embeddings
                             else embed)
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = [weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            self.layers.append(_Layer(
                input_norm=dev(weights[p + "input_layernorm.weight"]),
                post_attention_norm=dev(weights[p + "post_attention_layernorm.weight"]),
                w_qkv=dense(np.concatenate(qkv, axis=0)),
                b_qkv=(dev(np.concatenate([weights[p + f"self_attn.{n}_proj.bias"]
                                           for n in "qkv"])) if c.qkv_bias else None),
                w_o=dense(weights[p + "self_attn.o_proj.weight"]),
                b_o=dev(weights[p + "self_attn.o_proj.bias"]) if c.o_bias else None,
                w_gate_up=dense(np.concatenate([weights[p + "mlp.gate_proj.weight"],
                                                weights[p + "mlp.up_proj.weight"]], axis=0)),
                w_down=dense(weights[p + "mlp.down_proj.weight"]),
            ))
        # RoPE tables, cos/sin of θ_i = p · theta^(-2i/d) for every position p.
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float64)
                                           / c.head_dim))
        angles = np.outer(np.arange(c.max_position_embeddings, dtype=np.float64), inv_freq)
        self.rope_cos = dev(np.cos(angles))    # [max_position_embeddings, head_dim / 2]
        self.rope_sin = dev(np.sin(angles))
        # Scalars typed in the model dtype (np.float32 by default): a float64 scalar would
        # promote the forward to float64, a float32 one a float16 model to float32.
        self.scale = self.dtype.type(1.0 / np.sqrt(c.head_dim))
        self.eps = self.dtype.type(c.rms_norm_eps)

    # ------------------------------------------------------------------ building blocks
    def rms_norm(self, x, weight):
        variance = self.xp.mean(x * x, axis=-1, keepdims=True)
        return x * (1.0 / self.xp.sqrt(variance + self.eps)) * weight

    def rope(self, x, cos, sin):
        """x: [T, heads, head_dim] → rotated copy (rotate-half form, see module docstring)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def silu(self, x):
        # exp(-x) overflows to inf for very negative x; x / inf = -0 is the right limit.
        with np.errstate(over="ignore"):
            return x / (1.0 + self.xp.exp(-x))

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, positions, attn, kv_caches, logits_indices=None):
        """One step over a flat batch.

        input_ids, positions: [T] integer device arrays. attn: the step's AttentionMetadata
        (refserve/backends/attention_metadata.py), built once by ModelRunner.prepare and
        passed unchanged to every layer. kv_caches: per layer (k_cache, v_cache), each
        [num_blocks, block_size, num_kv_heads, head_dim]. logits_indices: rows of the batch
        whose logits are needed; None means every row. Returns logits
        [len(logits_indices), vocab] on the device, float32 (the only upcast).

        No value is read back to the host here: every size comes from array shapes or from
        the metadata's host scalars.
        """
        c, xp, backend = self.config, self.xp, self.backend
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # cos, sin of this step's positions, [T, 1, head_dim / 2] (the 1 broadcasts over
        # heads): gathered once per step, every layer's `rope` reuses them.
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        h = self.embed_tokens[input_ids]                                  # [T, hidden]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = self.rms_norm(h, layer.input_norm)
            qkv = backend.linear(x, layer.w_qkv)                          # [T, (H+2Hkv)·D]
            if layer.b_qkv is not None:
                qkv = qkv + layer.b_qkv
            # q and k heads side by side: one rope call rotates both.
            qk = self.rope(qkv[:, :(H + Hkv) * D].reshape(-1, H + Hkv, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + Hkv) * D:].reshape(-1, Hkv, D)
            backend.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
            o = backend.paged_attention(q, k_cache, v_cache, attn, self.scale)
            o = backend.linear(o.reshape(-1, H * D), layer.w_o)
            h = h + o if layer.b_o is None else h + (o + layer.b_o)
            x = self.rms_norm(h, layer.post_attention_norm)
            gate_up = backend.linear(x, layer.w_gate_up)                  # [T, 2·inter]
            gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
            h = h + backend.linear(self.silu(gate) * up, layer.w_down)
        if logits_indices is not None:
            h = h[logits_indices]
        logits = backend.linear(self.rms_norm(h, self.final_norm), self.lm_head)
        # A dtype is host-side metadata: checking it reads nothing back from the device.
        assert logits.dtype == self.dtype, f"forward promoted {self.dtype} to {logits.dtype}"
        return logits.astype(xp.float32, copy=False)  # only the logits are upcast
