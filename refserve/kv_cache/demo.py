"""`python -m refserve.kv_cache.demo [part]`: the paged KV cache, one part at a time.

Each part prints what one class does to a tiny pool (block size 2 or 4), in the order
WARMUP.md reads them; without an argument, all four:

    block_table       logical blocks, slots and the append rule
    block_allocator   the available queue and reference counts
    prefix_cache      the hash chain: full blocks found again by their tokens
    kv_cache_manager  a hit, a fork, one copy-on-write, and everything released
"""

from __future__ import annotations

import sys

from refserve.kv_cache.block_allocator import BlockAllocator
from refserve.kv_cache.block_table import BlockTable, blocks_for_tokens, slot_mapping
from refserve.kv_cache.hash_chain import HashChainCache
from refserve.kv_cache.kv_cache_manager import KVCacheManager


def block_table() -> None:
    table = BlockTable(block_size=4, block_ids=[7, 2, 9])
    print(table)
    bs = table.block_size
    for p in range(10):
        print(f"position {p}: logical block {p // bs}, slot "
              f"{slot_mapping(table.block_ids, p, bs)}")
    print("slots(3, 9) =", slot_mapping(table.block_ids, range(3, 9), bs).tolist())
    for n in (10, 12, 13):
        print(f"{n} tokens need {blocks_for_tokens(n, table.block_size)} blocks -> "
              f"{table.num_new_blocks(n)} new")


def block_allocator() -> None:
    allocator = BlockAllocator(4)
    print("start:           ", allocator)
    a, b = allocator.allocate(), allocator.allocate()
    print(f"allocate -> {a}, {b}: ", allocator)
    allocator.incref(a)
    print(f"incref({a}) (shared):", allocator)
    allocator.decref(a)
    allocator.decref(b)
    print(f"decref({a}), decref({b}):", allocator, f"<- {b} back at the tail, {a} still held")
    allocator.decref(a, to_front=True)
    print(f"decref({a}, to_front):", allocator)


def prefix_cache() -> None:
    allocator = BlockAllocator(4)
    cache = HashChainCache(2, allocator)
    a = [allocator.allocate() for _ in range(2)]
    cache.attach(0, [])
    cache.cache_full_blocks(0, [1, 2, 3, 4], a, 2)
    print("sequence 0 cached [1 2 | 3 4]:", cache)
    print("lookup [1 2 3 4 5] ->", cache.lookup([1, 2, 3, 4, 5]), " (both blocks hit)")
    print("lookup [3 4 1 2 5] ->", cache.lookup([3, 4, 1, 2, 5]), " (same tokens, other depth)")
    cache.release(0, a)
    print("released: evictable", cache.num_evictable_blocks, "| available queue",
          list(allocator.available_block_ids()), "(cached blocks at the tail)")


def kv_cache_manager() -> None:
    from refserve.sampling_params import SamplingParams
    from refserve.sequence import Sequence

    manager = KVCacheManager(num_blocks=8, block_size=4)
    a = Sequence("a", list(range(10)), SamplingParams(), seq_id=0)
    manager.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    manager.cache_full_blocks(a)
    print("a computed 10 tokens:   ", manager)
    b = Sequence("b", list(range(8)) + [99, 98], SamplingParams(), seq_id=1)
    blocks, hit = manager.get_computed_blocks(b)
    print(f"b shares 8 tokens: hit blocks {blocks}, {hit} tokens")
    manager.allocate_slots(b, b.num_tokens - hit, blocks)
    print("b admitted:             ", manager)
    c = a.fork(seq_id=2)
    manager.fork(a, c)
    print("a forked into c:        ", manager)
    c.append_token(42)  # c samples its own next token, at position 10 (shared block 2)
    print("c writes position 10 -> copies", manager.allocate_slots(c, 1))
    print("                        ", manager)
    for seq in (a, b, c):
        manager.release(seq)
    print("all released:           ", manager)
    print("available queue (head first):", list(manager.allocator.available_block_ids()))


PARTS = {"block_table": block_table, "block_allocator": block_allocator,
         "prefix_cache": prefix_cache, "kv_cache_manager": kv_cache_manager}


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"refserve.kv_cache.demo: unknown part(s) {unknown}; choose from "
              f"{', '.join(PARTS)} (or none for all)", file=sys.stderr)
        return 2
    for name in names or list(PARTS):
        print(f"== {name}")
        PARTS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
