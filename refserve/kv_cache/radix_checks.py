"""A radix cache's invariants checked against its state, and the tree drawn as indented
text: what tests, notebooks and a debugging student call, never the serving path. `self` is
the RadixCache (radix_cache.py).

The invariants `check_invariants` checks: the tree's shape (children keyed by their first block,
keys a whole number of blocks, each block in at most one node), lock counts monotone up the
tree, the evictable and protected sizes equal to the sums they stand for, the heap set equal
to the unlocked leaves, every cached block held by the allocator, and every block of an
unlocked node held by the tree alone (ref count 1).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

from refserve.kv_cache.radix_node import RadixNode


def check_invariants(self, holders: SequenceOf[int] | None = None) -> None:
    """Raise AssertionError if the tree breaks one of its invariants (module docstring);
    with `holders` (holders[b] = block tables holding b), also that ref count = holders
    + the tree's one and that the unlocked blocks are the cached ones no table holds."""
    if holders is not None:
        _check_holders(self, holders)
    bs, root = self.block_size, self.root
    assert root.lock_ref == 1 and not root.blocks and root.parent is None, "root changed"
    seen: dict[int, RadixNode] = {}
    evictable = protected = 0
    for node in self.nodes():
        assert node.blocks and len(node.key) == len(node.blocks) * bs, \
            f"{node}: key of {len(node.key)} tokens for {len(node.blocks)} blocks"
        assert node.parent.children.get(node.key[:bs]) is node, \
            f"{node} is not its parent's child under its first block"
        assert node.lock_ref >= 0, f"{node} has a negative lock count"
        if node.parent is not root:
            assert node.parent.lock_ref >= node.lock_ref, \
                f"{node} is locked more than its parent: lock counts did not walk up"
        for block_id in node.blocks:
            assert block_id not in seen, f"block {block_id} is in two nodes"
            seen[block_id] = node
            refs = self.allocator.ref_count(block_id)
            assert refs >= 1, f"cached block {block_id} is free in the allocator"
            assert node.lock_ref > 0 or refs == 1, \
                f"block {block_id} of unlocked {node} has {refs} holders, not the tree alone"
        if node.lock_ref == 0:
            evictable += len(node.blocks)
        else:
            protected += len(node.blocks)
    assert seen == self._node_of_block, "block -> node map is stale"
    assert (evictable, protected) == (self.num_evictable_blocks,
                                      self.num_protected_blocks), \
        (f"sizes: evictable {self.num_evictable_blocks} / protected "
         f"{self.num_protected_blocks}, but the tree has {evictable} / {protected}")
    leaves = {n for n in self.nodes() if n.is_leaf and n.lock_ref == 0}
    assert leaves == self._evictable_leaves, "eviction heap set != the unlocked leaves"

def _check_holders(self, holders: SequenceOf[int]) -> None:
    cached = self.cached_blocks()
    for block_id, count in enumerate(holders):
        expected = count + (block_id in cached)
        if self.allocator.ref_count(block_id) != expected:
            raise AssertionError(
                f"block {block_id}: ref count {self.allocator.ref_count(block_id)}, but "
                f"{count} block tables{' + the tree' if block_id in cached else ''}")
    unheld = sum(1 for block_id in cached if holders[block_id] == 0)
    if unheld != self.num_evictable_blocks:
        raise AssertionError(f"{unheld} cached blocks no table holds, but the tree "
                             f"counts {self.num_evictable_blocks} evictable")
    if set(self._locked) != set(self._num_inserted):
        raise AssertionError("locked nodes and insert counts name different sequences")

def render(self) -> str:
    """The tree as indented text: each node's tokens, blocks, lock count, last access."""
    lines = [f"radix tree (block_size {self.block_size}): {self.num_cached_blocks} blocks "
             f"cached, {self.num_evictable_blocks} evictable, {self.num_protected_blocks} "
             "protected", "root  lock 1"]

    def show(node: RadixNode, indent: str) -> None:
        children = list(node.children.values())
        for i, child in enumerate(children):
            last = i == len(children) - 1
            lines.append(f"{indent}{'└── ' if last else '├── '}{_preview(child.key)}  "
                         f"blocks {child.blocks}  lock {child.lock_ref}  "
                         f"t {child.last_access}")
            show(child, indent + ("    " if last else "│   "))

    show(self.root, "")
    return "\n".join(lines)


def _preview(key: tuple[int, ...], limit: int = 8) -> str:
    shown = " ".join(map(str, key[:limit]))
    return f"[{shown}{' ...' if len(key) > limit else ''}] ({len(key)} tokens)"
