"""The physical range of every fitted constant, with its source (bounds.toml).

A fitted constant is only as good as the physics it stands for: an "attention efficiency"
of 8% that absorbs whatever the roofline leaves out of a long prefill predicts nothing
else. So each constant the fit of world_fit.py may move has a range it may not leave, and
a `prior` (the pre-fit default every fit starts from, and keeps where no row exercises the
constant):

    GPU (per profile)   flops / bandwidth / kv_bandwidth / attention efficiency (fractions
                        of the datasheet peaks), the all-reduce latencies (NCCL's fixed
                        part and ring hop, a custom all-reduce's), kernel_gap_s
    engine (engines.toml)   the host terms: step_overhead_s, row_overhead_s, sample_row_s,
                        front_end_row_s, eager_layer_s, front_end_request_s

`Bounds.check(constants)` lists every constant outside its range (tests/test_simulator_world.py
runs it on the shipped gpus.toml and engines.toml).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refserve.simulator.engine_overheads import HOST_TERMS

BOUNDS_FILE = Path(__file__).with_name("bounds.toml")
GPU_CONSTANTS = ("flops_efficiency", "fp8_flops_efficiency", "bandwidth_efficiency",
                 "kv_bandwidth_efficiency", "attention_efficiency", "allreduce_latency_s",
                 "allreduce_hop_s", "custom_allreduce_latency_s", "kernel_gap_s")


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    prior: float
    source: str

    def __contains__(self, value: float) -> bool:
        slack = 1e-9 * max(abs(self.high), 1e-12)
        return self.low - slack <= value <= self.high + slack


class Bounds:
    """The ranges of bounds.toml, by (kind, profile key, constant name)."""

    def __init__(self, path: Path = BOUNDS_FILE) -> None:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        table = tomllib.loads(Path(path).read_text())
        self.gpu_ranges: dict[str, dict[str, Range]] = {}
        for name, entry in table["gpu"].items():
            if name not in GPU_CONSTANTS:
                raise ValueError(f"{path}: unknown GPU constant {name!r}")
            per_gpu = {k: v for k, v in entry.items() if isinstance(v, dict)}
            self.gpu_ranges[name] = {"*": _range(entry, f"gpu.{name}", path)}
            for key, sub in per_gpu.items():
                self.gpu_ranges[name][key] = _range(sub, f"gpu.{name}.{key}", path)
        self.engine_ranges: dict[str, dict[str, Range]] = {}
        for key, entry in table["engine"].items():
            unknown = set(entry) - set(HOST_TERMS)
            if unknown:
                raise ValueError(f"{path}: engine {key!r}: unknown constant(s) "
                                 f"{', '.join(sorted(unknown))}")
            self.engine_ranges[key] = {name: _range(sub, f"engine.{key}.{name}", path)
                                       for name, sub in entry.items()}

    def gpu(self, key: str, name: str) -> Range:
        ranges = self.gpu_ranges[name]
        return ranges.get(key, ranges["*"])

    def engine(self, key: str, name: str) -> Range:
        if key not in self.engine_ranges or name not in self.engine_ranges[key]:
            raise ValueError(f"bounds.toml has no range for engine {key!r}, {name}")
        return self.engine_ranges[key][name]

    def range_of(self, name: tuple) -> Range:
        """The range of a fitted value named (kind, key, constant) as world.Constants
        names them."""
        kind, key, constant = name
        return self.gpu(key, constant) if kind == "gpu" else self.engine(key, constant)

    def check(self, values: dict[tuple, float]) -> list[str]:
        """Every (kind, key, constant) = value outside its range, as sentences."""
        out = []
        for name, value in sorted(values.items()):
            r = self.range_of(name)
            if value not in r:
                out.append(f"{'.'.join(name)} = {value:.4g} outside [{r.low:.4g}, "
                           f"{r.high:.4g}] ({r.source})")
        return out


def _range(entry: dict, where: str, path: Path) -> Range:
    try:
        low, high, prior = (float(entry[k]) for k in ("low", "high", "prior"))
        source = str(entry["source"])
    except KeyError as e:
        raise ValueError(f"{path}: [{where}] lacks {e.args[0]}") from None
    if not 0 <= low <= prior <= high:
        raise ValueError(f"{path}: [{where}] needs 0 <= low <= prior <= high")
    return Range(low, high, prior, source)


__all__ = ["BOUNDS_FILE", "Bounds", "GPU_CONSTANTS", "Range"]
