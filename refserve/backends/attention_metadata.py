"""`AttentionMetadata`: everything paged attention needs to know about one step, built once.

`ModelRunner.prepare` builds one per step (model_runner.attention_metadata; a layout built by
hand goes through model_runner.build_attention_metadata, which checks it with
`checked_layout` first) and every layer receives the same object, so what is
derived from it (scalars, masks) is derived once per step, not once per layer.

For `S` sequences and `T = sum(q_len)` query tokens, ordered with the *decode rows first*
(rows 0 .. num_decodes-1 have q_len == 1, so their query tokens are tokens 0 .. num_decodes-1):

    device arrays (xp, on the backend's device)
    slot_mapping     [T]              int64  flat slot of each token's K/V; -1 = don't write
    query_start_loc  [S+1]            int32  tokens of row i: query_start_loc[i]:[i+1]
    context_lens     [S]              int32  keys visible to row i after this step's writes
                                             (= position of its last query + 1)
    block_tables     [S, max_blocks]  int32  physical block ids; entries past
                                             ceil(context_lens[i] / block_size) are PAD_BLOCK

    host values (plain Python ints / NumPy arrays: reading them never syncs a device)
    num_seqs                         S, the rows
    num_decodes                      decode rows (q_len == 1), so also their tokens
    max_decode_context_len           over the decode rows (0 when there are none)
    query_start_loc_cpu, context_lens_cpu, block_tables_cpu
                                     host copies of the arrays, for loops launched per
                                     sequence from the CPU (the CPU backends' loops)

A layer may read the host values freely. It must never turn a device array into a host value
(`int(a)`, `bool(a)`, `a.item()`, `a.tolist()`, `np.asarray(a)` on a GPU array): on a GPU
each is a device→host copy that waits for the whole queue, thirty layers a step.

`PAD_BLOCK = -1` pads the block tables: it is no block id, so a kernel that read one would
index out of bounds (CUDA) or be caught by a range check, instead of silently reading block 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PAD_BLOCK = -1

Array = Any


@dataclass
class AttentionMetadata:
    slot_mapping: Array
    query_start_loc: Array
    context_lens: Array
    block_tables: Array
    num_seqs: int
    num_decodes: int
    max_decode_context_len: int
    query_start_loc_cpu: np.ndarray
    context_lens_cpu: np.ndarray
    block_tables_cpu: np.ndarray


def checked_layout(slot_mapping, query_start_loc, context_lens, block_tables):
    """The four host arrays of a hand-built layout, as the dtypes above; ValueError if they
    break the layout (row bounds from 0 to T, a table row per sequence, 1 <= q_len <=
    context_len, decode rows first)."""
    query_start_loc = np.asarray(query_start_loc, dtype=np.int32)
    context_lens = np.asarray(context_lens, dtype=np.int32)
    block_tables = np.asarray(block_tables, dtype=np.int32)
    slot_mapping = np.asarray(slot_mapping, dtype=np.int64)
    num_seqs = len(context_lens)
    q_lens = np.diff(query_start_loc)
    if (query_start_loc.shape != (num_seqs + 1,) or query_start_loc[0] != 0
            or query_start_loc[-1] != len(slot_mapping)):
        raise ValueError(f"query_start_loc {query_start_loc} must run from 0 to "
                         f"T={len(slot_mapping)} with one entry per sequence plus one")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {block_tables.shape} needs one row per sequence "
                         f"({num_seqs})")
    if (q_lens < 1).any() or (q_lens > context_lens).any():
        raise ValueError(f"every row needs 1 <= q_len <= context_len, got q_lens {q_lens}, "
                         f"context_lens {context_lens}")
    num_decodes = int((q_lens == 1).sum())
    if not (q_lens[:num_decodes] == 1).all():
        raise ValueError(f"decode rows (q_len == 1) must come first, got q_lens {q_lens}")
    return slot_mapping, query_start_loc, context_lens, block_tables
