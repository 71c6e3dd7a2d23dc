"""What a serving engine spends on the host per step: the cost model's host terms, as data.

The GPU terms of a step (GEMMs, attention, all-reduces) belong to the hardware and live in
gpus.toml. What the engine's own code costs around them (scheduling, preparing inputs,
sampling, detokenizing, launching kernels, an HTTP front end) belongs to the engine, and
differs between engines and between versions of one engine by several times: vLLM's
v0.6.0 post measured the host at well over half of a Llama-3-8B step on an H100 in v0.5.3.
So those constants are a table of their own, `engines.toml` beside this file, one entry per
engine (and version family), each constant with what it was fitted on:

    step_overhead_s   seconds per step          scheduling, the step's fixed host work
    row_overhead_s    seconds per scheduled row preparing its inputs and block table
    sample_row_s      seconds per sampling row  sampling, detokenizing, appending
    front_end_row_s   seconds per streamed token   an HTTP front end (served runs only)
    front_end_request_s  seconds per request    an HTTP front end receiving, parsing and
                                                tokenizing a request before the engine
                                                sees it (served runs only): part of TTFT
    eager_layer_s     seconds per layer         launching a layer's kernels one by one (a
                                                step without a CUDA graph)

and three properties: `kv_read_per_query_head`, of its attention kernel: an engine without a
grouped-query decode kernel reads each KV head once for every query head that shares it
(TensorRT-LLM before its Hopper XQA kernels for Llama 2 70B, release 0.10.0), which
multiplies B_kv by num_heads / num_kv_heads; and `async_output`: the engine processes a
step's outputs while the next step runs (vLLM 0.6's asynchronous output processing), so
sample_row_s is a lane beside the GPU's work instead of a term after it (cost_model.py);
and `custom_allreduce`: its tensor-parallel all-reduce is a custom one-shot kernel over
NVLink rather than NCCL's ring, which prices the all-reduce's latency differently
(cost_model.py).

`CostModel` adds them as its `launch` and `cpu` terms (cost_model.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

ENGINES_FILE = Path(__file__).with_name("engines.toml")
DEFAULT_ENGINE = "vllm"


@dataclass(frozen=True)
class EngineOverheads:
    key: str
    name: str
    step_overhead_s: float
    row_overhead_s: float
    sample_row_s: float
    front_end_row_s: float
    eager_layer_s: float
    front_end_request_s: float = 0.0
    # The decode attention reads each KV head once per query head of its group (no
    # grouped-query reuse): KV bytes x num_heads / num_kv_heads.
    kv_read_per_query_head: bool = False
    # The outputs of step n are processed while step n + 1 runs.
    async_output: bool = False
    # The tensor-parallel all-reduce is a custom one-shot kernel, not NCCL's ring.
    custom_allreduce: bool = False
    source: dict[str, str] = field(default_factory=dict)

    def apply(self, eff):
        """`eff` (cost_model.Efficiencies) with this engine's host terms (those of a step:
        front_end_request_s is the engine's, SimulatedEngine delays arrivals by it)."""
        return dataclasses.replace(eff, **{name: getattr(self, name) for name in STEP_TERMS})

    def describe(self) -> str:
        return (f"engine {self.name}: host {self.step_overhead_s * 1e3:.2f} ms/step + "
                f"{self.row_overhead_s * 1e6:.1f} us/row + {self.sample_row_s * 1e6:.1f} "
                f"us/sampled row, HTTP {self.front_end_request_s * 1e3:.2f} ms/request + "
                f"{self.front_end_row_s * 1e6:.1f} us/streamed token, "
                f"eager launch {self.eager_layer_s * 1e6:.1f} us/layer "
                f"({self.source.get('fitted_on', '')})")


STEP_TERMS = ("step_overhead_s", "row_overhead_s", "sample_row_s", "front_end_row_s",
              "eager_layer_s")
HOST_TERMS = (*STEP_TERMS, "front_end_request_s")
FLAGS = ("kv_read_per_query_head", "async_output", "custom_allreduce")


def engine_names() -> list[str]:
    from refserve.simulator.hardware import read_table_file

    return list(read_table_file(ENGINES_FILE))


def load_engine(key: str = DEFAULT_ENGINE) -> EngineOverheads:
    """The entry `key` of engines.toml; every host term a number >= 0."""
    from refserve.simulator.hardware import read_table_file

    tables = read_table_file(ENGINES_FILE)
    if key not in tables:
        raise ValueError(f"unknown engine {key!r}; choose one of {', '.join(tables)} "
                         f"(refserve/simulator/engines.toml)")
    table = dict(tables[key])
    for name in HOST_TERMS:
        value = table.get(name, 0.0 if name == "front_end_request_s" else None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"engine {key!r}: {name}={value!r} must be a number >= 0")
    flags = {name: table.get(name, False) for name in FLAGS}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"engine {key!r}: {name} must be true or false")
    unknown = set(table) - set(HOST_TERMS) - {"name", "source", *FLAGS}
    if unknown:
        raise ValueError(f"engine {key!r}: unknown field(s) {', '.join(sorted(unknown))}")
    return EngineOverheads(key=key, name=table.get("name", key),
                           **{name: float(table.get(name, 0.0)) for name in HOST_TERMS},
                           **flags, source=dict(table.get("source", {})))
