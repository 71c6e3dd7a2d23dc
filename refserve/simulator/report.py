"""What a simulation reports: latency percentiles, the cost per token, a thinned timeline
and the chart of `python -m refserve.simulate --plot`."""

from __future__ import annotations

from pathlib import Path

from refserve.metrics import percentile


def usd_per_million(usd_per_hour_total: float, output_tokens_per_s: float) -> float | None:
    """$ / 1M output tokens = price per hour / 3600 / tokens per second x 1e6 (WARMUP §10)."""
    if output_tokens_per_s <= 0:
        return None
    return usd_per_hour_total / 3600 / output_tokens_per_s * 1e6


def latency_table(result) -> list[dict]:
    ms = [m for m in result.metrics.values() if m.finish_time is not None]
    series = {"TTFT": [m.ttft for m in ms], "TPOT": [m.tpot for m in ms],
              "ITL": list(getattr(result, "itl", ())),
              "latency": [m.finish_time - m.arrival_time for m in ms]}
    return [{"metric": name, **{f"p{q}": _ms(percentile(v, q)) for q in (50, 90, 99)},
             "max": _ms(max((x for x in v if x is not None), default=None))}
            for name, v in series.items()]


def _ms(x: float | None) -> float | None:
    return None if x is None else 1000 * x


def downsample(timeline: dict, points: int) -> dict:
    """At most `points` samples per series, one per window of steps: its start and end
    time, the tokens it sampled, and the maximum of scheduled, waiting and KV blocks (so
    peaks survive)."""
    n = len(timeline["t"])
    stride = max(1, -(-n // points))
    out = {k: [] for k in timeline}
    for a in range(0, n, stride):
        b = min(n, a + stride)
        out["t"].append(timeline["t"][a])
        out["t_end"].append(timeline["t_end"][b - 1])
        out["sampled"].append(sum(timeline["sampled"][a:b]))
        for k in ("scheduled", "waiting", "kv_blocks_used"):
            out[k].append(max(timeline[k][a:b]))
    return out


def plot(result, engine, path: Path, title: str, slo_ttft: float | None = None,
         slo_tpot: float | None = None) -> None:
    """Four panels: batch and queue, KV blocks in use, TTFT and TPOT distributions."""
    import numpy as np

    from refserve.bench.common import pyplot

    plt = pyplot()
    tl = downsample(result.timeline, 2000)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    a, b, c, d = axes.ravel()
    a.step(tl["t"], tl["scheduled"], where="post", label="scheduled (batch)", lw=1)
    a.step(tl["t"], tl["waiting"], where="post", label="waiting", lw=1)
    a.axhline(engine.config.max_num_seqs, color="grey", ls=":", lw=1, label="max_num_seqs")
    a.set(title="Batch and queue over time", xlabel="simulated time (s)",
          ylabel="sequences (max per window)")
    a.legend(fontsize=8)
    b.step(tl["t"], tl["kv_blocks_used"], where="post", color="tab:green", lw=1,
           label=f"in use (peak {result.summary.kv_blocks_peak})")
    pool = engine.num_blocks
    if result.summary.kv_blocks_peak < pool / 2:  # zoom in; the pool line is off the chart
        b.set_ylim(0, 1.3 * max(1, result.summary.kv_blocks_peak))
        b.set_title(f"KV blocks in use (pool: {pool} blocks, above the chart)")
    else:
        b.axhline(pool, color="tab:red", ls="--", lw=1, label=f"pool: {pool} blocks")
        b.set_ylim(0, pool * 1.05)
        b.set_title("KV blocks in use")
    b.set(xlabel="simulated time (s)", ylabel="blocks (max per window)")
    b.legend(fontsize=8)
    for ax, key, slo, name in ((c, "ttft", slo_ttft, "TTFT"), (d, "tpot", slo_tpot, "TPOT")):
        values = np.sort([1000 * getattr(m, key) for m in result.metrics.values()
                          if getattr(m, key) is not None])
        if len(values):
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), lw=1.5)
            for q, ls in ((50, "--"), (99, ":")):
                x = np.percentile(values, q)
                ax.axvline(x, color="grey", ls=ls, lw=1, label=f"p{q} {x:.1f} ms")
            if values[-1] > 20 * max(values[0], 1e-3):
                ax.set_xscale("log")
        note = ""
        if slo is not None:
            if len(values) and 1000 * slo > 3 * values[-1]:
                note = f", SLO {1000 * slo:g} ms far right"  # keep the curve readable
            else:
                ax.axvline(1000 * slo, color="tab:red", lw=1, label=f"SLO {1000 * slo:g} ms")
        ax.set(title=f"{name} distribution ({len(values)} requests{note})",
               xlabel=f"{name} (ms)", ylabel="fraction of requests <= x")
        ax.legend(fontsize=8)
    s = result.summary
    fig.suptitle(f"{title} | {s.output_tokens_per_s:.0f} tok/s, {s.num_preemptions} "
                 "preemptions", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


