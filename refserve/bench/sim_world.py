"""sim-world: the simulator against published GPU measurements (no GPU, no network).

Every row of refserve/simulator/measurements/ (a number a public source printed, with its
source at a fixed commit and its settings: engine and version, model, GPU, tensor
parallelism, precision, lengths, rate, scheduler flags) is replayed on the simulator at the
published request counts and compared with what was published:

    error = (predicted - published) / published

Three tables, from the strongest test to the weakest:

    leave-one-source-out   (--validate) each source predicted by constants refitted from
                           the pre-fit defaults on the other sources only
    leave-one-engine-out   (--validate) each engine likewise
    held-out-within-source the shipped constants (gpus.toml, engines.toml: fitted on the
                           rows not in world.HELD_OUT) on the held-out rows

Targets: leave-one-source-out median |error| <= 15%, every row within 40%; held-out rows
median <= 10%, every row within 25%. `--fit` refits the shipped constants (minutes: the
online runs are simulated again every round) and prints them with their ranges;
`--fit --write` writes them into gpus.toml and engines.toml. Every fitted constant must lie
in its physical range (bounds.toml); the command says which do not. `prior` beside each
row is its prediction with the pre-fit defaults.

`--quick` (CI) replays the held-out rows that simulate in a few seconds, at their
published request counts.
"""

from __future__ import annotations

import time

import numpy as np

from refserve.bench.common import print_table

HELP = ("the simulator against published GPU measurements: leave-one-source-out, "
        "leave-one-engine-out, held-out rows")
TARGETS = {"source": (0.15, 0.40), "held-out": (0.10, 0.25)}
# Held-out rows too slow for --quick (thousands of requests, or a static batch of
# hundreds decoding 2048 tokens).
SLOW_STEPS = 3000


def add_arguments(s) -> None:
    s.add_argument("--fit", action="store_true",
                   help="refit the constants from the pre-fit defaults on the fit rows "
                   "(minutes) and print them with their ranges")
    s.add_argument("--write", action="store_true",
                   help="with --fit: write the fitted constants into gpus.toml and "
                   "engines.toml")
    s.add_argument("--validate", action="store_true",
                   help="leave-one-source-out and leave-one-engine-out: a refit per group "
                   "(tens of minutes)")
    s.add_argument("--scale", type=float, default=1.0,
                   help="fraction of each serving run's requests to simulate (1: the "
                   "published counts, which every claim is made at)")


def apply_quick(args) -> None:
    args.validate = args.fit = False


POSITIVE = ("scale",)


def _rows_table(rows: list[dict], extra=()) -> None:
    print_table(rows, [("group", "group", ""), ("id", "row", ""), ("metric", "metric", ""),
                       ("published", "published", ".4g"), ("predicted", "predicted", ".4g"),
                       ("error", "error", "+.1%"), *extra])


def _summary_lines(name: str, summary: dict) -> list[str]:
    lines = []
    for group, s in summary.items():
        if s["rows"]:
            lines.append(f"  {name} {group}: {s['rows']} rows, median |error| "
                         f"{s['median_abs_error']:.1%}, max {s['max_abs_error']:.1%}")
    return lines


def _target(summary: dict, kind: str) -> bool:
    median, worst = TARGETS[kind]
    s = summary["all"]
    return bool(s["rows"]) and s["median_abs_error"] <= median and s["max_abs_error"] <= worst


