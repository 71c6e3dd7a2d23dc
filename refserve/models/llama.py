"""The Llama-family transformer, one forward pass over a flat batch of tokens.

Llama, SmolLM, Mistral and Qwen2 share one shape; the differences are config values
(grouped-query heads, rope theta, tied embeddings) and Qwen2's biases on q/k/v.

    h = embed(input_ids)
    for each layer:
        a = rms_norm(h) @ [Wq | Wk | Wv]         (+ bias: Qwen2, attention_bias)
        q, k = rope(q, positions), rope(k, positions)
        write k, v into the paged KV cache at slot_mapping     ← backend.write_kv
        o = attention(q, cached K/V of each sequence)         ← backend.paged_attention
        h = h + o @ Wo
        h = h + (silu(x @ Wgate) * (x @ Wup)) @ Wdown,  x = rms_norm(h)
    logits = rms_norm(h)[rows that sample] @ Wlm_headᵀ

    rms_norm(x) = x / sqrt(mean(x²) + eps) * weight
    rope: the "rotate half" form; each pair (x_i, x_{i+d/2}) at position p, θ_i = p·theta^(-2i/d),
          becomes (x_i cos θ_i − x_{i+d/2} sin θ_i,  x_{i+d/2} cos θ_i + x_i sin θ_i)

The batch is flat: T tokens from any number of sequences, prefill chunks and decodes mixed;
the attention metadata (see docs/architecture.md) tells the attention which token belongs
to which sequence. All dense math is written against `xp` (numpy or cupy), always float32.
Two CPU traps this file avoids on purpose: a float64 scalar silently promotes the whole
forward to float64 (4-6x slower), and a 3-D (B, 1, D) @ W matmul is ~5x slower than the same
product on a 2-D (B, D) array, so activations stay 2-D [T, hidden] throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False   # Qwen2, and Llama with attention_bias
    o_bias: bool = False     # Llama with attention_bias (Qwen2 has none on o_proj)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "llama"

    @classmethod
    def from_hf_dict(cls, raw: dict) -> LlamaConfig:
        """Build from an HF config.json dict (llama / mistral / qwen2)."""
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        rope_theta = raw.get("rope_theta")
        rope_params = raw.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or rope_params
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"rope scaling type {rope_type!r} is not implemented "
                             "(only plain RoPE)")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        model_type = raw.get("model_type", "llama")
        max_pos = raw["max_position_embeddings"]
        if model_type == "mistral" and raw.get("sliding_window"):
            # Sliding-window attention is not implemented; within the window it is plain
            # causal attention, so cap the context at the window.
            max_pos = min(max_pos, raw["sliding_window"])
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            model_type=model_type,
        )

    def expected_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor name → shape, for every tensor the forward reads."""
        d, hd = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * hd, self.num_key_value_heads * hd
        shapes = {"model.embed_tokens.weight": (self.vocab_size, d), "model.norm.weight": (d,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, d)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q_out, d),
                p + "self_attn.k_proj.weight": (kv_out, d),
                p + "self_attn.v_proj.weight": (kv_out, d),
                p + "self_attn.o_proj.weight": (d, q_out),
                p + "mlp.gate_proj.weight": (self.intermediate_size, d),
                p + "mlp.up_proj.weight": (self.intermediate_size, d),
                p + "mlp.down_proj.weight": (d, self.intermediate_size),
            })
            if self.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q_out,),
                               p + "self_attn.k_proj.bias": (kv_out,),
                               p + "self_attn.v_proj.bias": (kv_out,)})
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (d,)
        return shapes

    def num_parameters(self) -> int:
        return sum(int(np.prod(s)) for s in self.expected_tensor_shapes().values())


@dataclass
class _Layer:
    input_norm: object
    post_attention_norm: object
    w_qkv_t: object      # [hidden, (H + 2·Hkv)·head_dim]: q, k, v projections fused
    b_qkv: object | None
    w_o_t: object        # [H·head_dim, hidden]
    b_o: object | None
    w_gate_up_t: object  # [hidden, 2·intermediate]: gate and up fused
    w_down_t: object     # [intermediate, hidden]


