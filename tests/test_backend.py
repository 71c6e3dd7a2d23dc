"""Backend plumbing: write_kv, copy_blocks, allocate_kv_cache, get_backend."""

from __future__ import annotations

import numpy as np
import pytest

import refserve.backends as backends
from refserve.backends import Backend, CpuBackend, NumpyBackend, get_backend

BACKEND = NumpyBackend()


def random_cache(rng, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (
        rng.standard_normal(shape).astype(np.float32),
        rng.standard_normal(shape).astype(np.float32),
    )


# ------------------------------------------------------------------------------ write_kv


def test_write_kv_places_each_token_at_its_slot_and_skips_minus_one():
    rng = np.random.default_rng(0)
    k_cache, v_cache = random_cache(rng)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    block_size = k_cache.shape[1]
    k = rng.standard_normal((5, 2, 8)).astype(np.float32)
    v = rng.standard_normal((5, 2, 8)).astype(np.float32)
    slot_mapping = np.array([13, -1, 0, 23, -1], dtype=np.int64)

    BACKEND.write_kv(k, v, k_cache, v_cache, slot_mapping)

    written = set()
    for t, slot in enumerate(slot_mapping):
        if slot < 0:
            continue
        block, offset = divmod(int(slot), block_size)
        np.testing.assert_array_equal(k_cache[block, offset], k[t])
        np.testing.assert_array_equal(v_cache[block, offset], v[t])
        written.add((block, offset))
    for block in range(k_cache.shape[0]):  # every other slot untouched
        for offset in range(block_size):
            if (block, offset) not in written:
                np.testing.assert_array_equal(k_cache[block, offset], k_before[block, offset])
                np.testing.assert_array_equal(v_cache[block, offset], v_before[block, offset])


def test_write_kv_all_slots_valid_and_all_skipped():
    rng = np.random.default_rng(1)
    k_cache, v_cache = random_cache(rng)
    k = rng.standard_normal((3, 2, 8)).astype(np.float32)
    BACKEND.write_kv(k, -k, k_cache, v_cache, np.array([5, 6, 7]))
    flat_k = k_cache.reshape(-1, 2, 8)
    np.testing.assert_array_equal(flat_k[5:8], k)
    np.testing.assert_array_equal(v_cache.reshape(-1, 2, 8)[5:8], -k)

    before = k_cache.copy()
    BACKEND.write_kv(k, k, k_cache, v_cache, np.array([-1, -1, -1]))
    np.testing.assert_array_equal(k_cache, before)


def test_write_kv_rejects_a_non_contiguous_cache():
    rng = np.random.default_rng(2)
    k_cache, v_cache = random_cache(rng)
    k = np.zeros((1, 2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="copy"):
        BACKEND.write_kv(k, k, k_cache[::2], v_cache[::2], np.array([0]))


# --------------------------------------------------------------------------- copy_blocks


def test_copy_blocks_copies_exactly_the_listed_blocks():
    rng = np.random.default_rng(3)
    k_cache, v_cache = random_cache(rng)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    src_to_dst = np.array([[0, 3], [4, 1]], dtype=np.int64)

    BACKEND.copy_blocks(k_cache, v_cache, src_to_dst)

    np.testing.assert_array_equal(k_cache[3], k_before[0])
    np.testing.assert_array_equal(v_cache[3], v_before[0])
    np.testing.assert_array_equal(k_cache[1], k_before[4])
    np.testing.assert_array_equal(v_cache[1], v_before[4])
    for block in (0, 2, 4, 5):
        np.testing.assert_array_equal(k_cache[block], k_before[block])
        np.testing.assert_array_equal(v_cache[block], v_before[block])


def test_copy_blocks_reads_before_writing_and_accepts_empty():
    rng = np.random.default_rng(4)
    k_cache, v_cache = random_cache(rng)
    k_before = k_cache.copy()
    BACKEND.copy_blocks(k_cache, v_cache, np.array([[0, 1], [1, 2]]))  # chain 0->1, 1->2
    np.testing.assert_array_equal(k_cache[1], k_before[0])
    np.testing.assert_array_equal(k_cache[2], k_before[1])  # the old block 1

    before = k_cache.copy()
    BACKEND.copy_blocks(k_cache, v_cache, np.zeros((0, 2), dtype=np.int64))
    np.testing.assert_array_equal(k_cache, before)


# ------------------------------------------------------------- allocate / device helpers


def test_allocate_kv_cache_layout():
    caches = BACKEND.allocate_kv_cache(
        num_layers=3,
        num_blocks=5,
        block_size=16,
        num_kv_heads=3,
        head_dim=64,
        dtype=np.float32,
    )
    assert len(caches) == 3
    for k_cache, v_cache in caches:
        assert k_cache.shape == v_cache.shape == (5, 16, 3, 64)
        assert k_cache.dtype == v_cache.dtype == np.float32
        assert k_cache.flags.c_contiguous and not np.shares_memory(k_cache, v_cache)
        assert not k_cache.any() and not v_cache.any()
    assert not np.shares_memory(caches[0][0], caches[1][0])


def test_to_device_and_to_numpy_are_identity():
    a = np.arange(6, dtype=np.float32)
    assert BACKEND.to_device(a) is a
    assert BACKEND.to_numpy(a) is a


# ---------------------------------------------------------------------------- get_backend


def test_get_backend_numpy_cpu_and_auto():
    """numpy is the reference; without a GPU, auto (the default) is the tuned CPU backend."""
    assert type(get_backend("numpy")) is NumpyBackend
    for name in ("cpu", "auto"):
        backend = get_backend(name)
        assert isinstance(backend, CpuBackend) and isinstance(backend, Backend)
        assert backend.name == "cpu" and backend.xp is np
    assert get_backend().name == "cpu"


def test_get_backend_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        get_backend("tpu")
    for name in ("auto", "numpy", "cpu", "cupy"):
        assert name in str(err.value)


def test_get_backend_cupy_without_gpu_is_a_clear_runtime_error():
    reason = backends._gpu_unavailable_reason()
    if reason is None:
        pytest.skip("this machine has cupy and a CUDA GPU")
    with pytest.raises(RuntimeError, match=r"needs the gpu extra .*none found"):
        get_backend("cupy")


def test_get_backend_cupy_and_auto_with_gpu_construct_the_cupy_backend(monkeypatch):
    """With a usable GPU, "cupy" and "auto" both build CupyBackend (faked here: no GPU)."""
    import sys
    import types

    made = []
    fake = types.ModuleType("refserve.backends.cupy_backend")
    fake.CupyBackend = lambda **options: made.append(options) or "cupy-backend"
    monkeypatch.setitem(sys.modules, "refserve.backends.cupy_backend", fake)
    monkeypatch.setattr(backends, "_gpu_unavailable_reason", lambda: None)
    assert get_backend("cupy", enforce_eager=True) == "cupy-backend"
    assert get_backend("auto") == "cupy-backend"
    assert made == [{"enforce_eager": True}, {}]
    monkeypatch.setattr(backends, "_gpu_unavailable_reason", lambda: "cupy sees 0 CUDA devices")
    assert get_backend("auto").name == "cpu"
    with pytest.raises(RuntimeError, match="none found: cupy sees 0 CUDA devices"):
        get_backend("cupy")
