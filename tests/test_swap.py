"""Swap preemption (preemption_mode="swap"), bottom up.

* Its parts: the host block pool (refserve/kv_cache/host_pool.py) and the backend ops swap_out
  / swap_in (NumPy; CuPy's pointer arithmetic on the CPU, and on a GPU when there is one). A
  Hypothesis state machine swaps random groups of sequences out and in and checks that the
  device pool and the host pool stay consistent and that every sequence's KV, wherever it
  lives, is exactly what it was.
* The scheduler's side: a state machine over the scheduler keeps both pools consistent;
  victims of one step share host blocks; a full host pool falls back to recompute.
* End to end on the tiny model: a swapped-in sequence's K/V arrays equal what they were, and
  greedy output is the same as with recompute (forced preemption, speculation on, a host pool
  too small)."""

import ctypes
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_scheduler import expected_output, make, make_seq, step

from refserve import LLM, SamplingParams
from refserve.backends.base import contiguous_runs
from refserve.backends.numpy_backend import NumpyBackend
from refserve.capacity import kv_bytes_per_block, kv_bytes_per_token
from refserve.kv_cache.block_allocator import BlockAllocator
from refserve.kv_cache.host_pool import (
    HostBlockPool,
    HostPoolFullError,
    host_blocks_for_swap_space,
)
from refserve.sequence import SequenceStatus

LAYOUT = (2, 1, 3)  # block_size, num_kv_heads, head_dim of the small caches below


def caches(rng, num_blocks, host_blocks, dtype=np.float32):
    shape = (num_blocks, *LAYOUT)
    k, v = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
    host = (np.zeros((host_blocks, *LAYOUT), dtype), np.zeros((host_blocks, *LAYOUT), dtype))
    return k, v, *host


# ---- sizing -----------------------------------------------------------------------------------


def test_host_blocks_for_swap_space():
    # SmolLM2-135M in float16: 30 layers, 3 KV heads of 64 -> 23,040 B per token, 368,640 B
    # per 16-token block; 4 GiB = 4,294,967,296 B -> 11,650 whole blocks.
    block = kv_bytes_per_block(kv_bytes_per_token(30, 3, 64, 2), 16)
    assert block == 368_640
    assert host_blocks_for_swap_space(4, block) == 4 * 2**30 // 368_640 == 11_650
    assert host_blocks_for_swap_space(0, block) == 0
    assert host_blocks_for_swap_space(0.5, 2**20) == 512
    for bad in (-1, True, "4", float("nan")):
        with pytest.raises(ValueError, match="swap_space"):
            host_blocks_for_swap_space(bad, block)


# ---- the host pool ----------------------------------------------------------------------------


def test_a_shared_block_is_copied_once_with_its_ref_count():
    pool = HostBlockPool(8)
    copies = pool.swap_out({0: [4, 5, 7], 1: [4, 5, 9]})
    assert [d for d, _ in copies] == [4, 5, 7, 9]
    h4, h5 = copies[0][1], copies[1][1]
    assert pool.host_table(0)[:2] == pool.host_table(1)[:2] == [h4, h5]
    assert pool.ref_count(h4) == pool.ref_count(h5) == 2
    assert pool.num_available_blocks == 4 and pool.num_swapped_out_blocks == 4
    pool.check_invariants()


def test_swapped_in_together_they_share_again():
    pool = HostBlockPool(8)
    pool.swap_out({0: [4, 5, 7], 1: [4, 5, 9]})
    assert pool.blocks_to_swap_in([0, 1]) == 4
    back = pool.swap_in([0, 1], [10, 11, 12, 13])
    assert back.tables == {0: [10, 11, 12], 1: [10, 11, 13]}
    assert back.shared == {10: 2, 11: 2}
    assert len(back.copies) == 4 and pool.num_available_blocks == 8
    pool.check_invariants()


