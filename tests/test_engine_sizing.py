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
