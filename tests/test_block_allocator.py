"""BlockAllocator: ref counts, the O(1) available queue, and its errors."""

import pytest

from refserve.kv_cache import BlockAllocator, NoFreeBlocksError
from refserve.kv_cache.block_allocator import BlockAllocator as DirectBlockAllocator


def test_allocate_in_order_then_exhaust():
    allocator = BlockAllocator(3)
    assert [allocator.allocate() for _ in range(3)] == [0, 1, 2], "allocated in id order"
    assert allocator.num_available_blocks == 0, "3 of 3 blocks allocated"
    with pytest.raises(NoFreeBlocksError):
        allocator.allocate()
    allocator.check_invariants()


def test_reexported_class_is_the_same():
    assert BlockAllocator is DirectBlockAllocator


def test_decref_to_zero_goes_to_tail_and_to_front_goes_to_head():
    allocator = BlockAllocator(4)
    a, b = allocator.allocate(), allocator.allocate()  # 0, 1; available queue [2, 3]
    allocator.decref(a)
    queue = list(allocator.available_block_ids())
    assert queue == [2, 3, a], f"available queue {queue} after decref({a}): {a} joins the tail"
    allocator.decref(b, to_front=True)
    queue = list(allocator.available_block_ids())
    assert queue == [b, 2, 3, a], \
        f"available queue {queue} after decref({b}, to_front=True): {b} joins the head"
    assert allocator.allocate() == b, "allocate takes the head of the queue"
    allocator.check_invariants()


def test_incref_revives_a_block_from_the_middle_of_the_available_queue():
    allocator = BlockAllocator(5)
    assert list(allocator.available_block_ids()) == [0, 1, 2, 3, 4], "a new pool's queue"
    allocator.incref(2)  # a prefix-cache hit on an evictable block
    assert allocator.ref_count(2) == 1, f"ref count of block 2: {allocator.ref_count(2)}"
    queue = list(allocator.available_block_ids())
    assert queue == [0, 1, 3, 4], f"available queue {queue}: block 2 is held again"
    allocator.check_invariants()


def test_shared_block_is_available_only_after_the_last_holder_lets_go():
    allocator = BlockAllocator(2)
    block = allocator.allocate()
    allocator.incref(block)
    assert allocator.ref_count(block) == 2, f"ref count {allocator.ref_count(block)}"
    assert allocator.decref(block) is False, \
        "decref from 2 returns False: another holder keeps the block"
    assert block not in allocator.available_block_ids(), \
        "a block with ref count 1 must not be in the available queue"
    assert allocator.decref(block) is True, "decref from 1 returns True: the block is free"
    assert block in allocator.available_block_ids(), "at ref count 0 it is available"
    allocator.check_invariants()


def test_double_release_raises_with_the_id():
    allocator = BlockAllocator(2)
    block = allocator.allocate()
    allocator.decref(block)
    with pytest.raises(ValueError, match=rf"block {block}\b.*not held"):
        allocator.decref(block)
    # A block that was never allocated is not held either.
    with pytest.raises(ValueError, match="block 1"):
        allocator.decref(1)


@pytest.mark.parametrize("bad", [-1, 2, 99])
def test_unknown_block_id_raises(bad):
    allocator = BlockAllocator(2)
    for op in (allocator.decref, allocator.incref, allocator.ref_count):
        with pytest.raises(ValueError, match=f"block {bad} does not exist"):
            op(bad)


def test_block_ids_are_any_integer_and_nothing_else():
    """The id check's fast path is for plain ints; NumPy integers still pass, and a float or
    a string is refused rather than used as an index."""
    import numpy as np

    allocator = BlockAllocator(2)
    block = allocator.allocate()
    assert allocator.ref_count(np.int64(block)) == 1 == allocator.ref_count(np.int32(block))
    for bad in (float(block), str(block), None):
        with pytest.raises(ValueError, match="does not exist"):
            allocator.ref_count(bad)


def test_bad_pool_size():
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_available_queue_is_o1_at_scale():
    # 200k blocks: removing from the middle of a list would make this quadratic (minutes).
    n = 200_000
    allocator = BlockAllocator(n)
    for block in range(0, n, 2):
        allocator.incref(block)  # revive every other block from the middle
    assert allocator.num_available_blocks == n // 2
    for block in range(0, n, 2):
        allocator.decref(block)
    assert allocator.num_available_blocks == n
    taken = [allocator.allocate() for _ in range(n)]
    assert sorted(taken) == list(range(n))
