"""The NumPy Llama is the same function as transformers' Llama/Qwen2/Mistral.

Tiny random checkpoints are created here with transformers, saved as safetensors, loaded by
refserve, and the logits compared at every position: max relative error <= 1e-4.
"""

import numpy as np
import pytest
from model_utils import (
    hf_logits,
    max_rel_err,
    numpy_backend,
    prefill_logits,
    row,
    run_step,
    save_tiny_hf_model,
)

from refserve.model_runner import ModelRunner
from refserve.models.loader import load_model

CASES = [
    pytest.param("llama", True, 2, None, id="llama-gqa-tied"),
    pytest.param("llama", False, 4, None, id="llama-mha-untied"),
    pytest.param("llama", False, 1, True, id="llama-mqa-bias"),
    pytest.param("qwen2", False, 2, None, id="qwen2-qkv-bias"),
    pytest.param("mistral", True, 2, None, id="mistral"),
]


@pytest.mark.parametrize("model_type,tie,kv_heads,bias", CASES)
def test_logits_match_transformers(tmp_path, model_type, tie, kv_heads, bias):
    folder, hf = save_tiny_hf_model(tmp_path, model_type, tie, kv_heads, bias)
    model = load_model(folder, numpy_backend())
    assert model.config.qkv_bias == (model_type == "qwen2" or bool(bias))
    tokens = np.random.default_rng(1).integers(0, 97, size=40).tolist()
    ours, _ = prefill_logits(model, tokens, block_size=8)
    assert ours.dtype == np.float32
    assert max_rel_err(ours, hf_logits(hf, tokens)) <= 1e-4


@pytest.mark.parametrize("block_size,chunk", [(1, 7), (8, 5), (16, 16), (32, 1)])
def test_paged_chunked_and_decode_equal_contiguous(tmp_path, block_size, chunk):
    """Paged cache (shuffled physical blocks, chunked prefill, chunk=1 is pure decode) gives
    the logits of the contiguous cache (one block of max_model_len), which match HF."""
    folder, hf = save_tiny_hf_model(tmp_path, "llama", True, 2)
    model = load_model(folder, numpy_backend())
    tokens = np.random.default_rng(2).integers(0, 97, size=37).tolist()
    contiguous, _ = prefill_logits(model, tokens, block_size=128, block_ids=[0])
    nblocks = -(-len(tokens) // block_size)
    shuffled = np.random.default_rng(3).permutation(nblocks + 5)[:nblocks].tolist()
    paged, _ = prefill_logits(model, tokens, block_size=block_size, chunk=chunk,
                              block_ids=shuffled)
    np.testing.assert_allclose(paged, contiguous, rtol=1e-5, atol=1e-5)
    assert max_rel_err(contiguous, hf_logits(hf, tokens)) <= 1e-4


def test_ragged_batch_matches_each_sequence_alone(tmp_path):
    """A batch mixing a prefill, a chunk in the middle of a prompt and two decodes gives each
    sequence the logits it gets alone."""
    folder, hf = save_tiny_hf_model(tmp_path, "qwen2", False, 2)
    model = load_model(folder, numpy_backend())
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, 97, size=n).tolist() for n in (23, 30, 9, 17)]
    bs = 4
    runner = ModelRunner(model, model.backend, num_blocks=64, block_size=bs)
    tables, next_block = [], 0
    for s in seqs:
        n = -(-len(s) // bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    # Step 1: compute everything but the tail of each sequence (tails: 23, 12, 1, 1 tokens).
    done = [0, 18, 8, 16]
    warm = [row(s, 0, d, t, num_logits=0) for s, d, t in zip(seqs, done, tables) if d > 0]
    assert run_step(runner, warm).shape == (0, 97)
    step = [row(s, d, len(s) - d, t) for s, d, t in zip(seqs, done, tables)]
    logits = run_step(runner, step)  # decodes run first inside, logits come back in order
    for i, s in enumerate(seqs):
        expect = hf_logits(hf, s)[-1:]
        assert max_rel_err(logits[i:i + 1], expect) <= 1e-4, f"sequence {i}"


def test_no_float64_promotion(tmp_path):
    folder, _ = save_tiny_hf_model(tmp_path, "llama", True, 2)
    model = load_model(folder, numpy_backend())
    assert model.scale.dtype == np.float32 and model.eps.dtype == np.float32
    logits, runner = prefill_logits(model, [1, 2, 3, 4, 5])
    assert logits.dtype == np.float32
    assert all(k.dtype == np.float32 for k, _ in runner.kv_caches)
