"""sim-world: the simulator against published GPU measurements (no GPU, no network).

Every row of refserve/simulator/measurements.toml (a number a public source printed:
TensorRT-LLM's performance tables, SGLang's and vLLM's published serving runs; each with
its source, engine version, model, GPU, tensor parallelism, precision, lengths and rate) is
replayed on the simulator with the built-in profiles (gpus.toml, engines.toml) and
compared with what was published:

    error = (predicted - published) / published

Rows are either FIT rows (the constants of gpus.toml and engines.toml were fitted on
them, `--refit` redoes it) or HELD-OUT rows (refserve/simulator/world.py, HELD_OUT: never
seen by the fit). The claim: held-out median |error| <= 10%, every held-out row within
25%. `before` is each row predicted with the profiles as they were before the fit (the
priors: 1 ms + 5 us per row of host time, no launch, sampling or front-end terms).

`--quick` replays only the held-out rows that simulate in a second or two (the serving
runs with a quarter of their requests), as CI does. `--plan-check` also runs `plan` on the
hardware of the held-out serving rows and replays its recommendation at the planned rate
on other seeds, checking its SLOs.
"""

from __future__ import annotations

import time

import numpy as np

from refserve.bench.common import print_table

HELP = "the simulator against published GPU measurements: predicted vs published, fit vs held out"
TARGET_MEDIAN, TARGET_MAX = 0.10, 0.25
# The host terms and efficiencies the built-in profiles shipped with before the fit.
BEFORE_ENGINE = dict(step_overhead_s=1e-3, row_overhead_s=5e-6, sample_row_s=0.0,
                     front_end_row_s=0.0, eager_layer_s=0.0)
BEFORE_GPUS = {"h100-80gb": dict(flops_efficiency=0.60, bandwidth_efficiency=0.75,
                                 attention_efficiency=0.40, allreduce_latency_s=8e-6),
               "h200-141gb": dict(flops_efficiency=0.60, bandwidth_efficiency=0.75,
                                  attention_efficiency=0.40, allreduce_latency_s=8e-6),
               "a100-80gb": dict(flops_efficiency=0.65, bandwidth_efficiency=0.75,
                                 attention_efficiency=0.40, allreduce_latency_s=10e-6)}
# Held-out rows too slow for --quick (a static batch of hundreds decoding 2048 tokens).
SLOW = ("trt-a100-70b-128-2048", "trt-h100-70b-2048-2048-tp2", "trt-h100-7b-128-2048",
        "vllm-a100-8b-offline")


def add_arguments(s) -> None:
    s.add_argument("--refit", action="store_true",
                   help="fit the constants on the fit rows first (minutes) and replay with "
                   "the fitted ones (print them; gpus.toml / engines.toml keep theirs)")
    s.add_argument("--scale", type=float, default=1.0,
                   help="fraction of each serving run's requests to simulate")
    s.add_argument("--no-before", action="store_true",
                   help="skip the replay with the profiles as they were before the fit")
    s.add_argument("--plan-check", action="store_true",
                   help="run plan on the held-out serving rows' hardware and check its "
                   "recommendation at the planned rate (minutes)")


def apply_quick(args) -> None:
    args.scale = min(args.scale, 0.25)
    args.no_before = True


POSITIVE = ("scale",)


def before_constants():
    import dataclasses

    from refserve.simulator.engine_overheads import engine_names, load_engine
    from refserve.simulator.hardware import apply_overrides, load_gpu
    from refserve.simulator.world import Constants

    gpus = {key: apply_overrides(load_gpu(key), values) for key, values in BEFORE_GPUS.items()}
    engines = {key: dataclasses.replace(load_engine(key), kv_read_per_query_head=False,
                                        **BEFORE_ENGINE) for key in engine_names()}
    return Constants(gpus, engines)