def test_swapped_in_alone_a_sibling_keeps_the_host_copy():
    pool = HostBlockPool(8)
    pool.swap_out({0: [4, 5], 1: [4, 6]})
    shared_host = pool.host_table(0)[0]
    back = pool.swap_in([0], [20, 21])
    assert back.tables == {0: [20, 21]} and back.shared == {}
    assert pool.ref_count(shared_host) == 1  # still held for sequence 1
    back = pool.swap_in([1], [22, 23])
    assert back.copies[0] == (shared_host, 22)
    assert pool.num_available_blocks == 8
    pool.check_invariants()


def test_a_full_host_pool_tells_the_caller_and_changes_nothing():
    pool = HostBlockPool(3)
    pool.swap_out({0: [1, 2]})
    before = (pool.num_available_blocks, pool.swapped_out(), pool.num_swapped_out_blocks)
    with pytest.raises(HostPoolFullError, match="preempt by recompute"):
        pool.swap_out({1: [3, 4]})
    assert (pool.num_available_blocks, pool.swapped_out(), pool.num_swapped_out_blocks) == before
    pool.swap_out({1: [3]})  # one block still fits
    empty = HostBlockPool(0)  # swap_space = 0: every swap falls back to recompute
    with pytest.raises(HostPoolFullError):
        empty.swap_out({0: [1]})
    empty.check_invariants()


def test_host_pool_rejects_bad_calls():
    pool = HostBlockPool(8)
    pool.swap_out({0: [1, 2]})
    with pytest.raises(ValueError, match="already swapped out"):
        pool.swap_out({0: [3]})
    with pytest.raises(ValueError, match="twice"):
        pool.swap_out({1: [3, 3]})
    with pytest.raises(KeyError, match="not swapped out"):
        pool.swap_in([5], [1])
    with pytest.raises(ValueError, match="need 2 distinct device blocks"):
        pool.swap_in([0], [7])
    with pytest.raises(ValueError, match="need 2 distinct device blocks"):
        pool.swap_in([0], [7, 7])
    pool.release(0)
    pool.release(0)  # no-op
    assert pool.num_available_blocks == 8
    with pytest.raises(ValueError, match="num_blocks"):
        HostBlockPool(-1)


# ---- the backend ops ---------------------------------------------------------------------------


def test_numpy_swap_out_then_in_restores_the_blocks(rng):
    backend = NumpyBackend()
    k, v, host_k, host_v = caches(rng, 6, 4)
    original_k, original_v = k.copy(), v.copy()
    backend.swap_out(k, v, host_k, host_v, np.array([[5, 0], [2, 3]]))
    np.testing.assert_array_equal(host_k[[0, 3]], original_k[[5, 2]])
    np.testing.assert_array_equal(host_v[[0, 3]], original_v[[5, 2]])
    k[:], v[:] = -1, -1  # the device blocks are reused by others
    backend.swap_in(k, v, host_k, host_v, np.array([[0, 1], [3, 4]]))
    np.testing.assert_array_equal(k[[1, 4]], original_k[[5, 2]])
    np.testing.assert_array_equal(v[[1, 4]], original_v[[5, 2]])
    assert (k[[0, 2, 3, 5]] == -1).all()  # nothing else was written


def test_swap_ops_check_their_arguments(rng):
    backend = NumpyBackend()
    k, v, host_k, host_v = caches(rng, 4, 2)
    with pytest.raises(ValueError, match="host block ids must be in"):
        backend.swap_out(k, v, host_k, host_v, np.array([[0, 2]]))
    with pytest.raises(ValueError, match="device block ids must be in"):
        backend.swap_in(k, v, host_k, host_v, np.array([[0, 4]]))
    with pytest.raises(ValueError, match="destination block appears twice"):
        backend.swap_out(k, v, host_k, host_v, np.array([[0, 1], [2, 1]]))
    with pytest.raises(ValueError, match="one layout"):
        backend.swap_out(k, v, host_k.astype(np.float16), host_v, np.array([[0, 1]]))
    backend.swap_out(k, v, host_k, host_v, np.zeros((0, 2), np.int64))  # nothing to do


