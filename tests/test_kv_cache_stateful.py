"""A Hypothesis state machine drives the KVCacheManager like a scheduler would.

Steps: admit new sequences (sharing prefixes, so prefix-cache hits happen), compute chunks
of tokens ("write": apply the copy-on-write pairs, then write each token into a shadow KV
array at the slots from slot_mapping), sample tokens, fork, preempt and readmit, free, and
look up prefixes, and speculate (a verify step: the last token plus draft tokens computed
at once, some drafts rejected, their K/V un-computed and the blocks they alone used trimmed).
Small pools make allocations fail and cached blocks get evicted. Both prefix-caching
policies run the same rules: the hash chain and the radix tree (radix_cache.py), whose
tree holds one reference of its own on each cached block.

The shadow KV stores, for every slot, the token id whose K/V would be there. So "the cache
is correct" becomes checkable: every computed position of every live sequence reads back its
own token, and every cached block holds exactly the tokens its key says.
"""

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from refserve.capacity import blocks_for_tokens
from refserve.kv_cache import KVCacheManager
from refserve.sampling import SamplingParams
from refserve.sequence import Sequence

# Three prompts that share leading tokens, so block-aligned prefixes repeat.
PREFIXES = [
    list(range(1, 13)),
    list(range(1, 7)) + list(range(20, 26)),
    list(range(30, 42)),
]

