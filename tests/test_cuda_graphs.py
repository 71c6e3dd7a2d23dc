"""CUDA-graph decode (refserve/backends/cuda_graphs.py) on the CPU.

The padding and bucketing rules are pure functions, tested directly. The replay logic runs
with a stand-in capturer whose "graph" re-runs the recorded forward on the same persistent
buffers and writes into the same output array: what a faithful CUDA graph replay computes.
So a wrong buffer layout, a stale host scalar, a padding row that writes the KV cache or a
logits row taken from the wrong place fails here, against the eager forward.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_utils import row, run_step, save_tiny_hf_model

from refserve.backends import cuda_graphs as cg
from refserve.backends.cpu_backend import CpuBackend
from refserve.model_runner import ModelRunner
from refserve.models.loader import load_model

# ------------------------------------------------------------------ pure rules


def test_capture_sizes_are_vllms_list():
    assert cg.capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cg.capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and cg.capture_sizes(256)[-1] == 256
    assert cg.capture_sizes(1) == [1]


@given(n=st.integers(1, 300))
def test_padded_batch_size_is_the_smallest_size_that_fits(n):
    sizes = cg.capture_sizes(256)
    padded = cg.padded_batch_size(n, sizes)
    if n > 256:
        assert padded is None
    else:
        assert padded >= n and padded in sizes
        assert not [s for s in sizes if n <= s < padded]
        assert padded - n < 8


@given(ctx=st.integers(1, 40000), partition=st.sampled_from([256, 512]),
       cap=st.integers(1, 40000))
def test_context_bucket_covers_the_context_in_power_of_two_partitions(ctx, partition, cap):
    bucket = cg.context_bucket(ctx, partition, cap)
    if ctx <= cap:
        assert ctx <= bucket <= cap
    if bucket < cap:  # not capped: a power-of-two number of whole partitions
        partitions = bucket // partition
        assert bucket % partition == 0 and partitions & (partitions - 1) == 0
    assert bucket < 2 * max(ctx, partition)  # never more than twice the work
    assert cg.context_bucket(min(ctx, cap), partition, cap) == min(bucket, cap)


def test_pad_decode_inputs_layout():
    padded = cg.pad_decode_inputs(np.array([5, 6]), np.array([9, 3]), np.array([40, 17]),
                                  np.array([10, 4], np.int32),
                                  np.array([[2, 3], [1, -1]], np.int32), batch=4, width=3)
    ids, pos, slots = padded.ints64.reshape(3, 4)
    assert ids.tolist() == [5, 6, 0, 0] and pos.tolist() == [9, 3, 0, 0]
    assert slots.tolist() == [40, 17, -1, -1]       # padding rows write nothing
    ctx, tables = padded.ints32[:4], padded.ints32[4:].reshape(4, 3)
    assert ctx.tolist() == [10, 4, 1, 1]             # padding rows: one key...
    assert tables.tolist() == [[2, 3, -1], [1, -1, -1], [0, -1, -1], [0, -1, -1]]  # ...in 0
    with pytest.raises(ValueError, match="does not fit"):
        cg.pad_decode_inputs(np.zeros(5), np.zeros(5), np.zeros(5), np.zeros(5),
                             np.zeros((5, 1)), batch=4, width=3)


# ------------------------------------------------------------------ replay vs eager


class ReplayCapturer:
    """Stand-in for CupyCapturer: the graph re-runs fn on the same buffers and writes its
    result into the array returned at capture, as a CUDA graph replay writes its output."""

    def __init__(self):
        self.captures = 0

    def run_on_stream(self, fn):
        return fn()

    def capture(self, fn):
        self.captures += 1
        result = fn()

        def graph():
            result[...] = fn()
        return graph, result

    def replay(self, graph):
        graph()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """On the tuned CPU backend: its decode batch reads the metadata's device arrays, as a
    GPU kernel does. A graph's host copies are placeholders (its rows change every replay),
    and the reference's per-sequence loop reads those host copies. Its NumPy kernels: a
    replayed graph runs `model.forward`, the eager step the backend's forward, and with the
    compiled kernels that is another (fused) forward, equal only up to rounding."""
    folder, _ = save_tiny_hf_model(tmp_path_factory.mktemp("graphs"))
    return load_model(folder, CpuBackend(kernels="numpy"))


class GraphedBackend:
    """The model's backend with CupyBackend.forward's dispatch: a step the graphs can run
    replays, every other one runs eagerly."""

    def __init__(self, backend, graphs) -> None:
        self.backend, self.graphs = backend, graphs

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, model, inputs, kv_caches):
        logits = self.graphs.run(inputs)
        return self.backend.forward(model, inputs, kv_caches) if logits is None else logits


def with_graphs(runner, graphs):
    """`runner`, its decode steps through `graphs` (what CupyBackend does on a GPU)."""
    runner.backend = GraphedBackend(runner.backend, graphs)
    runner.decode_graphs = graphs
    return runner


def decode_run(model, use_graphs, lengths, steps, block_size=8, finish_at=None):
    """Prefill ragged prompts, then `steps` decode steps of greedy tokens; a sequence in
    `finish_at` (index -> step) drops out of the batch then. Returns (tokens, runner)."""
    rng = np.random.default_rng(0)
    runner = ModelRunner(model, model.backend, num_blocks=64, block_size=block_size)
    capturer = ReplayCapturer()
    if use_graphs:
        runner = with_graphs(runner, cg.DecodeGraphs(model, model.backend, runner.kv_caches,
                                                     block_size, capturer, max_batch=16,
                                                     partition_size=16))
    blocks = iter(rng.permutation(64).tolist())
    seqs = []
    for n in lengths:
        ids = rng.integers(model.config.vocab_size, size=n).tolist()
        table = [next(blocks) for _ in range(-(-(n + steps) // block_size))]
        logits = run_step(runner, [row(ids, 0, n, table)])
        seqs.append((ids + [int(np.argmax(logits[-1]))], table))
    finish_at = finish_at or {}
    for step in range(steps):
        live = [i for i in range(len(seqs)) if finish_at.get(i, steps) > step]
        logits = run_step(runner, [row(seqs[i][0], len(seqs[i][0]) - 1, 1, seqs[i][1])
                                   for i in live])
        for i, r in zip(live, logits):
            seqs[i][0].append(int(np.argmax(r)))
    return [s[0] for s in seqs], runner, capturer


def test_graph_replay_equals_the_eager_forward(tiny_model):
    """Ragged contexts crossing a 16-key bucket, a batch that shrinks from 5 to 3 rows (padded
    to 8 then 4), identical greedy tokens; graphs were captured and replayed."""
    lengths, steps, finish = [3, 9, 14, 12, 6], 12, {1: 4, 3: 7}
    eager, _, _ = decode_run(tiny_model, False, lengths, steps, finish_at=finish)
    graphed, runner, capturer = decode_run(tiny_model, True, lengths, steps, finish_at=finish)
    assert graphed == eager
    graphs = runner.decode_graphs
    assert graphs.num_replays == steps and graphs.disabled is None
    batches = {key[0] for key in graphs.graphs}
    buckets = {key[1] for key in graphs.graphs}
    assert batches == {8, 4} and len(buckets) >= 2
    assert capturer.captures == len(graphs.graphs)  # captured once per key, then replayed


def test_padding_rows_do_not_write_the_kv_cache(tiny_model):
    _, runner, _ = decode_run(tiny_model, True, [5], 3)
    k_cache = runner.kv_caches[0][0]
    # Block 0 is the padding rows' context; with slot -1 they must never write into it
    # (the one real sequence's blocks are random, so block 0 may be its own: skip then).
    graphs = runner.decode_graphs
    assert list(graphs.graphs) == [(1, 16)]          # batch 1 needs no padding row
    _, runner2, _ = decode_run(tiny_model, True, [5, 7, 4], 3)
    assert {key[0] for key in runner2.decode_graphs.graphs} == {4}  # one padding row
    eager, runner3, _ = decode_run(tiny_model, False, [5, 7, 4], 3)
    for (k2, v2), (k3, v3) in zip(runner2.kv_caches, runner3.kv_caches):
        np.testing.assert_array_equal(k2, k3)
        np.testing.assert_array_equal(v2, v3)
    assert k_cache.shape[0] == 64


def test_prefill_and_too_large_batches_run_eagerly(tiny_model):
    graphs = cg.DecodeGraphs(tiny_model, tiny_model.backend, [], 8, ReplayCapturer(),
                             max_batch=4)
    from types import SimpleNamespace
    decode = SimpleNamespace(num_seqs=3, num_decodes=3, max_decode_context_len=30)
    mixed = SimpleNamespace(num_seqs=3, num_decodes=2, max_decode_context_len=30)
    big = SimpleNamespace(num_seqs=5, num_decodes=5, max_decode_context_len=30)
    tables = np.zeros((3, 4), np.int32)
    assert graphs.key(SimpleNamespace(attn=decode, block_tables=tables)) == (4, 128)  # capped
    assert not graphs.can_run(SimpleNamespace(attn=mixed, block_tables=tables))
    assert not graphs.can_run(SimpleNamespace(attn=big, block_tables=tables))
    graphs.disabled = "capture failed"
    assert not graphs.can_run(SimpleNamespace(attn=decode, block_tables=tables))


def test_a_failing_capture_switches_to_eager(tiny_model, capsys):
    class Broken(ReplayCapturer):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    lengths = [4, 6]
    eager, _, _ = decode_run(tiny_model, False, lengths, 3)
    runner = ModelRunner(tiny_model, tiny_model.backend, num_blocks=64, block_size=8)
    runner = with_graphs(runner, cg.DecodeGraphs(tiny_model, tiny_model.backend,
                                                 runner.kv_caches, 8, Broken(), max_batch=4))
    rows = [row(list(range(1, 5)), 0, 4, [1]), row(list(range(1, 7)), 0, 6, [2])]
    run_step(runner, rows)
    logits = run_step(runner, [row(list(range(1, 6)), 4, 1, [1])])
    assert runner.decode_graphs.disabled.startswith("RuntimeError")
    assert "running decode eagerly" in capsys.readouterr().err
    assert logits.shape == (1, tiny_model.config.vocab_size)