def run(args) -> dict:
    from refserve.simulator.bounds import Bounds
    from refserve.simulator.world import Constants, load_measurements
    from refserve.simulator.world_fit import fit, prior_constants
    from refserve.simulator.world_replay import replay
    from refserve.simulator.world_validate import (
        held_out_within_source,
        leave_one_out,
        summarize,
    )

    if args.write and not args.fit:
        raise ValueError("--write writes what --fit fitted: add --fit")
    measurements = load_measurements()
    t0 = time.perf_counter()
    if args.quick:
        measurements = [m for m in measurements if m.role == "held-out" and _cheap(m)]
    out: dict = {"scale": args.scale, "rows": [], "fitted": None}
    bounds = Bounds()
    constants = Constants()
    if args.fit:
        rows = [m for m in measurements if m.role == "fit"]
        print(f"fitting on {len(rows)} rows from the pre-fit defaults ...", flush=True)
        report = fit(rows, scale=args.scale, on_round=lambda k, reps: print(
            f"  round {k}: median |error| {np.median([abs(r.error) for r in reps]):.1%}",
            flush=True))
        constants = report.constants
        out["fitted"] = _constants_table(constants, bounds)
        if args.write:
            from refserve.simulator.world_fit import write_record
            from refserve.simulator.world_write import write_constants

            write_record(report.record)
            print("written: " + ", ".join(write_constants(constants))
                  + " and the fit's last step (world_fit_record.json)")
    priors = prior_constants(measurements, bounds)
    from tqdm import tqdm

    for m in tqdm(measurements, desc="replaying", unit="row", mininterval=1.0):
        r = replay(m, constants, args.scale)
        out["rows"].append({
            "group": m.source_key, "id": m.id, "role": m.role, "source": m.source_key,
            "engine": m.engine_profile, "metric": m.metric, "published": m.value,
            "predicted": r.predicted, "error": r.error,
            "prior_error": (r.predict(priors) - m.value) / m.value if m.schedule_fixed
            else (replay(m, priors, args.scale).predicted - m.value) / m.value,
            "url": m.source, "where": m.where, "settings": m.describe()})
    held = held_out_within_source(measurements, constants, args.scale)
    lines = []
    out["held_out"] = summarize(held)
    if args.validate:
        for by in ("source", "engine"):
            print(f"leave-one-{by}-out: a refit per {by} ...", flush=True)
            rows = leave_one_out(measurements, by, args.scale, on_group=lambda g, rep: print(
                f"  without {g}: {rep.rounds} rounds", flush=True))
            out[f"leave_one_{by}_out"] = {"rows": rows, "summary": summarize(rows)}
            print()
            _rows_table(rows)
            lines += _summary_lines(f"leave-one-{by}-out", summarize(rows))
    print()
    _rows_table(sorted(out["rows"], key=lambda r: (r["role"] != "held-out", r["id"])),
                [("role", "role", ""), ("prior_error", "prior", "+.1%")])
    fit_rows = [r for r in out["rows"] if r["role"] == "fit"]
    out["fit_summary"] = summarize(fit_rows) if fit_rows else None
    print()
    if fit_rows:
        lines += _summary_lines("fit rows", {"all": out["fit_summary"]["all"]})
    lines += _summary_lines("held-out-within-source", out["held_out"])
    print("\n".join(lines))
    out["targets"] = {"held_out": _target(out["held_out"], "held-out")}
    if args.validate:
        out["targets"]["leave_one_source_out"] = _target(
            out["leave_one_source_out"]["summary"], "source")
    for name, ok in out["targets"].items():
        print(f"target {name.replace('_', '-')}: {'met' if ok else 'NOT met'}")
    outside = bounds.check(constants.values())
    out["outside_ranges"] = outside
    print("constants inside their physical ranges: "
          + ("all" if not outside else "NOT: " + "; ".join(outside)))
    if out["fitted"] is not None:
        print("fitted constants (range, source in refserve/simulator/bounds.toml):")
        for row in out["fitted"]:
            print(f"  {row['name']} = {row['value']:.4g}  [{row['low']:.4g}, {row['high']:.4g}]"
                  f"{'  (prior: no row moved it)' if row['at_prior'] else ''}")
    out["wall_seconds"] = time.perf_counter() - t0
    print(f"replayed in {out['wall_seconds']:.0f} s")
    return out


def _cheap(m) -> bool:
    if m.replay == "static":
        return m.output_len * max(1, m.batch_size // 64) <= SLOW_STEPS
    return m.num_requests * (m.output_len or 200) <= 300_000 and m.rate != "inf"


def _constants_table(constants, bounds) -> list[dict]:
    out = []
    for name, value in sorted(constants.values().items()):
        r = bounds.range_of(name)
        out.append({"name": ".".join(name), "value": value, "low": r.low, "high": r.high,
                    "prior": r.prior, "at_prior": abs(value - r.prior) <= 1e-9 * max(
                        abs(r.prior), 1e-12), "source": r.source})
    return out


def plot(result: dict, path) -> None:
    from refserve.bench.common import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 6))
    series = [("shipped constants", result["rows"], "o")]
    if "leave_one_source_out" in result:
        series.append(("source left out of the fit", result["leave_one_source_out"]["rows"],
                       "x"))
    lo = min(min(r["published"], r["predicted"]) for _, rows, _ in series for r in rows)
    hi = max(max(r["published"], r["predicted"]) for _, rows, _ in series for r in rows)
    for label, rows, marker in series:
        ax.scatter([r["published"] for r in rows], [r["predicted"] for r in rows],
                   marker=marker, label=f"{label} ({len(rows)})", alpha=0.7)
    xs = np.array([lo, hi])
    ax.plot(xs, xs, color="grey", lw=1, label="predicted = published")
    for f in (0.85, 1.15):
        ax.plot(xs, f * xs, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="published (tok/s or ms)", ylabel="simulated (same unit)",
           title="The simulator against published GPU measurements\n(dotted: +-15%)")
    ax.legend()
    save_figure(fig, result, path)
