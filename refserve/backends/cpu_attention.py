"""Paged attention of the tuned CPU backend: decode rows read the cache through block views,
partial softmaxes merged online; prefill chunks in query tiles.

The reference (numpy_backend.py) gathers each sequence's whole context into one array per
layer and runs the softmax over it. Over long contexts that copy is most of a decode step:
16 decodes over 1,000 keys copy 24 MB per layer, 30 layers a step, and a prefix that the 16
share (the prefix cache's point) is copied 16 times. Here a decode row's keys are read where
they lie, as vLLM's CPU kernel and FlashDecoding do: block by block, each block's partial
softmax merged into the row's running one.

SEGMENTS. A run of physically consecutive blocks is one view of the cache, no copy:

    cache[first : first + n].reshape(n * block_size, Hkv, D)[:num_keys]

`plan_decode` cuts every decode row's context into such runs, once per step, and cuts the
runs again where another row's run starts or ends inside them, so that rows reading the same
blocks (a shared prefix, forked samples) get the same piece. A piece read by r rows is one
matmul of all their queries against it: [Hkv, r·G, D] x [Hkv, D, keys]. Pieces too small to
pay for their own numpy calls (MIN_VIEW_WORK key-rows) are gathered instead, as the
reference does, into padded batches of the rows that have any: rows grouped by how many
leftover blocks they have, a group's widest at most twice its narrowest, so one row with a
long private context (a prompt that computed a shared prefix itself) does not pad every
other row's few blocks to its width. Each batch is one more partial of its rows.

ONLINE SOFTMAX. A partial over a set of keys is, per row and head, m = max score,
l = Σ exp(s - m) and o = Σ exp(s - m) · v. Two partials over disjoint keys merge exactly
(the log-sum-exp identity FlashDecoding's split-KV reduction uses):

    M = max(m₁, m₂),  l = l₁·e^(m₁-M) + l₂·e^(m₂-M),  o = o₁·e^(m₁-M) + o₂·e^(m₂-M)

and the answer is o / l. A decode query sees its whole context, so no mask is needed inside
a piece, and the order in which pieces are merged changes only float rounding. Every piece
holds at least one key, so every m is finite; the running m starts at -inf and its first
merge weight e^(-inf) = 0 multiplies a zero o.

PREFILL CHUNKS (q_len > 1) gather their context once per sequence and run in query tiles of
QUERY_TILE, each tile skipping the keys after its last query (all causally masked there).

Differs from the reference only in float rounding: the same scores, summed in another order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from refserve.backends.attention_metadata import PAD_BLOCK, AttentionMetadata
from refserve.kv_cache.block_table import blocks_for_tokens

# Prefill chunks are processed this many query tokens at a time, which bounds the score
# matrix at [num_heads, tile, L] floats, and lets each tile skip the keys after its last query
# (they are all causally masked), roughly halving the work of a full prefill.
QUERY_TILE = 256

# A piece read by r rows with n keys is computed through its own view when r · n reaches
# this; smaller ones are gathered with the rest. A view piece costs about 25 numpy calls
# (~60 µs at SmolLM2 shapes on the 2-core development machine); gathering costs ~0.2 µs per
# key-row (its 1.5 KB of K and V copied, then read again): break-even near 300 key-rows.
MIN_VIEW_WORK = 384

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)


def attend(q: np.ndarray, k_t: np.ndarray, v: np.ndarray, bias) -> np.ndarray:
    """softmax(q · Kᵀ + bias) · V over the last axis, in float32, numerically stable.

    Shapes (leading axes broadcast like np.matmul):
        q:     [..., M, D]   queries, already multiplied by `scale`
        k_t:   [..., D, N]   keys, transposed
        v:     [..., N, D]
        bias:  broadcastable to [..., M, N]: 0 where the key is visible, -inf where masked
        returns [..., M, D]

    Every row has at least one visible key, so its max is finite and masked keys get exactly
    exp(-inf) = 0.
    """
    out, total, _ = partial_softmax(q, k_t, v, bias)
    # Normalising after the matmul divides M*D numbers instead of M*N.
    out /= total
    return out


def partial_softmax(q, k_t, v, bias):
    """The unnormalised partial of `attend` over these keys: (o [..., M, D], l [..., M, 1],
    m [..., M, 1]) with m the row max of the scores, l = Σ exp(s - m), o = Σ exp(s - m) · v.
    Subtracting m keeps every exponent <= 0, so nothing overflows."""
    scores = q @ k_t  # [..., M, N]
    if bias is not None:
        scores += bias
    top = scores.max(axis=-1, keepdims=True)
    scores -= top
    np.exp(scores, out=scores)  # in place: the score matrix is the largest temporary
    return scores @ v, scores.sum(axis=-1, keepdims=True), top


@dataclass(frozen=True)
class Piece:
    """Keys 0 .. num_keys-1 of the cache's blocks first .. first+num_blocks-1 (one view), read
    by the decode rows `rows` (a slice when they are consecutive, else an index array)."""

    rows: slice | np.ndarray
    first: int
    num_blocks: int
    num_keys: int


@dataclass(frozen=True)
class Gathered:
    """What the view pieces leave: for `rows` (index array), the blocks of `table`
    [len(rows), nb] (padding entries repeat a block of the row and are masked), the first
    `num_keys` slots of them, and the mask `bias` [len(rows), 1, 1, num_keys]."""

    rows: np.ndarray
    table: np.ndarray
    num_keys: int
    bias: np.ndarray


@dataclass(frozen=True)
class DecodePlan:
    pieces: tuple[Piece, ...]
    gathered: tuple[Gathered, ...]


def _runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids as (first, stop) pairs: [7, 8, 9, 3, 4] -> (7, 10),
    (3, 5)."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = [0, *breaks.tolist()]
    stops = [*breaks.tolist(), len(ids)]
    return [(int(ids[a]), int(ids[b - 1]) + 1) for a, b in zip(starts, stops)]


def _as_rows(rows: list[int]):
    """Row indices as a slice when they are consecutive (a view instead of a copy)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return np.array(rows)


