"""From a scheduler decision to logits: the runner's three stages of one engine step,
`prepare`, `copy_blocks` and `forward` (LLMEngine.step lists all eight).

`prepare` is the whole translation, on the host. Each row `s` of `out.scheduled` computes
the query tokens `(seq.token_ids + s.draft_token_ids)[s.start : s.start +
s.num_scheduled_tokens]`, and its last `s.num_logits` tokens need logits. Rows are laid
out *decodes first* (q_len == 1, in scheduler order), then the others (prefill chunks,
speculative verifies), and for each:

    positions        start, start+1, ..., start+q-1           (absolute positions)
    slot_mapping     slot(p) = block_table[p // block_size] * block_size + p % block_size
                     (kv_cache.block_table.slot_mapping)
    context_lens     start + q                                 (keys visible after the writes)
    query_start_loc  running sum of q                          (where each row's tokens begin)
    block_tables     the row's block ids, padded with PAD_BLOCK (-1)
    logits_indices   flat token index of every logits row, in `out.scheduled` order

so `forward` returns the logits rows in scheduler order (row by row, each row's num_logits
tokens in position order), whatever the internal order. The host scalars a kernel needs
(num_decodes, max_decode_context_len) are computed here, once per step, into
the one `AttentionMetadata` every layer receives. No Python object crosses into the data
plane: the model sees only these arrays and scalars.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from refserve.backends.attention_metadata import PAD_BLOCK, AttentionMetadata, checked_layout
from refserve.kv_cache.block_table import slot_mapping as compute_slots


@dataclass
class ModelInputs:
    """One step's flat batch. Arrays are host NumPy (printable); `attn` holds the device
    copies of the attention arrays and the host scalars.

    row_order[i] is the index in `out.scheduled` of flat row i (decodes first).
    """

    input_ids: np.ndarray        # [T] int64
    positions: np.ndarray        # [T] int64
    slot_mapping: np.ndarray     # [T] int64, -1 = write nothing
    block_tables: np.ndarray     # [S, max_blocks] int32, PAD_BLOCK past each table
    context_lens: np.ndarray     # [S] int32
    query_start_loc: np.ndarray  # [S+1] int32
    logits_indices: np.ndarray   # [R] int64, R = sum of num_logits, scheduler order
    row_order: np.ndarray        # [S] int
    attn: AttentionMetadata

    @property
    def num_batched_tokens(self) -> int:
        """T, the batch's query tokens (SchedulerOutput.num_batched_tokens)."""
        return len(self.input_ids)

    @property
    def num_logits(self) -> int:
        return len(self.logits_indices)

    def __str__(self) -> str:
        a = self.attn
        lines = [
            f"ModelInputs: {len(self.row_order)} rows, {self.num_batched_tokens} tokens, "
            f"{self.num_logits} logits rows | num_decodes {a.num_decodes} | "
            f"max_decode_context_len {a.max_decode_context_len}",
            f"  row_order        {self.row_order.tolist()}   (flat row -> scheduled row)",
            f"  input_ids        {self.input_ids.tolist()}",
            f"  positions        {self.positions.tolist()}",
            f"  slot_mapping     {self.slot_mapping.tolist()}",
            f"  query_start_loc  {self.query_start_loc.tolist()}",
            f"  context_lens     {self.context_lens.tolist()}",
            f"  logits_indices   {self.logits_indices.tolist()}",
            "  block_tables",
        ]
        lines += [f"    {row.tolist()}" for row in self.block_tables]
        return "\n".join(lines)

    __repr__ = __str__


def build_attention_metadata(slot_mapping: np.ndarray, query_start_loc: np.ndarray,
                             context_lens: np.ndarray, block_tables: np.ndarray,
                             to_device=np.asarray) -> AttentionMetadata:
    """The step's `AttentionMetadata` from host arrays laid out by hand (tests, probes).
    Raises ValueError if they break the layout (attention_metadata.checked_layout), so that
    no kernel has to check it per layer. `prepare` builds the layout itself and calls
    `attention_metadata` directly."""
    return attention_metadata(*checked_layout(slot_mapping, query_start_loc, context_lens,
                                              block_tables), to_device)


def attention_metadata(slot_mapping, query_start_loc, context_lens, block_tables,
                       to_device) -> AttentionMetadata:
    """`AttentionMetadata` for a layout already known to be right: the four arrays moved to
    the device once, the host values computed once (decode rows are the first num_decodes)."""
    num_decodes = int((np.diff(query_start_loc) == 1).sum())
    return AttentionMetadata(
        slot_mapping=to_device(slot_mapping), query_start_loc=to_device(query_start_loc),
        context_lens=to_device(context_lens), block_tables=to_device(block_tables),
        num_seqs=len(context_lens), num_decodes=num_decodes,
        max_decode_context_len=int(context_lens[:num_decodes].max(initial=0)),
        query_start_loc_cpu=query_start_loc, context_lens_cpu=context_lens,
        block_tables_cpu=block_tables)


