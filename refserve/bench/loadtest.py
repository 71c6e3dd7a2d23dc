"""`loadtest`: the OpenAI-compatible server under Poisson traffic, over real sockets.

`python -m refserve.serve` is started in its own process on a free loopback port; with
`--url`, any OpenAI-compatible server already running (vLLM's, refserve's, another) is driven
instead, as vLLM's own serving benchmark does. For each request rate, N streaming completions
are sent at Poisson arrival times (seeded), and every number is measured on the client side,
as a user would see it:
    TTFT        first text chunk received - request sent
    TPOT        (last chunk - first chunk) / (output tokens - 1)
    ITL         the gaps between consecutive text chunks (one per token when the server
                streams every token)
    throughput  output tokens / (last response done - first request sent)
    goodput     requests/s that met both SLOs (TTFT <= --slo-ttft and TPOT <= --slo-tpot)
    $ / 1M      --usd-per-hour / 3600 / throughput x 1e6 (the machine rented by the hour)
Every request has one outcome: finished (all its tokens), rejected (503, the waiting
queue was full) or failed (anything else); finished + rejected + failed == sent.

What is sent: `--workload corpus` (the default), questions about the bundled corpus with
exponential output lengths; or the workloads of vLLM's benchmarks, the same descriptions
`python -m refserve.simulate` takes (refserve/benchmark_datasets.py), sent as token-id
prompts: `random` (--input-len, --output-len, --range-ratio), `sharegpt` (the built-in
ShareGPT-like lengths) or `--dataset-path FILE` (a ShareGPT JSON or a vLLM result JSON). A
rate of `inf` sends every request at once (offline).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from refserve import benchmark_datasets as datasets
from refserve.bench.common import ms, percentiles, print_table, pyplot, save_figure
from refserve.bench.corpus import PARAGRAPHS, QUESTIONS
from refserve.bench.servers import free_port, given, refserve_command, running
from refserve.bench.workloads import poisson_arrivals
from refserve.benchmark_datasets import DATASETS

HELP = "the HTTP server under Poisson load: TTFT/TPOT percentiles, goodput, $/1M tokens"


def add_arguments(p) -> None:
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0],
                   help="request rates to sweep (requests / s)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate")
    p.add_argument("--workload", "--dataset-name", default=None,
                   choices=("corpus", *DATASETS),
                   help="corpus (the default): questions about the bundled text; random / "
                   "sharegpt: vLLM's benchmark lengths, as token-id prompts (--input-len, "
                   "--output-len or --range-ratio imply random, --dataset-path a file's "
                   "lengths)")
    datasets.add_random_arguments(p)
    p.add_argument("--dataset-path", type=Path, default=None, metavar="JSON",
                   help="lengths from a ShareGPT JSON or a vLLM benchmark result JSON")
    p.add_argument("--mean-output", type=int, default=None,
                   help="corpus: mean output tokens (default 64)")
    p.add_argument("--max-paragraphs", type=int, default=None,
                   help="corpus: each prompt has 0..this many corpus paragraphs, then a "
                   "question (default 2)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="seconds per output token")
    p.add_argument("--usd-per-hour", type=float, default=0.10,
                   help="what the machine costs per hour (default: a small cloud CPU VM)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-waiting", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--url", default=None,
                   help="drive the OpenAI-compatible server at this URL (e.g. a vLLM server: "
                        "http://127.0.0.1:8000) instead of starting refserve's; the model is "
                        "the first one it lists at /v1/models")


# The flags that describe one workload each: a flag implies its workload, and one of
# another workload than the chosen one is an error (benchmark_datasets.resolve_workload).
WORKLOAD_FLAGS = {"random": tuple(datasets.RANDOM_FLAGS), "dataset": ("dataset_path",),
                  "corpus": ("mean_output", "max_paragraphs")}
CORPUS_DEFAULTS = {"mean_output": 64, "max_paragraphs": 2}


def resolve_workload_args(args) -> None:
    """The workload the flags ask for, and their defaults (ValueError: a flag that would
    change nothing)."""
    given = {f: getattr(args, f) for flags in WORKLOAD_FLAGS.values() for f in flags
             if getattr(args, f) is not None}
    args.workload = datasets.resolve_workload(args.workload, "corpus", given, WORKLOAD_FLAGS)
    for name, default in (*datasets.RANDOM_FLAGS.items(), *CORPUS_DEFAULTS.items()):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.mean_output <= 0 or args.max_paragraphs < 0:
        raise ValueError("--mean-output must be > 0 and --max-paragraphs >= 0")


def apply_quick(args) -> None:
    args.rates, args.num_requests = [1.0, 4.0], 4
    if args.workload in (None, "corpus") and args.dataset_path is None and all(
            getattr(args, f) is None for f in datasets.RANDOM_FLAGS):
        args.mean_output, args.max_paragraphs = 6, 0


POSITIVE = ("rates", "num_requests", "slo_ttft", "slo_tpot", "max_num_seqs", "max_waiting")


# Token ids of the length workloads' prompts: ordinary ids of any byte-level vocabulary
# (above the special tokens, below the smallest test model's 97).
PROMPT_IDS = (20, 90)


def length_requests(args, n: int, seed: int) -> list[dict] | None:
    """The random / sharegpt / dataset workloads as token-id prompts (None: corpus)."""
    rng = np.random.default_rng(seed)
    if args.dataset_path is not None:
        prompts, outputs = datasets.file_lengths(args.dataset_path, rng, n)
    elif args.workload == "random":
        prompts, outputs = datasets.random_lengths(rng, n, args.input_len, args.output_len,
                                                   args.range_ratio)
    elif args.workload == "sharegpt":
        prompts, outputs = datasets.sharegpt_lengths(rng, n)
    else:
        return None
    return [{"prompt": rng.integers(*PROMPT_IDS, int(p)).tolist(), "max_tokens": int(o)}
            for p, o in zip(prompts, outputs)]


def _requests(n: int, mean_output: int, max_paragraphs: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        paragraphs = rng.choice(len(PARAGRAPHS), size=int(rng.integers(0, max_paragraphs + 1)),
                                replace=False)
        context = "".join(PARAGRAPHS[j] + "\n\n" for j in paragraphs)
        prompt = f"{context}Question: {QUESTIONS[int(rng.integers(len(QUESTIONS)))]}\nAnswer:"
        max_tokens = int(np.clip(round(rng.exponential(mean_output)), 2, 4 * mean_output))
        out.append({"prompt": prompt, "max_tokens": max_tokens})
    return out


async def stream_completion(client, url: str, model: str, req: dict, delay: float,
                            t0: float) -> dict:
    """Send one streaming completion `delay` s after `t0` (req: "prompt", text or token ids,
    and "max_tokens"; greedy, EOS ignored) and time it as the client sees it."""
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    rec = {"sent": sent - t0, "max_tokens": req["max_tokens"], "outcome": "failed",
           "ttft": None, "tpot": None, "tokens": 0, "itl": []}
    first = last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code == 503:
                rec["outcome"] = "rejected"
                return rec
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}"
                return rec
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["error"] = chunk["error"]["message"]
                    return rec
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if last is not None:
                        rec["itl"].append(now - last)
                    last = now
                    first = first or last
        if done and rec["tokens"] == req["max_tokens"]:
            rec["outcome"] = "finished"
            rec["done"] = time.perf_counter() - t0
            if first is not None:
                rec["ttft"] = first - sent
                if rec["tokens"] > 1:
                    rec["tpot"] = (last - first) / (rec["tokens"] - 1)
        else:
            rec["error"] = f"stream ended with {rec['tokens']}/{req['max_tokens']} tokens"
    except Exception as e:  # noqa: BLE001 - a lost request is a result, not a crash
        rec["error"] = repr(e)
    return rec


async def send_requests(url: str, model: str, reqs: list[dict], arrivals: list[float],
                        desc: str, max_concurrency: int | None = None
                        ) -> tuple[list[dict], float]:
    """Send every request at its arrival time (s after the start); with `max_concurrency`,
    a request also waits until fewer than that many are in flight (1: one after another).
    Returns the per-request records and the wall time."""
    import httpx

    bar = tqdm(total=len(reqs), desc=desc, unit="req")
    limits = httpx.Limits(max_connections=len(reqs) + 8)
    seats = asyncio.Semaphore(max_concurrency or len(reqs))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def tracked(req, delay):
            async with seats:
                rec = await stream_completion(client, url, model, req, delay, t0)
            bar.update(1)
            return rec

        recs = await asyncio.gather(*(tracked(r, d) for r, d in zip(reqs, arrivals)))
        wall = time.perf_counter() - t0
    bar.close()
    return recs, wall


def _summarise(rate: float, recs: list[dict], wall: float, args) -> dict:
    fin = [r for r in recs if r["outcome"] == "finished"]
    tokens = sum(r["tokens"] for r in fin)
    end = max((r["done"] for r in fin), default=wall)
    throughput = tokens / end if end > 0 else 0.0
    good = [r for r in fin if r["ttft"] is not None and r["ttft"] <= args.slo_ttft
            and (r["tpot"] is None or r["tpot"] <= args.slo_tpot)]
    ttft, tpot = percentiles([r["ttft"] for r in fin]), percentiles([r["tpot"] for r in fin])
    itl = percentiles([gap for r in fin for gap in r["itl"]])
    row = {"rate": rate, "sent": len(recs), "finished": len(fin),
           "rejected": sum(r["outcome"] == "rejected" for r in recs),
           "failed": sum(r["outcome"] == "failed" for r in recs),
           "output_tokens": tokens, "seconds": end, "throughput_tok_s": throughput,
           "requests_per_s": len(fin) / end if end > 0 else 0.0,
           "goodput_req_s": len(good) / end if end > 0 else 0.0,
           "slo_attained": len(good) / len(recs),
           "usd_per_1m_output_tokens": (args.usd_per_hour / 3600 / throughput * 1e6
                                        if throughput > 0 else None)}
    for name, p in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q, v in p.items():
            row[f"{name}_{q}_ms"] = ms(v)
    errors = sorted({r["error"] for r in recs if r.get("error")})
    if errors:
        row["errors"] = errors[:5]
    return row


def _serve_args(args) -> list[str]:
    extra = ["--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting)]
    if args.model:
        extra += ["--model", args.model]
    if getattr(args, "trace", None) is not None:
        extra += ["--trace", str(args.trace)]
    return extra


def _server(args):
    """The server under test: the one at --url, else refserve's, started here."""
    if args.url:
        return given("server", args.url)
    port = free_port()
    return running("refserve", refserve_command(port, _serve_args(args)), port,
                   args.startup_timeout)


