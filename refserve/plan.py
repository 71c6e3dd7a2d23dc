"""`python -m refserve.plan`: which configuration serves this workload within the SLOs, at
what rate, for how many dollars; and the `vllm serve` line that runs it.

    python -m refserve.plan --model llama-3-8b --gpu h100-80gb --workload chat \\
        --slo-ttft-p99 2s --slo-tpot-p99 100ms --tensor-parallel-size 1,2,4,8

For each tensor-parallel degree it searches max_num_seqs, max_num_batched_tokens,
block_size, gpu_memory_utilization, prefix caching and the precision (--quantization fp8
weights, --kv-cache-dtype fp8, where the GPU has an fp8 peak) one knob at a time (from
vLLM's defaults), each configuration's highest arrival rate meeting p99 TTFT and p99 TPOT by
bisection (refserve/simulator/search.py), all on the simulator. The best configuration of
each degree is then re-simulated on two other seeds at `--headroom` below its edge: that
verified rate is the one to plan for. It prints the Pareto table (planned rate, goodput,
$ per 1M output tokens; a row is on the frontier when no other serves more for less) and,
for the cheapest row, the `vllm serve` command line.

The rates come from a simulation of `--num-requests` requests: more requests, a steadier
p99 and a slower search. A mistake is one `error: ...` line, exit status 2.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time

from refserve.bench.common import print_table
from refserve.capacity import KV_CACHE_DTYPES, QUANTIZATIONS
from refserve.config import EngineConfig
from refserve.engine_setup import resolve_token_budget
from refserve.entrypoints.cli_common import ArgumentParser, CLIError, RawDescriptionHelpFormatter
from refserve.simulate import (
    SEARCHED,
    add_hardware_args,
    add_simulator_args,
    engine_config,
    load_hardware,
    make_requests,
    resolve_workload_args,
    run_cli,
    usd_per_million,
    workload_name,
)

PRECISION_DEFAULTS = {"quantization": None, "kv_cache_dtype": "auto"}


def parse_duration(text: str) -> float:
    """'2s' -> 2.0, '100ms' -> 0.1, '1.5' -> 1.5 (seconds), '250us'."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|ms|us)?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration like 2s, 100ms or "
                                         "0.5 (seconds)")
    value = float(match.group(1)) * {"s": 1, "ms": 1e-3, "us": 1e-6, None: 1}[match.group(2)]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


def _list_of(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated "
                                             f"{kind.__name__}s, e.g. 1,2,4") from None
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return values
    return parse


def _quantization(text: str) -> str | None:
    if text.lower() in ("none", "off"):
        return None
    if text in QUANTIZATIONS:
        return text
    raise ValueError(text)


_quantization.__name__ = "quantization (none or fp8)"


def _kv_cache_dtype(text: str) -> str:
    if text in KV_CACHE_DTYPES:
        return text
    raise ValueError(text)


_kv_cache_dtype.__name__ = "kv cache dtype (auto or fp8)"


def _on_off(text: str) -> bool:
    if text.lower() in ("on", "true", "1", "yes"):
        return True
    if text.lower() in ("off", "false", "0", "no"):
        return False
    raise ValueError(text)