def test_allocate_host_kv_cache_has_the_device_layout():
    backend = NumpyBackend()
    (host_k, host_v), = backend.allocate_host_kv_cache(1, 5, *LAYOUT, dtype=np.float32)
    assert host_k.shape == host_v.shape == (5, *LAYOUT) and host_k.dtype == np.float32
    assert not host_k.any()
    with pytest.raises(ValueError, match="positive sizes"):
        backend.allocate_host_kv_cache(1, 0, *LAYOUT)


def test_contiguous_runs():
    assert contiguous_runs(np.array([[3, 0], [4, 1], [5, 2], [9, 3], [1, 7], [2, 8]])) == [
        (3, 0, 3), (9, 3, 1), (1, 7, 2)]
    assert contiguous_runs(np.array([[3, 0], [4, 2]])) == [(3, 0, 1), (4, 2, 1)]
    assert contiguous_runs(np.zeros((0, 2), np.int64)) == []


class _DeviceArray(np.ndarray):
    """A NumPy array that answers `.data.ptr` like a cupy array (for the fake below)."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


def _fake_cupy(log):
    def memcpy_async(dst, src, size, kind, stream):
        log.append((kind, size))
        ctypes.memmove(dst, src, size)

    runtime = SimpleNamespace(memcpyDeviceToHost=2, memcpyHostToDevice=1,
                              memcpyAsync=memcpy_async)
    stream = SimpleNamespace(ptr=0)
    return SimpleNamespace(cuda=SimpleNamespace(runtime=runtime,
                                                get_current_stream=lambda: stream))


def test_cupy_swap_pointer_arithmetic_on_the_cpu(rng):
    """CupyBackend's swap_out / swap_in with cudaMemcpyAsync replaced by a memmove over NumPy
    memory: the addresses, sizes, directions and runs it computes are the right ones."""
    from refserve.backends.cupy_backend import CupyBackend

    backend = CupyBackend.__new__(CupyBackend)  # no GPU: skip __init__, give it the fake
    log = []
    backend.xp = _fake_cupy(log)
    k, v, host_k, host_v = caches(rng, 8, 5)
    reference = NumpyBackend()
    ref_caches = [a.copy() for a in (k, v, host_k, host_v)]
    k, v = k.view(_DeviceArray), v.view(_DeviceArray)
    out = np.array([[6, 0], [7, 1], [2, 4]])
    backend.swap_out(k, v, host_k, host_v, out)
    reference.swap_out(*ref_caches, out)
    np.testing.assert_array_equal(host_k, ref_caches[2])
    np.testing.assert_array_equal(host_v, ref_caches[3])
    block = k[0].nbytes
    assert log == [(2, 2 * block), (2, block)] * 2  # two runs, for K then V
    back = np.array([[0, 3], [1, 4], [4, 0]])
    backend.swap_in(k, v, host_k, host_v, back)
    reference.swap_in(*ref_caches, back)
    np.testing.assert_array_equal(np.asarray(k), ref_caches[0])
    np.testing.assert_array_equal(np.asarray(v), ref_caches[1])
    assert log[4:] == [(1, 2 * block), (1, block)] * 2


def test_cupy_swap_round_trip_on_the_gpu():
    """On a GPU: pinned host blocks, asynchronous copies on the current stream, the same
    bytes as the NumPy op."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no device")
    except Exception as e:  # noqa: BLE001  (no cupy, no driver, no device)
        pytest.skip(f"no GPU: {e}")
    from refserve.backends.cupy_backend import CupyBackend

    backend = CupyBackend()
    rng = np.random.default_rng(0)
    k, v, _, _ = caches(rng, 8, 4, dtype=np.float16)
    (host_k, host_v), = backend.allocate_host_kv_cache(1, 4, *LAYOUT, dtype=np.float16)
    device_k, device_v = cupy.asarray(k), cupy.asarray(v)
    backend.swap_out(device_k, device_v, host_k, host_v, np.array([[6, 0], [7, 1], [2, 3]]))
    device_k[:] = 0
    device_v[:] = 0
    backend.swap_in(device_k, device_v, host_k, host_v, np.array([[0, 0], [1, 1], [3, 5]]))
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(host_k[[0, 1, 3]], k[[6, 7, 2]])
    np.testing.assert_array_equal(cupy.asnumpy(device_k)[[0, 1, 5]], k[[6, 7, 2]])
    np.testing.assert_array_equal(cupy.asnumpy(device_v)[[0, 1, 5]], v[[6, 7, 2]])