def summarize_errors(rows: list[dict], key: str = "error") -> dict:
    out = {}
    for role in ("fit", "held-out"):
        errs = np.array([abs(r[key]) for r in rows if r["role"] == role and r.get(key)
                         is not None])
        out[role] = {"rows": len(errs),
                     "median_abs_error": float(np.median(errs)) if len(errs) else None,
                     "max_abs_error": float(np.max(errs)) if len(errs) else None}
    return out


def run(args) -> dict:
    from refserve.simulator.world import Constants, load_measurements, replay
    from refserve.simulator.world_fit import fit

    measurements = load_measurements()
    if args.quick:
        measurements = [m for m in measurements if m.role == "held-out" and m.id not in SLOW]
    constants = Constants()
    fitted = None
    if args.refit:
        rows = [m for m in measurements if m.role == "fit"]
        print(f"fitting on {len(rows)} rows ...", flush=True)
        report = fit(rows, on_round=lambda k, reps: print(
            f"  round {k}: median |error| "
            f"{np.median([abs(r.error) for r in reps]):.1%}", flush=True))
        constants, fitted = report.constants, {
            "|".join(k): v for k, v in report.constants.values().items()}
    before = None if args.no_before else before_constants()
    from tqdm import tqdm

    rows = []
    t0 = time.perf_counter()
    for m in tqdm(measurements, desc="replaying", unit="row", mininterval=0.5):
        r = replay(m, constants, args.scale)
        b = None if before is None else replay(m, before, args.scale)
        rows.append({
            "id": m.id, "role": m.role, "engine": f"{m.engine} {m.version}",
            "model": m.model, "hardware": f"{m.tp} x {m.gpu}",
            "precision": m.dtype + (" w8" if m.quantization else "")
            + (" kv8" if m.kv_cache_dtype != "auto" else ""),
            "load": (f"b{m.batch_size} {m.input_len}/{m.output_len}" if m.replay == "static"
                     else f"{m.workload} {m.rate}/s"),
            "metric": m.metric, "published": m.value, "predicted": r.predicted,
            "error": r.error, "before": None if b is None else b.predicted,
            "before_error": None if b is None else b.error, "source": m.source,
            "where": m.where})
    wall = time.perf_counter() - t0
    print()
    rows.sort(key=lambda r: (r["role"] != "held-out", r["id"]))
    print_table(rows, [("role", "role", ""), ("id", "row", ""), ("hardware", "GPUs", ""),
                       ("precision", "dtype", ""), ("load", "load", ""),
                       ("metric", "metric", ""), ("published", "published", ".4g"),
                       ("predicted", "predicted", ".4g"), ("error", "error", "+.1%"),
                       ("before_error", "before", "+.1%")])
    summary = summarize_errors(rows)
    before_summary = None if before is None else summarize_errors(rows, "before_error")
    for role in ("fit", "held-out"):
        s = summary[role]
        if not s["rows"]:
            continue
        line = (f"{role}: {s['rows']} rows, median |error| {s['median_abs_error']:.1%}, max "
                f"{s['max_abs_error']:.1%}")
        if before_summary is not None:
            b = before_summary[role]
            line += (f" (before the fit: median {b['median_abs_error']:.1%}, max "
                     f"{b['max_abs_error']:.1%})")
        print(line)
    held = summary["held-out"]
    ok = (held["rows"] > 0 and held["median_abs_error"] <= TARGET_MEDIAN
          and held["max_abs_error"] <= TARGET_MAX)
    print(f"held-out target (median <= {TARGET_MEDIAN:.0%}, every row <= {TARGET_MAX:.0%}): "
          f"{'met' if ok else 'NOT met'}; replayed in {wall:.0f} s")
    if fitted is not None:
        print("fitted constants:")
        for name, value in sorted(fitted.items()):
            print(f"  {name} = {value:.6g}")
    plan = plan_check(args) if args.plan_check else None
    return {"rows": rows, "summary": summary, "before_summary": before_summary,
            "target_met": ok, "fitted": fitted, "plan_check": plan, "scale": args.scale}


