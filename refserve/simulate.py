"""`python -m refserve.simulate`: one serving configuration at GPU scale, simulated.

    python -m refserve.simulate --model llama-3-8b --gpu h100-80gb --workload chat \\
        --rate 8 --num-requests 2000 --max-num-seqs 256 --json --plot --trace

refserve's real Scheduler and KVCacheManager run on a virtual clock; each step costs what
the roofline cost model says it costs on the GPU (refserve/simulator/). It prints the
assumptions (every GPU number with its source), the real engine's summary line, latency
percentiles and the cost per million output tokens. --json writes every number, --plot a
chart (batch and queue, KV blocks, TTFT and TPOT distributions), --trace a Chrome
trace-event timeline (https://ui.perfetto.dev).

The engine flags are the engine's own (refserve/entrypoints/engine_args.py: vLLM's names),
with its defaults; where a default depends on the backend (the token budget and the
prefill cap), a GPU profile stands for the CuPy backend (vLLM's defaults) and
`--gpu this-machine` for the tuned CPU backend.

A mistake is one `error: ...` line, exit status 2, found before the simulation starts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from refserve.bench.common import print_table
from refserve.benchmark_datasets import RANDOM_FLAGS, add_random_arguments, resolve_workload
from refserve.capacity import KV_CACHE_DTYPES, QUANTIZATIONS
from refserve.config import EngineConfig
from refserve.entrypoints.cli_common import (
    EXIT_USAGE,
    ArgumentParser,
    CLIError,
    RawDescriptionHelpFormatter,
    check_output_path,
)
from refserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from refserve.simulator.engine_overheads import DEFAULT_ENGINE, engine_names
from refserve.simulator.report import downsample, latency_table, plot, usd_per_million

DEFAULT_OUT = {"json": "simulate.json", "plot": "simulate.png", "trace": "simulate.trace.json"}


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _assignment(text: str) -> tuple[str, float]:
    key, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected FIELD=NUMBER, e.g. memory_bandwidth=3.0e12") from None


def add_hardware_args(p: argparse.ArgumentParser) -> None:
    from refserve.simulator.workload import ARRIVALS, WORKLOADS

    h = p.add_argument_group("what is simulated (refserve's own)")
    h.add_argument("--model", default="llama-3-8b", help="a preset (llama-3-8b, llama-3-70b, "
                   "smollm2-135m) or an HF folder / config.json")
    h.add_argument("--gpu", default="h100-80gb", help="h100-80gb, h200-141gb, a100-80gb, "
                   "l4, rtx-4090, this-machine (measured now by the roofline bench), or a "
                   "profile of --hardware")
    h.add_argument("--hardware", type=Path, metavar="FILE", help="TOML/JSON GPU profiles "
                   "(the layout of refserve/simulator/gpus.toml); may override built-in ones")
    h.add_argument("--gpu-set", type=_assignment, action="append", default=[],
                   metavar="FIELD=NUMBER", help="override one number of the GPU profile, e.g. "
                   "memory_bandwidth=3.0e12 or peak_flops.bfloat16=8e14 (repeatable)")
    h.add_argument("--usd-per-hour", type=_positive_float, default=None,
                   help="price of one GPU per hour (default: the profile's assumption)")
    w = p.add_argument_group("workload (refserve's own names; the random / sharegpt "
                             "flags are vLLM's benchmark's)")
    w.add_argument("--workload", "--dataset-name", default=None, choices=WORKLOADS,
                   help="default chat; random: --input-len / --output-len / --range-ratio "
                   "(any of them implies random, as in vLLM's throughput benchmark); "
                   "sharegpt: the built-in ShareGPT-like lengths; dataset: --dataset-path "
                   "(refserve/benchmark_datasets.py)")
    add_random_arguments(w)
    w.add_argument("--dataset-path", type=Path, default=None, metavar="JSON",
                   help="lengths from a ShareGPT-format JSON or a vLLM benchmark result "
                   "JSON on disk (implies --workload dataset)")
    w.add_argument("--tokenizer", type=Path, default=None, metavar="TOKENIZER_JSON",
                   help="a tokenizer.json that counts a ShareGPT file's tokens (default: "
                   "4 characters per token)")
    w.add_argument("--replay", type=Path, metavar="JSONL", help="replay a trace instead of "
                   "--workload: {\"timestamp\": s, \"prompt_tokens\": n, \"output_tokens\": m} "
                   "per line (see refserve/simulator/workload.py)")
    w.add_argument("--arrival", default=None, choices=ARRIVALS, help="default poisson")
    w.add_argument("--burstiness", type=_positive_float, default=None,
                   help="--arrival bursty: coefficient of variation of the gaps (default 4)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload")


# Engine flags the simulator gives a meaning of its own, declared here, not taken from
# entrypoints/engine_args.py: --model names a preset or a config.json (a model's shape, no
# weights), --seed seeds the workload and the accept draws, --tensor-parallel-size
# simulates that many GPUs (the engine runs on one), and no --backend: the --gpu profile
# stands for one (simulator/engine.py: simulated_backend), whose defaults apply.
OWN_MEANING = ("model", "seed", "tensor_parallel_size", "backend")
# The engine knobs plan searches (its own comma-separated flags of the same names).
SEARCHED = ("max_num_seqs", "max_num_batched_tokens", "block_size", "gpu_memory_utilization",
            "enable_prefix_caching")


def add_simulator_args(p: argparse.ArgumentParser, search: bool = False) -> None:
    """The engine's flags (entrypoints/engine_args.py, all but OWN_MEANING) and the
    simulated engine's own: precision, host costs, multi-step, speculation's α. `search`:
    plan's, which declares the knobs it searches itself (as comma-separated lists)."""
    add_engine_args(p, exclude=OWN_MEANING + (SEARCHED if search else ()))
    v = p.add_argument_group("simulated engine: vLLM's names beyond refserve's engine")
    if not search:
        v.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="GPUs the model is sharded over (the simulated ones)")
        v.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="fp8: one byte per weight, GEMMs at the profile's fp8 peak")
        v.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="fp8: one byte per cached K/V element (the pool holds twice "
                       "the tokens)")
    v.add_argument("--num-scheduler-steps", type=int, default=1, metavar="N",
                   help="vLLM V0's multi-step scheduling: one scheduler call, then N decode "
                   "steps of the same batch; new requests wait for the round to end and a "
                   "round's tokens reach the client together (refserve/simulator/"
                   "multi_step.py)")
    r = p.add_argument_group("simulated engine: refserve's own")
    r.add_argument("--engine", default=DEFAULT_ENGINE, choices=engine_names(),
                   help="whose host costs to price (scheduling, sampling, launches): an "
                   "entry of refserve/simulator/engines.toml")
    r.add_argument("--served", action="store_true",
                   help="price an HTTP front end streaming every token (a served run, as "
                   "vLLM's benchmark_serving measures)")
    r.add_argument("--spec-alpha", type=float, default=0.7, metavar="ALPHA",
                   help="with --speculative-config: α, the probability that each draft is "
                   "accepted (per token; the printed draft acceptance rate, accepted / "
                   "proposed, is lower), for requests whose workload sets none (refserve/simulator/"
                   "outputs.py)")


