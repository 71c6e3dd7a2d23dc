"""`compare`: refserve beside a peer engine (vLLM) on the same workloads, in one run.

Both engines are OpenAI-compatible servers on loopback, driven by the same client as
`loadtest` (every number measured on the client side). refserve's is started here from this
python; the peer is vLLM started from its own virtual environment (`--peer-python`, made by
scripts/make_vllm_env.sh), a server already running (`--peer-url`), or a second refserve
(`--peer refserve`: two identical engines must tie, the control). Both stay up for the whole
run, idle while the other works, and are stopped at the end whatever happens.

Workloads (every request a function of the seed; greedy, EOS ignored, so each engine
computes exactly the same number of tokens):
    throughput     --num-requests chat-like requests (prompts of 16-128 tokens, long-tailed
                   outputs of mean --mean-output: bench/workloads.py, as `batching`), all sent
                   at once to --max-num-seqs seats
    decode         batch 1: --decode-requests requests of 32 prompt tokens and
                   --decode-tokens output tokens, one after another: TPOT is the ms per token
                   of one sequence alone
    shared-prefix  --prefix-requests requests that share one --prefix-tokens prefix, each
                   with its own 16-token question and --prefix-output answer tokens, all sent
                   at once, prefix caching on in both engines

The engines alternate (refserve, peer, then peer, refserve, ...) for --repeats rounds, each
round with a new seed, so no engine finds the previous round's prompts in its prefix cache and
slow drift of the machine (another job starting) falls on both. Per run: throughput (output
tokens / time to the last token), TTFT, TPOT and ITL p50 / p99, and the prompt tokens the
server reports as prefix-cache hits on /metrics (vLLM's vllm:prefix_cache_hits, refserve's
refserve:prefix_cache_hits). The summary is the median over rounds and refserve / peer.

What differs by design between the two servers is listed with the table (docs/benchmarks.md
has it too): vLLM's CPU build uses KV blocks of 128 tokens, a token budget of 4096 per step,
and binds its compute threads to all cores but one, which it leaves to its front end.

`--in-process` runs the same workloads through each engine's offline API instead
(`LLM.generate` in a worker process of its own, no HTTP: bench/offline.py): throughput,
seconds and ms per output token; the served mode's difference from it is what HTTP costs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import statistics
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from refserve.bench.common import ms, percentiles, print_table, pyplot, save_figure
from refserve.bench.loadtest import send_requests
from refserve.bench.servers import (
    free_port,
    given,
    refserve_command,
    running,
    vllm_command,
)
from refserve.bench.workloads import make_workload

HELP = "refserve beside vLLM (or any OpenAI server): throughput, TTFT, TPOT/ITL, prefix hits"
WORKLOADS = ("throughput", "decode", "shared-prefix")
PEERS = ("vllm", "refserve")
# Lines of a server's log that say how it runs (threads, cores, budget, KV blocks).
LOG_NOTES = re.compile(r"^refserve: |core ids=|reserved_cpus=|max_num_batched_tokens=|"
                       r"KV cache size|Reducing Torch threads")


def add_arguments(p) -> None:
    p.add_argument("--peer", choices=PEERS, default="vllm",
                   help="the engine beside refserve (refserve: a second one, the control)")
    p.add_argument("--peer-python", default=None,
                   help="python of the vLLM environment that starts the peer (e.g. "
                        "/work/vllm-venv/bin/python, made by scripts/make_vllm_env.sh)")
    p.add_argument("--peer-url", default=None,
                   help="a peer server already running at this URL instead (not stopped)")
    p.add_argument("--peer-args", default="",
                   help="extra flags for the peer server, one quoted string")
    p.add_argument("--peer-kv-cache-gib", type=int, default=1,
                   help="vLLM's KV cache on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)")
    p.add_argument("--refserve-args", default="",
                   help="extra flags for refserve's server, one quoted string")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--repeats", type=int, default=2, help="rounds of every workload")
    p.add_argument("--max-num-seqs", type=int, default=16, help="seats in both engines")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-requests", type=int, default=64, help="throughput: requests")
    p.add_argument("--mean-output", type=int, default=120, help="throughput: mean output")
    p.add_argument("--decode-requests", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--prefix-output", type=int, default=32)
    p.add_argument("--in-process", action="store_true",
                   help="each engine's offline API (LLM.generate) in a worker process, no "
                        "HTTP (--peer-python runs vLLM's; --peer-url does not apply)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /health (vLLM compiles first)")


def apply_quick(args) -> None:
    args.repeats, args.num_requests, args.mean_output = 1, 4, 8
    args.decode_requests, args.decode_tokens = 1, 8
    args.prefix_requests, args.prefix_tokens, args.prefix_output = 4, 64, 4


POSITIVE = ("repeats", "max_num_seqs", "max_model_len", "num_requests", "mean_output",
            "decode_requests", "decode_tokens", "prefix_requests", "prefix_tokens",
            "prefix_output", "startup_timeout", "peer_kv_cache_gib")


def _model_dir(args) -> Path:
    if args.model:
        return Path(args.model)
    from refserve.models.default_model import ensure_default_model

    return Path(ensure_default_model(progress=False))


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def make_requests(workload: str, args, seed: int, vocab_size: int) -> tuple[list[dict], int]:
    """(requests, max in flight) of one workload: prompts are token ids, so both engines get
    the same tokens whatever their tokenizers do with text. Each workload draws from a
    stream of its own: with one stream, the decode prompts would be the shared prefix's
    first tokens, and the prefix would hit their cached blocks."""
    rng = np.random.default_rng((seed, WORKLOADS.index(workload)))
    low = min(1000, vocab_size // 2)       # ordinary tokens, no special ones

    def draw(n: int) -> list[int]:
        return rng.integers(low, vocab_size, size=n).tolist()

    if workload == "throughput":
        w = make_workload(args.num_requests, seed, vocab_size, mean_output=args.mean_output,
                          output_range=(2, max(4, 4 * args.mean_output)))
        return [{"prompt": p, "max_tokens": n} for p, n in zip(w.prompts, w.output_lens)], 0
    if workload == "decode":
        return [{"prompt": draw(32), "max_tokens": args.decode_tokens}
                for _ in range(args.decode_requests)], 1
    prefix = draw(args.prefix_tokens)
    return [{"prompt": prefix + draw(16), "max_tokens": args.prefix_output}
            for _ in range(args.prefix_requests)], 0


def _peer_command(args, model_dir: Path, port: int) -> tuple[list[str], dict]:
    extra = shlex.split(args.peer_args)
    if args.peer == "refserve":
        return refserve_command(port, _refserve_flags(args) + extra), {}
    flags = ["--dtype", "float32", "--max-model-len", str(args.max_model_len),
             "--max-num-seqs", str(args.max_num_seqs), "--enable-prefix-caching",
             "--seed", str(args.seed), *extra]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.peer_kv_cache_gib)}
    return vllm_command(args.peer_python, str(model_dir), port, flags), env


def _refserve_flags(args) -> list[str]:
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
             str(args.max_model_len), "--enable-prefix-caching", "--seed", str(args.seed),
             "--max-waiting", str(max(args.num_requests, args.prefix_requests) + 8)]
    if args.model:
        flags += ["--model", args.model]
    return flags + shlex.split(args.refserve_args)


def _start(stack: ExitStack, args, model_dir: Path) -> list:
    """[refserve, peer] targets, each stopped when `stack` closes."""
    port = free_port()
    mine = stack.enter_context(running("refserve", refserve_command(
        port, _refserve_flags(args)), port, args.startup_timeout))
    if args.peer_url:
        peer = stack.enter_context(given(args.peer, args.peer_url))
    else:
        port = free_port()
        command, env = _peer_command(args, model_dir, port)
        peer = stack.enter_context(running(f"{args.peer}-peer" if args.peer == "refserve"
                                           else args.peer, command, port,
                                           args.startup_timeout, env))
    return [mine, peer]


def _warm_up(target) -> None:
    """One short request, uncounted: first-call costs (lazy imports, compiled graphs) are
    paid before timing starts."""
    reqs = [{"prompt": [1000 + i for i in range(8)], "max_tokens": 4}]
    asyncio.run(send_requests(target.url, target.model, reqs, [0.0], f"warm-up {target.name}"))


def measure(target, workload: str, reqs: list[dict], max_concurrency: int, rnd: int) -> dict:
    """One engine on one workload: the client-side numbers and the server's prefix hits."""
    before = target.metrics()
    recs, wall = asyncio.run(send_requests(
        target.url, target.model, reqs, [0.0] * len(reqs),
        f"{workload} round {rnd} {target.name}", max_concurrency or None))
    after = target.metrics()
    fin = [r for r in recs if r["outcome"] == "finished"]
    tokens = sum(r["tokens"] for r in fin)
    end = max((r["done"] for r in fin), default=wall)
    row = {"workload": workload, "engine": target.name, "round": rnd, "sent": len(recs),
           "finished": len(fin), "output_tokens": tokens, "seconds": end,
           "throughput_tok_s": tokens / end if end > 0 else 0.0}
    for name, values in (("ttft", [r["ttft"] for r in fin]), ("tpot", [r["tpot"] for r in fin]),
                         ("itl", [g for r in fin for g in r["itl"]])):
        for q, v in percentiles(values, (50, 99)).items():
            row[f"{name}_{q}_ms"] = ms(v)
    for key, suffix in (("prefix_hit_tokens", "prefix_cache_hits_total"),
                        ("prefix_queried_tokens", "prefix_cache_queries_total")):
        hi, lo = target.metric_total(suffix, after), target.metric_total(suffix, before)
        row[key] = None if hi is None or lo is None else int(hi - lo)
    errors = sorted({r["error"] for r in recs if r.get("error")})
    if errors:
        row["errors"] = errors[:3]
    return row


