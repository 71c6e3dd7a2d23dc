"""`LlamaConfig`: the shape of a Llama-family model, read from an HF `config.json`.

Llama, SmolLM, Mistral and Qwen2 differ only in these values (grouped-query heads, rope theta,
tied embeddings, Qwen2's q/k/v biases). `models/loader.py` builds one from config.json and
checks the weights against `expected_tensor_shapes()`; `models/llama.py` computes with it.
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
