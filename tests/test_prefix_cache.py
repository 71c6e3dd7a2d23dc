"""Prefix caching and copy-on-write through the KVCacheManager."""

import itertools

import pytest

from refserve.kv_cache import BlockAllocator, KVCacheManager, hash_chain
from refserve.kv_cache.hash_chain import BlockKey, HashChainCache
from refserve.sampling import SamplingParams
from refserve.sequence import Sequence

BS = 4


_ids = itertools.count()  # the manager is used alone here, so the test numbers sequences


def make_seq(tokens, request_id="r"):
    return Sequence(request_id, list(tokens), SamplingParams(), seq_id=next(_ids))


def run_prefill(manager, seq):
    """Admit seq the way the scheduler does, compute its whole prompt, cache full blocks."""
    blocks, hit_tokens = manager.get_computed_blocks(seq)
    copies = manager.allocate_slots(seq, seq.num_tokens - hit_tokens, blocks)
    seq.num_computed_tokens += hit_tokens
    seq.num_cached_tokens = hit_tokens
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)
    manager.check_invariants()
    return blocks, hit_tokens, copies


PREFIX = list(range(100, 100 + 3 * BS))  # 3 full blocks


def test_same_3_block_prefix_different_tail_hits_exactly_3_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_seq(PREFIX + [1, 2])
    run_prefill(manager, a)
    b = make_seq(PREFIX + [7, 8, 9])
    blocks, hit_tokens, copies = run_prefill(manager, b)
    assert hit_tokens == 3 * BS, \
        f"hit tokens {hit_tokens}: b shares a's 3 full blocks ({3 * BS} tokens)"
    assert blocks == manager.get_block_ids(a.seq_id)[:3], f"hit blocks {blocks}: a's first 3"
    assert manager.get_block_ids(b.seq_id)[:3] == blocks, "b's table starts with the hits"
    assert manager.get_block_ids(b.seq_id)[3] != manager.get_block_ids(a.seq_id)[3], \
        "b's own tail is a block of its own"
    assert copies == [], f"copies {copies}: hit blocks are never written"
    assert manager.prefix_cache_queried_tokens == a.num_tokens + b.num_tokens, \
        "prefix_cache_queried_tokens"
    assert manager.prefix_cache_hit_tokens == 3 * BS, "prefix_cache_hit_tokens"
    for block in blocks:
        assert manager.allocator.ref_count(block) == 2, \
            f"ref count of shared block {block}: a and b hold it"


def test_last_prompt_token_is_never_a_hit():
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_seq(PREFIX)  # exactly 3 full blocks
    run_prefill(manager, a)
    assert len(manager.prefix_cache) == 3, "all three full blocks of a are cached"
    b = make_seq(PREFIX)
    blocks, hit_tokens = manager.get_computed_blocks(b)
    assert hit_tokens == 2 * BS, (
        f"hit tokens {hit_tokens} for a prompt of exactly 3 cached blocks: the block "
        "holding the last token is never a hit (its logits must be computed)")
    assert len(blocks) == 2, f"hit blocks {blocks}"
    c = make_seq(PREFIX + [5])
    hit = manager.get_computed_blocks(c)[1]
    assert hit == 3 * BS, f"hit tokens {hit}: one token past 3 cached blocks"
    hit = manager.get_computed_blocks(make_seq(PREFIX[:1]))[1]
    assert hit == 0, f"hit tokens {hit} for a 1-token prompt"


def test_get_computed_blocks_touches_nothing_and_stops_at_first_miss():
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_seq(PREFIX + [1])
    run_prefill(manager, a)
    free_before = manager.num_available_blocks
    refs_before = [manager.allocator.ref_count(b) for b in range(16)]
    other_second_block = PREFIX[:BS] + [0] * BS + PREFIX[2 * BS:] + [1]
    blocks, hit_tokens = manager.get_computed_blocks(make_seq(other_second_block))
    assert hit_tokens == BS, (
        f"hit tokens {hit_tokens}: block 1 misses, and block 2 (same tokens, another "
        "prefix) is no hit after it")
    assert manager.num_available_blocks == free_before, "a lookup takes no block"
    assert [manager.allocator.ref_count(b) for b in range(16)] == refs_before, \
        "a lookup takes no reference"