_on_off.__name__ = "on/off value"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m refserve.plan", description=__doc__,
                       formatter_class=RawDescriptionHelpFormatter)
    add_hardware_args(p)
    s = p.add_argument_group("contract")
    s.add_argument("--slo-ttft-p99", type=parse_duration, required=True, metavar="DURATION")
    s.add_argument("--slo-tpot-p99", type=parse_duration, required=True, metavar="DURATION")
    s.add_argument("--target-rate", type=float, default=None, metavar="REQ_PER_S",
                   help="also say how many replicas of the best row serve this rate")
    k = p.add_argument_group("search space (comma-separated values; vLLM's flag names)")
    k.add_argument("--tensor-parallel-size", type=_list_of(int), default=[1])
    k.add_argument("--max-num-seqs", type=_list_of(int), default=[64, 128, 256, 512])
    k.add_argument("--max-num-batched-tokens", type=_list_of(int),
                   default=[2048, 4096, 8192, 16384])
    k.add_argument("--block-size", type=_list_of(int), default=[16, 32])
    k.add_argument("--gpu-memory-utilization", type=_list_of(float), default=[0.9, 0.95])
    k.add_argument("--enable-prefix-caching", type=_list_of(_on_off), default=[True, False],
                   metavar="on,off")
    k.add_argument("--quantization", type=_list_of(_quantization), default=[None, "fp8"],
                   metavar="none,fp8", help="weights: fp8 only where the GPU has an fp8 "
                   "peak (gpus.toml)")
    k.add_argument("--kv-cache-dtype", type=_list_of(_kv_cache_dtype),
                   default=["auto", "fp8"], metavar="auto,fp8")
    k.add_argument("--num-requests", type=int, default=600,
                   help="requests per simulation")
    k.add_argument("--tolerance", type=float, default=0.05,
                   help="bisection stops when the rate is known to this fraction")
    k.add_argument("--headroom", type=float, default=0.1,
                   help="plan this fraction below the edge, verified on two other seeds")
    add_simulator_args(p, search=True)
    p.add_argument("--no-progress", action="store_true")
    return p


def _check(args) -> None:
    resolve_workload_args(args)
    if args.num_requests < 10:
        raise CLIError(f"--num-requests {args.num_requests}: need >= 10 for a p99")
    for name, lo, hi in (("tolerance", 0.001, 0.5), ("headroom", 0.0, 0.5)):
        value = getattr(args, name)
        if not lo <= value <= hi:
            raise CLIError(f"--{name} {value}: must be in [{lo}, {hi}]")
    if args.target_rate is not None and not args.target_rate > 0:
        raise CLIError("--target-rate must be > 0")
    for name in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens",
                 "block_size"):
        bad = [v for v in getattr(args, name) if v < 1]
        if bad:
            raise CLIError(f"--{name.replace('_', '-')} {bad[0]}: must be >= 1")
    bad = [v for v in args.gpu_memory_utilization if not 0 < v <= 1]
    if bad:
        raise CLIError(f"--gpu-memory-utilization {bad[0]}: must be in (0, 1]")


def engine_defaults(gpu) -> dict:
    """The searched knobs' defaults: the engine's, with the token budget of the backend the
    GPU profile stands for (on a GPU, vLLM's: config.py)."""
    from refserve.simulator.engine import simulated_backend

    config = resolve_token_budget(EngineConfig(), simulated_backend(gpu))[0]
    return {k: getattr(config, k) for k in SEARCHED}