class ModelRunner:
    """Owns the model and its KV cache; prepares, copies and runs one scheduler step."""

    def __init__(self, model, backend, num_blocks: int, block_size: int,
                 num_host_blocks: int = 0) -> None:
        c = model.config
        self.model = model
        self.backend = backend
        self.block_size = block_size
        dtype = getattr(model, "dtype", np.float32)
        self.kv_caches = backend.allocate_kv_cache(
            c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
            dtype=dtype)
        # Swap preemption's host block pool (host_pool.py holds its bookkeeping); None
        # with preemption_mode="recompute".
        self.host_kv_caches = backend.allocate_host_kv_cache(
            c.num_hidden_layers, num_host_blocks, block_size, c.num_key_value_heads,
            c.head_dim, dtype=dtype) if num_host_blocks else None
        self.time_in_forward = 0.0  # seconds inside model.forward (the rest is overhead)

    # ------------------------------------------------------------------ stage 1: prepare
    def prepare(self, out, rows=None) -> ModelInputs:
        """Flatten `out.scheduled` (or `rows`, a list of ScheduledSequence) into a
        `ModelInputs` (host arrays, decodes first) and build the step's `AttentionMetadata`
        (arrays moved to the device once, scalars computed on the host once). Raises
        IndexError on a position without a block."""
        rows = out.scheduled if rows is None else rows
        # Decodes first: a row of one query token sorts before the others.
        order = sorted(range(len(rows)), key=lambda i: rows[i].num_scheduled_tokens > 1)
        width = max([1] + [len(s.block_ids) for s in rows])
        block_tables = np.full((len(rows), width), PAD_BLOCK, dtype=np.int32)
        input_ids, positions, slots, context_lens = [], [], [], []
        for flat, i in enumerate(order):
            s = rows[i]
            block_tables[flat, :len(s.block_ids)] = s.block_ids
            # BEGIN EXERCISE runner_prepare: a row's query tokens, positions, slots, context_len
            # ... extend input_ids, positions and slots by n each; append to context_lens
            # (token_ids + drafts)[start:start + n]; a verify row's drafts follow its last token
            n = s.num_scheduled_tokens
            input_ids += (s.seq.token_ids[s.start:] + list(s.draft_token_ids))[:n]
            positions += range(s.start, s.start + n)
            # The row's own table, not the padded row: a position without a block raises
            # IndexError instead of turning PAD_BLOCK into a negative slot.
            slots += compute_slots(s.block_ids, positions[-n:], self.block_size).tolist()
            context_lens.append(s.start + n)  # keys visible after the writes
            # END EXERCISE
        query_start_loc = np.cumsum([0] + [rows[i].num_scheduled_tokens for i in order],
                                    dtype=np.int32)
        row_end = dict(zip(order, query_start_loc[1:].tolist()))  # one past a row's last token
        # Logits rows in scheduler order: each row's last num_logits tokens.
        logits_indices = [t for i, s in enumerate(rows)
                          for t in range(row_end[i] - s.num_logits, row_end[i])]
        input_ids, positions, slots, logits_indices, order = (
            np.array(a, dtype=np.int64) for a in (input_ids, positions, slots, logits_indices,
                                                  order))
        context_lens = np.array(context_lens, dtype=np.int32)
        attn = attention_metadata(slots, query_start_loc, context_lens, block_tables,
                                  self.backend.to_device)
        return ModelInputs(
            input_ids=input_ids, positions=positions, slot_mapping=slots,
            block_tables=block_tables, context_lens=context_lens,
            query_start_loc=query_start_loc, logits_indices=logits_indices, row_order=order,
            attn=attn)

    # ------------------------------------------------------------------ stage 2: copy
    def copy_blocks(self, block_copies, swap_out=(), swap_in=()) -> None:
        """The step's block copies, before its forward, in this order (scheduler/
        swapping.py says why): swap_out (device, host) pairs to the host pool, swap_in
        (host, device) pairs back, then copy-on-write: for each (src, dst), block dst :=
        block src in every layer's K and V cache."""
        if len(swap_out) or len(swap_in):
            if self.host_kv_caches is None:
                raise ValueError("copy_blocks: swap copies, but this runner has no host "
                                 "pool (preemption_mode='swap' sizes one)")
            for mapping, op in ((swap_out, self.backend.swap_out),
                                (swap_in, self.backend.swap_in)):
                if len(mapping):
                    pairs = np.asarray(list(mapping), dtype=np.int64).reshape(-1, 2)
                    for (k, v), (host_k, host_v) in zip(self.kv_caches, self.host_kv_caches):
                        op(k, v, host_k, host_v, pairs)
        if not len(block_copies):
            return
        src_to_dst = self.backend.to_device(np.asarray(list(block_copies), dtype=np.int64))
        for k_cache, v_cache in self.kv_caches:
            self.backend.copy_blocks(k_cache, v_cache, src_to_dst)

    # ------------------------------------------------------------------ stage 3: forward
    def forward(self, inputs: ModelInputs) -> np.ndarray:
        """One model forward over the prepared batch (`backend.forward`: on the CPU backends
        the model's forward itself). Returns float32 logits on the host,
        [inputs.num_logits, vocab], rows in scheduler order. The only device->host copy of
        the step is this result."""
        if not len(inputs.input_ids):
            return np.zeros((0, self.model.config.vocab_size), dtype=np.float32)
        t0 = time.perf_counter()
        logits = self.backend.to_numpy(self.backend.forward(self.model, inputs, self.kv_caches))
        self.time_in_forward += time.perf_counter() - t0
        return logits