def test_only_computed_blocks_are_cached():
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_seq(PREFIX + [1])
    manager.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = BS + 2  # one and a half blocks of KV written so far
    manager.cache_full_blocks(a)
    assert len(manager.prefix_cache) == 1
    a.num_computed_tokens = a.num_tokens
    manager.cache_full_blocks(a)
    assert len(manager.prefix_cache) == 3


def test_disabled_prefix_caching_hashes_nothing():
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    run_prefill(manager, make_seq(PREFIX + [1]))
    _, hit_tokens, _ = run_prefill(manager, make_seq(PREFIX + [1]))
    assert hit_tokens == 0
    assert len(manager.prefix_cache) == 0
    assert manager.prefix_cache_queried_tokens == 0


def test_evictable_hit_blocks_are_revived_and_counted_once():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq(PREFIX + [1])  # 4 blocks: the whole pool
    run_prefill(manager, a)
    manager.release(a)
    # the 3 cached blocks are evictable (not held, still findable), the 4th is free; an
    # allocation can take all 4
    assert (manager.num_held_blocks, manager.num_evictable_blocks,
            manager.num_free_blocks, manager.num_available_blocks) == (0, 3, 1, 4)
    b = make_seq(PREFIX + [2])
    blocks, hit_tokens = manager.get_computed_blocks(b)
    assert hit_tokens == 3 * BS
    # Needs the 3 revived blocks + 1 new = 4 <= 4 available: counting revived blocks as
    # both "available" and "already mine" would wrongly allow 2 new blocks too.
    assert manager.allocate_slots(b, BS + 1, blocks) is None
    assert not manager.has_sequence(b.seq_id)  # atomic: nothing changed
    assert manager.num_available_blocks == 4 and manager.num_evictable_blocks == 3
    manager.check_invariants()
    manager.allocate_slots(b, 1, blocks)
    assert manager.num_available_blocks == 0 and manager.num_evictable_blocks == 0
    assert manager.num_held_blocks == 4
    manager.check_invariants()


def test_lru_eviction_order():
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    # Sequence x: 2 full cached blocks + 1 partial. Sequence y: 2 full cached + 1 partial.
    x = make_seq([1] * BS + [2] * BS + [3])
    y = make_seq([4] * BS + [5] * BS + [6])
    run_prefill(manager, x)
    run_prefill(manager, y)
    x_blocks, y_blocks = manager.get_block_ids(x.seq_id), manager.get_block_ids(y.seq_id)
    manager.release(x)  # x released first: least recently used
    manager.release(y)
    queue = list(manager.allocator.available_block_ids())
    # Uncached partial blocks first (worthless), then x tail-first, then y tail-first.
    assert set(queue[:2]) == {x_blocks[2], y_blocks[2]}
    assert queue[2:] == [x_blocks[1], x_blocks[0], y_blocks[1], y_blocks[0]]

    # A new unrelated sequence of 3 blocks takes both partial blocks, then evicts x's
    # deepest block: x's first block and all of y's stay findable.
    z = make_seq([9] * (2 * BS + 1))
    run_prefill(manager, z)
    assert not manager.prefix_cache.is_cached(x_blocks[1])
    assert manager.prefix_cache.is_cached(x_blocks[0])
    assert manager.get_computed_blocks(make_seq([1] * BS + [2] * BS + [3]))[1] == BS
    assert manager.get_computed_blocks(make_seq([4] * BS + [5] * BS + [6]))[1] == 2 * BS


def test_hit_moves_block_out_of_lru_order():
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    x = make_seq([1] * BS + [2])
    run_prefill(manager, x)
    x0 = manager.get_block_ids(x.seq_id)[0]
    manager.release(x)
    y = make_seq([1] * BS + [3])  # hits x0 and revives it from the free queue
    run_prefill(manager, y)
    assert manager.get_block_ids(y.seq_id)[0] == x0
    assert x0 not in list(manager.allocator.available_block_ids())
    manager.check_invariants()


