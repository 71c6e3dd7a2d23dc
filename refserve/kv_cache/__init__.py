"""The PagedAttention control plane: which physical KV-cache block holds which tokens.

    BlockAllocator   fixed pool of physical blocks, O(1) free queue, ref counts
    BlockTable       one sequence's logical -> physical block map, slot arithmetic
    PrefixCache      the prefix cache interface (prefix_cache.py); its policies: the
                     hash chain (hash_chain.py, HashChainCache) and the radix tree
                     (radix_cache.py, RadixCache)
    KVCacheManager   what the scheduler talks to (allocate, copy-on-write, fork, free)

The names are imported on first use rather than here, so that each module's demo
(`python -m refserve.kv_cache.block_table`, ...) runs without the package having imported
that very module first.
"""

import importlib

_WHERE = {
    "BlockAllocator": "block_allocator",
    "NoFreeBlocksError": "block_allocator",
    "BlockTable": "block_table",
    "KVCacheManager": "kv_cache_manager",
    "BlockKey": "hash_chain",
    "HashChainCache": "hash_chain",
    "PrefixCache": "prefix_cache",
    "RadixCache": "radix_cache",
}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"refserve.kv_cache.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'refserve.kv_cache' has no attribute {name!r}")
