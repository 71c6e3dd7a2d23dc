"""KV pool sizing at start-up and EngineConfig.dtype.

The engine sizes its pool with refserve/capacity.py and refuses, at construction, a pool that
cannot hold one max_model_len sequence (accepted, such a pool would fail the first long
request mid-run).
"""

import numpy as np
import pytest

import refserve.engine as engine_module
from refserve import LLM, SamplingParams, capacity
from refserve.backends.numpy_backend import NumpyBackend
from refserve.config import EngineConfig
from refserve.engine import LLMEngine
from refserve.engine_setup import DeviceMemory, PoolShape, size_kv_pool

# The tiny model: 2 layers, 2 KV heads of head_dim 12, max_position_embeddings 128.
KV_BYTES_PER_TOKEN_F32 = 2 * 2 * 2 * 12 * 4


def engine(folder, **kw):
    return LLMEngine(model=str(folder), progress=False, **kw)


def test_pool_smaller_than_one_max_model_len_sequence_is_refused(tiny_llama):
    # 10 blocks of 4 = 40 tokens; max_model_len 64 needs 16 blocks.
    with pytest.raises(ValueError) as err:
        engine(tiny_llama, block_size=4, num_gpu_blocks_override=10, max_model_len=64)
    msg = str(err.value)
    for part in ("10 blocks = 40 tokens", "max_model_len=64", "needs 16 blocks",
                 "num_gpu_blocks_override=10", "more memory", "num_gpu_blocks_override >= 16",
                 "lower max_model_len to at most 40"):
        assert part in msg, (part, msg)


def test_pool_sized_from_kv_cache_memory_is_refused_with_the_knob_named(tiny_llama):
    # 20 blocks' worth of memory, but the model's default max_model_len (128) needs 32.
    memory = 20 * 4 * KV_BYTES_PER_TOKEN_F32
    with pytest.raises(ValueError, match=rf"kv_cache_memory_bytes={memory}.*max_model_len=128"):
        engine(tiny_llama, block_size=4, kv_cache_memory_bytes=memory)


def test_pool_of_exactly_one_sequence_is_accepted_and_serves_it(tiny_llama):
    llm = LLM(model=str(tiny_llama), progress=False, block_size=4, num_gpu_blocks_override=16,
              max_model_len=64)
    assert llm.llm_engine.num_blocks == 16
    params = SamplingParams(max_tokens=64 - 40, temperature=0.0, ignore_eos=True)
    out = llm.generate([list(range(3, 43))], params)[0]
    assert len(out.outputs[0].token_ids) == 24       # grew to exactly max_model_len