def engine_config(args, **overrides) -> EngineConfig:
    """The EngineConfig of the parsed engine flags (plus `overrides`); a bad value is a
    CLIError. The budget left None is the backend's the profile stands for."""
    try:
        return engine_config_from_args(args, exclude=OWN_MEANING, **overrides)
    except ValueError as e:
        raise CLIError(str(e)) from None


def load_hardware(args):
    """(ModelShape, GpuProfile) from --model / --gpu / --hardware / --gpu-set."""
    from refserve.simulator.hardware import (
        THIS_MACHINE,
        apply_overrides,
        host_profile,
        load_gpu,
        load_model,
    )

    overrides = dict(args.gpu_set)
    if args.usd_per_hour is not None:
        overrides["usd_per_hour"] = args.usd_per_hour
    try:
        model = load_model(args.model)
        if args.gpu == THIS_MACHINE:
            from refserve.bench.roofline import measure_ceilings

            print("measuring this machine (float32 matmul, array copy)...", file=sys.stderr,
                  flush=True)
            gpu = apply_overrides(host_profile(measure_ceilings(1024, 128)), overrides)
        else:
            gpu = load_gpu(args.gpu, args.hardware, overrides)
    except ValueError as e:
        raise CLIError(str(e)) from None
    return model, gpu