def run(args) -> dict:
    resolve_workload_args(args)
    if args.url and getattr(args, "trace", None) is not None:
        raise ValueError("--trace records the server this bench starts; with --url, trace "
                         "the server where it runs")
    rows = []
    with _server(args) as target:
        for i, rate in enumerate(args.rates):
            reqs = length_requests(args, args.num_requests, args.seed + i) or _requests(
                args.num_requests, args.mean_output, args.max_paragraphs, args.seed + i)
            arrivals = poisson_arrivals(args.num_requests, rate, args.seed + i)
            recs, wall = asyncio.run(send_requests(target.url, target.model, reqs, arrivals,
                                                   f"rate {rate:g} req/s"))
            row = _summarise(rate, recs, wall, args)
            row["server_preemptions_total"] = target.metric_total("num_preemptions_total")
            rows.append(row)
    proc = target.proc
    if getattr(args, "trace", None) is not None:
        written = args.trace.exists() and proc.returncode == 0
        print(f"trace: {args.trace} (the server's; open it in https://ui.perfetto.dev)"
              if written else f"trace: the server did not write {args.trace} "
              f"(exit code {proc.returncode})")
    print()
    print_table(rows, [("rate", "req/s in", "g"), ("sent", "sent", "d"),
                       ("finished", "finished", "d"), ("rejected", "rejected", "d"),
                       ("failed", "failed", "d"), ("throughput_tok_s", "tok/s", ".1f"),
                       ("goodput_req_s", "goodput req/s", ".2f"),
                       ("slo_attained", "in SLO", ".0%"),
                       ("ttft_p50_ms", "TTFT p50", ".0f"), ("ttft_p90_ms", "p90", ".0f"),
                       ("ttft_p99_ms", "p99", ".0f"), ("tpot_p50_ms", "TPOT p50", ".0f"),
                       ("tpot_p90_ms", "p90", ".0f"), ("tpot_p99_ms", "p99", ".0f"),
                       ("usd_per_1m_output_tokens", "$/1M tok", ".2f")])
    print(f"SLO: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s; "
          f"${args.usd_per_hour}/hour")
    lost = [r for r in rows if r["finished"] + r["rejected"] + r["failed"] != r["sent"]]
    print("every request accounted for" if not lost else f"LOST requests at {lost}")
    return {"rows": rows, "slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot,
            "usd_per_hour": args.usd_per_hour}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    rates = [r["rate"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("ttft_p50_ms", "TTFT p50", "o-"), ("ttft_p99_ms", "TTFT p99",
                                                                    "o--"),
                              ("tpot_p50_ms", "TPOT p50", "s-"), ("tpot_p99_ms", "TPOT p99",
                                                                    "s--")):
        a.plot(rates, [r[key] for r in rows], style, label=label)
    a.axhline(1000 * result["slo_ttft_s"], color="tab:red", lw=0.8, label="TTFT SLO")
    a.axhline(1000 * result["slo_tpot_s"], color="tab:purple", lw=0.8, label="TPOT SLO")
    a.set_yscale("log")
    a.set_xlabel("offered load (requests / s)")
    a.set_ylabel("ms (client side)")
    a.set_title("Latency vs load: the knee")
    a.legend(fontsize=7)
    b.plot(rates, [r["throughput_tok_s"] for r in rows], "o-", label="throughput (tok/s)")
    b2 = b.twinx()
    b2.plot(rates, [r["goodput_req_s"] for r in rows], "s--", color="tab:green",
            label="goodput (req/s in SLO)")
    b.set_xlabel("offered load (requests / s)")
    b.set_ylabel("output tokens / s")
    b2.set_ylabel("requests / s meeting the SLO")
    b.set_title("Throughput and goodput")
    b.legend(loc="upper left", fontsize=7)
    b2.legend(loc="lower right", fontsize=7)
    save_figure(fig, result, path)
