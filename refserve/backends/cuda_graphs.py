"""CUDA graphs for decode steps: capture the model forward once per shape, then replay it.

A decode step of a small model is launch-bound: ~10 kernels per layer, each a few µs of GPU
work behind ~5-10 µs of Python and launch overhead. A CUDA graph records the whole forward's
kernels once (stream capture) and replays them with one launch. The price: a graph replays
*exactly* what was recorded: the same kernels, grids and pointers. So (vLLM's scheme):

  * the inputs live in persistent buffers, allocated once at the largest batch; a step copies
    its arrays into them (two host→device copies) and replays;
  * the batch is padded up to one of a few captured sizes (`capture_sizes`): padding rows
    decode token 0 at position 0 with slot -1 (nothing written) over a one-key context in
    block 0 (read, never used), and their logits are dropped;
  * host scalars baked into the launches (the v1/v2 choice and the v2 grid's partition
    count) come from `context_bucket`: the longest context rounded up to a power-of-two
    number of partitions, so a graph serves every step whose contexts fit its bucket;
  * graphs are captured lazily, the first time a (batch size, context bucket) is needed,
    after one eager warm-up at the same shapes (kernel compilation, cuBLAS set-up and
    workspace growth must not happen inside a capture);
  * temporaries of a capture come from a private memory pool that nothing else allocates
    from, so no later array can land on memory a replay writes.

Only pure decode steps (every row q_len == 1, batch <= the largest size) replay; anything
else, or `enforce_eager=True`, runs the readable eager forward (CupyBackend.forward
decides). If a capture fails (an unsupported operation), graphs are switched off with one
message and eager takes over.

`Capturer` is the seam: `CupyCapturer` records with `cupy.cuda.Stream.begin_capture`; the
CPU tests use a capturer whose "graph" simply calls the forward again on the same buffers,
which is what a faithful replay computes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from refserve.backends.attention_metadata import PAD_BLOCK, AttentionMetadata
from refserve.kv_cache.block_table import blocks_for_tokens

MAX_CAPTURE_SIZE = 256


def capture_sizes(max_batch: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, then every multiple of 8 up to max_batch
    (vLLM's list): padding wastes at most 7 rows, and 8-row multiples suit the matmuls."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if max_batch not in sizes and max_batch > 0:
        sizes.append(max_batch)
    return sorted(sizes)


def padded_batch_size(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= num_rows, or None when the batch is too large."""
    for size in sizes:
        if size >= num_rows:
            return size
    return None