# ---- the state machine --------------------------------------------------------------------------

NUM_LAYERS = 2


class SwapMachine(RuleBasedStateMachine):
    """Running sequences hold device blocks (shared after forks, copied on write); groups of
    them are swapped out (or, when the host pool is full, preempted by recompute) and swapped
    back in. The manager's part (allocating, freeing, ref counts) is played here by hand; the
    engine's path through KVCacheManager and the scheduler is test_swap_preemption.py's."""

    def __init__(self):
        super().__init__()
        self.backend = NumpyBackend()
        self.running: dict[int, list[int]] = {}  # seq id -> device block table
        self.expected: dict[int, np.ndarray] = {}  # seq id -> its KV, [layers, 2, blocks, ...]
        self.ids = itertools.count()
        self.recomputed = 0

    @initialize(num_blocks=st.integers(4, 16), host_blocks=st.integers(0, 12),
                seed=st.integers(0, 2**16))
    def setup(self, num_blocks, host_blocks, seed):
        self.rng = np.random.default_rng(seed)
        self.allocator = BlockAllocator(num_blocks)
        self.pool = HostBlockPool(host_blocks)
        self.device = self.backend.allocate_kv_cache(NUM_LAYERS, num_blocks, *LAYOUT)
        self.host = (self.backend.allocate_host_kv_cache(NUM_LAYERS, host_blocks, *LAYOUT)
                     if host_blocks else [])

    def gather(self, pairs, table):
        return np.stack([np.stack([k[table], v[table]]) for k, v in pairs])

    def fill(self, block):
        """The forward writes fresh K/V into a block this sequence holds alone."""
        for k, v in self.device:
            k[block], v[block] = self.rng.standard_normal((2, *LAYOUT))

    def release(self, table):
        for block in table:
            if self.allocator.decref(block):
                for k, v in self.device:  # a freed block may be overwritten by anyone
                    k[block], v[block] = np.nan, np.nan

    @rule(num_blocks=st.integers(1, 3), num_children=st.integers(0, 2))
    def new_request(self, num_blocks, num_children):
        """A prompt computed into fresh blocks, forked into num_children more samples."""
        if self.allocator.num_available_blocks < num_blocks:
            return
        table = [self.allocator.allocate() for _ in range(num_blocks)]
        for block in table:
            self.fill(block)
        seq_id = next(self.ids)
        self.running[seq_id] = table
        self.expected[seq_id] = self.gather(self.device, table)
        for _ in range(num_children):
            self.fork_of(seq_id)

    @rule(data=st.data())
    def fork(self, data):
        if not self.running:
            return
        self.fork_of(data.draw(st.sampled_from(sorted(self.running))))

    def fork_of(self, parent):
        for block in self.running[parent]:
            self.allocator.incref(block)
        child = next(self.ids)
        self.running[child] = list(self.running[parent])
        self.expected[child] = self.expected[parent].copy()

    @rule(data=st.data())
    def write_last_block(self, data):
        if not self.running:
            return
        """Copy-on-write then write: the last block becomes private and gets new K/V."""
        seq_id = data.draw(st.sampled_from(sorted(self.running)))
        table = self.running[seq_id]
        if self.allocator.ref_count(table[-1]) > 1:
            if self.allocator.num_available_blocks == 0:
                return
            private = self.allocator.allocate()
            self.allocator.decref(table[-1])
            table[-1] = private
        self.fill(table[-1])
        self.expected[seq_id] = self.gather(self.device, table)

    @rule(data=st.data(), with_sharers=st.booleans())
    def swap_out(self, data, with_sharers):
        if not self.running:
            return
        group = data.draw(st.lists(st.sampled_from(sorted(self.running)), min_size=1,
                                   max_size=3, unique=True))
        if with_sharers:  # and every running sequence sharing a block with the first
            first = set(self.running[group[0]])
            group = [s for s, t in self.running.items() if s == group[0] or first & set(t)]
        tables = {seq_id: self.running[seq_id] for seq_id in group}
        before = (self.pool.num_available_blocks, self.pool.swapped_out())
        try:
            copies = self.pool.swap_out(tables)
        except HostPoolFullError:
            assert self.pool.blocks_to_swap_out(tables) > self.pool.num_available_blocks
            assert (self.pool.num_available_blocks, self.pool.swapped_out()) == before
            event("host pool full: recompute")
            for seq_id in group:  # fall back to recompute: the KV is simply dropped
                self.release(self.running.pop(seq_id))
                del self.expected[seq_id]
                self.recomputed += 1
            return
        assert len(copies) == len({b for t in tables.values() for b in t})
        if len(copies) < sum(map(len, tables.values())):
            event("swap_out copied a shared block once")
        for (k, v), (host_k, host_v) in zip(self.device, self.host):
            self.backend.swap_out(k, v, host_k, host_v, np.array(copies).reshape(-1, 2))
        for seq_id in group:
            self.release(self.running.pop(seq_id))

    @rule(data=st.data(), with_sharers=st.booleans())
    def swap_in(self, data, with_sharers):
        if not self.pool.swapped_out():
            return
        group = data.draw(st.lists(st.sampled_from(sorted(self.pool.swapped_out())),
                                   min_size=1, max_size=3, unique=True))
        if with_sharers:  # and every swapped-out sequence sharing a host block with it
            first = set(self.pool.host_table(group[0]))
            group = [s for s in self.pool.swapped_out()
                     if s == group[0] or first & set(self.pool.host_table(s))]
        needed = self.pool.blocks_to_swap_in(group)
        if needed > self.allocator.num_available_blocks:
            return  # stays swapped out until the pool has room
        fresh = [self.allocator.allocate() for _ in range(needed)]
        back = self.pool.swap_in(group, fresh)
        if back.shared:
            event("swap_in shares blocks again")
        for block, holders in back.shared.items():
            for _ in range(holders - 1):
                self.allocator.incref(block)
        for (k, v), (host_k, host_v) in zip(self.device, self.host):
            self.backend.swap_in(k, v, host_k, host_v, np.array(back.copies).reshape(-1, 2))
        for seq_id, table in back.tables.items():
            self.running[seq_id] = table
            # The point of it all: the KV came back exactly as it was.
            np.testing.assert_array_equal(self.gather(self.device, table),
                                          self.expected[seq_id])

    @rule(data=st.data())
    def finish(self, data):
        if not self.running:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.running)))
        self.release(self.running.pop(seq_id))
        del self.expected[seq_id]

    @rule(data=st.data())
    def abort_swapped_out(self, data):
        if not self.pool.swapped_out():
            return
        seq_id = data.draw(st.sampled_from(sorted(self.pool.swapped_out())))
        self.pool.release(seq_id)
        del self.expected[seq_id]

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        self.allocator.check_invariants()
        self.pool.check_invariants()
        holders = {}
        for table in self.running.values():
            for block in table:
                holders[block] = holders.get(block, 0) + 1
        for block in range(self.allocator.num_blocks):
            assert self.allocator.ref_count(block) == holders.get(block, 0)
        host_held = {b for s in self.pool.swapped_out() for b in self.pool.host_table(s)}
        assert self.pool.num_available_blocks + len(host_held) == self.pool.num_blocks
        assert set(self.running).isdisjoint(self.pool.swapped_out())
        assert set(self.expected) == set(self.running) | set(self.pool.swapped_out())
        for seq_id, table in self.running.items():
            np.testing.assert_array_equal(self.gather(self.device, table),
                                          self.expected[seq_id])
        for seq_id in self.pool.swapped_out():
            np.testing.assert_array_equal(
                self.gather(self.host, self.pool.host_table(seq_id)), self.expected[seq_id])

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for seq_id in self.pool.swapped_out():
            self.pool.release(seq_id)
        for table in self.running.values():
            self.release(table)
        assert self.pool.num_available_blocks == self.pool.num_blocks
        assert self.allocator.num_available_blocks == self.allocator.num_blocks


SwapMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSwapStateful = SwapMachine.TestCase


# ---- the scheduler's side and end to end ------------------------------------------------


STEMS = [[(g * 131 + i * 17) % 991 + 1 for i in range(24)] for g in range(2)]


class SwapSchedulerMachine(RuleBasedStateMachine):
    """Requests arrive (some sharing a stem, so prefix hits share blocks), steps run
    against the fake runner (which checks every position's K/V each step), some requests
    are aborted; a small pool forces preemption, a small host pool forces fallbacks."""

    def __init__(self):
        super().__init__()
        self.ids = itertools.count()
        self.live = {}  # request id -> sequence, until it finishes or is aborted
        self.finished = {}

    @initialize(num_blocks=st.integers(8, 14), host_blocks=st.sampled_from([0, 3, 8, 64]),
                prefix_policy=st.sampled_from(["hash", "radix"]),
                policy=st.sampled_from(["fcfs", "priority"]))
    def setup(self, num_blocks, host_blocks, prefix_policy, policy):
        self.sched, self.kv, self.runner = make(
            num_blocks=num_blocks, block_size=4, max_num_seqs=4, budget=16,
            max_model_len=32, prefix_policy=prefix_policy, policy=policy,
            host_blocks=host_blocks)
        self.host = self.sched.swapper.host_pool
        self.host_blocks = host_blocks

    @rule(stem=st.sampled_from([None, 0, 1]), shared=st.integers(0, 24),
          own=st.integers(1, 6), max_tokens=st.integers(1, 12), priority=st.integers(0, 2))
    def add(self, stem, shared, own, max_tokens, priority):
        rid = f"r{next(self.ids)}"
        seq = make_seq(rid, own, max_tokens)
        if stem is not None:
            seq.prompt_token_ids = STEMS[stem][:shared] + seq.prompt_token_ids
            seq.token_ids = list(seq.prompt_token_ids)
        seq.priority = priority if self.sched.policy.name == "priority" else 0
        self.sched.add_sequence(seq)
        self.live[rid] = seq

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def run_step(self):
        _, retired = step(self.sched, self.runner)
        for seq in retired:
            self.finished[seq.request_id] = self.live.pop(seq.request_id)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def abort(self, index):
        rid = sorted(self.live)[index % len(self.live)]
        seq = self.live.pop(rid)
        assert self.sched.abort(seq.seq_id) is seq

    @invariant()
    def pools_are_consistent(self):
        self.kv.check_invariants()
        self.host.check_invariants()
        waiting = {seq.seq_id: seq for seq in self.sched.waiting}
        swapped = set(self.host.swapped_out())
        assert swapped <= set(waiting), "a host table outlived its sequence's wait"
        for seq_id in swapped:
            assert not self.kv.has_sequence(seq_id), "swapped out, yet holding device blocks"
            assert waiting[seq_id].num_computed_tokens > 0
        for seq in self.sched.running:
            assert self.kv.has_sequence(seq.seq_id) and seq.seq_id not in swapped
        for seq_id, seq in waiting.items():  # a recompute victim holds nothing anywhere
            if seq_id not in swapped:
                assert seq.num_computed_tokens == 0 and not self.kv.has_sequence(seq_id)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.run_step()
        assert not self.sched.has_unfinished()
        for rid, seq in self.finished.items():
            tokens, _ = expected_output(rid, seq.num_prompt_tokens, seq.sampling_params, 32,
                                        None)
            assert seq.output_token_ids == tokens
        assert self.kv.num_held_blocks == 0
        assert self.host.num_available_blocks == self.host_blocks  # nothing left on host


SwapSchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSwapScheduler = SwapSchedulerMachine.TestCase


def two_on_a_small_pool():
    """Two 4-token prompts that want 12 tokens each on a 6-block pool of 4-token blocks:
    the second is preempted (swapped out) within a few steps."""
    sched, kv, runner = make(num_blocks=6, block_size=4, max_num_seqs=2, prefix=False,
                             host_blocks=16)
    a, b = make_seq("a", 4, 12), make_seq("b", 4, 12)
    sched.add_sequence(a)
    sched.add_sequence(b)
    return sched, kv, runner, a, b


def test_a_swapped_out_sequence_keeps_its_computed_tokens():
    sched, kv, runner, a, b = two_on_a_small_pool()
    for _ in range(100):
        out, _ = step(sched, runner)
        if out.preempted:
            break
    assert out.preempted == [b.seq_id] and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens > 0 and sched.swapper.is_swapped_out(b)
    assert len(out.swap_out) == len(sched.swapper.host_pool.host_table(b.seq_id))
    assert "swap out" in str(out)
    assert sched.num_recomputed_tokens == 0
    while b.status is SequenceStatus.WAITING:
        out, _ = step(sched, runner)
    assert out.swap_in and not sched.swapper.is_swapped_out(b)
    # it resumed where it stopped: the row starts at its computed tokens, not at 0
    row = next(r for r in out.scheduled if r.seq is b)
    assert row.start > 0


