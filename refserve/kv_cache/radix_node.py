"""The radix tree's parts: a node (one edge of tokens and their blocks) and the answers of a
lookup and an insert (radix_cache.py is the tree)."""

from __future__ import annotations

from dataclasses import dataclass


class RadixNode:
    """One edge of the tree: a run of tokens and the blocks that hold their KV."""

    __slots__ = ("key", "blocks", "children", "parent", "lock_ref", "last_access", "node_id")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: RadixNode | None,
                 last_access: int, node_id: int) -> None:
        self.key = key
        self.blocks = blocks
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access
        self.node_id = node_id

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (f"RadixNode(id={self.node_id}, tokens={len(self.key)}, blocks={self.blocks}, "
                f"lock_ref={self.lock_ref})")


@dataclass(frozen=True)
class RadixMatch:
    """A lookup's answer: the cached blocks of the longest matching prefix, in order, the
    tokens they cover (len(block_ids) * block_size) and the deepest node matched (the root
    when nothing matched): lock it once the blocks are attached."""

    block_ids: list[int]
    num_tokens: int
    node: RadixNode


@dataclass(frozen=True)
class RadixInsert:
    """An insert's answer: how many of the inserted tokens were cached already (their given
    blocks were not taken: they duplicate the tree's), the tree's blocks for all the inserted
    tokens, and the node that ends them (lock it to protect them)."""

    num_cached_tokens: int
    block_ids: list[int]
    node: RadixNode


def common_blocks(key: tuple[int, ...], tokens: tuple[int, ...], start: int, bs: int) -> int:
    """Tokens (a multiple of bs) on which key and tokens[start:] agree, whole blocks only."""
    n = min(len(key), len(tokens) - start) // bs * bs
    if key[:n] == tokens[start:start + n]:
        return n  # the common case: the whole key (or all the tokens) matches
    common = 0
    while common < n and key[common:common + bs] == tokens[start + common:start + common + bs]:
        common += bs
    return common