def test_engine_sizing_uses_the_capacity_math(tiny_llama, monkeypatch):
    """The pool is num_blocks_for_memory(...) of the capacity module, called, not re-derived:
    replacing the function changes the pool."""
    e = engine(tiny_llama, block_size=4, kv_cache_memory_bytes=1 << 20)
    assert e.num_blocks == min((1 << 20) // (4 * KV_BYTES_PER_TOKEN_F32), 256 * 32)
    monkeypatch.setattr(capacity, "num_blocks_for_memory", lambda *a, **k: 77)
    assert engine(tiny_llama, block_size=4, kv_cache_memory_bytes=1 << 20).num_blocks == 77


# ------------------------------------------------------------------------------- dtype


def test_dtype_names_are_validated():
    with pytest.raises(ValueError, match="dtype='fp64'.*auto, float32, float16, bfloat16"):
        EngineConfig(dtype="fp64")
    assert EngineConfig().dtype == "auto"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_numpy_backend_accepts_only_float32(tiny_llama, dtype):
    for backend in ("numpy", "cpu"):
        with pytest.raises(ValueError, match=f"{backend} backend computes in float32; use "
                                             "dtype='float32' or the cupy backend"):
            engine(tiny_llama, dtype=dtype, num_gpu_blocks_override=64, backend=backend)
    for ok in ("auto", "float32"):
        kv = engine(tiny_llama, dtype=ok, num_gpu_blocks_override=64).runner.kv_caches
        assert kv[0][0].dtype == np.float32


def test_dtype_sizes_the_pool_and_the_cache_and_only_logits_are_upcast(tiny_llama,
                                                                        monkeypatch):
    """A backend that computes in float16: weights and KV cache are float16, a KV pool of the
    same memory holds twice the blocks, and the logits come back float32."""

    class HalfBackend(NumpyBackend):
        def resolve_dtype(self, dtype):
            return np.dtype(np.float16)

    monkeypatch.setattr(engine_module, "get_backend", lambda name, **options: HalfBackend())
    memory = 1 << 18
    half = engine(tiny_llama, block_size=4, kv_cache_memory_bytes=memory, dtype="float16")
    assert half.num_blocks == memory // (4 * KV_BYTES_PER_TOKEN_F32 // 2)
    assert half.runner.kv_caches[0][0].dtype == np.float16
    assert half.model.layers[0].attention.w_qkv.dtype == np.float16
    half.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    out = half.scheduler.schedule()
    logits = half.runner.forward(half.runner.prepare(out))
    assert logits.dtype == np.float32 and logits.shape == (1, 97)


def test_the_old_knob_names_still_work_and_warn():
    """num_gpu_blocks and kv_cache_memory are the old spellings of vLLM's names."""
    with pytest.warns(FutureWarning, match="num_gpu_blocks is deprecated"):
        assert EngineConfig(num_gpu_blocks=12).num_gpu_blocks_override == 12
    with pytest.warns(FutureWarning, match="kv_cache_memory is deprecated"):
        assert EngineConfig(kv_cache_memory=1 << 20).kv_cache_memory_bytes == 1 << 20


# ---- size_kv_pool: the one pool-sizing rule (the engine's and the simulator's) ----------

# The tiny model's shape: 2 layers, 2 KV heads of 12, hidden 48, MLP 96, vocab 97.
TINY = PoolShape(num_layers=2, num_kv_heads=2, head_dim=12, hidden_size=48,
                 intermediate_size=96, vocab_size=97)
# 4 MB device, 1 MB in use: float32, 4-token blocks (1536 bytes), a 64-token step whose
# activations are 64 x (4 x 48 + 2 x 96) x 4 + 64 x 97 x 4 = 123 136 bytes.
DEVICE = DeviceMemory(4_000_000, 1_000_000, "weights")


def pool(device=DEVICE, draft=None, **kw):
    options = {k: kw.pop(k) for k in ("kv_dtype_bytes", "tensor_parallel_size") if k in kw}
    config = EngineConfig(**{"block_size": 4, "max_num_batched_tokens": 64,
                             "gpu_memory_utilization": 0.5, **kw})
    return size_kv_pool(config, TINY, 4, kw.get("max_model_len", 128), device, draft,
                        **options)


def test_size_kv_pool_by_hand():
    cpu = pool(device=None, kv_cache_memory_bytes=1 << 20)
    assert (cpu.bytes_per_token, cpu.bytes_per_block) == (384, 1536)
    assert cpu.num_blocks == 682 and cpu.knob == "kv_cache_memory_bytes=1048576"  # 2^20 // 1536
    # 0.5 x 4 MB - 1 MB in use - 123 136 of activations = 876 864 bytes: 570 blocks.
    gpu = pool()
    assert gpu.num_blocks == 570
    assert gpu.knob.startswith("gpu_memory_utilization=0.5 of the device's total")
    assert "in use before the pool (weights)" in gpu.knob
    # A draft model of the same shape: both caches get the same count, 876 864 // 3072.
    spec = pool(draft=TINY)
    assert (spec.num_blocks, spec.draft_bytes_per_block) == (285, 1536)
    # A one-byte cache: 384 bytes a block, 876 864 // 384.
    assert pool(kv_dtype_bytes=1).num_blocks == 2283
    # Two devices: one KV head each (768 bytes a block), half the hidden activations
    # (49 152 + 24 832 logits): 926 016 // 768.
    assert pool(tensor_parallel_size=2).num_blocks == 1205
    # Capped at max_num_seqs sequences of max_model_len: 2 x ceil(128 / 4).
    assert pool(max_num_seqs=2).num_blocks == 64
    # The override wins; the contiguous layout has one block of max_model_len per sequence.
    assert pool(num_gpu_blocks_override=40).num_blocks == 40
    contiguous = pool(device=None, kv_cache_layout="contiguous", max_model_len=64)
    assert contiguous.block_size == 64 and contiguous.num_blocks == 256  # capped: 256 seqs
    # Swap preemption's host pool: 1 GiB of swap space in 1536-byte blocks.
    assert pool(preemption_mode="swap", swap_space=1.0).num_host_blocks == 2**30 // 1536


def test_size_kv_pool_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2: .*in use already "
                                         r"\(weights\).*do not fit"):
        pool(gpu_memory_utilization=0.2)
    with pytest.raises(ValueError, match="num_gpu_blocks_override=10.*needs 32 blocks"):
        pool(num_gpu_blocks_override=10)