# ---- the tiny model -----------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts():
    rng = np.random.default_rng(3)
    stem = rng.integers(3, 97, size=8).tolist()
    return [stem + rng.integers(3, 97, size=int(n)).tolist() for n in (2, 5, 9, 3, 7)]


def generate(tiny_llama, spy=None, **kw):
    llm = LLM(model=str(tiny_llama), progress=False, block_size=4, max_model_len=48,
              num_gpu_blocks_override=16, max_num_seqs=4, **kw)
    if spy is not None:
        spy(llm.llm_engine)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    llm.llm_engine.kv_cache_manager.check_invariants()
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.stats()


def test_swapped_in_kv_equals_what_was_swapped_out(tiny_llama):
    """Every swap-out records the device blocks' K and V (all layers) by host block; every
    swap-in must put exactly those arrays into the new device blocks."""
    saved, checked = {}, []

    def spy(engine):
        runner, original = engine.runner, engine.runner.copy_blocks

        def copy_blocks(block_copies, swap_out=(), swap_in=()):
            for device, host in swap_out:
                saved[host] = [(k[device].copy(), v[device].copy()) for k, v in runner.kv_caches]
            original(block_copies, swap_out, swap_in)
            for host, device in swap_in:
                for (k, v), (k0, v0) in zip(runner.kv_caches, saved[host]):
                    np.testing.assert_array_equal(k[device], k0)
                    np.testing.assert_array_equal(v[device], v0)
                checked.append(host)

        runner.copy_blocks = copy_blocks

    _, stats = generate(tiny_llama, spy, preemption_mode="swap", swap_space=0.01)
    assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]
    assert checked, "no block was swapped back in"


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1}])
def test_greedy_output_is_the_same_recompute_or_swap(tiny_llama, spec):
    recompute, r_stats = generate(tiny_llama, speculative_config=spec)
    swap, s_stats = generate(tiny_llama, speculative_config=spec, preemption_mode="swap",
                             swap_space=0.01)
    assert recompute == swap
    assert r_stats["num_preemptions"] > 0 and r_stats["recomputed_tokens"] > 0
    assert r_stats["swap_outs"] == 0
    assert s_stats["swap_outs"] > 0 and s_stats["swap_fallbacks_to_recompute"] == 0
    assert s_stats["recomputed_tokens"] == 0 and s_stats["swap_bytes"] > 0


def test_a_full_host_pool_falls_back_to_recompute(tiny_llama):
    recompute, _ = generate(tiny_llama)
    swap, stats = generate(tiny_llama, preemption_mode="swap", swap_space=0)
    assert recompute == swap
    assert stats["swap_outs"] == 0 and stats["swap_fallbacks_to_recompute"] > 0
    assert stats["recomputed_tokens"] > 0


