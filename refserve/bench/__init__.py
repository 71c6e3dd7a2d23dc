"""`python -m refserve.bench <scenario>`: the course's claims, measured side by side in one run.

Scenarios (one file each in this package)
    batching   continuous vs static batching vs transformers' generate
    paged      paged vs contiguous KV cache: the cost of the gather
    prefix     prefix caching off / hash / radix, and fcfs vs lpm on a shuffled arrival
               order, on four branching workloads (few-shot, multi-turn, branches, agent)
    chunked    running decodes while a long prompt arrives, chunked prefill on vs off
    memory     KV slots reserved vs used: paged vs the naive max_model_len cache; n = 4 with
               and without copy-on-write
    spec       speculative decoding: none vs n-gram vs self-draft, quote-heavy and creative,
               batch 1 and 8: wall-clock speedup, acceptance, identical greedy output
    capacity   the capacity formula vs the sequences the engine really holds, per pool size
    roofline   measured peak FLOP/s and bandwidth; where prefill and decode steps land
    loadtest   the HTTP server under Poisson arrivals: TTFT/TPOT percentiles, throughput,
               goodput under an SLO, $ per 1M output tokens, every request accounted for
    sim-fidelity  the simulator vs the real engine: fit the cost model on a profiling run,
               then throughput / TTFT / TPOT errors on other workloads (refserve/simulator/)
    sim-world  the simulator vs published GPU measurements (TensorRT-LLM, SGLang, vLLM):
               predicted vs published per row, fit rows vs held-out rows (no GPU needed)
    preemption recompute vs swap preemption against context length, a pool forced to preempt
    compare    refserve beside vLLM (its own virtual environment) or any OpenAI-compatible
               server, engines interleaved: throughput, TTFT, TPOT/ITL p50/p99, prefix hits
    busy       throughput and batch-1 decode quiet and beside a busy-loop process, per
               thread setting (auto: the tuned CPU backend's policy, or a fixed count)

Each prints a table, states the machine (cores, BLAS and its kernel, GPU) and the exact
command, writes every number with --json and a chart with --plot (and the engines' timelines with
--trace, where a scenario runs an engine; loadtest's is its server's). Workloads are built from a
seed and text bundled in refserve/bench/corpus.py. `--quick` is a CI-sized run. Numbers are
compared only between systems measured in the same run.
"""

from refserve.bench.cli import main
from refserve.bench.workloads import Workload, make_workload

__all__ = ["main", "make_workload", "Workload"]
