"""`AttentionMetadata`: everything paged attention needs to know about one step, built once.

`ModelRunner.prepare` builds one per step (model_runner.attention_metadata; a layout built by
hand goes through model_runner.build_attention_metadata, which checks it first) and every layer receives the same object, so what is
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

from dataclasses import dataclass, field
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
    num_decodes: int
    max_decode_context_len: int
    query_start_loc_cpu: np.ndarray
    context_lens_cpu: np.ndarray
    block_tables_cpu: np.ndarray
    num_seqs: int
    # Values a backend derives from this metadata (masks, gather plans), filled on first use
    # by the first layer and reused by the others. Private to the backend that fills it.
    backend_cache: dict = field(default_factory=dict, repr=False)
