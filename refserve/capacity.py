"""Capacity math: how many tokens of KV cache fit on a GPU, and how many sequences that serves.

Every token a sequence has seen keeps one key vector and one value vector per layer per KV
head in the cache. So

    KV bytes per token = 2 (K and V) * num_layers * num_kv_heads * head_dim * dtype_bytes

Llama-3-8B (32 layers, 8 KV heads of 128, float16): 2 * 32 * 8 * 128 * 2 = 131072 bytes,
128 KiB per token, so a 2048-token context is 256 MiB. Grouped-query attention (8 KV heads
for 32 query heads) is what keeps this 4x smaller than it would be with 32 KV heads.

Paged KV cache: memory is cut into blocks of `block_size` tokens.

    blocks for n tokens          = ceil(n / block_size)
    tokens in the last block     = n - (blocks - 1) * block_size       (1 .. block_size)
    internal fragmentation       = blocks * block_size - n             (< block_size)
    KV bytes per block           = block_size * KV bytes per token
    pool (blocks)                = floor((memory * utilisation - weights) / bytes per block)
    max concurrent sequences     = floor(pool / blocks for one sequence)

Run `python -m refserve.capacity --model llama-3-8b --memory 80GiB --context 2048` for a table
(the command line lives in refserve/capacity_cli.py; core modules import only this file).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# The block arithmetic is the block table's (its append rule); capacity builds on it.
from refserve.kv_cache.block_table import (  # noqa: F401 (blocks_for_tokens: re-exported)
    blocks_for_tokens,
    check_block_size,
)

# ---- the arithmetic ----------------------------------------------------------------------


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> int:
    """2 * num_layers * num_kv_heads * head_dim * dtype_bytes (the 2 is one K plus one V)."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        _require_positive_int(name, value)
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def last_block_fill(num_tokens: int, block_size: int) -> int:
    """Tokens held by the last block: num_tokens - (blocks - 1) * block_size, in 1..block_size
    (0 when there are no tokens). The last block wastes block_size - fill slots."""
    blocks = blocks_for_tokens(num_tokens, block_size)
    return 0 if blocks == 0 else num_tokens - (blocks - 1) * block_size


def kv_bytes_per_block(bytes_per_token: int, block_size: int) -> int:
    """block_size * KV bytes per token (all layers' K and V for block_size tokens)."""
    _require_positive_int("bytes_per_token", bytes_per_token)
    check_block_size(block_size)
    return block_size * bytes_per_token


def num_blocks_for_memory(free_bytes: int, gpu_memory_utilization: float, weights_bytes: int,
                          bytes_per_block: int, activation_bytes: int = 0) -> int:
    """floor((free_bytes * gpu_memory_utilization - weights_bytes - activation_bytes)
    / bytes_per_block).

    The engine may use a fraction `gpu_memory_utilization` of the device memory (the rest is
    head-room for the CUDA context, other processes and fragmentation of the allocator).
    Inside that budget the weights come first; whatever is left becomes the KV-cache pool,
    allocated once at start-up and cut into blocks. (A real engine also measures the peak
    activation memory of a forward pass and subtracts it: `activation_bytes`.)
    Raises ValueError if the weights alone do not fit in the budget.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization!r}: must be in (0, 1]")
    _require_positive_int("bytes_per_block", bytes_per_block)
    budget = int(free_bytes * gpu_memory_utilization)
    left = budget - weights_bytes - activation_bytes
    if left < 0:
        raise ValueError(
            f"the weights ({format_bytes(weights_bytes)}) do not fit in "
            f"{gpu_memory_utilization} x {format_bytes(free_bytes)} = {format_bytes(budget)}")
    return left // bytes_per_block


def max_concurrent_sequences(num_blocks: int, avg_tokens: int, block_size: int) -> int:
    """floor(num_blocks / ceil(avg_tokens / block_size)): sequences of `avg_tokens` tokens
    the pool holds at once. Each wastes at most one partly filled block, unlike a contiguous
    cache that reserves max_model_len slots per sequence."""
    per_sequence = blocks_for_tokens(avg_tokens, block_size)
    if per_sequence == 0:
        raise ValueError("avg_tokens must be >= 1")
    return num_blocks // per_sequence


# ---- model weights -----------------------------------------------------------------------

# Hugging Face config.json fields of the presets (only the ones the math reads).
PRESETS: dict[str, dict] = {
    "smollm2-135m": {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
    },
    "llama-3-8b": {
        "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
    },
    "llama-3-70b": {
        "model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
    },
    # Llama 2: no grouped-query attention at 7B (32 KV heads: 4x Llama 3's KV bytes).
    "llama-2-7b": {
        "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
        "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    },
    "llama-2-70b": {
        "model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 28672, "vocab_size": 32000, "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    },
}
# Llama 3.1: the Llama 3 shapes with a 128K context.
for _size in ("8b", "70b"):
    PRESETS[f"llama-3.1-{_size}"] = {**PRESETS[f"llama-3-{_size}"],
                                     "max_position_embeddings": 131072}

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}

# vLLM's --quantization (weights) and --kv-cache-dtype (the KV cache) choices that the
# capacity math and the simulator price: one byte per weight, one byte per K or V element.
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def weight_dtype_bytes(dtype: str, quantization: str | None = None) -> int:
    """Bytes per weight: 1 with quantization="fp8", else the model dtype's."""
    if quantization is None:
        return DTYPE_BYTES[dtype]
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: choose one of "
                         f"{', '.join(QUANTIZATIONS)} (or none)")
    return 1


