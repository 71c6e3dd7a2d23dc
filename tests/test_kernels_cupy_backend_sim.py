"""CupyBackend's Python, run on the CPU: `cupy` replaced by NumPy plus the kernel simulator.

The fake module gives CupyBackend NumPy arrays and a RawModule whose functions run the kernels
in tests/cuda_sim, so everything the backend decides (decode rows vs varlen rows, v1 vs v2,
workspace reuse, the copy-chain fallback, argument packing) is checked against the NumPy
backend without a GPU. What it cannot check: NVRTC compilation, device memory, streams.
"""

from __future__ import annotations

import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from cuda_sim.sim_module import SimModule

from refserve.backends import cuda_launch as cl
from refserve.backends.numpy_backend import NumpyBackend
from refserve.model_runner import build_attention_metadata

attention_metadata = pytest.importorskip("refserve.backends.attention_metadata")
pytestmark = pytest.mark.skipif(shutil.which("g++") is None,
                                reason="g++ (C++20) is needed to run the CUDA kernels on the CPU")


class FakeRawModule:
    def __init__(self, code, options, name_expressions):
        self.sim = SimModule(name_expressions)

    def get_function(self, name):
        return lambda grid, block, args: self.sim.run(cl.Launch(name, grid, block, tuple(args)))


def fake_cupy(num_sms):
    device = SimpleNamespace(use=lambda: None, attributes={"MultiProcessorCount": num_sms})
    return SimpleNamespace(asarray=np.asarray, asnumpy=np.asarray, empty=np.empty,
                           ascontiguousarray=np.ascontiguousarray,
                           RawModule=FakeRawModule,
                           cuda=SimpleNamespace(Device=lambda index: device))


@pytest.fixture
def make_backend(monkeypatch):
    def make(num_sms=132, partition_size=cl.PARTITION_SIZE):
        monkeypatch.setitem(sys.modules, "cupy", fake_cupy(num_sms))
        from refserve.backends.cupy_backend import CupyBackend

        return CupyBackend(partition_size=partition_size)
    return make


def step(rng, q_lens, context_lens, block_size, num_kv_heads, group, head_dim, dtype):
    """One step's metadata (decode rows first) over a shuffled pool, and fresh K/V/q."""
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    physical = iter(rng.permutation(num_blocks))
    max_blocks = max(-(-n // block_size) for n in context_lens)
    tables = np.full((len(q_lens), max_blocks), attention_metadata.PAD_BLOCK, dtype=np.int32)
    slots = []
    for s, (q_len, n) in enumerate(zip(q_lens, context_lens)):
        tables[s, : -(-n // block_size)] = [next(physical) for _ in range(-(-n // block_size))]
        for pos in range(n - q_len, n):
            slots.append(tables[s, pos // block_size] * block_size + pos % block_size)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    attn = build_attention_metadata(np.array(slots), qsl, context_lens, tables)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [rng.standard_normal(shape).astype(dtype) for _ in range(2)]
    num_tokens, num_heads = len(slots), num_kv_heads * group
    qkv = rng.standard_normal((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim))
    qkv = qkv.astype(dtype)  # q, k, v as strided views of one fused projection, as in llama.py
    q = qkv[:, : num_heads * head_dim].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].reshape(
        num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].reshape(num_tokens, num_kv_heads,
                                                                  head_dim)
    return attn, caches, q, k, v


@pytest.mark.parametrize("num_sms, partition_size", [(132, 512), (4, 16)])  # v1, then v2
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_mixed_step_equals_the_numpy_backend(make_backend, num_sms, partition_size, dtype):
    backend = make_backend(num_sms, partition_size)
    rng = np.random.default_rng(0)
    q_lens, context_lens = [1, 1, 1, 4, 7], [40, 1, 70, 20, 7]
    attn, (k_cache, v_cache), q, k, v = step(rng, q_lens, context_lens, 16, 2, 3, 64, dtype)
    part = cl.choose_partitioning(attn.num_decodes, 6, 2, attn.max_decode_context_len,
                                  num_sms, partition_size)
    assert part.use_v2 == (num_sms == 4)

    k_ref, v_ref = k_cache.astype(np.float32), v_cache.astype(np.float32)
    reference = NumpyBackend()
    reference.write_kv(k.astype(np.float32), v.astype(np.float32), k_ref, v_ref,
                       attn.slot_mapping)
    expected = reference.paged_attention(q.astype(np.float32), k_ref, v_ref, attn, 0.125)

    backend.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
    np.testing.assert_array_equal(k_cache.astype(np.float32), k_ref)
    out = backend.paged_attention(q, k_cache, v_cache, attn, 0.125)
    assert out.dtype == dtype and out.flags.c_contiguous
    tol = 1e-5 if dtype == np.float32 else 2.0**-11 + 1e-5
    np.testing.assert_allclose(out.astype(np.float32), expected, rtol=tol, atol=2e-5)


def test_copy_blocks_runs_the_kernel_or_the_chain_fallback(make_backend):
    backend = make_backend()
    rng = np.random.default_rng(1)
    for pairs in ([[0, 3], [0, 4], [1, 5]], [[1, 2], [2, 3], [3, 1]]):  # CoW fork; a cycle
        caches = [rng.standard_normal((6, 8, 1, 64)).astype(np.float16) for _ in range(2)]
        expected = [c.copy() for c in caches]
        NumpyBackend().copy_blocks(*expected, np.array(pairs))
        backend.copy_blocks(*caches, np.array(pairs))
        np.testing.assert_array_equal(caches[0], expected[0])
        np.testing.assert_array_equal(caches[1], expected[1])


def test_resolve_dtype_defaults_to_float16_and_refuses_bfloat16(make_backend):
    backend = make_backend()
    assert backend.resolve_dtype("auto") == np.float16
    assert backend.resolve_dtype("float32") == np.float32
    with pytest.raises(ValueError, match="bfloat16"):
        backend.resolve_dtype("bfloat16")


def test_rejection_sample_equals_the_numpy_op(make_backend):
    """Same uniforms -> identical tokens, with draft probabilities and with n-gram (None)."""
    from refserve.sampling.rejection_sampler import rejection_sample

    backend = make_backend()
    rng = np.random.default_rng(2)
    batch, k, vocab = 3, 4, 300
    target = rng.dirichlet(np.full(vocab, 0.1), size=(batch, k + 1)).astype(np.float32)
    draft = rng.dirichlet(np.full(vocab, 0.1), size=(batch, k)).astype(np.float32)
    drafts = rng.integers(vocab, size=(batch, k))
    drafts[0] = target[0, :k].argmax(axis=-1)  # likely accepted: exercises the bonus token
    drafts[1, 2:] = -1
    for q in (draft, None):
        args = (drafts, q, target, rng.random((batch, k)), rng.random(batch))
        tokens, accepted = backend.rejection_sample(*args)
        expected_tokens, expected_accepted = rejection_sample(*args)
        np.testing.assert_array_equal(tokens, expected_tokens)
        np.testing.assert_array_equal(accepted, expected_accepted)
