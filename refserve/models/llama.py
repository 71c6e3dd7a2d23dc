"""The Llama-family transformer, one forward pass over a flat batch of tokens.

Llama, SmolLM, Mistral and Qwen2 share one shape; the differences are config values
(grouped-query heads, rope theta, tied embeddings) and Qwen2's biases on q/k/v.

    h = embed(input_ids)
    cos, sin = rope tables at this step's positions         (once per step, not per layer)
    for each layer (a Block, as nanoGPT's):
        h = h + attention(rms_norm(h))
        h = h + mlp(rms_norm(h))
    logits = rms_norm(h)[rows that sample] @ Wlm_headᵀ

    attention(x):  q, k, v = x @ [Wq | Wk | Wv]ᵀ        (+ bias: Qwen2, attention_bias)
                   q, k = rope(q), rope(k)
                   write k, v into the paged KV cache at slot_mapping  ← backend.write_kv
                   o = softmax(q Kᵀ · scale) V over each sequence's cached K/V
                                                          ← backend.paged_attention
                   return o @ Woᵀ
    mlp(x):        return (silu(x @ Wgateᵀ) * (x @ Wupᵀ)) @ Wdownᵀ

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
class Attention:
    """One layer's attention weights: q, k and v fused into one product (as nanoGPT's
    c_attn), then the output projection."""

    w_qkv: object           # [(H + 2·Hkv)·head_dim, hidden]: Wq, Wk, Wv stacked
    b_qkv: object | None
    w_o: object             # [hidden, H·head_dim]
    b_o: object | None


@dataclass
class MLP:
    """One layer's gated MLP weights: gate and up fused into one product, then down."""

    w_gate_up: object       # [2·intermediate, hidden]: Wgate, Wup stacked
    w_down: object          # [hidden, intermediate]


@dataclass
class Block:
    """One transformer layer: h + attention(norm(h)), then h + mlp(norm(h))."""

    input_norm: object
    attention: Attention
    post_attention_norm: object
    mlp: MLP


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
        self.layers: list[Block] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = [weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            self.layers.append(Block(
                input_norm=dev(weights[p + "input_layernorm.weight"]),
                attention=Attention(
                    w_qkv=dense(np.concatenate(qkv, axis=0)),
                    b_qkv=(dev(np.concatenate([weights[p + f"self_attn.{n}_proj.bias"]
                                               for n in "qkv"])) if c.qkv_bias else None),
                    w_o=dense(weights[p + "self_attn.o_proj.weight"]),
                    b_o=dev(weights[p + "self_attn.o_proj.bias"]) if c.o_bias else None),
                post_attention_norm=dev(weights[p + "post_attention_layernorm.weight"]),
                mlp=MLP(
                    w_gate_up=dense(np.concatenate([weights[p + "mlp.gate_proj.weight"],
                                                    weights[p + "mlp.up_proj.weight"]])),
                    w_down=dense(weights[p + "mlp.down_proj.weight"])),
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
        # cos, sin of this step's positions, [T, 1, head_dim / 2] (the 1 broadcasts over
        # heads): gathered once per step, every layer's `rope` reuses them.
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        h = self.embed_tokens[input_ids]                                  # [T, hidden]
        for block, kv_cache in zip(self.layers, kv_caches):
            h = h + self.attention(block.attention, self.rms_norm(h, block.input_norm),
                                   cos, sin, kv_cache, attn)
            h = h + self.mlp(block.mlp, self.rms_norm(h, block.post_attention_norm))
        if logits_indices is not None:
            h = h[logits_indices]
        logits = self.backend.linear(self.rms_norm(h, self.final_norm), self.lm_head)
        # A dtype is host-side metadata: checking it reads nothing back from the device.
        assert logits.dtype == self.dtype, f"forward promoted {self.dtype} to {logits.dtype}"
        return logits.astype(self.xp.float32, copy=False)  # only the logits are upcast

    def attention(self, w: Attention, x, cos, sin, kv_cache, attn):
        """One layer's attention of x [T, hidden] (module docstring): its K/V are written
        into `kv_cache` = (k_cache, v_cache), then every query attends its sequence's
        cached context. Returns [T, hidden]."""
        c, backend = self.config, self.backend
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = backend.linear(x, w.w_qkv)                              # [T, (H + 2Hkv)·D]
        if w.b_qkv is not None:
            qkv = qkv + w.b_qkv
        # q and k heads side by side: one rope call rotates both.
        qk = self.rope(qkv[:, :(H + Hkv) * D].reshape(-1, H + Hkv, D), cos, sin)
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + Hkv) * D:].reshape(-1, Hkv, D)
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        o = backend.paged_attention(q, k_cache, v_cache, attn, self.scale)   # [T, H, D]
        o = backend.linear(o.reshape(-1, H * D), w.w_o)
        return o if w.b_o is None else o + w.b_o

    def mlp(self, w: MLP, x):
        """The gated MLP of x [T, hidden]: down(silu(gate(x)) * up(x))."""
        gate_up = self.backend.linear(x, w.w_gate_up)                 # [T, 2·intermediate]
        inter = self.config.intermediate_size
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        return self.backend.linear(self.silu(gate) * up, w.w_down)
