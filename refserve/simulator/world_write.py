"""Writing fitted constants into gpus.toml and engines.toml (`bench sim-world --fit
--write`), four significant digits each, every other line of the files kept as it is."""

from __future__ import annotations

import re

from refserve.simulator.engine_overheads import ENGINES_FILE, HOST_TERMS
from refserve.simulator.hardware import PROFILES_FILE
from refserve.simulator.world import FIT_GPU, GPU_VALUES, LATENCIES, Constants

SIGNIFICANT = 4
GPU_FIELDS = (*GPU_VALUES.values(), *LATENCIES)


def shipped_value(value: float) -> float:
    """A constant as the files hold it: rounded to SIGNIFICANT digits."""
    return float(f"{value:.{SIGNIFICANT}g}")


def replace_in_table(text: str, table: str, values: dict[str, float]) -> str:
    """`text` (TOML) with `name = ...` lines of [table] set to `values`."""
    header = re.compile(r"^\[" + re.escape(table) + r"\]\s*$", re.M)
    match = header.search(text)
    if match is None:
        raise ValueError(f"no [{table}] table to write into")
    end = re.compile(r"^\[", re.M).search(text, match.end())
    stop = end.start() if end else len(text)
    body = text[match.end():stop]
    for name, value in values.items():
        line = re.compile(r"^" + re.escape(name) + r"\s*=.*$", re.M)
        new = f"{name} = {shipped_value(value):.{SIGNIFICANT}g}"
        body, n = line.subn(new, body)
        if n != 1:
            raise ValueError(f"[{table}] has {n} lines for {name}")
    return text[:match.end()] + body + text[stop:]


def write_constants(constants: Constants) -> list[str]:
    """Write every fitted value of `constants` into the shipped files; the GPUs sharing a
    chip's constants (world.FIT_GPU) get them too. Returns the tables written."""
    values = constants.values()
    written = []
    text = PROFILES_FILE.read_text()
    for key in constants.gpus:
        fit_key = FIT_GPU.get(key, key)
        text = replace_in_table(text, key, {n: values[("gpu", fit_key, n)] for n in GPU_FIELDS
                                            if ("gpu", fit_key, n) in values})
        written.append(key)
    PROFILES_FILE.write_text(text)
    text = ENGINES_FILE.read_text()
    for key in constants.engines:
        text = replace_in_table(text, key, {n: values[("engine", key, n)] for n in HOST_TERMS})
        written.append(key)
    ENGINES_FILE.write_text(text)
    return written


__all__ = ["replace_in_table", "shipped_value", "write_constants"]
