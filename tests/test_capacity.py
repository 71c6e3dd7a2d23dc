"""Capacity math, checked by hand, and the `python -m refserve.capacity` CLI."""

import json
import subprocess
import sys

import pytest

from refserve import capacity, capacity_cli
from refserve.capacity import (
    PRESETS,
    blocks_for_tokens,
    capacity_report,
    kv_bytes_per_block,
    kv_bytes_per_token,
    last_block_fill,
    max_concurrent_sequences,
    num_blocks_for_memory,
    num_parameters,
    parse_memory,
    weights_bytes,
)

GiB = 2**30


def test_blocks_for_1000_tokens():
    assert blocks_for_tokens(1000, 16) == 63
    assert last_block_fill(1000, 16) == 8
    assert blocks_for_tokens(0, 16) == 0
    assert last_block_fill(0, 16) == 0
    assert blocks_for_tokens(16, 16) == 1
    assert last_block_fill(16, 16) == 16
    assert blocks_for_tokens(17, 16) == 2
    assert last_block_fill(17, 16) == 1


def test_blocks_for_tokens_is_exact_past_float_precision():
    """Integer ceiling division: a float ceil(n / b) rounds n / b first and loses the +1."""
    assert blocks_for_tokens(2**53 + 1, 1) == 2**53 + 1
    assert blocks_for_tokens(2**60 + 1, 16) == 2**56 + 1


def test_llama_3_8b_by_hand():
    # 2 (K and V) * 32 layers * 8 KV heads * 128 head_dim * 2 bytes (fp16) = 128 KiB.
    per_token = kv_bytes_per_token(32, 8, 128, 2)
    assert per_token == 131072 == 128 * 1024
    per_block = kv_bytes_per_block(per_token, 16)
    assert per_block == 2 * 1024 * 1024  # 16 tokens * 128 KiB = 2 MiB

    # Parameters: embeddings 128256*4096 twice (untied), per layer q 4096*4096,
    # k and v 4096*1024, o 4096*4096, MLP 3*4096*14336, two norms, plus the final norm.
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096
    expected = 2 * 128256 * 4096 + 32 * per_layer + 4096
    assert expected == 8_030_261_248
    assert num_parameters(PRESETS["llama-3-8b"]) == expected
    weights = weights_bytes(PRESETS["llama-3-8b"], 2)
    assert weights == 2 * expected

    # 80 GiB * 0.9 = 72 GiB budget; minus 16.06e9 bytes of weights; / 2 MiB per block.
    num_blocks = num_blocks_for_memory(80 * GiB, 0.9, weights, per_block)
    assert num_blocks == (int(80 * GiB * 0.9) - weights) // per_block == 29205
    # A 2048-token sequence needs 128 blocks (256 MiB); 29205 // 128 = 228 sequences.
    assert max_concurrent_sequences(num_blocks, 2048, 16) == 228


def test_smollm2_135m_parameters():
    # The published size of SmolLM2-135M: 134,515,008 parameters (tied embeddings).
    assert num_parameters(PRESETS["smollm2-135m"]) == 134_515_008
    assert kv_bytes_per_token(30, 3, 64, 2) == 23040


def test_weights_variants():
    base = dict(PRESETS["smollm2-135m"])
    tied = num_parameters(base)
    untied = num_parameters({**base, "tie_word_embeddings": False})
    assert untied - tied == 49152 * 576
    qkv = 9 * 64 + 2 * 3 * 64
    assert num_parameters({**base, "model_type": "qwen2"}) - tied == 30 * qkv
    assert num_parameters({**base, "attention_bias": True}) - tied == 30 * (qkv + 576)
    # Defaults: no num_key_value_heads means no GQA, no head_dim means hidden // heads.
    no_gqa = {k: v for k, v in base.items() if k not in ("num_key_value_heads", "head_dim")}
    assert capacity.model_shape(no_gqa)["num_kv_heads"] == 9
    assert capacity.model_shape(no_gqa)["head_dim"] == 64
    with pytest.raises(ValueError, match="hidden_size"):
        num_parameters({k: v for k, v in base.items() if k != "hidden_size"})


