"""Cells of notebooks/01_paged_kv_cache.ipynb (built by build_notebooks.py)."""

CELLS = [
    ("md", r"""
# 01 · The paged KV cache: blocks, the append rule, copy-on-write, prefix caching

A sequence sees its KV cache as one contiguous array of positions. The engine stores it in
fixed-size **blocks** of `block_size` slots taken from one physical pool, and a **block
table** maps each *logical* block of the sequence to a *physical* block of the pool. This
notebook drives the KV-cache manager by hand, the way the scheduler does, and draws the
block tables and the pool before and after each operation.

* WARMUP.md §3 (blocks, the append rule, internal fragmentation) and §4 (ref counts,
  copy-on-write, prefix caching)
* code: `refserve/kv_cache/` (`block_allocator.py`, `block_table.py`,
  `kv_cache_manager.py`, `prefix_cache.py`, `hash_chain.py`; the radix tree: `radix_cache.py`,
  `radix_draw.py`)
* grading: `pytest -m block_table`, `-m allocator`, `-m cow`, `-m prefix_cache`

How to read the pictures: the top rows are block tables (one per sequence; `→7 KV 3/4` means
"stored in physical block 7, K/V written in 3 of its 4 slots"; a hatched bar would be tokens
not computed yet), the bottom grid is the physical pool. A
hatched pool block with `rc=2` is shared by two tables; a grey `cached` block is free but its
KV is still findable by the prefix cache.
"""),
    ("code", r"""
import matplotlib.pyplot as plt
from kvpictures import before_after, snapshot

from refserve.kv_cache import KVCacheManager
from refserve.sampling import SamplingParams
from refserve.sequence import Sequence

BLOCK_SIZE = 4
kv = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, enable_prefix_caching=True)
params = SamplingParams(max_tokens=8)
kv
"""),
    ("md", r"""
## 1. Allocate

Sequence A has a 6-token prompt. It needs `ceil(6 / 4) = 2` blocks; the second one holds 2
tokens and leaves 2 slots empty. Those empty slots are the only waste paging leaves
(*internal fragmentation*, at most `block_size - 1` per sequence).

`allocate_slots(seq, n)` gives the sequence slots for its next `n` tokens. The scheduler
calls it; the forward then writes K/V at the slots `slot(p) = table[p // bs] * bs + p % bs`.
After the step the scheduler advances `num_computed_tokens` and hashes the blocks that became
full (`cache_full_blocks`), so that later requests can find them.
"""),
    ("code", r"""
a = Sequence("A", [11, 12, 13, 14, 15, 16], params, seq_id=0)
empty = snapshot(kv, [a])
copies = kv.allocate_slots(a, a.num_tokens)      # prefill: slots for positions 0..5
print("block table of A:", kv.get_block_ids(a.seq_id), " copy-on-write pairs:", copies)
print("slot_mapping of positions 0..5:", kv.slot_mapping(a.seq_id, 0, 6))
a.num_computed_tokens = a.num_tokens            # the forward wrote their K/V
kv.cache_full_blocks(a)                         # block 0 is full and computed: hash it
kv.check_invariants()
before_after(empty, snapshot(kv, [a]), ("empty pool", "A allocated 6 tokens"))
plt.show()
"""),
    ("md", r"""
## 2. Append across a block boundary

The append rule: appending one token takes a new block **if and only if the last block is
exactly full**. A has 6 tokens in 2 blocks. Tokens 7 and 8 go into the free slots of its
last block; token 9 finds the last block full and takes a new one.
"""),
    ("code", r"""
from refserve.capacity import blocks_for_tokens

for token in (17, 18):
    a.append_token(token)                       # the sampled token joins the sequence
    kv.allocate_slots(a, 1)                     # a slot for it (same block)
    a.num_computed_tokens += 1
    kv.cache_full_blocks(a)
    print(f"{a.num_tokens} tokens -> {blocks_for_tokens(a.num_tokens, BLOCK_SIZE)} blocks:",
          kv.get_block_ids(a.seq_id))

before = snapshot(kv, [a])
a.append_token(19)
print("last block full?", a.num_tokens - 1 == len(kv.get_block_ids(0)) * BLOCK_SIZE)
kv.allocate_slots(a, 1)                         # position 8: a new block
a.num_computed_tokens += 1
kv.cache_full_blocks(a)
print(f"{a.num_tokens} tokens -> blocks", kv.get_block_ids(a.seq_id),
      f"(internal fragmentation: {3 * BLOCK_SIZE - a.num_tokens} slots)")
kv.check_invariants()
before_after(before, snapshot(kv, [a]), ("8 tokens: last block exactly full",
                                         "9th token: a new block"))
plt.show()
"""),
    ("md", r"""
## 3. Fork with copy-on-write

Parallel sampling (`SamplingParams(n=2)`) forks a sequence: the child B shares **every**
block of its parent (each ref count goes to 2) instead of copying the KV. Nothing is copied
until someone writes into a shared block. B's next token lands in the partly filled last
block, which A also holds, so `allocate_slots` gives B a private copy first and returns the
pair `(src, dst)`; the runner copies the block (`runner.copy_blocks`) *before* the forward
writes into it. After that A is the last holder of the old block and writes in place.
"""),
    ("code", r"""
b = a.fork(seq_id=1)
kv.fork(a, b)
forked = snapshot(kv, [a, b])
print("after fork: A", kv.get_block_ids(0), " B", kv.get_block_ids(1))
print("ref counts:", {blk: kv.allocator.ref_count(blk) for blk in kv.get_block_ids(0)})

b.append_token(21)                              # B samples its own next token
copies = kv.allocate_slots(b, 1)                # position 9 is in a shared block
print("B writes position 9 -> copy-on-write pairs (src, dst):", copies)
a.append_token(20)
print("A writes position 9 -> pairs:", kv.allocate_slots(a, 1), "(A is the last holder)")
for seq in (a, b):
    seq.num_computed_tokens += 1
kv.check_invariants()
before_after(forked, snapshot(kv, [a, b]), ("B forked from A: all blocks shared",
                                            "B wrote: its last block was copied"))
plt.show()
"""),
    ("md", r"""
## 4. A prefix-cache hit

A full, computed block is identified by its tokens **and everything before them** (a hash
chain: `key(i) = hash(key(i-1), tokens of block i)`). A new request C that starts with the
same 8 tokens as A finds A's first two blocks in the cache and reuses them: those 8 tokens
are not computed again (`get_computed_blocks` returns the blocks and the tokens they cover).

One rule is easy to get wrong: the block holding the **last** prompt token is never a hit,
even when it is full and cached, because that token must be computed to get the logits that
sample the next token. Request D's prompt is exactly A's first 8 tokens: it gets 1 block, not 2.
"""),
    ("code", r"""
c = Sequence("C", a.token_ids[:8] + [31, 32, 33], params, seq_id=2)
hit_blocks, hit_tokens = kv.get_computed_blocks(c)
print(f"C: hit blocks {hit_blocks}, {hit_tokens} of {c.num_tokens} tokens need no compute")
before = snapshot(kv, [a, b])
kv.allocate_slots(c, c.num_tokens - hit_tokens, hit_blocks)
c.num_computed_tokens = c.num_tokens            # (the scheduler adds the hit, then the step)
kv.cache_full_blocks(c)

d = Sequence("D", a.token_ids[:8], params, seq_id=3)
print("D (exactly 2 full blocks):", kv.get_computed_blocks(d), "<- the last token's block is "
      "never a hit")
kv.check_invariants()
before_after(before, snapshot(kv, [a, b, c]), ("A and B", "C admitted with a prefix-cache hit"))
plt.show()
"""),
    ("md", r"""
## 5. Free: blocks stay cached until reused

When a sequence finishes its blocks are released, last block first. A block whose ref count
reaches 0 joins the free queue but keeps its KV: while nobody reuses it, it is still in the
prefix cache (grey), and a later request with the same prefix revives it. Uncached blocks go
to the head of the free queue, cached ones to the tail, so that worthless blocks are reused
before any cached block is evicted (least recently used).
"""),
    ("code", r"""
before = snapshot(kv, [a, b, c])
for seq in (a, b, c):
    kv.release(seq)
kv.check_invariants()
print("free queue, head (reused first) to tail:", list(kv.allocator.available_block_ids()))
e = Sequence("E", a.token_ids[:8] + [41], params, seq_id=4)
print("a new request E with A's prefix still hits:", kv.get_computed_blocks(e))
before_after(before, snapshot(kv, []),
             ("A, B, C running", "all freed: cached blocks stay findable"))
plt.show()
"""),
    ("md", r"""
## 6. The same prefixes as a radix tree

`prefix_caching_policy="radix"` (SGLang's RadixAttention, WARMUP.md §13) finds the same hits
another way: the cached prefixes form a tree whose edges are runs of whole blocks. A lookup
walks down from the root; a match that ends inside a node **splits** it; an insert adds the
new blocks as a leaf. Each sequence locks the deepest node it uses, and the lock counts walk
up to the root: a node with lock 0 is evictable, and eviction takes unlocked leaves, least
recently used first. The manager's interface and the three words (held / evictable / free)
do not change; here the tree keeps one reference of its own on each cached block.

Below: R1 caches an 8-token system prompt plus its question, R2 shares the system prompt and
branches, R3 shares only its first block. Then R1 finishes: its own leaf becomes evictable.
"""),
    ("code", r"""
from refserve.kv_cache.radix_draw import draw_radix_tree

radix = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, prefix_caching_policy="radix")
system = [1, 2, 3, 4, 5, 6, 7, 8]


def run_prompt(name, tokens, seq_id):
    seq = Sequence(name, tokens, params, seq_id=seq_id)
    hit_blocks, hit_tokens = radix.get_computed_blocks(seq)
    radix.allocate_slots(seq, seq.num_tokens - hit_tokens, hit_blocks)
    seq.num_computed_tokens = seq.num_tokens    # the hit, then the step
    radix.cache_full_blocks(seq)
    print(f"{name}: {hit_tokens} of {seq.num_tokens} tokens hit")
    return seq


r1 = run_prompt("R1", system + [11, 12, 13, 14, 15], 10)
r2 = run_prompt("R2", system + [21, 22, 23, 24, 25], 11)
r3 = run_prompt("R3", system[:4] + [31, 32, 33, 34, 35], 12)
radix.check_invariants()
print(radix.radix_tree)
draw_radix_tree(radix.radix_tree)
plt.show()
"""),
    ("code", r"""
radix.release(r1)
radix.check_invariants()
print(f"held {radix.num_held_blocks}, evictable {radix.num_evictable_blocks}, "
      f"free {radix.num_free_blocks}")
print(radix.radix_tree)
draw_radix_tree(radix.radix_tree)
plt.show()
"""),
    ("md", r"""
**Try it** (WARMUP.md §3–4 exercises): change `BLOCK_SIZE` to 2 and 8 and count the wasted
slots; fork B *before* A's last block is full and predict which pairs `allocate_slots`
returns; make C differ from A in its first token and check that nothing hits.
"""),
]