def kv_cache_dtype_bytes(dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes per cached K or V element: the model dtype's ("auto", vLLM's default) or 1
    for an fp8 cache, which halves KV bytes per token against 16-bit and so doubles the
    tokens a pool of the same bytes holds."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return DTYPE_BYTES[dtype] if kv_cache_dtype == "auto" else 1


def _config_int(config: dict, key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise ValueError(f"model config is missing {key!r}")
    _require_positive_int(key, value)
    return value


def model_shape(config: dict) -> dict[str, int]:
    """The integer shape fields of a Llama-family HF config, with HF's defaults applied:
    num_key_value_heads defaults to num_attention_heads (no GQA), head_dim to
    hidden_size // num_attention_heads."""
    hidden = _config_int(config, "hidden_size")
    heads = _config_int(config, "num_attention_heads")
    return {
        "num_layers": _config_int(config, "num_hidden_layers"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": _config_int(config, "num_key_value_heads", heads),
        "head_dim": _config_int(config, "head_dim", hidden // heads),
        "intermediate_size": _config_int(config, "intermediate_size"),
        "vocab_size": _config_int(config, "vocab_size"),
    }


def num_parameters(config: dict) -> int:
    """Parameter count of a Llama-family model (Llama, Mistral, SmolLM, Qwen2).

        embeddings      vocab * hidden
        lm_head         vocab * hidden, unless tie_word_embeddings (then it reuses embeddings)
        per layer:
          attention     q: hidden * heads*hd     k, v: hidden * kv_heads*hd each
                        o: heads*hd * hidden     (+ q/k/v biases when present)
          MLP           gate, up: hidden * inter each; down: inter * hidden (SwiGLU)
          norms         2 * hidden (RMSNorm before attention and before the MLP)
        final norm      hidden

    Biases: Qwen2 has q/k/v biases; Llama's `attention_bias: true` adds q/k/v/o biases and
    `mlp_bias: true` adds MLP biases. A missing tie_word_embeddings means untied (the
    default of LlamaConfig).
    """
    s = model_shape(config)
    hidden, hd = s["hidden_size"], s["head_dim"]
    q_dim, kv_dim = s["num_heads"] * hd, s["num_kv_heads"] * hd

    if config.get("model_type") == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))

    attention = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    if qkv_bias:
        attention += q_dim + 2 * kv_dim
    if o_bias:
        attention += hidden
    mlp = 3 * hidden * s["intermediate_size"]
    if mlp_bias:
        mlp += 2 * s["intermediate_size"] + hidden
    per_layer = attention + mlp + 2 * hidden

    embeddings = s["vocab_size"] * hidden
    lm_head = 0 if config.get("tie_word_embeddings", False) else embeddings
    return embeddings + lm_head + s["num_layers"] * per_layer + hidden


def weights_bytes(config: dict, dtype_bytes: int = 2) -> int:
    """num_parameters(config) * dtype_bytes."""
    _require_positive_int("dtype_bytes", dtype_bytes)
    return num_parameters(config) * dtype_bytes


# ---- model configs: a preset name or an HF config.json ------------------------------

PRESET_DTYPE = "bfloat16"  # the presets ship bfloat16 weights


def model_dtype(config: dict) -> str | None:
    """config.json's dtype ("torch_dtype", or "dtype" in newer transformers), if known."""
    dtype = config.get("torch_dtype") or config.get("dtype")
    return dtype if dtype in DTYPE_BYTES else None


def load_model_config(model: str) -> tuple[str, dict]:
    """A preset name or a folder holding config.json -> (display name, config dict)."""
    if model.lower() in PRESETS:
        return model.lower(), PRESETS[model.lower()]
    path = Path(model)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ValueError(
            f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a folder "
            f"holding config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {config_path}: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} does not hold a JSON object")
    # Some multimodal checkpoints nest the language model under text_config.
    config = config.get("text_config", config)
    return str(path), config


# ---- parsing and formatting --------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """'80GiB' -> 85899345920, '24GB' -> 24000000000, '512MiB', '1.5GiB', '4096' (bytes).
    Units are case-insensitive; GB is 10^9 bytes, GiB is 2^30."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot parse memory size {text!r}: expected a number and a unit, "
            f"like 80GiB, 24GB or 512MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be > 0")
    return value