# ---- plan's recommendation, replayed --------------------------------------------------

PLAN_CASES = (("a100-80gb", "llama-3.1-8b", 1, 0.5, 0.05),
              ("h100-80gb", "llama-3.1-70b", 4, 1.0, 0.08))


def plan_check(args) -> list[dict]:
    """For the hardware of the held-out serving rows: plan (on the sharegpt workload, the
    vllm engine profile, SLOs p99 TTFT / TPOT), then the recommended configuration
    simulated at its planned rate on two fresh seeds; both must meet the SLOs."""
    from refserve.config import EngineConfig
    from refserve.simulator.engine_overheads import load_engine
    from refserve.simulator.hardware import load_gpu, load_model
    from refserve.simulator.search import SLO, Candidate, Planner
    from refserve.simulator.workload import make_workload

    out = []
    engine = load_engine("vllm")
    for gpu_key, model_key, tp, ttft, tpot in PLAN_CASES:
        model, gpu = load_model(model_key), load_gpu(gpu_key)
        slo = SLO(ttft, tpot)

        def requests(rate, seed, n, model=model):
            return make_workload("sharegpt", n, rate, vocab_size=model.vocab_size,
                                 max_model_len=4096, seed=seed)

        planner = Planner(model, gpu, requests, slo, num_requests=300, engine_overheads=engine,
                          served=True)
        fp8_weights = "fp8" if "fp8" in gpu.peak_flops else None  # an A100 has no fp8
        base = Candidate(EngineConfig(max_model_len=4096, enable_prefix_caching=False), tp,
                         quantization=fp8_weights, kv_cache_dtype="fp8")
        best, ev, _ = planner.search(base, {"max_num_seqs": [128, 256, 512]})
        planned = planner.planned_rate(best, ev.rate, 0.1, (11, 12)) if ev else None
        checks = [planner.evaluate(best, planned.rate, seed) for seed in (21, 22)] \
            if planned else []
        row = {"hardware": f"{tp} x {gpu_key}", "model": model_key,
               "slo_ttft_p99_s": ttft, "slo_tpot_p99_s": tpot,
               "planned_rate": planned.rate if planned else None,
               "max_num_seqs": best.config.max_num_seqs,
               "replayed_ok": bool(checks) and all(c.ok for c in checks),
               "ttft_p99_s": [c.ttft_p99 for c in checks],
               "tpot_p99_s": [c.tpot_p99 for c in checks]}
        out.append(row)
        print(f"plan on {row['hardware']} ({model_key}, KV fp8"
              f"{', weights fp8' if fp8_weights else ''}): "
              f"{row['planned_rate'] or 0:.2f} req/s "
              f"with max_num_seqs {row['max_num_seqs']}; replayed on seeds 21, 22: "
              f"{'within' if row['replayed_ok'] else 'OUTSIDE'} p99 TTFT <= {ttft} s, "
              f"TPOT <= {tpot * 1e3:g} ms")
    return out


def plot(result: dict, path) -> None:
    from refserve.bench.common import pyplot, save_figure

    plt = pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 6))
    for role, marker in (("fit", "o"), ("held-out", "s")):
        pts = [r for r in rows if r["role"] == role]
        ax.scatter([r["published"] for r in pts], [r["predicted"] for r in pts],
                   marker=marker, label=f"{role} ({len(pts)})")
    lo = min(min(r["published"], r["predicted"]) for r in rows)
    hi = max(max(r["published"], r["predicted"]) for r in rows)
    xs = np.array([lo, hi])
    ax.plot(xs, xs, color="grey", lw=1, label="predicted = published")
    for f in (0.9, 1.1):
        ax.plot(xs, f * xs, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="published (tok/s or ms)", ylabel="simulated (same unit)",
           title="The simulator against published GPU measurements\n(dotted: +-10%)")
    ax.legend()
    save_figure(fig, result, path)