def summarise(rows: list[dict], names: tuple[str, str]) -> list[dict]:
    """Per workload and engine: the median over rounds; then refserve / peer of throughput
    (above 1: refserve faster) and of TPOT p50 (below 1: refserve faster)."""
    out = []
    keys = ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
            "itl_p50_ms", "itl_p99_ms", "prefix_hit_tokens", "seconds", "ms_per_token",
            "output_tokens")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        per = {}
        for name in names:
            mine = [r for r in rows if r["workload"] == workload and r["engine"] == name]
            med = {"workload": workload, "engine": name, "rounds": len(mine)}
            for k in keys:
                vals = [r[k] for r in mine if r.get(k) is not None]
                med[k] = statistics.median(vals) if vals else None
            per[name] = med
            out.append(med)
        a, b = per[names[0]], per[names[1]]
        ratio = {"workload": workload, "engine": f"{names[0]} / {names[1]}"}
        for k in ("throughput_tok_s", "tpot_p50_ms", "ttft_p50_ms", "seconds", "ms_per_token"):
            ratio[k] = a[k] / b[k] if a[k] and b[k] else None
        out.append(ratio)
    return out


COLUMNS = [("workload", "workload", ""), ("engine", "engine", ""),
           ("throughput_tok_s", "tok/s", ".1f"), ("ttft_p50_ms", "TTFT p50", ".0f"),
           ("ttft_p99_ms", "p99", ".0f"), ("tpot_p50_ms", "TPOT p50", ".1f"),
           ("tpot_p99_ms", "p99", ".1f"), ("itl_p50_ms", "ITL p50", ".1f"),
           ("itl_p99_ms", "p99", ".1f"), ("prefix_hit_tokens", "prefix hits", ".0f"),
           ("seconds", "s", ".1f")]