def make_requests(args, model, max_model_len: int, rate: float, seed: int | None = None,
                  num_requests: int | None = None):
    from refserve.simulator.workload import load_trace, make_workload

    seed = args.seed if seed is None else seed
    try:
        if args.replay is not None:
            return load_trace(args.replay, vocab_size=model.vocab_size,
                              max_model_len=max_model_len, seed=seed,
                              rate=None if math.isinf(rate) else rate)
        return make_workload(workload_name(args), num_requests or args.num_requests, rate,
                             vocab_size=model.vocab_size, max_model_len=max_model_len,
                             seed=seed, arrival=args.arrival, burstiness=args.burstiness,
                             input_len=args.input_len, output_len=args.output_len,
                             range_ratio=args.range_ratio, dataset_path=args.dataset_path,
                             count_tokens=token_counter(args.tokenizer))
    except ValueError as e:
        raise CLIError(str(e)) from None


# The flags that describe one workload each (a flag implies its workload, and a flag of
# another workload than the one chosen is an error: benchmark_datasets.resolve_workload).
WORKLOAD_FLAGS = {"random": tuple(RANDOM_FLAGS), "dataset": ("dataset_path", "tokenizer")}
DEFAULT_WORKLOAD = "chat"
DEFAULT_RATE = 8.0


def resolve_workload_args(args, rate: float | None = None) -> None:
    """Check the workload flags of simulate / plan and fill in their defaults: a flag that
    would change nothing is one `error:` line, never ignored. `rate`: simulate's --rate
    (plan searches the rate)."""
    given = {f: getattr(args, f) for flags in WORKLOAD_FLAGS.values() for f in flags
             if getattr(args, f, None) is not None}
    if args.replay is not None:
        stray = [f for f in ("workload", "arrival", "burstiness", *given)
                 if getattr(args, f, None) is not None]
        if getattr(args, "num_requests_given", False):
            stray.append("num_requests")
        if stray:
            names = ", ".join("--" + f.replace("_", "-") for f in stray)
            raise CLIError(f"--replay takes the requests, their lengths and their arrival "
                           f"times from the trace; {names} would change nothing: drop it")
    else:
        try:
            args.workload = resolve_workload(args.workload, DEFAULT_WORKLOAD, given,
                                             WORKLOAD_FLAGS)
        except ValueError as e:
            raise CLIError(str(e)) from None
    if getattr(args, "tokenizer", None) is not None and args.dataset_path is None:
        raise CLIError("--tokenizer counts the tokens of a --dataset-path file's text; give "
                       "--dataset-path or drop --tokenizer")
    if args.burstiness is not None and args.arrival != "bursty":
        raise CLIError("--burstiness shapes --arrival bursty; add --arrival bursty or drop "
                       "--burstiness")
    if args.arrival == "bursty" and rate is not None and math.isinf(rate):
        raise CLIError("--arrival bursty needs a finite --rate (inf sends every request at "
                       "t = 0, with no gaps to shape)")
    for name, default in (*RANDOM_FLAGS.items(), ("arrival", "poisson"),
                          ("burstiness", 4.0)):
        if getattr(args, name) is None:
            setattr(args, name, default)


def workload_name(args) -> str:
    return args.workload