def test_weights_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit"):
        num_blocks_for_memory(8 * GiB, 0.9, 16 * GiB, 2**21)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        num_blocks_for_memory(8 * GiB, 1.5, 0, 2**21)


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * GiB), ("24GB", 24 * 10**9), ("512MiB", 512 * 2**20),
    ("1.5GiB", 3 * GiB // 2), ("4096", 4096), ("2 gib", 2 * GiB),
])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80XB", "-1GiB", "0GiB", "eighty"])
def test_parse_memory_errors(text):
    with pytest.raises(ValueError):
        parse_memory(text)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "refserve.capacity", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_llama_3_8b():
    result = run_cli("--model", "llama-3-8b", "--memory", "80GiB", "--context", "2048")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "128.00 KiB" in out  # KV per token
    assert "2.00 MiB" in out  # KV per block
    assert "8,030,261,248" in out
    assert "29,205 blocks" in out
    assert "228 sequences" in out


def test_cli_smollm2_in_process(capsys):
    assert capacity_cli.main(["--model", "smollm2-135m", "--memory", "24GB", "--context", "1000",
                          "--block-size", "16", "--dtype", "float16",
                          "--gpu-memory-utilization", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "134,515,008" in out
    assert "22.50 KiB" in out  # 2 * 30 * 3 * 64 * 2 bytes
    assert "63 blocks, last holds 8/16, 8 slots wasted" in out


def test_cli_model_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-3-8b"]))
    assert capacity_cli.main(["--model", str(tmp_path), "--memory", "80GiB",
                          "--context", "2048"]) == 0
    assert "228 sequences" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--memory", "80XB"], "cannot parse memory size"),
    (["--model", "no-such-model"], "neither a preset"),
    (["--context", "0"], "must be >= 1"),
    (["--gpu-memory-utilization", "1.5"], "must be in"),
    (["--memory", "8GiB"], "do not fit"),
])
def test_cli_errors(args, message, capsys):
    argv = {"--model": "llama-3-8b", "--memory": "80GiB", "--context": "2048"}
    argv.update(dict(zip(args[::2], args[1::2], strict=True)))
    with pytest.raises(SystemExit) as exc:
        capacity_cli.main([x for pair in argv.items() for x in pair])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_fp8_weights_and_kv_cache_arithmetic():
    from refserve.capacity import kv_cache_dtype_bytes, weight_dtype_bytes

    assert weight_dtype_bytes("bfloat16") == 2 and weight_dtype_bytes("bfloat16", "fp8") == 1
    assert kv_cache_dtype_bytes("bfloat16") == 2
    assert kv_cache_dtype_bytes("float32", "fp8") == 1
    assert kv_cache_dtype_bytes("bfloat16", "fp8_e4m3") == 1
    with pytest.raises(ValueError, match="quantization='awq'"):
        weight_dtype_bytes("bfloat16", "awq")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        kv_cache_dtype_bytes("bfloat16", "int8")
    config = PRESETS["llama-3-70b"]
    # The bf16 weights (131 GiB) do not fit in 0.9 x 80 GiB; in fp8 (66 GiB) they do.
    with pytest.raises(ValueError, match="do not fit"):
        capacity_report(config, 80 * 2**30, 4096)
    fp8 = capacity_report(config, 80 * 2**30, 4096, weight_bytes=1, kv_bytes=1)
    # Llama-3-70B: 2 x 80 x 8 x 128 x 1 = 163,840 bytes per token in fp8, half of bf16's.
    assert fp8["kv_bytes_per_token"] == 163_840 == kv_bytes_per_token(80, 8, 128, 2) // 2
    assert fp8["weights_bytes"] == num_parameters(config)  # one byte per parameter
    budget = int(80 * 2**30 * 0.9)
    assert fp8["num_blocks"] == (budget - num_parameters(config)) // (16 * 163_840)
    kv_only = capacity_report(PRESETS["llama-3-8b"], 80 * 2**30, 2048, kv_bytes=1)
    bf16 = capacity_report(PRESETS["llama-3-8b"], 80 * 2**30, 2048)
    # Same weights, KV in one byte: the pool holds twice the blocks (to the block).
    assert kv_only["num_blocks"] in (2 * bf16["num_blocks"], 2 * bf16["num_blocks"] + 1)
    assert kv_only["max_concurrent_sequences"] >= 2 * bf16["max_concurrent_sequences"]


def test_capacity_cli_fp8_flags(capsys):
    from refserve.capacity_cli import main

    assert main(["--model", "llama-3-8b", "--memory", "80GiB", "--context", "2048",
                 "--kv-cache-dtype", "fp8", "--quantization", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "fp8 weights, fp8 KV cache" in out
    assert "64.00 KiB = 2 x 32 x 8 x 128 x 1 bytes" in out