seq_index = st.integers(0, 1000)
chunk_size = st.integers(1, 12)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.manager = None
        self.running: list[Sequence] = []  # hold blocks
        self.waiting: list[Sequence] = []  # preempted, blocks freed, to be readmitted
        self.shadow: dict[int, list] = {}
        self.ids = itertools.count()  # the manager is used alone: the test numbers sequences

    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 20),
                enable_prefix_caching=st.booleans(), policy=st.sampled_from(["hash", "radix"]))
    def setup(self, block_size, num_blocks, enable_prefix_caching, policy):
        self.bs = block_size
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching, policy)
        self.radix = enable_prefix_caching and policy == "radix"
        # shadow[block][offset] = the token whose K/V sits in that slot (None = never written)
        self.shadow = {b: [None] * block_size for b in range(num_blocks)}

    # ---- helpers -------------------------------------------------------------------------

    def check_hit_blocks(self, seq, blocks, hit_tokens):
        assert hit_tokens == len(blocks) * self.bs
        assert hit_tokens <= seq.num_tokens - 1  # never the last token
        for i, block in enumerate(blocks):
            assert self.shadow[block] == seq.token_ids[i * self.bs:(i + 1) * self.bs]

    def write(self, seq, copies, num_tokens):
        """What the backend does in one step: copy-on-write copies, then scatter K/V."""
        m = self.manager
        for src, dst in copies:
            assert m.allocator.ref_count(dst) == 1
            self.shadow[dst] = list(self.shadow[src])
        start = seq.num_computed_tokens
        slots = m.slot_mapping(seq.seq_id, start, start + num_tokens)
        assert len(slots) == num_tokens
        for position, slot in zip(range(start, start + num_tokens), slots, strict=True):
            block, offset = divmod(slot, self.bs)
            assert block in m.get_block_ids(seq.seq_id)
            assert m.allocator.ref_count(block) == 1, f"write into shared block {block}"
            self.shadow[block][offset] = seq.token_ids[position]
        seq.num_computed_tokens += num_tokens  # the scheduler's job, after the step
        m.cache_full_blocks(seq)

    def admit(self, seq, chunk):
        """Admission as the scheduler does it. Returns True if seq got its blocks."""
        m = self.manager
        blocks, hit_tokens = m.get_computed_blocks(seq)
        self.check_hit_blocks(seq, blocks, hit_tokens)
        n = min(chunk, seq.num_tokens - hit_tokens)
        free_before = m.num_available_blocks
        copies = m.allocate_slots(seq, n, blocks)
        if copies is None:  # the pool is short: atomic, nothing changed
            assert not m.has_sequence(seq.seq_id) and m.num_available_blocks == free_before
            return False
        assert copies == []  # a new sequence shares only hit blocks, which it never writes
        seq.num_computed_tokens += hit_tokens
        self.running.append(seq)
        self.write(seq, copies, n)
        return True

    def pick(self, index):
        return self.running[index % len(self.running)]

    # ---- rules ---------------------------------------------------------------------------

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), prefix_len=st.integers(0, 12),
          tail=st.lists(st.integers(50, 52), max_size=5), chunk=chunk_size)
    def add_sequence(self, prefix, prefix_len, tail, chunk):
        tokens = PREFIXES[prefix][:prefix_len] + tail or [50]
        self.admit(Sequence("r", tokens, SamplingParams(), seq_id=next(self.ids)), chunk)

    @precondition(lambda self: self.running)
    @rule(index=seq_index, chunk=chunk_size)
    def compute(self, index, chunk):
        seq = self.pick(index)
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        if n == 0:
            return
        m = self.manager
        blocks_before, free_before = m.get_block_ids(seq.seq_id), m.num_available_blocks
        copies = m.allocate_slots(seq, n)
        if copies is None:  # atomic: nothing changed
            assert m.get_block_ids(seq.seq_id) == blocks_before
            assert m.num_available_blocks == free_before
            return
        self.write(seq, copies, n)

    @precondition(lambda self: self.running)
    @rule(index=seq_index, token=st.integers(50, 53))
    def sample(self, index, token):
        seq = self.pick(index)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)

    @precondition(lambda self: self.running)
    @rule(index=seq_index, drafts=st.lists(st.integers(50, 53), min_size=1, max_size=6),
          num_accepted=st.integers(0, 6), last=st.integers(50, 53))
    def speculate(self, index, drafts, num_accepted, last):
        """A verify step as the scheduler and engine run it: the last real token and the
        drafts get slots and K/V, `num_accepted` drafts are kept and one recovered (or bonus)
        token appended, then the roll back un-computes the rejected drafts
        (num_computed_tokens = min(computed, num_tokens - 1)) and trims the blocks beyond
        the tokens (as Scheduler.update does)."""
        seq = self.pick(index)
        if seq.num_computed_tokens != seq.num_tokens - 1:
            return
        m = self.manager
        num_accepted = min(num_accepted, len(drafts))
        start, n = seq.num_computed_tokens, 1 + len(drafts)
        copies = m.allocate_slots(seq, n)
        if copies is None:
            return
        for src, dst in copies:
            self.shadow[dst] = list(self.shadow[src])
        query = (seq.token_ids + list(drafts))[start:start + n]
        for token, slot in zip(query, m.slot_mapping(seq.seq_id, start, start + n),
                               strict=True):
            block, offset = divmod(slot, self.bs)
            assert m.allocator.ref_count(block) == 1, f"write into shared block {block}"
            self.shadow[block][offset] = token
        for token in drafts[:num_accepted]:
            seq.append_token(token)
        if num_accepted < len(drafts):  # a recovered token differs from the rejected draft
            rejected = drafts[num_accepted]
            seq.append_token(last if last != rejected else last + 1)
        else:
            seq.append_token(last)  # the bonus token
        seq.num_computed_tokens = min(start + n, seq.num_tokens - 1)
        m.trim(seq, seq.num_tokens)
        assert seq.num_computed_tokens == seq.num_tokens - 1
        # what was allocated for the verify, minus the blocks past the kept tokens
        assert len(m.get_block_ids(seq.seq_id)) == min(
            blocks_for_tokens(start + n, self.bs), blocks_for_tokens(seq.num_tokens, self.bs))
        m.cache_full_blocks(seq)

    @precondition(lambda self: self.running)
    @rule(index=seq_index)
    def fork(self, index):
        parent = self.pick(index)
        child = parent.fork(seq_id=next(self.ids))
        self.manager.fork(parent, child)
        assert self.manager.get_block_ids(child.seq_id) == self.manager.get_block_ids(
            parent.seq_id)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(index=seq_index)
    def free(self, index):
        seq = self.pick(index)
        self.running.remove(seq)
        self.manager.release(seq)
        assert not self.manager.has_sequence(seq.seq_id)

    @precondition(lambda self: self.running)
    @rule(index=seq_index)
    def preempt(self, index):
        seq = self.pick(index)
        self.running.remove(seq)
        self.manager.release(seq)
        seq.num_computed_tokens = 0  # recompute: its tokens are kept, its KV is not
        self.waiting.append(seq)

    @precondition(lambda self: self.waiting)
    @rule(chunk=chunk_size)
    def readmit(self, chunk):
        if self.admit(self.waiting[0], chunk):
            self.waiting.pop(0)

    @precondition(lambda self: self.manager is not None)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), prefix_len=st.integers(1, 12))
    def lookup(self, prefix, prefix_len):
        m = self.manager
        refs = [m.allocator.ref_count(b) for b in range(m.num_blocks)]
        queue = list(m.allocator.available_block_ids())
        seq = Sequence("probe", PREFIXES[prefix][:prefix_len] + [99], SamplingParams(),
                       seq_id=-1)
        blocks, hit_tokens = m.get_computed_blocks(seq)
        self.check_hit_blocks(seq, blocks, hit_tokens)
        assert [m.allocator.ref_count(b) for b in range(m.num_blocks)] == refs
        assert list(m.allocator.available_block_ids()) == queue

    # ---- invariants after every step -----------------------------------------------------

    @invariant()
    def pool_is_consistent(self):
        m = self.manager
        if m is None:
            return
        m.check_invariants()
        holders = [0] * m.num_blocks
        for seq in self.running:
            for block in m.get_block_ids(seq.seq_id):
                holders[block] += 1
        cached = m.cached_blocks()
        held = {b for b in range(m.num_blocks) if holders[b] > 0}
        evictable = {b for b in cached if holders[b] == 0}
        free = set(range(m.num_blocks)) - held - evictable
        # held + evictable + free == the pool, each counted exactly
        assert (m.num_held_blocks, m.num_evictable_blocks, m.num_free_blocks) == (
            len(held), len(evictable), len(free))
        assert m.block_counts() == (len(held), len(evictable), len(free), m.num_blocks)
        assert m.num_available_blocks == len(free) + len(evictable)
        assert set(m.allocator.available_block_ids()) == (
            free if self.radix else free | evictable)
        # ref count = the block tables holding it (+ the radix tree's own on a cached block)
        assert [holders[b] + (self.radix and b in cached) for b in range(m.num_blocks)] == [
            m.allocator.ref_count(b) for b in range(m.num_blocks)]
        for seq in self.waiting:
            assert not m.has_sequence(seq.seq_id)
        # Rollback: no sequence holds a block lying wholly past its tokens (such a block
        # could only hold rejected drafts' K/V).
        for seq in self.running:
            assert len(m.get_block_ids(seq.seq_id)) <= blocks_for_tokens(seq.num_tokens,
                                                                         self.bs)

    @invariant()
    def kv_contents_are_right(self):
        m = self.manager
        if m is None:
            return
        # Every computed position of every live sequence reads back its own token ...
        for seq in self.running:
            slots = m.slot_mapping(seq.seq_id, 0, seq.num_computed_tokens)
            for position, slot in enumerate(slots):
                block, offset = divmod(slot, self.bs)
                assert self.shadow[block][offset] == seq.token_ids[position]
        # ... and every cached block (referenced or evictable) holds its key's tokens.
        for block, tokens in m.cached_blocks().items():
            assert self.shadow[block] == list(tokens)
        if not m.enable_prefix_caching:
            assert not m.cached_blocks()

    def teardown(self):
        m = self.manager
        if m is None:
            return
        for seq in self.running:
            m.release(seq)
        m.check_invariants()
        assert m.num_held_blocks == 0  # nothing leaks: everything free ...
        assert m.num_evictable_blocks == len(m.cached_blocks())  # ... or cached, evictable
        assert m.num_free_blocks + m.num_evictable_blocks == m.num_blocks
        for block in m.cached_blocks():
            assert m.allocator.ref_count(block) == int(self.radix)


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestKVCacheManager = KVCacheMachine.TestCase
