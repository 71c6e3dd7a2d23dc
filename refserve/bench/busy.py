"""`busy`: the engine on a quiet machine and beside a busy neighbour, per thread setting.

The neighbour is one busy-loop process at the same priority, started as a program of its
own (its own session, as another user's job would be), bounded in time by itself and killed
when each measurement ends, whatever happens. Per thread setting (--threads: auto, the
default policy of refserve/backends/cpu_threads.py, or a fixed count) and per round, the
engine serves the same two workloads quiet and then beside the neighbour (the order
alternates between rounds, so slow drift falls on both):

    throughput  --num-requests chat-like requests (bench/workloads.py) on --max-num-seqs
                seats, all at once, greedy, EOS ignored: useful output tokens / s
    decode      one request alone, 32 prompt tokens, --decode-tokens output tokens: ms per
                token

The table gives the medians over --repeats rounds and what the neighbour leaves of the quiet
numbers (kept = with / quiet throughput, quiet / with ms per token). On 2 cores a perfectly
shared machine leaves one core: two threads that scale perfectly would keep 50-67%, one
thread about 100%.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from refserve.bench.common import print_table, pyplot, save_figure, traced
from refserve.bench.workloads import make_workload
from refserve.config import BACKENDS
from refserve.sampling import SamplingParams

HELP = "throughput and batch-1 decode quiet vs beside a busy-loop process, per thread setting"
# The neighbour: spins until its deadline (argv[1], seconds from its start), then exits, so
# it cannot outlive a bench that is killed before it can stop it.
HOG = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\n" \
      "while time.monotonic() < end:\n    pass\n"


def add_arguments(p) -> None:
    p.add_argument("--threads", nargs="+", default=["auto"],
                   help="thread settings to compare: auto (the policy) or counts, e.g. "
                        "auto 1 2 (REFSERVE_CPU_THREADS's values)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--mean-output", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="rounds per thread setting")
    p.add_argument("--hog-seconds", type=float, default=900.0,
                   help="the neighbour's own time limit per measurement (it is killed "
                        "when the measurement ends in any case)")
    p.add_argument("--backend", default="auto", choices=BACKENDS)


def apply_quick(args) -> None:
    args.num_requests, args.mean_output, args.max_num_seqs = 4, 8, 4
    args.decode_tokens, args.repeats = 8, 1


POSITIVE = ("num_requests", "mean_output", "max_num_seqs", "decode_tokens", "repeats",
            "hog_seconds")


@contextmanager
def busy_neighbour(seconds: float):
    """One busy-loop process at this process's priority beside the block, in a session of
    its own; killed (its whole process group) when the block ends, and bounded by
    `seconds` in any case."""
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(seconds)],
                           start_new_session=True)
    try:
        time.sleep(0.2)  # let it start spinning before the measurement
        yield hog
    finally:
        try:
            os.killpg(hog.pid, 9)
        except ProcessLookupError:  # it reached its deadline
            pass
        hog.wait()


def thread_setting(value: str):
    """A ThreadPolicy for `value` ("auto" or a count), or ValueError naming the flag."""
    from refserve.backends.cpu_threads import ThreadPolicy, parse_setting

    try:
        return ThreadPolicy(parse_setting(value))
    except ValueError as e:
        raise ValueError(f"--threads {value}: {e}") from None


def measure(llm, workload, decode_tokens: int) -> dict:
    """Throughput of `workload` and batch-1 ms per token, on the engine as it is set."""
    engine = llm.llm_engine
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in workload.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == workload.useful_tokens, (produced, workload.useful_tokens)
    one = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([workload.prompts[0][:32]], [one], use_tqdm=False)
    tpot = llm.last_summary.tpot_p50
    threads = getattr(engine.backend, "threads", None)
    return {"tokens_per_s": produced / elapsed, "decode_ms_per_token": 1000 * tpot,
            "threads_after": threads.threads() if threads is not None else None,
            "thread_changes": threads.changes if threads is not None else None,
            "load_1min": os.getloadavg()[0]}


COLS = [("threads", "threads", ""), ("quiet_tok_s", "quiet tok/s", ".1f"),
        ("busy_tok_s", "beside hog tok/s", ".1f"), ("kept_throughput", "kept", ".0%"),
        ("quiet_ms", "quiet ms/token", ".1f"), ("busy_ms", "beside hog ms/token", ".1f"),
        ("kept_decode", "kept", ".0%")]


def run(args) -> dict:
    from refserve.llm import LLM

    for value in args.threads:  # checked before the engine loads
        thread_setting(value)
    # Prefix caching off: every run of a round sends the same prompts, and with it on only
    # the round's first run would compute its prefills (the others would hit the cache).
    llm = traced(args, LLM(model=args.model, backend=args.backend, enable_prefix_caching=False,
                           max_num_seqs=args.max_num_seqs, progress=False), "busy")
    backend = llm.llm_engine.backend
    if not hasattr(backend, "threads"):
        print(f"the {backend.name} backend has no thread policy: --threads is ignored, "
              "BLAS runs as it is set", flush=True)
        args.threads = args.threads[:1]
    vocab = llm.llm_engine.model.config.vocab_size
    print(f"backend {args.backend}→{backend.name}; {args.num_requests} requests on "
          f"{args.max_num_seqs} seats, decode {args.decode_tokens} tokens; neighbour: one "
          f"busy loop; load before {os.getloadavg()[0]:.2f}", flush=True)
    runs = []
    for r in range(args.repeats):
        for value in args.threads:
            if hasattr(backend, "threads"):  # a fresh policy sets BLAS's threads as it starts
                backend.threads = thread_setting(value)
                if getattr(backend, "compiled", False):    # numba's threads, BLAS on one
                    backend.threads.cap_blas(1)
            workload = make_workload(args.num_requests, args.seed + r, vocab,
                                     mean_output=args.mean_output)
            for busy in ((False, True) if r % 2 == 0 else (True, False)):
                if busy:
                    with busy_neighbour(args.hog_seconds):
                        numbers = measure(llm, workload, args.decode_tokens)
                else:
                    numbers = measure(llm, workload, args.decode_tokens)
                runs.append({"round": r, "threads": value, "neighbour": busy, **numbers})
                print(f"round {r} threads {value} {'beside hog' if busy else 'quiet':10s}: "
                      f"{numbers['tokens_per_s']:.1f} tok/s, "
                      f"{numbers['decode_ms_per_token']:.1f} ms/token (threads now "
                      f"{numbers['threads_after']}, load {numbers['load_1min']:.2f})",
                      flush=True)
    rows = []
    for value in args.threads:
        def median(key, busy, value=value):
            return statistics.median(x[key] for x in runs
                                     if x["threads"] == value and x["neighbour"] == busy)

        row = {"threads": value, "quiet_tok_s": median("tokens_per_s", False),
               "busy_tok_s": median("tokens_per_s", True),
               "quiet_ms": median("decode_ms_per_token", False),
               "busy_ms": median("decode_ms_per_token", True)}
        row["kept_throughput"] = row["busy_tok_s"] / row["quiet_tok_s"]
        row["kept_decode"] = row["quiet_ms"] / row["busy_ms"]
        rows.append(row)
    print()
    print_table(rows, COLS)
    return {"rows": rows, "runs": runs}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    names = [f"threads {r['threads']}" for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, quiet, busy, label in ((a, "quiet_tok_s", "busy_tok_s", "output tokens / s"),
                                   (b, "quiet_ms", "busy_ms", "ms per token, batch 1")):
        ax.bar([i - 0.2 for i in x], [r[quiet] for r in rows], 0.4, label="quiet")
        ax.bar([i + 0.2 for i in x], [r[busy] for r in rows], 0.4,
               label="beside a busy loop")
        ax.set_xticks(list(x), names)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    a.set_title("Throughput (higher is better)")
    b.set_title("Decode, batch 1 (lower is better)")
    save_figure(fig, result, path)