def test_swap_knobs_are_checked(tiny_llama):
    with pytest.raises(ValueError, match="preemption_mode='evict'"):
        LLM(model=str(tiny_llama), progress=False, preemption_mode="evict")
    with pytest.raises(ValueError, match="swap_space=-1"):
        LLM(model=str(tiny_llama), progress=False, swap_space=-1)
    with pytest.raises(ValueError, match="draft model"):
        LLM(model=str(tiny_llama), progress=False, preemption_mode="swap",
            speculative_config={"method": "draft_model", "model": "self",
                                "num_speculative_tokens": 2, "num_draft_layers": 1})
    # static batching has no swap: refused, not silently run by recompute
    with pytest.raises(ValueError, match="preemption_mode='swap' needs batching='continuous'"):
        LLM(model=str(tiny_llama), progress=False, preemption_mode="swap", batching="static")


def test_a_step_never_applied_carries_its_swap_copies():
    """The forward of the step that planned a swap-out fails: the next schedule() carries
    the copies over (the host pool already names those blocks), so the KV still arrives."""
    sched, kv, runner, a, b = two_on_a_small_pool()
    for _ in range(100):
        out = sched.schedule()
        if out.swap_out:
            break
        sched.update(out, runner.execute(out))
    assert out.swap_out
    again = sched.schedule()  # `out` was never run nor applied
    assert set(out.swap_out) <= set(again.swap_out)
    sched.update(again, runner.execute(again))
    done = {}
    while sched.has_unfinished():
        _, retired = step(sched, runner)
        done.update({seq.request_id: seq for seq in retired})
    for seq in (a, b):
        tokens, _ = expected_output(seq.request_id, 4, seq.sampling_params, 512, None)
        assert done[seq.request_id].output_token_ids == tokens


def test_victims_of_one_step_share_their_host_blocks():
    """Two forked siblings preempted in the same step: their 3 shared blocks are copied
    once, onto host blocks of ref count 2; device ref counts drop as on recompute."""
    from refserve.kv_cache import KVCacheManager
    from refserve.kv_cache.host_pool import HostBlockPool
    from refserve.scheduler import SchedulerOutput
    from refserve.scheduler.swapping import Swapper
    from refserve.sequence import Sequence

    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    a = Sequence("a", list(range(10)), SamplingParams(), seq_id=0)
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    b = a.fork(seq_id=1)
    kv.fork(a, b)
    swapper = Swapper(HostBlockPool(8), kv)
    assert swapper.defer(a) and swapper.defer(b)
    assert kv.num_held_blocks == 0  # released at once: the pool can use them this step
    out = SchedulerOutput(step=0)
    swapper.flush(out)
    host = swapper.host_pool
    assert len(out.swap_out) == 3 and host.host_table(0) == host.host_table(1)
    assert [host.ref_count(h) for h in host.host_table(0)] == [2, 2, 2]
    back = SchedulerOutput(step=1)
    # Alone: its own device copies; b keeps the host blocks.
    assert swapper.swap_in(a, 0, back) == []
    assert len(back.swap_in) == 3 and kv.get_block_ids(0) == [d for _, d in back.swap_in]
    assert [host.ref_count(h) for h in host.host_table(1)] == [1, 1, 1]
    kv.check_invariants()
    host.check_invariants()


def test_a_victim_the_host_pool_cannot_hold_is_left_to_recompute():
    from refserve.kv_cache import KVCacheManager
    from refserve.kv_cache.host_pool import HostBlockPool
    from refserve.scheduler.swapping import Swapper
    from refserve.sequence import Sequence

    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    a = Sequence("a", list(range(10)), SamplingParams(), seq_id=0)
    kv.allocate_slots(a, 10)
    swapper = Swapper(HostBlockPool(2), kv)  # 3 blocks do not fit
    assert not swapper.defer(a) and swapper.num_fallbacks == 1
    assert kv.has_sequence(0) and not swapper.is_swapped_out(a)  # nothing changed
