"""From a scheduler decision to one model forward: flatten the batch into plain arrays.

`prepare_inputs` is the whole translation. For every scheduled sequence it appends the
query tokens of this step to one flat batch and records where they go:

    positions     start, start+1, ..., start+q-1           (absolute positions)
    slot_mapping  slot(p) = block_table[p // block_size] * block_size + p % block_size
    context_lens  start + q                                 (keys visible after the writes)
    query_start_loc  running sum of q                       (where each sequence's rows begin)
    logits_indices   the last row of each sequence that samples a token

No Python object crosses into the data plane: the model and a CUDA kernel see only these
integer arrays (see docs/architecture.md, "Attention metadata").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class AttentionMetadata:
    slot_mapping: np.ndarray     # [T] int64, -1 = do not write
    block_tables: np.ndarray     # [S, max_blocks] int32, padded with 0 (never read)
    context_lens: np.ndarray     # [S] int32
    query_start_loc: np.ndarray  # [S+1] int32


@dataclass
class BatchEntry:
    """One sequence's share of a step: `token_ids` computed at positions `start...`."""
    token_ids: list[int]
    start: int
    block_ids: list[int]
    write_kv: bool = True   # False for static batching's padding rows
    samples: bool = True    # whether the last row's logits are needed


@dataclass
class ModelInputs:
    input_ids: np.ndarray
    positions: np.ndarray
    attn: AttentionMetadata
    logits_indices: np.ndarray   # [num sampling sequences] rows of the batch to unembed


def prepare_inputs(entries: list[BatchEntry], block_size: int) -> ModelInputs:
    num_seqs = len(entries)
    q_lens = np.array([len(e.token_ids) for e in entries], dtype=np.int32)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(q_lens, out=query_start_loc[1:])
    max_blocks = max((len(e.block_ids) for e in entries), default=0)
    block_tables = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int32)
    input_ids, positions, slots = [], [], []
    for i, e in enumerate(entries):
        block_tables[i, :len(e.block_ids)] = e.block_ids
        pos = np.arange(e.start, e.start + len(e.token_ids), dtype=np.int64)
        if e.write_kv:
            table = np.asarray(e.block_ids, dtype=np.int64)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        else:
            slots.append(np.full(len(pos), -1, dtype=np.int64))
        input_ids.append(np.asarray(e.token_ids, dtype=np.int64))
        positions.append(pos)
    logits_indices = np.array([query_start_loc[i + 1] - 1 for i, e in enumerate(entries)
                               if e.samples], dtype=np.int64)
    context_lens = np.array([e.start + len(e.token_ids) for e in entries], dtype=np.int32)

    def cat(parts):
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    return ModelInputs(
        input_ids=cat(input_ids),
        positions=cat(positions),
        attn=AttentionMetadata(slot_mapping=cat(slots), block_tables=block_tables,
                               context_lens=context_lens, query_start_loc=query_start_loc),
        logits_indices=logits_indices,
    )


class ModelRunner:
    """Owns the model and its KV cache; runs one scheduler step."""

    def __init__(self, model, backend, num_blocks: int, block_size: int) -> None:
        c = model.config
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.kv_caches = backend.allocate_kv_cache(
            c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.time_in_forward = 0.0  # seconds inside model.forward (the rest is overhead)

    def entries_for(self, scheduler_output) -> list[BatchEntry]:
        entries = []
        for s in scheduler_output.scheduled:
            seq = s.seq
            if s.is_padding:
                # Static batching: a finished sequence still occupies its slot. Recompute its
                # last cached token (real work, nothing written, result thrown away).
                p = seq.num_computed_tokens - 1
                entries.append(BatchEntry([seq.token_ids[p]], p, s.block_ids,
                                          write_kv=False, samples=False))
            else:
                entries.append(BatchEntry(seq.token_ids[s.start:s.start + s.num_tokens],
                                          s.start, s.block_ids, samples=s.samples))
        return entries

    def execute(self, entries: list[BatchEntry], block_copies=()) -> np.ndarray:
        """Run copy-on-write copies, then the forward; returns logits of sampling rows
        ([num sampling sequences, vocab], host NumPy)."""
        if block_copies:
            src_to_dst = self.backend.to_device(np.asarray(block_copies, dtype=np.int64))
            for k_cache, v_cache in self.kv_caches:
                self.backend.copy_blocks(k_cache, v_cache, src_to_dst)
        inputs = prepare_inputs(entries, self.block_size)
        if len(inputs.input_ids) == 0:
            return np.zeros((0, self.model.config.vocab_size), dtype=np.float32)
        to_dev = self.backend.to_device
        attn = AttentionMetadata(*(to_dev(a) for a in (
            inputs.attn.slot_mapping, inputs.attn.block_tables, inputs.attn.context_lens,
            inputs.attn.query_start_loc)))
        t0 = time.perf_counter()
        logits = self.model.forward(to_dev(inputs.input_ids), to_dev(inputs.positions), attn,
                                    self.kv_caches, to_dev(inputs.logits_indices))
        logits = self.backend.to_numpy(logits)
        self.time_in_forward += time.perf_counter() - t0
        return logits
