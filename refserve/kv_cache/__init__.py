"""The PagedAttention control plane: which physical KV-cache block holds which tokens.

    BlockAllocator   fixed pool of physical blocks, O(1) free queue, ref counts
    BlockTable       one sequence's logical -> physical block map, slot arithmetic
    PrefixCache      hash chain of full blocks, so equal prefixes share blocks
    KVCacheManager   what the scheduler talks to (allocate, copy-on-write, fork, free)
"""

from refserve.kv_cache.block_allocator import BlockAllocator, NoFreeBlocksError
from refserve.kv_cache.block_table import BlockTable
from refserve.kv_cache.kv_cache_manager import KVCacheManager
from refserve.kv_cache.prefix_cache import BlockKey, PrefixCache

__all__ = ["BlockAllocator", "BlockKey", "BlockTable", "KVCacheManager", "NoFreeBlocksError",
           "PrefixCache"]