def token_counter(path: Path | None):
    """len(ids) of a tokenizer.json's encoding, or None (4 characters per token)."""
    if path is None:
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's mistake
        raise CLIError(f"--tokenizer {path}: cannot load a tokenizer.json ({e})") from None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def build_engine(model, gpu, config: EngineConfig, tensor_parallel_size: int,
                 spec_alpha: float = 0.7, seed: int = 0, *, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", engine: str = DEFAULT_ENGINE,
                 served: bool = False, num_scheduler_steps: int = 1):
    from refserve.simulator.engine import SimulatedEngine

    try:
        return SimulatedEngine(model, gpu, config, tensor_parallel_size=tensor_parallel_size,
                               spec_alpha=spec_alpha, spec_seed=seed,
                               quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                               engine=engine, served=served,
                               num_scheduler_steps=num_scheduler_steps)
    except (ValueError, NotImplementedError) as e:
        raise CLIError(str(e)) from None


def check_out_paths(args) -> None:
    for name in ("json", "plot", "trace"):
        path = getattr(args, name, None)
        if path is not None:
            check_output_path(path, f"--{name}")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m refserve.simulate", description=__doc__,
                       formatter_class=RawDescriptionHelpFormatter)
    add_hardware_args(p)
    w = p.add_argument_group("load")
    w.add_argument("--rate", type=_positive_float, default=None,
                   help="requests per second (inf: all at t = 0; default 8); with --replay, "
                   "rescales the trace's timestamps to this mean rate")
    w.add_argument("--num-requests", type=int, default=None, help="default 1000")
    w.add_argument("--slo-ttft", type=_positive_float, default=None, metavar="SECONDS",
                   help="with --slo-tpot: report goodput (requests/s within both SLOs)")
    w.add_argument("--slo-tpot", type=_positive_float, default=None, metavar="SECONDS")
    add_simulator_args(p)
    o = p.add_argument_group("output")
    for name, help_ in (("json", "every number"), ("plot", "a PNG chart"),
                        ("trace", "Chrome trace-event JSON (Perfetto, chrome://tracing)")):
        o.add_argument(f"--{name}", type=Path, nargs="?", const=Path(DEFAULT_OUT[name]),
                       default=None, metavar="PATH",
                       help=f"{help_} (default path {DEFAULT_OUT[name]})")
    o.add_argument("--no-progress", action="store_true")
    return p


def prepare(args):
    """Everything a run needs from the parsed flags, each checked before it starts: the
    workload's defaults filled in, the model, the GPU, the simulated engine and its requests.
    Returns (model, gpu, config, engine, requests); a mistake is a CLIError."""
    args.num_requests_given = args.num_requests is not None
    if args.rate is None and args.replay is None:
        args.rate = DEFAULT_RATE
    resolve_workload_args(args, args.rate)
    if args.num_requests is None:
        args.num_requests = 1000
    if args.num_requests < 1:
        raise CLIError(f"--num-requests {args.num_requests}: must be >= 1")
    model, gpu = load_hardware(args)
    config = engine_config(args)
    engine = build_engine(model, gpu, config, args.tensor_parallel_size, args.spec_alpha,
                          args.seed, quantization=args.quantization,
                          kv_cache_dtype=args.kv_cache_dtype, engine=args.engine,
                          served=args.served,
                          num_scheduler_steps=args.num_scheduler_steps)
    requests = make_requests(args, model, engine.max_model_len,
                             math.inf if args.rate is None else args.rate)
    try:
        engine.check_requests(requests)
    except ValueError as e:
        raise CLIError(str(e)) from None
    return model, gpu, config, engine, requests