def plan_decode(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int,
                min_view_work: int = MIN_VIEW_WORK) -> DecodePlan:
    """How the decode rows' keys are read (module docstring): host arrays of the decode rows
    only (block_tables [B, max_blocks], context_lens [B]). Built once per step.

    Row b's keys are its first nb = ceil(L / block_size) blocks, the last holding
    L - (nb - 1) · block_size of them. Its runs of consecutive block ids are cut at every
    run boundary of any row that falls inside them; equal pieces (same blocks, same number of
    keys) are one piece read by all their rows."""
    batch = len(context_lens)
    runs = []  # per row: [(first, stop, keys in the run)]
    for b in range(batch):
        length = int(context_lens[b])
        num_blocks = blocks_for_tokens(length, block_size)
        row_runs = _runs(block_tables[b, :num_blocks])
        missing = num_blocks * block_size - length  # empty slots of the last block
        runs.append([(first, stop, (stop - first) * block_size - (missing if i == len(
            row_runs) - 1 else 0)) for i, (first, stop) in enumerate(row_runs)])
    cuts = sorted({edge for row_runs in runs for first, stop, _ in row_runs
                   for edge in (first, stop)})
    readers: dict[tuple[int, int, int], list[int]] = {}
    for b, row_runs in enumerate(runs):
        for first, stop, keys in row_runs:
            inner = cuts[np.searchsorted(cuts, first, side="right"):
                         np.searchsorted(cuts, stop, side="left")]
            edges = [first, *inner, stop]
            for a, z in zip(edges, edges[1:]):
                # Only the run's last piece can hold its partly filled last block.
                piece_keys = (z - a) * block_size if z != stop else keys - (a - first) * block_size
                readers.setdefault((a, z, piece_keys), []).append(b)
    pieces, leftover = [], [[] for _ in range(batch)]  # leftover[b]: [(block, keys)]
    for (first, stop, keys), rows in readers.items():
        if len(rows) * keys >= min_view_work:
            pieces.append(Piece(rows=_as_rows(rows), first=first, num_blocks=stop - first,
                                num_keys=keys))
        else:
            for b in rows:
                for block in range(first, stop):
                    leftover[b].append((block, min(block_size, keys - (block - first)
                                                   * block_size)))
    return DecodePlan(tuple(pieces), _gathered(leftover, block_size))


