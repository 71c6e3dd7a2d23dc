"""BlockAllocator: ref counts, the O(1) free queue, and its errors."""

import pytest

from refserve.kv_cache import BlockAllocator, NoFreeBlocksError
from refserve.kv_cache.block_allocator import BlockAllocator as DirectBlockAllocator


def test_allocate_in_order_then_exhaust():
    allocator = BlockAllocator(3)
    assert [allocator.allocate() for _ in range(3)] == [0, 1, 2]
    assert allocator.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        allocator.allocate()
    allocator.check_invariants()


def test_reexported_class_is_the_same():
    assert BlockAllocator is DirectBlockAllocator


def test_free_goes_to_tail_and_to_front_goes_to_head():
    allocator = BlockAllocator(4)
    a, b = allocator.allocate(), allocator.allocate()  # 0, 1; free queue [2, 3]
    allocator.free(a)
    assert list(allocator.free_block_ids()) == [2, 3, a]
    allocator.free(b, to_front=True)
    assert list(allocator.free_block_ids()) == [b, 2, 3, a]
    assert allocator.allocate() == b
    allocator.check_invariants()


def test_incref_revives_a_block_from_the_middle_of_the_free_queue():
    allocator = BlockAllocator(5)
    assert list(allocator.free_block_ids()) == [0, 1, 2, 3, 4]
    allocator.incref(2)  # a prefix-cache hit on an evictable block
    assert allocator.ref_count(2) == 1
    assert list(allocator.free_block_ids()) == [0, 1, 3, 4]
    assert not allocator.is_free(2)
    allocator.check_invariants()


def test_shared_block_is_free_only_after_the_last_holder_frees_it():
    allocator = BlockAllocator(2)
    block = allocator.allocate()
    allocator.incref(block)
    assert allocator.ref_count(block) == 2
    assert allocator.free(block) is False
    assert not allocator.is_free(block)
    assert allocator.free(block) is True
    assert allocator.is_free(block)
    allocator.check_invariants()


def test_double_free_raises_with_the_id():
    allocator = BlockAllocator(2)
    block = allocator.allocate()
    allocator.free(block)
    with pytest.raises(ValueError, match=rf"block {block}\b.*already free"):
        allocator.free(block)
    # A block that was never allocated is also "already free".
    with pytest.raises(ValueError, match="block 1"):
        allocator.free(1)


@pytest.mark.parametrize("bad", [-1, 2, 99])
def test_unknown_block_id_raises(bad):
    allocator = BlockAllocator(2)
    for op in (allocator.free, allocator.incref, allocator.ref_count):
        with pytest.raises(ValueError, match=f"block {bad} does not exist"):
            op(bad)


def test_bad_pool_size():
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_free_queue_is_o1_at_scale():
    # 200k blocks: removing from the middle of a list would make this quadratic (minutes).
    n = 200_000
    allocator = BlockAllocator(n)
    for block in range(0, n, 2):
        allocator.incref(block)  # revive every other block from the middle
    assert allocator.num_free_blocks == n // 2
    for block in range(0, n, 2):
        allocator.free(block)
    assert allocator.num_free_blocks == n
    taken = [allocator.allocate() for _ in range(n)]
    assert sorted(taken) == list(range(n))
