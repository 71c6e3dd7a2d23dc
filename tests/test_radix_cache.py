"""The radix prefix cache (refserve/kv_cache/radix_cache.py): unit tests of each rule, then
a Hypothesis state machine that drives the tree the way the KV-cache manager will (match,
attach, lock, compute, insert, move the lock, release, evict) and checks after every step
that the tree, the allocator and the holders agree."""

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from refserve.kv_cache.block_allocator import BlockAllocator
from refserve.kv_cache.radix_cache import RadixCache
from refserve.kv_cache.radix_draw import tree_layout

pytestmark = pytest.mark.prefix_cache


def make(num_blocks=16, block_size=2):
    allocator = BlockAllocator(num_blocks)
    return allocator, RadixCache(block_size, allocator)


def computed(allocator, tree, tokens, keep=False):
    """A holder that allocated and computed blocks for `tokens`, cached them and then (unless
    keep) retired: its blocks stay cached by the tree alone."""
    blocks = [allocator.allocate() for _ in range(len(tokens) // tree.block_size)]
    done = tree.insert(tokens, blocks)
    if keep:
        tree.lock(done.node)
        return blocks, done
    for block_id in blocks:
        allocator.decref(block_id)
    return blocks, done


def shape(tree):
    """The tree as nested (tokens, blocks, lock_ref, children) tuples."""
    def walk(node):
        return [(node_.key, node_.blocks, node_.lock_ref, walk(node_))
                for node_ in node.children.values()]
    return walk(tree.root)


# ---- matching -------------------------------------------------------------------------------


def test_match_splits_a_node_where_the_match_ends():
    allocator, tree = make()
    blocks, _ = computed(allocator, tree, [1, 2, 3, 4, 5, 6, 7, 8])
    hit = tree.match_prefix([1, 2, 3, 4, 9, 9, 9])
    assert hit.block_ids == blocks[:2] and hit.num_tokens == 4
    assert hit.node.key == (1, 2, 3, 4) and hit.node.blocks == blocks[:2]
    assert shape(tree) == [((1, 2, 3, 4), blocks[:2], 0,
                            [((5, 6, 7, 8), blocks[2:], 0, [])])]
    tree.check_invariants()


def test_insert_of_a_diverging_prefix_splits_and_branches():
    allocator, tree = make()
    a, _ = computed(allocator, tree, [1, 2, 3, 4, 5, 6])
    b, done = computed(allocator, tree, [1, 2, 7, 7])
    assert done.num_cached_tokens == 2 and done.block_ids == [a[0], b[1]]
    assert shape(tree) == [((1, 2), [a[0]], 0, [((3, 4, 5, 6), a[1:], 0, []),
                                                 ((7, 7), [b[1]], 0, [])])]
    # b's first block computed the same tokens as a's: a duplicate the tree did not take.
    assert not tree.is_cached(b[0]) and b[0] in allocator.available_block_ids()
    tree.check_invariants()


def test_insert_returns_how_much_was_cached_and_takes_only_new_blocks():
    allocator, tree = make()
    a, _ = computed(allocator, tree, [1, 2, 3, 4, 5, 6])
    dup = [allocator.allocate() for _ in range(4)]
    done = tree.insert([1, 2, 3, 4, 5, 6, 7, 8], dup)
    assert done.num_cached_tokens == 6
    assert done.block_ids == a + [dup[3]]
    assert [allocator.ref_count(b) for b in dup] == [1, 1, 1, 2]  # the tree took dup[3] only
    again = tree.insert([1, 2, 3, 4, 5, 6, 7, 8], dup)
    assert again.num_cached_tokens == 8 and again.node is done.node
    tree.lock(done.node)  # the holder of dup[3] protects it (the protocol)
    tree.check_invariants()


def test_last_prompt_token_is_never_a_hit():
    for block_size, expected in ((1, 7), (2, 6), (4, 4)):
        allocator, tree = make(block_size=block_size)
        computed(allocator, tree, list(range(1, 9)))
        assert tree.match_prefix(list(range(1, 9))).num_tokens == expected
        assert tree.match_length(list(range(1, 9))) == expected
        assert tree.match_prefix(list(range(1, 10))).num_tokens == 8


def test_match_is_block_aligned():
    allocator, tree = make(block_size=4)
    blocks, _ = computed(allocator, tree, list(range(8)))
    hit = tree.match_prefix([0, 1, 2, 3, 4, 5, 99, 7, 8])
    assert hit.block_ids == blocks[:1] and hit.num_tokens == 4  # tokens 4, 5 not shared
    assert tree.match_prefix([0, 1, 2, 99, 4]).num_tokens == 0


def test_the_last_hit_block_names_the_node_to_lock():
    allocator, tree = make()
    blocks, _ = computed(allocator, tree, [1, 2, 3, 4, 5, 6])
    hit = tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert tree.node_of(hit.block_ids[-1]) is hit.node
    tree.match_prefix([1, 2, 8, 8])  # a later split above it keeps that true
    assert tree.node_of(hit.block_ids[-1]) is hit.node
    assert tree.path_blocks(hit.node) == hit.block_ids
    assert tree.node_of(allocator.num_blocks - 1) is None


def test_match_length_changes_nothing():
    allocator, tree = make()
    computed(allocator, tree, [1, 2, 3, 4, 5, 6])
    before = str(tree)
    assert tree.match_length([1, 2, 3, 4, 9, 9, 9]) == 4
    assert str(tree) == before


# ---- locks ----------------------------------------------------------------------------------


def test_lock_counts_walk_up_to_the_root():
    allocator, tree = make()
    computed(allocator, tree, [1, 2, 3, 4, 5, 6])
    computed(allocator, tree, [1, 2, 3, 4, 7, 7])
    computed(allocator, tree, [1, 2, 9, 9])
    leaf = tree.match_prefix([1, 2, 3, 4, 7, 7, 0]).node
    middle, top = leaf.parent, leaf.parent.parent
    assert (top.key, middle.key, leaf.key) == ((1, 2), (3, 4), (7, 7))
    tree.lock(leaf)
    assert (top.lock_ref, middle.lock_ref, leaf.lock_ref) == (1, 1, 1)
    assert tree.num_protected_blocks == 3 and tree.num_evictable_blocks == 2
    tree.lock(middle)
    assert (top.lock_ref, middle.lock_ref, leaf.lock_ref) == (2, 2, 1)
    assert tree.evictable_on_path(leaf) == 0
    tree.unlock(leaf)
    assert (top.lock_ref, middle.lock_ref, leaf.lock_ref) == (1, 1, 0)
    assert tree.evictable_on_path(leaf) == 1
    tree.unlock(middle)
    assert tree.num_protected_blocks == 0 and tree.num_evictable_blocks == 5
    assert tree.evictable_on_path(leaf) == 3
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(middle)
    tree.check_invariants()


def test_a_split_keeps_the_lock_counts():
    allocator, tree = make()
    blocks, done = computed(allocator, tree, [1, 2, 3, 4, 5, 6], keep=True)
    tree.match_prefix([1, 2, 8, 8, 8])  # splits the locked node
    assert [n.lock_ref for n in tree.nodes()] == [1, 1]
    assert tree.num_protected_blocks == 3
    tree.unlock(done.node)  # the lock taken before the split still releases everything
    for block_id in blocks:
        allocator.decref(block_id)
    assert tree.num_evictable_blocks == 3 and tree.num_protected_blocks == 0
    tree.check_invariants()


def test_root_is_always_locked_and_never_evicted():
    allocator, tree = make()
    assert tree.root.lock_ref == 1
    tree.lock(tree.root)  # an empty match's node: nothing to protect
    tree.unlock(tree.root)
    assert tree.root.lock_ref == 1
    computed(allocator, tree, [1, 2, 3, 4])
    assert len(tree.evict(100)) == 2
    assert tree.root.lock_ref == 1 and not tree.root.children and not tree.root.blocks
    assert allocator.num_available_blocks == allocator.num_blocks
    assert tree.evict(5) == []
    tree.check_invariants()


# ---- eviction -------------------------------------------------------------------------------


def test_eviction_takes_the_least_recently_used_leaf_first():
    allocator, tree = make()
    a, _ = computed(allocator, tree, [1, 1])
    b, _ = computed(allocator, tree, [2, 2])
    c, _ = computed(allocator, tree, [3, 3])
    tree.match_prefix([1, 1, 0])  # a is used again: b is now the oldest
    assert tree.evict(1) == b
    assert tree.evict(1) == c
    assert tree.evict(1) == a
    assert tree.num_evicted_blocks == 3


def test_locked_leaves_are_not_evicted():
    allocator, tree = make()
    a, _ = computed(allocator, tree, [1, 1, 1, 1], keep=True)
    b, _ = computed(allocator, tree, [2, 2])
    assert tree.evict(10) == b
    assert tree.num_cached_blocks == 2 and all(tree.is_cached(x) for x in a)


def test_parent_whose_last_child_goes_becomes_a_leaf():
    allocator, tree = make()
    a, _ = computed(allocator, tree, [1, 2, 3, 4])
    b, _ = computed(allocator, tree, [1, 2, 5, 6, 7, 8])
    # Tree: [1 2] -> {[3 4], [5 6 7 8]}; [3 4] is the older leaf.
    assert tree.evict(1) == [a[1]]
    # The parent [1 2] still has a child: the next victims are b's, deepest block first,
    # and only then the parent, which became a leaf.
    assert tree.evict(3) == [b[2], b[1], a[0]]
    assert not tree.root.children


def test_eviction_trims_a_leaf_only_as_far_as_needed():
    allocator, tree = make()
    blocks, _ = computed(allocator, tree, [1, 2, 3, 4, 5, 6])
    assert tree.evict(1) == [blocks[2]]
    assert blocks[2] in allocator.available_block_ids()
    hit = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert hit.block_ids == blocks[:2]  # the rest of the leaf is still found
    tree.check_invariants()


def test_evicted_node_cannot_be_locked():
    allocator, tree = make()
    _, done = computed(allocator, tree, [1, 2])
    tree.evict(1)
    with pytest.raises(ValueError, match="not in this tree"):
        tree.lock(done.node)


# ---- bad input ------------------------------------------------------------------------------


def test_insert_rejects_bad_blocks_and_changes_nothing():
    allocator, tree = make()
    a, _ = computed(allocator, tree, [1, 2])
    held = allocator.allocate()
    with pytest.raises(ValueError, match="whole computed blocks"):
        tree.insert([1, 2, 3], [held])
    with pytest.raises(ValueError, match="is free"):
        tree.insert([5, 5], [allocator.num_blocks - 1])
    with pytest.raises(ValueError, match="already cached"):
        tree.insert([1, 2, 3, 3], [held, a[0]])
    with pytest.raises(ValueError, match="twice"):
        tree.insert([4, 4, 3, 3], [held, held])
    assert tree.num_cached_blocks == 1
    tree.check_invariants()
    with pytest.raises(ValueError, match="block_size"):
        RadixCache(0, allocator)


# ---- printing and drawing -------------------------------------------------------------------


def test_tree_prints_as_text():
    allocator, tree = make()
    computed(allocator, tree, [1, 2, 3, 4], keep=True)
    computed(allocator, tree, [1, 2, 5, 6])
    text = str(tree)
    assert "3 blocks cached, 1 evictable, 2 protected" in text
    assert "├── [3 4]" in text or "└── [3 4]" in text
    assert "└── [5 6] (2 tokens)" in text and "lock 0" in text


def test_layout_puts_leaves_in_columns_and_parents_above_their_middle():
    allocator, tree = make()
    computed(allocator, tree, [1, 2, 3, 4])
    computed(allocator, tree, [1, 2, 5, 6])
    computed(allocator, tree, [9, 9])
    pos = tree_layout(tree)
    top = tree.root.children[(1, 2)]
    left, right = top.children.values()
    assert pos[left] == (0.0, -2.0) and pos[right] == (1.0, -2.0)
    assert pos[top] == (0.5, -1.0)
    assert pos[tree.root.children[(9, 9)]] == (2.0, -1.0)
    assert pos[tree.root] == (1.25, 0.0)


def test_draw_returns_a_figure():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from refserve.kv_cache.radix_draw import draw_radix_tree

    allocator, tree = make()
    computed(allocator, tree, [1, 2, 3, 4], keep=True)
    computed(allocator, tree, [1, 2, 5, 6])
    fig = draw_radix_tree(tree, token_text=lambda ids: "".join(chr(96 + i) for i in ids))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "root" in texts and any("'cd'" in t for t in texts)
    import matplotlib.pyplot as plt

    plt.close(fig)


# ---- the state machine ----------------------------------------------------------------------

# Stems over a 3-token vocabulary, so random prompts share block-aligned prefixes often.
stem = st.lists(st.integers(0, 2), min_size=0, max_size=12)


class Holder:
    """A sequence as the manager will run it: its block table and the node it locked."""

    def __init__(self, tokens, blocks, node):
        self.tokens, self.blocks, self.node = tokens, blocks, node


class RadixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.holders: dict[int, Holder] = {}
        self.pins = []  # locks taken without holding blocks (allowed: they only protect)
        self.ids = itertools.count()
        self.content: dict[int, tuple] = {}  # block -> the tokens its KV was computed for

    @initialize(block_size=st.sampled_from([1, 2, 3]), num_blocks=st.integers(4, 24))
    def setup(self, block_size, num_blocks):
        self.bs = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tree = RadixCache(block_size, self.allocator)

    def num_available(self):
        return self.allocator.num_available_blocks + self.tree.num_evictable_blocks

    def take_block(self):
        if self.allocator.num_available_blocks == 0:
            assert len(self.tree.evict(1)) == 1
        return self.allocator.allocate()

    def compute(self, holder, dedup):
        """Allocate and compute the holder's missing full blocks, insert them, move its
        lock down; with dedup, swap its duplicate blocks for the tree's."""
        bs = self.bs
        num_full = len(holder.tokens) // bs
        missing = num_full - len(holder.blocks)
        if missing > self.num_available():
            missing = self.num_available()
        for _ in range(missing):
            block_id = self.take_block()
            i = len(holder.blocks)
            self.content[block_id] = tuple(holder.tokens[i * bs:(i + 1) * bs])
            holder.blocks.append(block_id)
        done = self.tree.insert(holder.tokens[:len(holder.blocks) * bs], holder.blocks)
        assert done.num_cached_tokens % bs == 0
        for i, block_id in enumerate(done.block_ids):
            assert self.content[block_id] == tuple(holder.tokens[i * bs:(i + 1) * bs])
        if dedup:
            for i in range(done.num_cached_tokens // bs):
                tree_block = done.block_ids[i]
                if holder.blocks[i] != tree_block:
                    self.allocator.incref(tree_block)
                    self.allocator.decref(holder.blocks[i], to_front=True)
                    holder.blocks[i] = tree_block
        self.tree.lock(done.node)
        self.tree.unlock(holder.node)
        holder.node = done.node

    @rule(prefix=stem, use_cache=st.booleans(), dedup=st.booleans())
    def admit(self, prefix, use_cache, dedup):
        tokens = list(prefix) + [7]  # a last token that is never a hit
        node, blocks = self.tree.root, []
        if use_cache:
            hit = self.tree.match_prefix(tokens)
            assert hit.num_tokens == len(hit.block_ids) * self.bs <= len(tokens) - 1
            assert hit.block_ids == self.tree.path_blocks(hit.node)
            for i, block_id in enumerate(hit.block_ids):  # never a wrong hit
                assert self.content[block_id] == tuple(tokens[i * self.bs:(i + 1) * self.bs])
            for block_id in hit.block_ids:
                self.allocator.incref(block_id)
            self.tree.lock(hit.node)
            node, blocks = hit.node, list(hit.block_ids)
        holder = Holder(tokens, blocks, node)
        self.holders[next(self.ids)] = holder
        self.compute(holder, dedup)

    @precondition(lambda self: self.holders)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=6),
          dedup=st.booleans())
    def extend(self, data, more, dedup):
        holder = self.holders[data.draw(st.sampled_from(sorted(self.holders)))]
        holder.tokens.extend(more)
        self.compute(holder, dedup)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release(self, data):
        holder = self.holders.pop(data.draw(st.sampled_from(sorted(self.holders))))
        for block_id in reversed(holder.blocks):
            self.allocator.decref(block_id, to_front=True)
        self.tree.unlock(holder.node)

    @rule(prefix=stem)
    def pin(self, prefix):
        node = self.tree.match_prefix(prefix + [7]).node
        self.tree.lock(node)
        self.pins.append(node)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        self.tree.unlock(self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1))))

    @rule(prefix=stem)
    def match(self, prefix):
        tokens = prefix + [7]
        length = self.tree.match_length(tokens)
        hit = self.tree.match_prefix(tokens)
        assert hit.num_tokens == length
        for i, block_id in enumerate(hit.block_ids):
            assert self.content[block_id] == tuple(tokens[i * self.bs:(i + 1) * self.bs])

    @rule(n=st.integers(0, 8))
    def evict(self, n):
        node_of = {b: node for node in self.tree.nodes() for b in node.blocks}
        before = {b: (node.lock_ref, node.is_leaf) for b, node in node_of.items()}
        held = {b for h in self.holders.values() for b in h.blocks}
        evictable = self.tree.num_evictable_blocks
        freed = self.tree.evict(n)
        assert len(freed) == min(n, evictable)
        for block_id in freed:
            lock_ref, _ = before[block_id]
            assert lock_ref == 0, f"evicted block {block_id} of a locked node"
            assert block_id not in held and self.allocator.ref_count(block_id) == 0
        # Only leaves lose blocks: a node that had children when evict began loses blocks
        # only after all its children went (they are then gone from the tree).
        for block_id in freed:
            node = node_of[block_id]
            if not before[block_id][1]:
                assert not node.children

    @invariant()
    def consistent(self):
        if not hasattr(self, "tree"):
            return
        tree, allocator = self.tree, self.allocator
        tree.check_invariants()
        allocator.check_invariants()
        # Every block is referenced exactly by the tree and by the holders that hold it.
        for block_id in range(allocator.num_blocks):
            expected = int(tree.is_cached(block_id)) + sum(
                h.blocks.count(block_id) for h in self.holders.values())
            assert allocator.ref_count(block_id) == expected, f"block {block_id}"
        held = sum(allocator.ref_count(b) > 0 for b in range(allocator.num_blocks))
        assert allocator.num_available_blocks + held == allocator.num_blocks
        assert tree.num_evictable_blocks + tree.num_protected_blocks == tree.num_cached_blocks
        # Lock counts: each node counts the locks taken on it or below it.
        expected_locks = {}
        for node in [h.node for h in self.holders.values()] + self.pins:
            while node is not tree.root:
                expected_locks[node] = expected_locks.get(node, 0) + 1
                node = node.parent
        for node in tree.nodes():
            assert node.lock_ref == expected_locks.get(node, 0), f"{node}"

    def teardown(self):
        if not hasattr(self, "tree"):
            return
        for key in list(self.holders):
            holder = self.holders.pop(key)
            for block_id in holder.blocks:
                self.allocator.decref(block_id)
            self.tree.unlock(holder.node)
        while self.pins:
            self.tree.unlock(self.pins.pop())
        self.tree.evict(self.allocator.num_blocks)
        # Nothing leaks: every block is free, the tree is empty, only the root is left.
        assert self.allocator.num_available_blocks == self.allocator.num_blocks
        assert self.tree.num_cached_blocks == 0 and not self.tree.root.children
        assert self.tree.num_evictable_blocks == self.tree.num_protected_blocks == 0


RadixMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestRadixCache = RadixMachine.TestCase


def test_the_worked_example_prints_what_warmup_quotes(capsys):
    """WARMUP §13 quotes `python -m refserve.kv_cache.radix_demo`: b's hit splits a's node,
    locks walk up (2 on the shared node), and evict(2) frees only the unlocked leaf."""
    from refserve.kv_cache.radix_demo import main

    tree = main()
    text = capsys.readouterr().out
    assert ("└── [1 2 3 4] (4 tokens)  blocks [0, 1]  lock 2  t 4\n"
            "    ├── [5 6] (2 tokens)  blocks [2]  lock 1  t 2\n"
            "    └── [9 9] (2 tokens)  blocks [3]  lock 1  t 5") in text
    assert "evict(2) frees [2]" in text
    assert tree.num_cached_blocks == 3
    warmup = (Path(__file__).parents[1] / "WARMUP.md").read_text()
    assert "python -m refserve.kv_cache.radix_demo" in warmup
    assert "└── [1 2 3 4] (4 tokens)  blocks [0, 1]  lock 2  t 4" in warmup
