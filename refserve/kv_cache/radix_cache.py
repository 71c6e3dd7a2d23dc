"""The radix prefix cache: prefix sharing as a tree (SGLang's RadixAttention).

The hash chain (hash_chain.py) names every full block by its whole prefix and finds a
sequence's hits block by block. A radix tree stores the same knowledge as paths: each edge
is a run of tokens, and the path from the root to a node spells a prefix whose KV is cached.
A lookup walks down from the root, so it finds the longest cached prefix in one pass, and the
tree shows which prompts share what (print it, or draw it with radix_draw.py).

    root ── [system prompt, 3 blocks] ─┬─ [question A, 2 blocks]
                                       └─ [question B, 1 block]

A node holds
    key          its run of tokens (a whole number of blocks, see below)
    blocks       the physical KV blocks holding those tokens, one per block_size tokens
    children     keyed by the tokens of their first block (no two children start alike)
    lock_ref     how many holders use this node or a node below it (see "Locks")
    last_access  a logical clock tick, for least-recently-used eviction

Block alignment (the block_size > 1 rule). Keys, matches and splits are whole blocks: a
match that ends inside a block stops at the start of that block, and the partial block is
computed again. The alternative, sharing the partly matched block read-only and copying it
on the first write, was rejected because
  * only full blocks whose KV was computed are ever inserted (exactly as the hash chain
    caches them), so a partial block is never the tree's to share;
  * it would save fewer than block_size tokens of prefill per hit and always pay a whole
    block copy, on the step of the hit;
  * a hit then always covers len(blocks) * block_size tokens, the rule the scheduler and the
    KV-cache manager already follow for the hash chain, so the two policies plug into the
    same code.
With block_size = 1 (SGLang's default page size) matching is per token.

Reference counts go through the BlockAllocator. The tree holds one reference on every block
it caches (taken by `insert`, dropped by `evict`), and each sequence that holds a cached
block in its block table holds its own. So a cached block is never in the allocator's free
queue: the free queue holds only blocks with no useful content, and "cached but unused"
blocks are counted by the tree (`num_evictable_blocks`), not as free. A cached block is also
always shared (ref count >= 2 while a sequence holds it), so any write into it goes through
copy-on-write and the tree never advertises overwritten KV.

Locks. A holder (a sequence using cached blocks) locks the deepest node whose path covers
the cached blocks it holds; `lock` walks up to the root adding 1 to every node on the way,
`unlock` walks up subtracting 1. So lock_ref(node) = number of locks taken on the node or
below it, and a parent's lock_ref is >= each child's. A node with lock_ref 0 is evictable
(no holder uses its blocks: each has ref count 1, the tree's own), and its blocks count in
`num_evictable_blocks`; the rest count in `num_protected_blocks`. The root is always locked
(lock_ref 1, never evicted, no blocks).

Eviction (least recently used). `evict(n)` frees n blocks: it takes the unlocked leaf with
the oldest last_access from a heap, frees its blocks deepest first, and deletes the leaf once
empty; its parent may then become an unlocked leaf and joins the heap. Blocks leave only
from the bottom of the tree, so a cached prefix never loses its beginning while keeping its
end (the hash chain can orphan deeper blocks that way). A leaf is trimmed only as far as
needed, so evicting one block of a long leaf keeps the rest of it findable.

The holder's protocol is the `PrefixCache` interface (prefix_cache.py); the KV-cache manager
calls it, and here it means:

    lookup(tokens)          match_prefix: the hit blocks (splitting the node the match ends
                            inside, marking the path used); no reference, no lock
    attach(seq, hits)       a reference on each hit block (an evictable one is revived:
                            revive_cost counts them), and a lock on the node they end at
    cache_full_blocks(...)  insert the newly full computed blocks, move the sequence's lock
                            down to the node that ends them; a block that duplicates the
                            tree's comes back as (logical block, tree block) for the manager
                            to swap into the table and free
    release(seq, blocks)    one reference per block, tail first, then unlock
    take_block()            a free block; only when none is left, evict(1) (the LRU leaf)

`check_invariants` checks the tree's invariants (radix_checks.py lists them).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence as SequenceOf

from refserve.kv_cache import radix_checks
from refserve.kv_cache.block_allocator import BlockAllocator
from refserve.kv_cache.prefix_cache import PrefixCache
from refserve.kv_cache.radix_node import RadixInsert, RadixMatch, RadixNode, common_blocks


class RadixCache(PrefixCache):
    """Block-aligned radix tree of cached prefixes over one BlockAllocator, and
    prefix_caching_policy="radix" behind the KVCacheManager (see the module docstring for
    the rules, the holder's protocol and the invariants).

    Reference counts differ from the hash chain in one way: the tree holds one reference on
    each block it caches, so an evictable block has ref count 1 (not 0) and is not in the
    allocator's available queue. The pool's three words keep their meaning:

        held       some block table holds it   = allocator-held blocks - evictable ones
        evictable  cached, no table holds it   = the blocks of unlocked nodes
        free       ref count 0                 = the allocator's available queue

    Per holding sequence it keeps the node it locked and how many leading blocks it has
    inserted; every cached block a table holds lies on that sequence's locked path.
    """

    def __init__(self, block_size: int, allocator: BlockAllocator) -> None:
        super().__init__(block_size, allocator)
        self._clock = itertools.count(1)
        self._ids = itertools.count()
        self.root = RadixNode((), [], None, 0, next(self._ids))
        self.root.lock_ref = 1  # always locked: never evicted, never a leaf to evict
        self._node_of_block: dict[int, RadixNode] = {}
        self._evictable_leaves: set[RadixNode] = set()
        self._num_evictable = 0
        self.num_protected_blocks = 0
        self.num_evicted_blocks = 0
        self._locked: dict[int, RadixNode] = {}  # seq_id -> the node it holds locked
        self._num_inserted: dict[int, int] = {}  # seq_id -> leading blocks inserted

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    @property
    def num_free_blocks(self) -> int:
        """The allocator's available blocks: the tree's own reference keeps every cached
        block out of that queue."""
        return self.allocator.num_available_blocks

    def __len__(self) -> int:
        return len(self._node_of_block)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._node_of_block

    def node_of(self, block_id: int) -> RadixNode | None:
        """The node holding a cached block (None if it is not cached). The last block of a
        match is the last block of match.node, so a caller that kept only the block ids of a
        hit finds the node to lock this way."""
        return self._node_of_block.get(block_id)

    def match_prefix(self, token_ids: SequenceOf[int]) -> RadixMatch:
        """The longest cached block-aligned prefix of token_ids, never covering the last
        token (its logits must be computed): at most (len - 1) // block_size blocks.

        Splits the node the match ends inside, so that the answer ends at a node, and marks
        the matched path as just used. Takes no reference and no lock."""
        tokens = tuple(token_ids)
        limit = max(0, len(tokens) - 1) // self.block_size * self.block_size
        blocks, node, _ = self._walk(tokens[:limit], split=True)
        return RadixMatch(blocks, len(blocks) * self.block_size, node)

    def match_length(self, token_ids: SequenceOf[int]) -> int:
        """Tokens match_prefix would hit, without splitting or touching anything (what the
        longest-prefix-match scheduling policy sorts by)."""
        tokens = tuple(token_ids)
        limit = max(0, len(tokens) - 1) // self.block_size * self.block_size
        return self._walk(tokens[:limit], split=False)[2]

    def path_blocks(self, node: RadixNode) -> list[int]:
        """The blocks from the root down to `node`, in order (ValueError if node was
        evicted): what a match that ended at `node` returned, if nothing was evicted."""
        path = self._path(node)
        return [block for n in reversed(path) for block in n.blocks]

    def evictable_on_path(self, node: RadixNode) -> int:
        """Blocks that lock(node) would move from evictable to protected: those of the
        unlocked nodes on the path (they are counted as reclaimable until then)."""
        return sum(len(n.blocks) for n in self._path(node) if n.lock_ref == 0)

    # ---- mutations -----------------------------------------------------------------------

    def insert(self, token_ids: SequenceOf[int], block_ids: SequenceOf[int]) -> RadixInsert:
        """Cache blocks whose KV is computed: token_ids (a whole number of blocks) are held
        by block_ids, block i holding tokens [i * bs, (i + 1) * bs). Call it only after the
        forward wrote them, with blocks the caller holds.

        The walk splits a node where the tokens leave it. The leading tokens already in the
        tree keep the tree's blocks (the returned num_cached_tokens of them: their given
        blocks are duplicates the caller may free); the rest become one new leaf, and the
        tree takes a reference on each of its blocks. Checked first, atomic."""
        bs = self.block_size
        tokens = tuple(token_ids)
        blocks = [int(b) for b in block_ids]
        if len(tokens) != len(blocks) * bs:
            raise ValueError(f"insert: {len(tokens)} tokens but {len(blocks)} blocks of "
                             f"{bs}; insert whole computed blocks only")
        cached_tokens = self._walk(tokens, split=False)[2]
        new_blocks = blocks[cached_tokens // bs:]
        for block_id in new_blocks:
            if self.allocator.ref_count(block_id) == 0:
                raise ValueError(f"insert: block {block_id} is free; insert only blocks "
                                 "the caller holds, after their KV was written")
            if block_id in self._node_of_block:
                raise ValueError(f"insert: block {block_id} is already cached for another "
                                 "prefix; a block holds one prefix")
        if len(set(new_blocks)) != len(new_blocks):
            raise ValueError(f"insert: a block appears twice in {new_blocks}")
        # Checked: from here on nothing can fail.
        tree_blocks, node, matched = self._walk(tokens, split=True)
        if matched < len(tokens):
            leaf = RadixNode(tokens[matched:], new_blocks, node, next(self._clock),
                             next(self._ids))
            node.children[leaf.key[:bs]] = leaf
            for block_id in new_blocks:
                self.allocator.incref(block_id)
                self._node_of_block[block_id] = leaf
            self._num_evictable += len(new_blocks)
            self._update_leaf(node)
            self._update_leaf(leaf)
            tree_blocks = tree_blocks + new_blocks
            node = leaf
        return RadixInsert(matched, tree_blocks, node)

    def lock(self, node: RadixNode) -> None:
        """inc_lock: a holder now uses the blocks from the root to `node`. Adds 1 to the
        lock count of every node on the path; a node locked for the first time moves its
        blocks from evictable to protected. Locking the root changes nothing."""
        for n in self._path(node):
            if n.lock_ref == 0:
                self._num_evictable -= len(n.blocks)
                self.num_protected_blocks += len(n.blocks)
            n.lock_ref += 1
            self._update_leaf(n)

    def unlock(self, node: RadixNode) -> None:
        """dec_lock: undo one lock(node). A node whose count drops to 0 moves its blocks
        back to evictable (and, if it is a leaf, joins the eviction heap)."""
        path = self._path(node)
        if path and node.lock_ref == 0:
            raise ValueError(f"unlock: {node} is not locked")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.num_protected_blocks -= len(n.blocks)
                self._num_evictable += len(n.blocks)
            self._update_leaf(n)

    def evict(self, num_blocks: int) -> list[int]:
        """Free up to num_blocks cached blocks back to the allocator, least recently used
        unlocked leaf first and, inside a leaf, deepest block first. Returns the freed block
        ids (fewer than asked only if fewer are evictable); each is now free."""
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"evict: num_blocks={num_blocks!r} must be an integer >= 0")
        heap = [(n.last_access, n.node_id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(len(leaf.blocks), num_blocks - len(freed))
            for block_id in reversed(leaf.blocks[len(leaf.blocks) - take:]):
                assert self.allocator.ref_count(block_id) == 1, \
                    f"evicting block {block_id} of unlocked {leaf}, but a holder has it"
                self.allocator.decref(block_id, to_front=True)  # worthless now: reuse first
                del self._node_of_block[block_id]
                freed.append(block_id)
            self._num_evictable -= take
            if take < len(leaf.blocks):  # trimmed: the leaf keeps its first blocks
                leaf.blocks = leaf.blocks[:len(leaf.blocks) - take]
                leaf.key = leaf.key[:len(leaf.blocks) * self.block_size]
                continue
            parent = leaf.parent
            del parent.children[leaf.key[:self.block_size]]
            self._evictable_leaves.discard(leaf)
            leaf.parent = None  # marks it evicted: lock / path_blocks refuse it
            self._update_leaf(parent)
            if parent in self._evictable_leaves:  # a parent whose last child went
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        self.num_evicted_blocks += len(freed)
        return freed

    # ---- the PrefixCache interface: the holder's protocol for each sequence --------------

    def num_cached_blocks_of(self, seq_id: int) -> int:
        return self._num_inserted.get(seq_id, 0)

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        bs = self.block_size
        return {block: node.key[i * bs:(i + 1) * bs]
                for node in self.nodes() for i, block in enumerate(node.blocks)}

    def lookup(self, token_ids: SequenceOf[int]) -> list[int]:
        """match_prefix's blocks (it splits the node the match ends inside and marks the
        path used; it takes no reference)."""
        return self.match_prefix(token_ids).block_ids

    def revive_cost(self, blocks: SequenceOf[int]) -> int:
        """The evictable blocks on the unlocked nodes of the hit's path."""
        return self.evictable_on_path(self.node_of(blocks[-1])) if blocks else 0

    def still_cached(self, token_ids: SequenceOf[int], blocks: SequenceOf[int]) -> bool:
        if not blocks:
            return True
        node = self.node_of(blocks[-1])
        if node is None or node.blocks[-1] != blocks[-1] or self.path_blocks(node) != list(blocks):
            return False
        keys, n = [], node
        while n is not self.root:
            keys.append(n.key)
            n = n.parent
        tokens = tuple(t for key in reversed(keys) for t in key)
        return tokens == tuple(token_ids[:len(tokens)])

    def attach(self, seq_id: int, blocks: SequenceOf[int]) -> None:
        """Take a reference on each hit block and lock the node they end at (the root when
        there is no hit: a no-op lock)."""
        node = self.node_of(blocks[-1]) if blocks else self.root
        super().attach(seq_id, blocks)
        self.lock(node)
        self._locked[seq_id] = node
        self._num_inserted[seq_id] = len(blocks)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares the parent's blocks, so it takes its own lock on its node."""
        node = self._locked[parent_id]
        self.lock(node)
        self._locked[child_id] = node
        self._num_inserted[child_id] = self._num_inserted[parent_id]

    def cache_full_blocks(self, seq_id: int, token_ids: SequenceOf[int],
                          block_ids: SequenceOf[int], num_full: int) -> list[tuple[int, int]]:
        """Insert the first num_full blocks if some are new and move the sequence's lock
        down to the node that ends them. Where the sequence's block duplicates the tree's
        (the same prefix computed twice), returns (logical block, tree block): the caller
        puts the tree's block in the table (this method took its reference) and drops its
        own, as SGLang does."""
        if num_full <= self._num_inserted[seq_id]:
            return []
        block_ids = list(block_ids)
        done = self.insert(token_ids[:num_full * self.block_size], block_ids[:num_full])
        self.lock(done.node)
        self.unlock(self._locked[seq_id])
        self._locked[seq_id] = done.node
        self._num_inserted[seq_id] = num_full
        swaps = [(i, tree_block) for i, tree_block in enumerate(done.block_ids)
                 if block_ids[i] != tree_block]
        for _, tree_block in swaps:
            self.allocator.incref(tree_block)  # locked by this sequence: protected already
        return swaps

    def trim(self, seq_id: int, keep: int, dropped: SequenceOf[int]) -> None:
        """Inserted blocks hold computed positions only, which a trim keeps: none of
        `dropped` is in the tree."""
        for block_id in dropped:
            assert not self.is_cached(block_id), \
                f"block {block_id} is cached but holds no computed position of {seq_id}"

    def release(self, seq_id: int, block_ids: SequenceOf[int]) -> None:
        """One reference per block, tail first (to the head of the free queue: a cached
        block is still held by the tree), then the sequence's lock."""
        super().release(seq_id, block_ids)
        self.unlock(self._locked.pop(seq_id))
        del self._num_inserted[seq_id]

    def take_block(self) -> tuple[int, bool]:
        """A free block first; only when none is left, evict one block (LRU leaf)."""
        evicted = False
        if self.allocator.num_available_blocks == 0:
            evicted = bool(self.evict(1))
        return self.allocator.allocate(), evicted

    # ---- the walk ------------------------------------------------------------------------

    def _walk(self, tokens: tuple[int, ...], split: bool
              ) -> tuple[list[int], RadixNode, int]:
        """Follow `tokens` (a multiple of block_size long is assumed; a shorter tail is
        ignored) down from the root, block by block.

        Returns (blocks matched, deepest node, tokens matched). With split=True a match
        ending inside a node splits it there (so the answer ends at a node) and the path is
        marked as used; with split=False nothing changes and the node returned is the last
        one matched whole."""
        bs = self.block_size
        node, matched, blocks = self.root, 0, []
        now = next(self._clock) if split else 0
        while len(tokens) - matched >= bs:
            child = node.children.get(tokens[matched:matched + bs])
            if child is None:
                break
            common = common_blocks(child.key, tokens, matched, bs)
            if common < len(child.key):
                if not split:
                    blocks.extend(child.blocks[:common // bs])
                    matched += common
                    break
                child = self._split(child, common)
            if split:
                child.last_access = now
            blocks.extend(child.blocks)
            matched += common
            node = child
        return blocks, node, matched

    def _split(self, child: RadixNode, num_tokens: int) -> RadixNode:
        """Cut `child` after its first num_tokens tokens (a whole number of blocks): a new
        node takes that head and becomes child's parent. Locks are copied (every lock on
        child passes through the new node), so no size moves."""
        bs = self.block_size
        head_blocks = num_tokens // bs
        top = RadixNode(child.key[:num_tokens], child.blocks[:head_blocks], child.parent,
                        child.last_access, next(self._ids))
        top.lock_ref = child.lock_ref
        child.parent.children[top.key[:bs]] = top  # same first block: replaces child there
        child.key = child.key[num_tokens:]
        child.blocks = child.blocks[head_blocks:]
        child.parent = top
        top.children[child.key[:bs]] = child
        for block_id in top.blocks:
            self._node_of_block[block_id] = top
        return top

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """node, its parent, ... up to (not including) the root; ValueError if node is not
        in this tree (evicted, or another tree's)."""
        path = []
        while node is not self.root:
            if node.parent is None:
                raise ValueError(f"{node} is not in this tree (evicted?)")
            path.append(node)
            node = node.parent
        return path

    def _update_leaf(self, node: RadixNode) -> None:
        """Keep _evictable_leaves == the unlocked leaves (the root is never one)."""
        if node.is_leaf and node.lock_ref == 0 and node is not self.root:
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)

    # ---- inspection ----------------------------------------------------------------------

    def nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children (depth first)."""
        out, stack = [], list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children.values()))
        return out

    def check_invariants(self, holders: SequenceOf[int] | None = None) -> None:
        """Raise AssertionError if the tree breaks an invariant (radix_checks.py); with
        `holders` (holders[b] = block tables holding b), also the ref counts against them."""
        radix_checks.check_invariants(self, holders)

    def __str__(self) -> str:
        return radix_checks.render(self)  # each node's tokens, blocks, locks, last access

    def __repr__(self) -> str:
        return (f"RadixCache(block_size={self.block_size}, cached={self.num_cached_blocks}, "
                f"evictable={self.num_evictable_blocks}, protected={self.num_protected_blocks})")
