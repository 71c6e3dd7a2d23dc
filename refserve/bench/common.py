"""What every scenario shares: the machine it ran on, tables, JSON, percentiles, plots.

Numbers are only ever compared between systems measured in the same run on the same
machine; `machine_info()` records which machine that was, down to the BLAS kernel
OpenBLAS picked (threadpoolctl). The bench reports OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE
when they are set and never changes them.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from pathlib import Path

import numpy as np


def machine_info() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__}
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        from threadpoolctl import threadpool_info
        blas = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        if blas:
            b = blas[0]
            info["blas"] = f"{b.get('internal_api')} {b.get('version')}"
            info["blas_kernel"] = b.get("architecture")
            info["blas_threads"] = b.get("num_threads")
    except ImportError:
        info["blas"] = "unknown (pip install threadpoolctl)"
    pinned = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
              if k in os.environ}
    if pinned:
        info["blas_env"] = pinned
    info["gpu"] = _gpu_name()
    return info


def _gpu_name() -> str | None:
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no cupy, no driver or no device: no GPU
        return None


def machine_line(info: dict) -> str:
    cores = info.get("cpus_usable", info["cpu_count"])
    blas = f"{info.get('blas', '?')} kernel {info.get('blas_kernel', '?')} " \
           f"x{info.get('blas_threads', '?')}"
    if info.get("blas_env"):
        blas += f" (pinned by {info['blas_env']})"
    gpu = info.get("gpu") or "no GPU"
    return (f"{info['machine']}, {cores} cores, {blas}, {gpu}, python {info['python']}, "
            f"numpy {info['numpy']}")


def percentiles(values, qs=(50, 90, 99)) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    return {f"p{q}": (float(np.percentile(vals, q)) if vals else None) for q in qs}


def ms(x: float | None) -> float | None:
    return None if x is None else 1000.0 * x


def print_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """cols: (key, header, format spec). Right-aligned; missing values print as '-'."""
    cells = [[("-" if r.get(k) is None else format(r[k], f)) for k, _, f in cols]
             for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(cols)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(cols, widths)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))


def write_json(result: dict, path: Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
    print(f"numbers written to {path}")


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def non_finite(obj, where: str = "") -> list[str]:
    """Paths of every NaN or infinite number in a result (tests assert there are none)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return [where]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in non_finite(v, f"{where}.{k}")]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in non_finite(v, f"{where}[{i}]")]
    return []


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend (imported only when --plot asks)."""
    try:
        import matplotlib
    except ImportError:
        print("error: --plot needs matplotlib; pip install 'refserve[bench]'", file=sys.stderr)
        raise SystemExit(2) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


BANNER_FONTSIZE = 7


def save_figure(fig, result: dict, path: Path, bottom: float = 0.0) -> None:
    """The machine banner on top, wrapped to the figure's width (a long machine line, e.g.
    with a GPU's name, would otherwise run past both edges of a narrow figure), then the
    axes laid out below it and above `bottom` (room for a figure legend)."""
    import textwrap

    banner = f"{result['scenario']}: {machine_line(result['machine'])}"
    # About 0.55 em per character: the line length that fits the figure, in characters.
    fits = max(20, int(fig.get_figwidth() * 72 / (0.55 * BANNER_FONTSIZE)) - 4)
    lines = textwrap.wrap(banner, fits)
    fig.suptitle("\n".join(lines), fontsize=BANNER_FONTSIZE)
    # makes room for the (suptitle) banner above the axes
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def traced(args, engine, label: str):
    """With --trace, record `engine` (an LLMEngine or an LLM) into this run's timeline,
    labelled (bench/cli.py writes the file at the end); returns `engine`."""
    tracer = getattr(args, "tracer", None)
    return engine if tracer is None else tracer.attach(engine, label)