def test_stale_computed_blocks_are_rejected():
    manager = KVCacheManager(num_blocks=2, block_size=BS)
    a = make_seq([1] * BS + [2])
    run_prefill(manager, a)
    manager.release(a)
    b = make_seq([1] * BS + [3])
    blocks, _ = manager.get_computed_blocks(b)
    run_prefill(manager, make_seq([7] * (2 * BS)))  # evicts and reuses the hit block
    with pytest.raises(ValueError, match="no longer cached"):
        manager.allocate_slots(b, 1, blocks)


def test_collision_guard_with_constant_hash(monkeypatch):
    monkeypatch.setattr(hash_chain, "hash_block", lambda parent_hash, tokens: 42)
    assert BlockKey(None, (1, 2)) != BlockKey(None, (3, 4))
    # Same tokens at another depth: still different keys.
    assert BlockKey(BlockKey(None, (1, 2)), (1, 2)) != BlockKey(None, (1, 2))
    assert BlockKey(BlockKey(None, (1, 2)), (3, 4)) == BlockKey(BlockKey(None, (1, 2)), (3, 4))

    manager = KVCacheManager(num_blocks=32, block_size=BS)
    a = make_seq([1] * BS + [2] * BS + [3] * BS + [0])
    run_prefill(manager, a)
    assert len(manager.prefix_cache) == 3  # all hash to 42, all cached separately
    a_blocks = manager.get_block_ids(a.seq_id)
    # Everything collides; only exact prefixes hit, each on the right block.
    cases = [
        ([1] * BS + [2] * BS + [3] * BS + [0], a_blocks[:3]),
        ([1] * BS + [2] * BS + [9] * BS + [0], a_blocks[:2]),
        ([2] * BS + [2] * BS + [3] * BS + [0], []),
        ([1] * BS + [3] * BS + [0], a_blocks[:1]),
        ([2] * BS + [0], []),
    ]
    for tokens, expected in cases:
        blocks, hit_tokens = manager.get_computed_blocks(make_seq(tokens))
        assert blocks == expected, tokens
        assert hit_tokens == len(expected) * BS


def test_prefix_cache_keeps_first_block_for_a_duplicate_prefix():
    allocator = BlockAllocator(2)
    cache = HashChainCache(2, allocator)
    first, second = allocator.allocate(), allocator.allocate()
    for seq_id, block in ((0, first), (1, second)):
        cache.attach(seq_id, [])
        cache.cache_full_blocks(seq_id, [1, 2, 3], [block], 1)
    assert cache.lookup([1, 2, 3]) == [first] and len(cache) == 1
    assert not cache.is_cached(second)
    assert cache.num_cached_blocks_of(1) == 1  # chained on the first block's key
    for seq_id, block in ((0, first), (1, second)):
        cache.release(seq_id, [block])
    assert cache.num_evictable_blocks == 1
    assert cache.take_block() == (second, False)  # uncached: at the head, reused first
    assert cache.take_block() == (first, True)  # then the cached block is evicted
    assert cache.lookup([1, 2, 3]) == []


# ---- copy-on-write -----------------------------------------------------------------------