def context_bucket(max_context_len: int, partition_size: int, max_context_cap: int) -> int:
    """The context length a graph is captured for: max_context_len rounded up to a
    power-of-two number of partitions (1, 2, 4, ... partitions of partition_size keys), and
    at most max_context_cap (the longest context a block table can hold). Steps whose
    longest context is at most the bucket share the graph (partitions past a context return
    at once)."""
    partitions = max(1, -(-max_context_len // partition_size))
    bucket = (1 << (partitions - 1).bit_length()) * partition_size
    return min(bucket, max_context_cap)


@dataclass
class PaddedDecode:
    """One decode step's inputs padded to `batch` rows, as the two flat host arrays copied
    into a graph's persistent buffers (one host→device copy each)."""

    ints64: np.ndarray    # [3 * batch]: input_ids, positions, slot_mapping (-1 on padding)
    ints32: np.ndarray    # [batch * (1 + width)]: context_lens, then block_tables rows


def pad_decode_inputs(input_ids, positions, slot_mapping, context_lens, block_tables,
                      batch: int, width: int) -> PaddedDecode:
    """Pad one decode step (n rows, one token each) to `batch` rows and `width` table
    columns. Padding rows: token 0 at position 0, slot -1 (no write), context 1, block 0."""
    n = len(input_ids)
    if n > batch or block_tables.shape[1] > width:
        raise ValueError(f"decode step of {n} rows x {block_tables.shape[1]} blocks does not "
                         f"fit a graph of {batch} rows x {width} blocks")
    ints64 = np.zeros((3, batch), dtype=np.int64)
    ints64[0, :n], ints64[1, :n], ints64[2, :n] = input_ids, positions, slot_mapping
    ints64[2, n:] = -1
    ctx = np.ones(batch, dtype=np.int32)
    ctx[:n] = context_lens
    tables = np.full((batch, width), PAD_BLOCK, dtype=np.int32)
    tables[:n, :block_tables.shape[1]] = block_tables
    tables[n:, 0] = 0
    return PaddedDecode(ints64.reshape(-1), np.concatenate([ctx, tables.reshape(-1)]))


def _copy_into(dst, src: np.ndarray) -> None:
    """Host array -> the leading part of a persistent (contiguous) buffer, in place."""
    if hasattr(dst, "set"):      # cupy: one host→device copy on the current stream
        dst[:len(src)].set(src)
    else:
        dst[:len(src)] = src


class CupyCapturer:
    """Records with CuPy stream capture on a private stream and memory pool."""

    def __init__(self, cupy) -> None:
        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()  # capture temporaries only; never freed

    def run_on_stream(self, fn):
        """fn() on the private stream, ordered after the caller's stream's earlier work and
        before its later work (events both ways: correct whichever stream is current)."""
        caller = self.cupy.cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        with self.stream:
            result = fn()
        caller.wait_event(self.stream.record())
        return result

    def capture(self, fn):
        """(graph, fn's result) with fn's kernels recorded, not run."""
        cupy = self.cupy
        cupy.cuda.Device().synchronize()
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture()
            try:
                result = fn()
            finally:
                graph = self.stream.end_capture()
        return graph, result

    def replay(self, graph) -> None:
        graph.launch(stream=self.stream)


class DecodeGraphs:
    """Captured decode forwards of one model over one set of KV caches, keyed by
    (padded batch size, context bucket). `run(inputs)` replays; `can_run` says when."""

    def __init__(self, model, backend, kv_caches, block_size: int, capturer,
                 max_batch: int = MAX_CAPTURE_SIZE, partition_size: int = 512) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.capturer = capturer
        self.sizes = capture_sizes(max_batch)
        self.partition_size = partition_size
        self.max_context = model.config.max_position_embeddings
        self.width = blocks_for_tokens(self.max_context, block_size)  # block-table columns
        xp, largest = backend.xp, self.sizes[-1]
        # Flat persistent buffers. A graph of `batch` rows reads their leading parts in the
        # layout of pad_decode_inputs(batch): each graph has its own layout, and each replay
        # writes the buffers in its own graph's layout first.
        self.ints64 = xp.zeros(3 * largest, dtype=np.int64)
        self.ints32 = xp.zeros(largest * (1 + self.width), dtype=np.int32)
        self.query_start_loc = xp.asarray(np.arange(largest + 1, dtype=np.int32))
        self.graphs: dict[tuple[int, int], tuple[Any, Any, AttentionMetadata, dict]] = {}
        self.disabled: str | None = None
        self.num_replays = 0

    def key(self, inputs) -> tuple[int, int] | None:
        """The graph for this step, or None if it must run eagerly."""
        attn = inputs.attn
        if self.disabled or attn.num_seqs == 0 or attn.num_decodes != attn.num_seqs:
            return None
        batch = padded_batch_size(attn.num_seqs, self.sizes)
        if batch is None or inputs.block_tables.shape[1] > self.width:
            return None
        return batch, context_bucket(attn.max_decode_context_len, self.partition_size,
                                     self.max_context)

    def can_run(self, inputs) -> bool:
        return self.key(inputs) is not None

    def _views(self, batch: int, bucket: int):
        """Input views of the persistent buffers and the AttentionMetadata a graph of
        `batch` rows records (host scalars: the bucket, so the v1/v2 choice fits)."""
        ctx = self.ints32[:batch]
        tables = self.ints32[batch:batch * (1 + self.width)].reshape(batch, self.width)
        attn = AttentionMetadata(
            slot_mapping=self.ints64[2 * batch:3 * batch],
            query_start_loc=self.query_start_loc[:batch + 1],
            context_lens=ctx, block_tables=tables, num_decodes=batch,
            max_decode_context_len=bucket,
            query_start_loc_cpu=np.arange(batch + 1, dtype=np.int32),
            context_lens_cpu=np.full(batch, bucket, dtype=np.int32),
            block_tables_cpu=np.zeros((batch, self.width), dtype=np.int32), num_seqs=batch)
        return self.ints64[:batch], self.ints64[batch:2 * batch], attn

    def _fill(self, padded: PaddedDecode) -> None:
        _copy_into(self.ints64, padded.ints64)
        _copy_into(self.ints32, padded.ints32)

    def _capture(self, batch: int, bucket: int):
        input_ids, positions, attn = self._views(batch, bucket)
        empty = np.zeros((0,), dtype=np.int64)
        self._fill(pad_decode_inputs(empty, empty, empty, empty.astype(np.int32),
                                     np.zeros((0, 1), np.int32), batch, self.width))

        def forward():
            return self.model.forward(input_ids, positions, attn, self.kv_caches, None)

        self.capturer.run_on_stream(forward)  # warm-up: compile, set up, grow workspaces
        graph, logits = self.capturer.capture(forward)
        # Keep every scratch buffer the recorded kernels point at alive for the graph's life.
        keepalive = dict(getattr(self.backend, "_workspace", {}))
        return graph, logits, attn, keepalive

    def run(self, inputs):
        """Replay the step's graph; returns device logits [num_logits, V] (scheduler order),
        or None when this step must run eagerly (`key`) or its capture failed."""
        if not self.can_run(inputs):
            return None
        batch, bucket = self.key(inputs)
        entry = self.graphs.get((batch, bucket))
        if entry is None:
            try:
                entry = self.graphs[(batch, bucket)] = self._capture(batch, bucket)
            except Exception as exc:  # an op that cannot be captured: eager from now on
                self.disabled = f"{type(exc).__name__}: {exc}"
                print(f"refserve: CUDA graph capture failed ({self.disabled}); running "
                      "decode eagerly", file=sys.stderr, flush=True)
                return None
        graph, logits, attn, _ = entry
        padded = pad_decode_inputs(inputs.input_ids, inputs.positions, inputs.slot_mapping,
                                   inputs.context_lens, inputs.block_tables, batch,
                                   self.width)

        rows = self.backend.to_device(inputs.logits_indices)

        def replay():
            self._fill(padded)
            self.capturer.replay(graph)
            return logits[rows]  # drop padding rows; a copy

        self.num_replays += 1
        return self.capturer.run_on_stream(replay)