class LlamaModel:
    """Weights plus the forward pass. Weights are stored transposed ([in, out]) and the q/k/v
    and gate/up projections fused, so each is one 2-D matmul `x @ W` per layer."""

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], backend) -> None:
        self.config = config
        self.backend = backend
        self.xp = backend.xp
        c = config

        def dev(a):
            return backend.to_device(np.ascontiguousarray(a, dtype=np.float32))

        self.embed_tokens = dev(weights["model.embed_tokens.weight"])
        self.final_norm = dev(weights["model.norm.weight"])
        lm_head = (weights["model.embed_tokens.weight"] if c.tie_word_embeddings
                   else weights["lm_head.weight"])
        self.lm_head_t = dev(lm_head.T)
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = [weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
            self.layers.append(_Layer(
                input_norm=dev(weights[p + "input_layernorm.weight"]),
                post_attention_norm=dev(weights[p + "post_attention_layernorm.weight"]),
                w_qkv_t=dev(np.concatenate(qkv, axis=0).T),
                b_qkv=(dev(np.concatenate([weights[p + f"self_attn.{n}_proj.bias"]
                                           for n in "qkv"])) if c.qkv_bias else None),
                w_o_t=dev(weights[p + "self_attn.o_proj.weight"].T),
                b_o=dev(weights[p + "self_attn.o_proj.bias"]) if c.o_bias else None,
                w_gate_up_t=dev(np.concatenate([weights[p + "mlp.gate_proj.weight"],
                                                weights[p + "mlp.up_proj.weight"]], axis=0).T),
                w_down_t=dev(weights[p + "mlp.down_proj.weight"].T),
            ))
        # RoPE tables, cos/sin of θ_i = p · theta^(-2i/d) for every position p, in float32.
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float64)
                                           / c.head_dim))
        angles = np.outer(np.arange(c.max_position_embeddings, dtype=np.float64), inv_freq)
        self.rope_cos = dev(np.cos(angles))
        self.rope_sin = dev(np.sin(angles))
        self.scale = np.float32(1.0 / np.sqrt(c.head_dim))  # np.float32: never promote
        self.eps = np.float32(c.rms_norm_eps)

    # ------------------------------------------------------------------ building blocks
    def rms_norm(self, x, weight):
        xp = self.xp
        variance = xp.mean(x * x, axis=-1, keepdims=True)
        return x * (1.0 / xp.sqrt(variance + self.eps)) * weight

    def rope(self, x, positions):
        """x: [T, heads, head_dim] → rotated copy (rotate-half form, see module docstring)."""
        half = x.shape[-1] // 2
        cos = self.rope_cos[positions][:, None, :]
        sin = self.rope_sin[positions][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return self.xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def silu(self, x):
        xp = self.xp
        # exp(-x) overflows to inf for very negative x; x / inf = -0 is the right limit.
        with np.errstate(over="ignore"):
            return x / (1.0 + xp.exp(-x))

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids, positions, attn, kv_caches, logits_indices=None):
        """One step over a flat batch.

        input_ids, positions: [T] integer arrays. attn: AttentionMetadata (slot_mapping,
        block_tables, context_lens, query_start_loc). kv_caches: per layer (k_cache, v_cache),
        each [num_blocks, block_size, num_kv_heads, head_dim]. logits_indices: rows of the
        batch whose logits are needed (the last token of each sequence that samples); None
        means every row. Returns float32 logits [len(logits_indices), vocab].
        """
        c, xp, backend = self.config, self.xp, self.backend
        T = int(input_ids.shape[0])
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = self.embed_tokens[input_ids]                                  # [T, hidden]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = self.rms_norm(h, layer.input_norm)
            qkv = x @ layer.w_qkv_t                                       # [T, (H+2Hkv)·D]
            if layer.b_qkv is not None:
                qkv = qkv + layer.b_qkv
            q = self.rope(qkv[:, :H * D].reshape(T, H, D), positions)
            k = self.rope(qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D), positions)
            v = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D)
            backend.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
            o = backend.paged_attention(q, k_cache, v_cache, attn.block_tables,
                                        attn.context_lens, attn.query_start_loc, self.scale)
            o = o.reshape(T, H * D) @ layer.w_o_t
            h = h + o if layer.b_o is None else h + (o + layer.b_o)
            x = self.rms_norm(h, layer.post_attention_norm)
            gate_up = x @ layer.w_gate_up_t                               # [T, 2·inter]
            inter = c.intermediate_size
            h = h + (self.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ layer.w_down_t
        if logits_indices is not None:
            h = h[logits_indices]
        logits = self.rms_norm(h, self.final_norm) @ self.lm_head_t
        assert logits.dtype == xp.float32, f"forward promoted to {logits.dtype}"
        return logits


def load_model(folder, backend) -> LlamaModel:
    """Load config and weights from an HF-format folder onto the backend."""
    from refserve.models.loader import load_config, load_weights

    config = load_config(folder)
    return LlamaModel(config, load_weights(folder, config), backend)