def test_fork_then_child_write_in_shared_partial_block_copies_once():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq(list(range(2 * BS + 2)))  # 2 full blocks + a partial one
    run_prefill(manager, parent)
    child = parent.fork(seq_id=next(_ids))
    manager.fork(parent, child)
    parent_blocks = manager.get_block_ids(parent.seq_id)
    assert manager.get_block_ids(child.seq_id) == parent_blocks
    manager.check_invariants()

    child.append_token(77)  # sampled; position 2*BS+2 lies in the shared partial block
    copies = manager.allocate_slots(child, 1)
    child_blocks = manager.get_block_ids(child.seq_id)
    assert child_blocks[2] != parent_blocks[2], (
        f"the child's table {child_blocks} still points at the shared block "
        f"{parent_blocks[2]} it writes into")
    assert copies == [(parent_blocks[2], child_blocks[2])], (
        f"copies {copies}: one (src, dst) = (the shared block {parent_blocks[2]}, the "
        f"child's new block {child_blocks[2]})")
    assert child_blocks[:2] == parent_blocks[:2], "full blocks stay shared"
    assert manager.get_block_ids(parent.seq_id) == parent_blocks, "the parent is untouched"
    assert manager.allocator.ref_count(parent_blocks[2]) == 1, (
        f"ref count of the shared block {parent_blocks[2]} after the copy: "
        f"{manager.allocator.ref_count(parent_blocks[2])}, the parent's alone")
    assert manager.allocator.ref_count(child_blocks[2]) == 1, (
        f"ref count of the child's new block {child_blocks[2]}: "
        f"{manager.allocator.ref_count(child_blocks[2])}")
    assert manager.slot_mapping(child.seq_id, 2 * BS + 2, 2 * BS + 3) == [
        child_blocks[2] * BS + 2], "the child writes into its own copy"
    manager.check_invariants()

    # The parent is now the last holder of its partial block: it writes in place.
    parent.append_token(88)
    assert manager.allocate_slots(parent, 1) == []
    assert manager.get_block_ids(parent.seq_id) == parent_blocks


def test_kv_cache_demo_fork_prints_the_one_cow_copy_warmup_quotes(capsys):
    """`python -m refserve.kv_cache.demo kv_cache_manager` (WARMUP quotes it): a forked
    sequence's write into a shared block makes one copy-on-write."""
    from refserve.kv_cache import demo

    assert demo.main(["kv_cache_manager"]) == 0
    text = capsys.readouterr().out
    assert "c writes position 10 -> copies [(2, 4)]" in text, text
    assert "2: [0, 1, 4]" in text, text


def test_fork_write_into_fresh_block_needs_no_copy():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq(list(range(2 * BS)))  # exactly full: next token opens a new block
    run_prefill(manager, parent)
    child = parent.fork(seq_id=next(_ids))
    manager.fork(parent, child)
    child.append_token(1)
    assert manager.allocate_slots(child, 1) == []
    assert len(manager.get_block_ids(child.seq_id)) == 3


def test_cow_is_atomic_when_pool_is_short():
    manager = KVCacheManager(num_blocks=2, block_size=BS)
    parent = make_seq([1, 2])
    run_prefill(manager, parent)
    children = [parent.fork(seq_id=next(_ids)) for _ in range(2)]
    for child in children:
        manager.fork(parent, child)
    children[0].append_token(3)
    manager.allocate_slots(children[0], 1)  # takes the last free block for its copy
    children[1].append_token(3)
    before = manager.get_block_ids(children[1].seq_id)
    assert manager.allocate_slots(children[1], 1) is None
    assert manager.get_block_ids(children[1].seq_id) == before
    manager.check_invariants()


def test_append_rule_through_the_manager():
    manager = KVCacheManager(num_blocks=8, block_size=16)
    seq = make_seq(list(range(15)))
    manager.allocate_slots(seq, 15)
    seq.num_computed_tokens = 15
    assert manager.num_held_blocks == 1
    seq.append_token(1)  # the 16th token: no new block
    manager.allocate_slots(seq, 1)
    seq.num_computed_tokens = 16
    assert manager.num_held_blocks == 1
    seq.append_token(2)  # the 17th token: exactly one new block
    manager.allocate_slots(seq, 1)
    assert manager.num_held_blocks == 2 and manager.num_free_blocks == 6
    manager.release(seq)
    assert manager.num_held_blocks == 0 and manager.num_available_blocks == 8
    manager.release(seq)  # releasing a sequence without blocks is a no-op


