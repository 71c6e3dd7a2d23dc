"""Cost probes: wall-clock seconds of a model's dense products and of whole forwards.

The adaptive speculation rule prices a verify step with the target's dense products timed
at a few row counts when the engine starts (spec_decode/adaptive.py, `calibrate`); the
benches time the same products (bench batching's dense-matmul floor) and whole forwards
(bench spec's verify / plain pass). The probes read the model's weights and run the
backend's ops; the model itself keeps no timing code.

A host clock times only host work: on a device backend (xp is not numpy) the probes return
None.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import numpy as np

from refserve.kv_cache.block_table import blocks_for_tokens
from refserve.model_runner import ModelInputs, build_attention_metadata


def dense_weights(model, num_layers: int | None = None) -> list:
    """The prepared weights of one forward's dense products in forward order: per layer
    (the first `num_layers`, default all) q/k/v, o, gate/up, down; then the lm_head."""
    return [w for block in model.layers[:num_layers]
            for w in (block.attention.w_qkv, block.attention.w_o, block.mlp.w_gate_up,
                      block.mlp.w_down)] + [model.lm_head]


def dense_seconds(model, rows, repeats: int = 3) -> dict[int, list[float]] | None:
    """Wall-clock seconds of one forward's dense products (every layer's, then the
    lm_head's, each `backend.linear`) at each of `rows` (row counts), `repeats` times each,
    interleaved (every round times every row count once, so a slow spell of a shared
    machine hits them alike). The weights are the model's own, each layer's distinct, so
    they are read from memory as in a real forward; activations are random. None on a
    device backend."""
    if model.xp is not np:
        return None
    backend = model.backend
    weights = dense_weights(model)
    inputs = [backend.weight_matrix(w).shape[1] for w in weights]
    rng = np.random.default_rng(0)
    out: dict[int, list[float]] = {r: [] for r in rows}
    for _ in range(repeats):
        for r in rows:
            xs = {k: rng.standard_normal((r, k), dtype=np.float32).astype(model.dtype)
                  for k in set(inputs)}
            t0 = time.perf_counter()
            for w, k in zip(weights, inputs):
                backend.linear(xs[k], w)
            out[r].append(time.perf_counter() - t0)
    return out


def forward_seconds(model, num_seqs: int, query_len: int, context_len: int = 64,
                    repeats: int = 3, block_size: int = 16) -> list[float] | None:
    """Wall-clock seconds of one whole forward as the engine runs it (the backend's
    `forward`), once per repeat: `num_seqs` sequences,
    each with `context_len` tokens already cached and `query_len` new ones (1: a decode
    row; 1 + k: a verify row with k drafts), logits for every query token. Runs on a
    private KV cache of just the blocks it needs (cache contents do not change the cost);
    token ids are arbitrary. None on a device backend."""
    if model.xp is not np:
        return None
    c, total = model.config, context_len + query_len
    per_seq = blocks_for_tokens(total, block_size)
    caches = model.backend.allocate_kv_cache(c.num_hidden_layers, num_seqs * per_seq,
                                             block_size, c.num_key_value_heads,
                                             c.head_dim, dtype=model.dtype)
    tables = np.arange(num_seqs * per_seq, dtype=np.int32).reshape(num_seqs, per_seq)
    positions = np.tile(np.arange(context_len, total), num_seqs)
    seq_of = np.repeat(np.arange(num_seqs), query_len)
    slots = tables[seq_of, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    attn = build_attention_metadata(
        slots, np.arange(num_seqs + 1, dtype=np.int32) * query_len,
        np.full(num_seqs, total, dtype=np.int32), tables, to_device=model.backend.to_device)
    ids = np.arange(len(positions), dtype=np.int64) % c.vocab_size
    # The step as the engine runs it: through the backend's forward (a fused one, or a graph).
    inputs = ModelInputs(ids, positions, slots, tables, attn.context_lens_cpu,
                         attn.query_start_loc_cpu, np.arange(len(positions)),
                         np.arange(num_seqs), attn)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.backend.forward(model, inputs, caches)
        out.append(time.perf_counter() - t0)
    return out


def with_backend(model, backend):
    """A shallow copy of `model` that runs on `backend` (same device and dtype): every dense
    weight prepared again by it from W [out, in] (a copy only where the layouts differ).
    For timing one backend's ops against another's in one process."""
    def prepared(w):
        return backend.prepare_weight(np.ascontiguousarray(model.backend.weight_matrix(w)))

    other = copy.copy(model)
    other.backend = backend
    other.layers = [dataclasses.replace(
        block,
        attention=dataclasses.replace(block.attention, w_qkv=prepared(block.attention.w_qkv),
                                      w_o=prepared(block.attention.w_o)),
        mlp=dataclasses.replace(block.mlp, w_gate_up=prepared(block.mlp.w_gate_up),
                                w_down=prepared(block.mlp.w_down)))
        for block in model.layers]
    other.lm_head = prepared(model.lm_head)
    return other