def format_bytes(num_bytes: float) -> str:
    """1536 -> '1.50 KiB' (binary units)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def _require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an integer >= 1")


# ---- the whole report ----------------------------------------------------------------------


def capacity_report(config: dict, memory_bytes: int, context: int, block_size: int = 16,
                    dtype_bytes: int = 2, gpu_memory_utilization: float = 0.9, *,
                    weight_bytes: int | None = None, kv_bytes: int | None = None) -> dict:
    """All the numbers the CLI prints, as a dict (handy for tests and notebooks).
    `weight_bytes` / `kv_bytes`: bytes per weight / per K or V element when they differ
    from `dtype_bytes` (fp8 weights: --quantization fp8; an fp8 KV cache:
    --kv-cache-dtype fp8, which halves KV per token against 16-bit and so doubles the
    pool's tokens and the sequences it holds)."""
    shape = model_shape(config)
    per_token = kv_bytes_per_token(shape["num_layers"], shape["num_kv_heads"],
                                   shape["head_dim"], kv_bytes or dtype_bytes)
    per_block = kv_bytes_per_block(per_token, block_size)
    weights = weights_bytes(config, weight_bytes or dtype_bytes)
    num_blocks = num_blocks_for_memory(memory_bytes, gpu_memory_utilization, weights,
                                       per_block)
    blocks_per_seq = blocks_for_tokens(context, block_size)
    return {
        **shape,
        "parameters": num_parameters(config),
        "weights_bytes": weights,
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_block": per_block,
        "budget_bytes": int(memory_bytes * gpu_memory_utilization),
        "num_blocks": num_blocks,
        "pool_tokens": num_blocks * block_size,
        "blocks_per_sequence": blocks_per_seq,
        "last_block_fill": last_block_fill(context, block_size),
        "wasted_slots_per_sequence": blocks_per_seq * block_size - context,
        "kv_bytes_per_sequence": blocks_per_seq * per_block,
        "max_concurrent_sequences": max_concurrent_sequences(num_blocks, context, block_size),
    }


def check_pool_holds_one_sequence(num_blocks: int, block_size: int, max_model_len: int,
                                  memory_knob: str) -> None:
    """Refuse a KV pool that cannot hold one sequence of max_model_len tokens.

    Such a pool starts fine and then fails the first request that grows long, mid-run; so it
    is refused at start-up (vLLM does the same). `memory_knob` names the setting that sized
    the pool, for the message. Raises ValueError with both numbers and the two fixes.
    """
    needed = blocks_for_tokens(max_model_len, block_size)
    if num_blocks >= needed:
        return
    raise ValueError(
        f"the KV cache pool holds {num_blocks} blocks = {num_blocks * block_size} tokens "
        f"({memory_knob}), but one sequence of max_model_len={max_model_len} tokens needs "
        f"{needed} blocks of {block_size}; give the KV cache more memory (or "
        f"num_gpu_blocks_override >= {needed}), or lower max_model_len to at most "
        f"{num_blocks * block_size}")


def kv_budget_on_device(total: int, in_use: int, utilization: float, activations: int,
                        in_use_what: str = "weights, other processes") -> tuple[int, str]:
    """Bytes the KV pool may take on a GPU, vLLM's rule: the whole instance may use
    utilization × the device's TOTAL memory; what is already in use (`in_use`: weights,
    CUDA context, other processes; `in_use_what` names them for the messages) and one
    step's activations come off. Returns (bytes, what sized it); raises ValueError when
    nothing is left."""
    budget = int(total * utilization) - in_use - activations
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization}: the instance may use "
            f"{format_bytes(total * utilization)} of the device's "
            f"{format_bytes(total)}, but {format_bytes(in_use)} is in use already "
            f"({in_use_what}) and one step's activations need {format_bytes(activations)}: "
            "they do not fit; raise gpu_memory_utilization")
    return budget, (f"gpu_memory_utilization={utilization} of the device's total "
                    f"{format_bytes(total)}, {format_bytes(in_use)} in use before the pool "
                    f"({in_use_what})")


if __name__ == "__main__":
    # `python -m refserve.capacity` runs the command line, which lives in capacity_cli.py so
    # that this module (imported by the engine) never imports a CLI.
    import runpy

    runpy.run_module("refserve.capacity_cli", run_name="__main__")