OFFLINE_COLUMNS = [("workload", "workload", ""), ("engine", "engine", ""),
                   ("output_tokens", "tokens", ".0f"), ("throughput_tok_s", "tok/s", ".1f"),
                   ("ms_per_token", "ms/token", ".1f"), ("seconds", "s", ".2f")]


RATIO_COLUMNS = [("workload", "workload", ""), ("throughput_tok_s", "tok/s", ".2f"),
                 ("tpot_p50_ms", "TPOT p50", ".2f"), ("ttft_p50_ms", "TTFT p50", ".2f"),
                 ("ms_per_token", "ms/token", ".2f"), ("seconds", "s", ".2f")]


def _engine_notes(target) -> list[str]:
    if target.log is None or not target.log.exists():
        return [f"{target.name}: given by URL {target.url}"]
    lines = target.log.read_text(errors="replace").splitlines()
    return [f"{target.name}: {line.strip()[:400]}" for line in lines if LOG_NOTES.search(line)]


def run(args) -> dict:
    if args.peer_url and args.peer_python:
        raise ValueError("give --peer-python (start vLLM here) or --peer-url (one running), "
                         "not both")
    if args.peer == "vllm" and not (args.peer_python or args.peer_url):
        raise ValueError("--peer vllm needs --peer-python (the vLLM environment's python, "
                         "made by scripts/make_vllm_env.sh) or --peer-url")
    if args.peer_python and not Path(args.peer_python).exists():
        raise ValueError(f"--peer-python {args.peer_python}: no such file (make the vLLM "
                         "environment with scripts/make_vllm_env.sh)")
    if args.in_process and args.peer_url:
        raise ValueError("--in-process runs each engine's offline API; --peer-url names a "
                         "server: give --peer-python instead")
    model_dir = _model_dir(args)
    vocab = _vocab_size(model_dir)
    rows: list[dict] = []
    load = {"before": os.getloadavg()}     # another job on the cores changes everything
    with ExitStack() as stack:
        if args.in_process:
            from refserve.bench import offline

            targets = offline.workers(stack, args, model_dir,
                                      {"VLLM_CPU_KVCACHE_SPACE": str(args.peer_kv_cache_gib)})
        else:
            targets = _start(stack, args, model_dir)
            for t in targets:
                _warm_up(t)
        names = (targets[0].name, targets[1].name)
        for rnd in range(args.repeats):
            order = targets if rnd % 2 == 0 else targets[::-1]
            for workload in args.workloads:
                reqs, concurrency = make_requests(workload, args, args.seed + rnd, vocab)
                for t in order:
                    rows.append(offline.measure(t, workload, reqs, rnd) if args.in_process
                                else measure(t, workload, reqs, concurrency, rnd))
        notes = [] if args.in_process else [n for t in targets for n in _engine_notes(t)]
    load["after"] = os.getloadavg()
    summary = summarise(rows, names)
    columns = OFFLINE_COLUMNS if args.in_process else COLUMNS
    print("\nevery round:")
    print_table(rows, [("round", "round", "d"), *columns])
    print("\nmedian over rounds:")
    print_table([r for r in summary if "rounds" in r], columns)
    print(f"\n{names[0]} / {names[1]} (tok/s above 1, the times below 1: {names[0]} ahead):")
    print_table([r for r in summary if "rounds" not in r], RATIO_COLUMNS)
    print("\nhow each engine ran (from its log):")
    for n in notes:
        print("  " + n)
    print("load average (1, 5, 15 min) before / after: " + " / ".join(
        ", ".join(f"{x:.2f}" for x in load[k]) for k in ("before", "after")))
    lost = [r for r in rows if r["finished"] != r["sent"]]
    print("every request finished" if not lost else
          f"UNFINISHED requests: {[(r['workload'], r['engine'], r.get('errors')) for r in lost]}")
    return {"rows": rows, "summary": summary, "engine_notes": notes,
            "engines": list(names), "load_average": load,
            "mode": "in-process" if args.in_process else "served"}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    summary = [r for r in result["summary"] if "rounds" in r]
    workloads = list(dict.fromkeys(r["workload"] for r in summary))
    engines = result["engines"]
    panels = (("throughput_tok_s", "output tokens / s (higher is better)"),
              ("tpot_p50_ms", "TPOT p50, ms (lower is better)"),
              ("ttft_p50_ms", "TTFT p50, ms (lower is better)"))
    if result.get("mode") == "in-process":       # no per-request times offline
        panels = (("throughput_tok_s", "output tokens / s (higher is better)"),
                  ("seconds", "seconds per workload (lower is better)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    width = 0.8 / len(engines)
    for ax, (key, title) in zip(axes, panels):
        for j, engine in enumerate(engines):
            vals = [next((r[key] for r in summary if r["workload"] == w
                          and r["engine"] == engine), None) or 0.0 for w in workloads]
            ax.bar(np.arange(len(workloads)) + j * width, vals, width, label=engine)
        ax.set_xticks(np.arange(len(workloads)) + width * (len(engines) - 1) / 2)
        ax.set_xticklabels(workloads, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    save_figure(fig, result, path)