def _gathered(leftover: list[list[tuple[int, int]]],
              block_size: int) -> tuple[Gathered, ...]:
    """The padded gathers of the leftover blocks (none when the pieces cover every key):
    rows by decreasing leftover width, a new batch whenever a row is less than half as wide
    as its batch's first, so padding at most doubles a batch's reads."""
    rows = sorted((b for b, blocks in enumerate(leftover) if blocks),
                  key=lambda b: -len(leftover[b]))
    batches: list[list[int]] = []
    for b in rows:
        if not batches or 2 * len(leftover[b]) < len(leftover[batches[-1][0]]):
            batches.append([])
        batches[-1].append(b)
    return tuple(_gather_batch(sorted(batch), leftover, block_size) for batch in batches)


def _gather_batch(rows: list[int], leftover: list[list[tuple[int, int]]],
                  block_size: int) -> Gathered:
    """One padded gather of the leftover blocks of `rows`."""
    width = max(len(leftover[b]) for b in rows)
    table = np.empty((len(rows), width), dtype=np.int64)
    filled = np.zeros((len(rows), width), dtype=np.int64)  # keys in each gathered block
    for r, b in enumerate(rows):
        blocks, keys = zip(*leftover[b])
        table[r] = blocks[0]  # padding repeats a block of the row: read, then masked
        table[r, :len(blocks)] = blocks
        filled[r, :len(keys)] = keys
    # One block per row: gather only the slots some row uses (the contiguous cache's block
    # is max_model_len long).
    num_keys = int(filled.max()) if width == 1 else width * block_size
    slot = np.arange(num_keys)
    visible = (slot % block_size)[None, :] < filled[:, slot // block_size]
    bias = np.where(visible, _ZERO, _NEG_INF)[:, None, None, :]
    return Gathered(rows=np.array(rows), table=table, num_keys=num_keys, bias=bias)


class PagedAttention:
    """The tuned `paged_attention` (see `Backend.paged_attention`), with its reusable gather
    buffers. One per backend; not shared between threads."""

    def __init__(self, min_view_work: int = MIN_VIEW_WORK) -> None:
        self.min_view_work = min_view_work
        # Reusable gather buffers, one per cache ("k", "v"), grown to the largest gather seen.
        # A fresh multi-MB array per layer costs a page fault per 4 KiB page, which measured
        # as 2/3 of the gather time; reusing the memory removes it. Nothing returned to the
        # caller aliases these buffers.
        self._scratch: dict[str, np.ndarray] = {}
        # The last decode plan and what it was planned from: every layer of a step reads
        # the same tables, so the first layer plans and the others reuse it.
        self._plan_key: tuple | None = None
        self._plan: DecodePlan | None = None

    def __call__(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                 attn: AttentionMetadata, scale: np.floating) -> np.ndarray:
        """Rows 0 .. num_decodes-1 (q_len == 1) through `decode`; the others (chunks of
        q_len > 1) one sequence at a time, sizes from the metadata's host copies.

        The decode plan reads the "device" block tables and context lengths: on the CPU they
        are host arrays already, and they are what a replayed decode graph refills (its host
        copies are the bucket's placeholders, as a GPU kernel never reads them)."""
        out = np.empty_like(q)
        num_decodes = attn.num_decodes
        if num_decodes > 0:
            plan = self.decode_plan(np.asarray(attn.block_tables)[:num_decodes],
                                    np.asarray(attn.context_lens)[:num_decodes],
                                    k_cache.shape[1])
            out[:num_decodes] = self.decode(q[:num_decodes], k_cache, v_cache, plan, scale)
        qsl, ctx = attn.query_start_loc_cpu, attn.context_lens_cpu
        for i in range(num_decodes, attn.num_seqs):
            start, end = int(qsl[i]), int(qsl[i + 1])
            out[start:end] = chunk_attention(q[start:end], k_cache, v_cache,
                                             attn.block_tables_cpu[i], int(ctx[i]), scale)
        return out

    def decode_plan(self, block_tables: np.ndarray, context_lens: np.ndarray,
                    block_size: int) -> DecodePlan:
        """`plan_decode` of these decode rows, planned once for all the layers of a step:
        the plan is a function of its arguments, so it is reused while they are equal (a
        few hundred bytes compared per layer)."""
        key = (block_size, block_tables.shape, block_tables.dtype.str, block_tables.tobytes(),
               context_lens.tobytes())
        if key != self._plan_key:
            self._plan = plan_decode(block_tables, context_lens, block_size,
                                     self.min_view_work)
            self._plan_key = key
        return self._plan

    def decode(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
               plan: DecodePlan, scale: np.floating) -> np.ndarray:
        """Attention of B single-token queries `[B, H, D]`, each over its whole context (no
        mask), read as `plan` says. Returns `[B, H, D]`."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        # [B, H, D] -> [B, Hkv, G, D]: the G query heads of a kv head share its keys.
        q_grouped = (q * scale).reshape(batch, num_kv_heads, group, head_dim)
        if not plan.pieces and len(plan.gathered) == 1:  # one batch, normalised at once
            g = plan.gathered[0]
            return attend(q_grouped, *self._gather(k_cache, v_cache, g),
                          g.bias).reshape(batch, num_heads, head_dim)
        acc = np.zeros_like(q_grouped)                                   # o, [B, Hkv, G, D]
        total = np.zeros((batch, num_kv_heads, group, 1), dtype=q.dtype)  # l
        top = np.full((batch, num_kv_heads, group, 1), _NEG_INF, dtype=q.dtype)  # m
        for piece in plan.pieces:
            rows = q_grouped[piece.rows]                                  # [r, Hkv, G, D]
            r = rows.shape[0]
            # All r·G queries of a kv head are the rows of one matmul against its keys.
            queries = rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, r * group, head_dim)
            span = slice(piece.first, piece.first + piece.num_blocks)
            keys = k_cache[span].reshape(-1, num_kv_heads, head_dim)[:piece.num_keys]
            values = v_cache[span].reshape(-1, num_kv_heads, head_dim)[:piece.num_keys]
            partial = partial_softmax(queries, keys.transpose(1, 2, 0),
                                      values.transpose(1, 0, 2), None)
            # [Hkv, r·G, X] -> [r, Hkv, G, X], X = D for o, 1 for l and m
            o, l, m = (a.reshape(num_kv_heads, r, group, -1).transpose(1, 0, 2, 3)
                       for a in partial)
            _merge(acc, total, top, piece.rows, o, l, m)
        for g in plan.gathered:
            k_t, v = self._gather(k_cache, v_cache, g)
            o, l, m = partial_softmax(q_grouped[g.rows], k_t, v, g.bias)
            _merge(acc, total, top, g.rows, o, l, m)
        acc /= total
        return acc.reshape(batch, num_heads, head_dim)

    def _gather(self, k_cache, v_cache, g: Gathered):
        """The gathered keys transposed [R, Hkv, D, keys] and values [R, Hkv, keys, D]."""
        if g.num_keys < k_cache.shape[1]:
            k_cache, v_cache = k_cache[:, :g.num_keys], v_cache[:, :g.num_keys]
        shape = (len(g.rows), g.num_keys, *k_cache.shape[2:])
        keys = self._gather_blocks("k", k_cache, g.table).reshape(shape)
        values = self._gather_blocks("v", v_cache, g.table).reshape(shape)
        return keys.transpose(0, 2, 3, 1), values.transpose(0, 2, 1, 3)

    def _gather_blocks(self, which: str, cache: np.ndarray, table: np.ndarray) -> np.ndarray:
        """`cache[table]` (shape `[*table.shape, block_size, Hkv, D]`) written into a reused
        scratch buffer instead of a fresh array. Valid until the next call with `which`."""
        shape = table.shape + cache.shape[1:]
        size = math.prod(shape)
        buffer = self._scratch.get(which)
        if buffer is None or buffer.size < size or buffer.dtype != cache.dtype:
            buffer = np.empty(size, dtype=cache.dtype)
            self._scratch[which] = buffer
        out = buffer[:size].reshape(shape)
        # mode="clip" lets take write straight into `out` (the default mode="raise" gathers
        # into a temporary first). Ids come from block tables the KV-cache manager filled,
        # padding replaced by a block of the row (plan_decode), so nothing is clipped.
        return np.take(cache, table, axis=0, out=out, mode="clip")


def _merge(acc, total, top, rows, o, l, m) -> None:
    """Fold a partial (o, l, m) of `rows` into the running (acc, total, top), in place: the
    log-sum-exp merge of the module docstring."""
    old = top[rows]
    new = np.maximum(old, m)
    keep, add = np.exp(old - new), np.exp(m - new)
    total[rows] = total[rows] * keep + l * add
    acc[rows] = acc[rows] * keep + o * add
    top[rows] = new


def gather_context(cache: np.ndarray, block_table: np.ndarray, num_keys: int) -> np.ndarray:
    """The first `num_keys` tokens of one sequence as `[num_keys, num_kv_heads, head_dim]`.

    `block_table` is the row's host copy. Key n sits in block `block_table[n //
    block_size]` at offset `n % block_size`, so gathering the first ceil(num_keys /
    block_size) blocks and flattening them lines the keys up in position order; padding
    entries (PAD_BLOCK) lie past those blocks and are never read. If the keys all sit in the
    first block (the contiguous cache), a slice of that block is already the answer: a view.
    """
    block_size = cache.shape[1]
    if num_keys <= block_size:
        return cache[block_table[0], :num_keys]
    num_blocks = blocks_for_tokens(int(num_keys), block_size)
    assert block_table[num_blocks - 1] != PAD_BLOCK
    blocks = np.take(cache, block_table[:num_blocks], axis=0)  # [nb, block_size, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:num_keys]


def chunk_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_table: np.ndarray, context_len: int,
                    scale: np.floating) -> np.ndarray:
    """Causal attention of one chunk of `q_len` queries `[q_len, H, D]` at the end of a
    context of `context_len` keys. Returns `[q_len, H, D]`.

    Query j sits at position `context_len - q_len + j` and sees keys 0 ..= that position.
    Grouped-query heads: q is viewed as `[Hkv, G, q_len, D]` (head h = kv * G + g, so
    h // G = kv) and each kv head's keys serve its G query heads through broadcasting.
    """
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    first_pos = context_len - q_len  # position of query 0

    keys = gather_context(k_cache, block_table, context_len)  # [L, Hkv, D]
    values = gather_context(v_cache, block_table, context_len)
    # [L, Hkv, D] -> keys transposed per kv head [Hkv, 1, D, L] and values [Hkv, 1, L, D];
    # the 1 broadcasts over the G query heads of the group.
    k_t = keys.transpose(1, 2, 0)[:, None]
    v = values.transpose(1, 0, 2)[:, None]
    # [q_len, H, D] -> [Hkv, G, q_len, D]
    q_grouped = (q * scale).reshape(q_len, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)

    out = np.empty((num_kv_heads, group, q_len, head_dim), dtype=q.dtype)
    for start in range(0, q_len, QUERY_TILE):
        end = min(start + QUERY_TILE, q_len)
        # Keys after the tile's last query position are masked for the whole tile.
        num_keys = first_pos + end
        query_pos = first_pos + np.arange(start, end)  # [tile]
        key_pos = np.arange(num_keys)  # [num_keys]
        causal_bias = np.where(key_pos[None, :] <= query_pos[:, None], _ZERO, _NEG_INF)
        out[:, :, start:end] = attend(
            q_grouped[:, :, start:end],
            k_t[..., :num_keys],
            v[..., :num_keys, :],
            causal_bias,  # [tile, num_keys], broadcast over [Hkv, G]
        )
    # [Hkv, G, q_len, D] -> [q_len, H, D]
    return out.transpose(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