def _start(values: list, default):
    """The search starts at the engine's default when the space holds it, else in the
    middle."""
    return default if default in values else values[len(values) // 2]


def _first_that_fits(planner, base, tp: int, precision: dict, args):
    """The search's start at this degree: the default precision, or else the first of the
    searched ones whose weights and pool fit (fp8 weights can fit a model that 16-bit
    weights do not). Returns (candidate, None) or (None, why the default does not fit)."""
    from refserve.simulator.search import Candidate

    order = [precision] + [{"quantization": q, "kv_cache_dtype": k}
                           for q in args.quantization for k in args.kv_cache_dtype]
    why = None
    for p in order:
        cand = Candidate(base, tp, **p)
        try:
            planner.engine(cand)
            return cand, None
        except (ValueError, NotImplementedError) as e:
            why = why or " ".join(str(e).split())
    return None, why


def vllm_command(model, cand, max_model_len: int, dtype: str,
                 num_scheduler_steps: int = 1) -> str:
    """The `vllm serve` line of a planned candidate: only flags of vLLM's documented CLI
    (`vllm serve --help`; tests/test_simulator_plan.py parses it with vLLM's own parser
    when vllm is installed). --num-scheduler-steps, a V0 flag, only when asked for."""
    from refserve.simulator.hardware import HF_IDS

    c = cand.config
    prefix = "--enable-prefix-caching" if c.enable_prefix_caching else \
        "--no-enable-prefix-caching"
    chunked = "--enable-chunked-prefill" if c.enable_chunked_prefill else \
        "--no-enable-chunked-prefill"
    precision = "".join([f" --quantization {cand.quantization}" if cand.quantization else "",
                         f" --kv-cache-dtype {cand.kv_cache_dtype}"
                         if cand.kv_cache_dtype != "auto" else ""])
    eager = " --enforce-eager" if c.enforce_eager else ""
    return (f"vllm serve {HF_IDS.get(model.name, model.name)} --dtype {dtype} "
            f"--tensor-parallel-size {cand.tensor_parallel_size} --max-model-len "
            f"{max_model_len} --max-num-seqs {c.max_num_seqs} --max-num-batched-tokens "
            f"{c.max_num_batched_tokens} --block-size {c.block_size} "
            f"--gpu-memory-utilization {c.gpu_memory_utilization} {prefix} "
            f"{chunked}{precision}{eager}"
            + (f" --num-scheduler-steps {num_scheduler_steps}" if num_scheduler_steps > 1
               else ""))


def run(args) -> int:
    from refserve.simulator.search import SLO, Planner

    _check(args)
    model, gpu = load_hardware(args)
    slo = SLO(args.slo_ttft_p99, args.slo_tpot_p99)
    base = engine_config(args, **{k: _start(getattr(args, k), d)
                                  for k, d in engine_defaults(gpu).items()})
    max_model_len = base.max_model_len or model.max_position_embeddings
    if not base.enable_chunked_prefill and any(
            t < max_model_len for t in args.max_num_batched_tokens):
        raise CLIError(f"--no-enable-chunked-prefill: vLLM refuses a "
                       f"--max-num-batched-tokens below --max-model-len ({max_model_len}); "
                       "search budgets >= it, or lower --max-model-len")
    if "fp8" not in gpu.peak_flops:  # no fp8 GEMMs on this GPU (an A100): search without
        args.quantization = [q for q in args.quantization if q is None] or [None]
    make_requests(args, model, max_model_len, 1.0)  # a bad workload fails here, not later

    def requests(rate, seed, num_requests):
        return make_requests(args, model, max_model_len, rate, seed=seed,
                             num_requests=num_requests)

    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(desc="simulations", unit="sim", file=sys.stderr, mininterval=0.5)

    def on_simulation(cand, ev):
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"tp={cand.tensor_parallel_size} seqs="
                                f"{cand.config.max_num_seqs} tokens="
                                f"{cand.config.max_num_batched_tokens} at {ev.rate:.2f}/s "
                                f"{'ok' if ev.ok else 'over'}", refresh=False)

    planner = Planner(model, gpu, requests, slo, num_requests=args.num_requests,
                      seed=args.seed, tolerance=args.tolerance, on_simulation=on_simulation,
                      engine_overheads=args.engine, served=args.served,
                      num_scheduler_steps=args.num_scheduler_steps)
    knobs = {k: getattr(args, k) for k in (*SEARCHED, *PRECISION_DEFAULTS)}
    precision = {k: _start(getattr(args, k), d) for k, d in PRECISION_DEFAULTS.items()}
    print(f"plan: {model.name} on {gpu.name}; "
          f"{workload_name(args) if not args.replay else args.replay}"
          f"; SLO p99 TTFT <= {slo.ttft_p99:g} s, p99 TPOT <= {slo.tpot_p99 * 1e3:g} ms; "
          f"{args.num_requests} requests per simulation", flush=True)
    t0 = time.perf_counter()
    rows = []
    for tp in args.tensor_parallel_size:
        start, why = _first_that_fits(planner, base, tp, precision, args)
        if start is None:
            print(f"tensor parallel {tp}: does not fit: {why}")
            continue
        best, best_ev, tried = planner.search(start, knobs)
        if best_ev is None:
            print(f"tensor parallel {tp}: no configuration meets the SLO even at a "
                  "hundredth of its throughput ceiling")
            continue
        seeds = (args.seed + 1, args.seed + 2)
        planned = planner.planned_rate(best, best_ev.rate, args.headroom, seeds)
        engine = planner.engine(best)
        price = gpu.usd_per_hour * tp
        c = best.config
        rows.append({
            "cand": best, "tp": tp, "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens, "block_size": c.block_size,
            "gpu_memory_utilization": c.gpu_memory_utilization,
            "prefix": "on" if c.enable_prefix_caching else "off",
            "precision": (best.quantization or "-") + "/" + (
                "fp8" if best.kv_cache_dtype != "auto" else "-"),
            "edge": best_ev.rate, "bound": best_ev.bound,
            "rate": planned.rate if planned else None,
            "goodput": planned.goodput_req_s if planned else None,
            "tok_s": planned.output_tokens_per_s if planned else None,
            "ttft_p99": 1e3 * planned.ttft_p99 if planned else None,
            "tpot_p99": 1e3 * planned.tpot_p99 if planned and planned.tpot_p99 else None,
            "usd_per_1m": usd_per_million(price, planned.output_tokens_per_s)
            if planned else None, "usd_per_hour": price, "kv_blocks": engine.num_blocks,
            "configs": len(tried)})
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if not rows:
        print("no configuration meets the SLOs; relax them or add GPUs")
        return 1
    for r in rows:  # Pareto: nobody else serves at least as much for at most as much
        r["pareto"] = "*" if r["rate"] is not None and not any(
            o is not r and o["rate"] is not None and o["rate"] >= r["rate"]
            and o["usd_per_1m"] <= r["usd_per_1m"]
            and (o["rate"] > r["rate"] or o["usd_per_1m"] < r["usd_per_1m"])
            for o in rows) else ""
    print()
    print_table(rows, [("pareto", "", ""), ("tp", "TP", "d"), ("max_num_seqs", "seqs", "d"),
                       ("max_num_batched_tokens", "tokens", "d"), ("block_size", "block", "d"),
                       ("gpu_memory_utilization", "mem", ".2f"), ("prefix", "prefix", ""),
                       ("precision", "w/kv fp8", ""),
                       ("kv_blocks", "KV blocks", "d"), ("edge", "edge req/s", ".2f"),
                       ("bound", "bound by", ""),
                       ("rate", "plan req/s", ".2f"), ("goodput", "goodput req/s", ".2f"),
                       ("tok_s", "output tok/s", ".0f"), ("ttft_p99", "TTFT p99 ms", ".0f"),
                       ("tpot_p99", "TPOT p99 ms", ".1f"), ("usd_per_1m", "$/1M tok", ".3f")])
    print(f"(edge: the highest rate within the SLO on seed {args.seed}, bound by the SLO or "
          f"by the saturation throughput; plan: {args.headroom:.0%} or more below it, within "
          f"the SLO on seeds {args.seed + 1} and {args.seed + 2}; goodput and tok/s in steady "
          f"state at the plan rate; * = Pareto frontier of rate and $/1M; "
          f"${gpu.usd_per_hour:.2f} per GPU-hour)")
    best = min((r for r in rows if r["rate"] is not None), key=lambda r: r["usd_per_1m"],
               default=None)
    if best is not None:
        print(f"\ncheapest per token: TP {best['tp']} at {best['rate']:.2f} req/s, "
              f"${best['usd_per_1m']:.3f} per 1M output tokens; run it on vLLM with")
        dtype = planner.engine(best["cand"]).dtype
        line = vllm_command(model, best["cand"], max_model_len, dtype,
                            args.num_scheduler_steps)
        print(f"  {line}")
        if args.target_rate is not None:
            replicas = math.ceil(args.target_rate / best["rate"])
            print(f"  {args.target_rate:g} req/s needs {replicas} replica(s) = "
                  f"{replicas * best['tp']} GPUs, ${replicas * best['usd_per_hour']:.2f}/hour")
    print(f"\nsearched {sum(r['configs'] for r in rows)} configurations with "
          f"{planner.simulations} simulations in {wall:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())