def run(args) -> int:
    check_out_paths(args)
    model, gpu, config, engine, requests = prepare(args)
    from refserve.simulator.trace import TraceRecorder

    print(f"model: {model.name} ({model.total_params / 1e9:.2f}B params, {engine.dtype})")
    for line in gpu.describe(engine.cost_model.gemm_dtype):
        print(line)
    print(engine.describe())
    print(engine.cost_model.describe())
    source = f"replay of {args.replay}" if args.replay else (
        f"{workload_name(args)}, {args.arrival} arrivals at {args.rate:g} req/s")
    rate_text = "the trace's times" if args.rate is None else f"{args.rate:g} req/s"
    print(f"workload: {len(requests)} requests, {source}, seed {args.seed}", flush=True)
    recorder = TraceRecorder() if args.trace is not None else None
    t0 = time.perf_counter()
    result = engine.run(requests, progress=not args.no_progress, recorder=recorder)
    wall = time.perf_counter() - t0
    s = result.summary
    print(f"summary: {s.format()}")
    rows = latency_table(result)
    print_table(rows, [("metric", "", ""), ("p50", "p50 ms", ".1f"), ("p90", "p90 ms", ".1f"),
                       ("p99", "p99 ms", ".1f"), ("max", "max ms", ".1f")])
    total_price = gpu.usd_per_hour * args.tensor_parallel_size
    cost = usd_per_million(total_price, s.output_tokens_per_s)
    goodput = None
    if args.slo_ttft is not None and args.slo_tpot is not None:
        good = [m for m in result.metrics.values() if m.ttft is not None
                and m.ttft <= args.slo_ttft and (m.tpot is None or m.tpot <= args.slo_tpot)]
        goodput = len(good) / s.elapsed if s.elapsed > 0 else 0.0
        print(f"goodput: {goodput:.2f} req/s within TTFT <= {args.slo_ttft} s and TPOT <= "
              f"{args.slo_tpot} s ({len(good)}/{len(result.metrics)} requests)")
    print(f"cost: {args.tensor_parallel_size} x ${gpu.usd_per_hour:.2f}/hour -> "
          + ("-" if cost is None else f"${cost:.3f} per 1M output tokens"))
    print(f"simulated {s.elapsed:.1f} s in {wall:.1f} s wall: {result.num_steps} steps, "
          f"{result.num_steps / wall:.0f} steps/s")
    report = {
        "command": "python -m refserve.simulate " + " ".join(sys.argv[1:]),
        "model": vars(model), "gpu": vars(gpu), "dtype": engine.dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "cost_model": vars(engine.cost_model.eff),
        "config": {k: getattr(config, k) for k in (
            "max_num_seqs", "max_num_batched_tokens", "block_size", "gpu_memory_utilization",
            "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "batching",
            "kv_cache_layout")},
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "engine": args.engine, "served": args.served,
        "num_scheduler_steps": args.num_scheduler_steps,
        "speculative_config": (None if config.speculative_config is None
                               else vars(config.speculative_config)),
        "spec_alpha": args.spec_alpha if config.speculative_config is not None else None,
        "num_blocks": engine.num_blocks, "max_model_len": engine.max_model_len,
        "workload": {"name": None if args.replay else workload_name(args),
                     "replay": None if args.replay is None else str(args.replay),
                     "rate": args.rate, "arrival": args.arrival, "seed": args.seed,
                     "num_requests": len(requests)},
        "summary": s.to_dict(), "latency_ms": rows, "goodput_req_s": goodput,
        "usd_per_1m_output_tokens": cost, "wall_seconds": wall,
        "num_steps": result.num_steps, "steps_per_second": result.num_steps / wall,
        "requests": [{"request_id": rid, **m.to_dict()} for rid, m in result.metrics.items()],
        "timeline": downsample(result.timeline, 2000)}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"numbers written to {args.json}")
    if args.plot is not None:
        title = (f"{model.name} on {args.tensor_parallel_size} x {gpu.name} | "
                 f"{'replay' if args.replay else workload_name(args)} at {rate_text}")
        plot(result, engine, args.plot, title, args.slo_ttft, args.slo_tpot)
        print(f"plot written to {args.plot}")
    if recorder is not None:
        recorder.write(args.trace)
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    return 0


def run_cli(parser: argparse.ArgumentParser, run_args, argv: list[str] | None) -> int:
    """Parse, run; a CLIError is one `error:` line and exit status 2 (simulate and plan)."""
    args = parser.parse_args(argv)
    try:
        return run_args(args)
    except CLIError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