def test_hit_below_a_recached_parent_block():
    """Keys compare by content, not object identity: a cached block whose parent block was
    evicted and later cached again (as a new key object, in another physical block) is
    still a correct hit, and allocate_slots accepts it."""
    bs = 2
    manager = KVCacheManager(num_blocks=9, block_size=bs)
    a = make_seq([1, 1, 2, 2, 3])
    b = make_seq([1, 1, 2, 2, 5, 5, 6])
    for seq in (a, b):  # admitted in the same step: neither sees the other's blocks
        manager.allocate_slots(seq, seq.num_tokens)
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        manager.cache_full_blocks(seq)
    b_blocks = manager.get_block_ids(b.seq_id)
    assert not manager.prefix_cache.is_cached(b_blocks[0])  # duplicate of a's block 0
    assert manager.prefix_cache.is_cached(b_blocks[2])  # [5, 5] chained on a's keys
    manager.release(a)
    filler = make_seq([9] * 10)  # takes every free block: a's cached blocks are evicted
    manager.allocate_slots(filler, filler.num_tokens)
    manager.release(filler)
    assert manager.get_computed_blocks(make_seq([1, 1, 2, 2, 0]))[1] == 0
    run_prefill(manager, make_seq([1, 1, 2, 2, 7]))  # caches [1,1] and [2,2] again
    d = make_seq([1, 1, 2, 2, 5, 5, 8])
    blocks, hit_tokens = manager.get_computed_blocks(d)
    assert hit_tokens == 6 and blocks[2] == b_blocks[2]
    manager.allocate_slots(d, 1, blocks)
    manager.check_invariants()


def test_blocks_after_a_hole_in_the_chain_are_no_hits():
    """A cached block can outlive its parent block: b's block [5, 5] is chained on a's
    keys, and a's blocks are evicted. A lookup stops at the first miss, so that block is
    no hit for [1, 1, 2, 2, 5, 5, 8]: its K/V follow tokens no cached block holds now."""
    bs = 2
    manager = KVCacheManager(num_blocks=9, block_size=bs)
    a = make_seq([1, 1, 2, 2, 3])
    b = make_seq([1, 1, 2, 2, 5, 5, 6])
    for seq in (a, b):  # admitted in the same step: b's first two blocks duplicate a's
        manager.allocate_slots(seq, seq.num_tokens)
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        manager.cache_full_blocks(seq)
    manager.release(a)
    filler = make_seq([9] * 10)  # takes every available block: a's cached ones are evicted
    manager.allocate_slots(filler, filler.num_tokens)
    hits, _ = manager.get_computed_blocks(make_seq([1, 1, 2, 2, 5, 5, 8]))
    assert hits == [], f"blocks 0 and 1 miss, so nothing after them is a hit; got {hits}"


def hash_chain_problems(keys) -> list[str]:
    """What is wrong with the hashes of a chain of keys (block 0 first): each must be
    hash_block(parent's hash, its tokens), and no two may be equal (the chain repeats the
    same tokens, so only the parent's hash tells them apart)."""
    problems = []
    for depth, key in enumerate(keys):
        parent = None if depth == 0 else keys[depth - 1].value
        if key.value != hash_chain.hash_block(parent, key.tokens):
            problems.append(f"block {depth}: value is not hash_block(parent hash, tokens)")
    if len({k.value for k in keys}) != len(keys):
        problems.append("equal tokens at different depths share a hash: the parent's hash "
                        "is not in it")
    return problems


def test_block_hash_includes_the_parent_hash():
    """Equality walks the whole chain, so a hash without the parent still gives correct
    hits, only slower (every equal block collides): the hash value itself is asserted."""
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_seq([3] * (4 * BS) + [1])  # four full blocks holding the same tokens
    run_prefill(manager, a)
    key_of_block = manager.prefix_cache._key_of_block  # the chain itself, read directly
    keys = [key_of_block[b] for b in manager.get_block_ids(a.seq_id)[:4]]
    assert [k.parent for k in keys] == [None, *keys[:-1]]
    assert hash_chain_problems(keys) == []
    tokens = (1, 2, 3, 4)
    assert hash_chain.hash_block(None, tokens) != hash_chain.hash_block(12345, tokens)
    assert BlockKey(BlockKey(None, (9,) * BS), tokens).value != BlockKey(None, tokens).value


def test_hash_chain_check_catches_a_hash_without_the_parent(monkeypatch):
    """Negative control: the mistake the test above is for."""
    monkeypatch.setattr(hash_chain, "hash_block", lambda parent_hash, tokens: hash(tokens))
    key = None
    keys = []
    for _ in range(3):
        key = BlockKey(key, (3,) * BS)
        keys.append(key)
    assert any("parent" in p for p in hash_chain_problems(keys))
