"""The simulator against the world: published GPU measurements and how each is set up.

refserve/simulator/measurements/ holds one TOML file per public source; each row is a
number the source printed, with its settings (`Measurement`). `Constants` are the GPU
profiles and engine host terms a replay uses (by default the shipped gpus.toml and
engines.toml); `engine_for` builds the simulated engine a row runs on. world_replay.py
replays a row, world_fit.py fits the constants, world_validate.py leaves sources out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

from refserve.capacity import blocks_for_tokens
from refserve.config import EngineConfig
from refserve.simulator.cost_model import CostModel
from refserve.simulator.engine import SimulatedEngine
from refserve.simulator.engine_overheads import HOST_TERMS, EngineOverheads, load_engine
from refserve.simulator.hardware import GpuProfile, apply_overrides, load_gpu, load_model
from refserve.simulator.workload import SimRequest, make_workload

MEASUREMENTS_DIR = Path(__file__).with_name("measurements")

# The rows the shipped fit never sees, chosen before fitting: within each source, rows
# between the settings of its fit rows (the middle lengths of a table, the second arrival
# rate of an online run, the middle tensor-parallel degree). The headline validation
# leaves whole sources out (bench sim-world); these judge the shipped constants.
HELD_OUT = (
    "trt-a100-7b-2048-128", "trt-a100-70b-128-2048", "trt-h100-7b-128-2048",
    "trt-h100-70b-2048-2048-tp2", "trt-a100-70b-ttft-2048", "trt-h100-7b-ttft-2048",
    "sglang-a100-8b-rate8-tpot", "sglang-h100-70b-rate8-ttft", "vllm-h100-70b-rate8-tpot",
    "vllm-a100-8b-offline", "vllm-a100-8b-rate8-ttft", "sglang-h100-70b-rate8-itl",
    "gptfast-a100-7b-tp4", "gptfast-a100-70b-tp4",
    "gptfast-nccl-a100-7b-tp4", "gptfast-nccl-a100-70b-tp4",
    "lmdeploy-a100-7b-b1-128-2048", "lmdeploy-a100-70b-ttft-128",
    "lmdeploy-a100-70b-sharegpt-b128",
    "trt1-h200-8b-5000-500", "trt1-h100-8b-2048-128",
)

METRIC_UNITS = {"output_tokens_per_s": "tok/s", "ttft_ms": "ms", "ttft_p50_ms": "ms",
                "tpot_p50_ms": "ms", "itl_p50_ms": "ms"}
# The fitted GPU constants of a profile live under another's key when both are one chip:
# an H200 is an H100's Hopper die with more and faster HBM (gpus.toml).
FIT_GPU = {"h200-141gb": "h100-80gb"}


@dataclass(frozen=True)
class Measurement:
    """One published number (the fields of a measurements/*.toml row)."""

    id: str
    source: str          # the public page at a fixed commit
    source_key: str      # its [source] key
    publisher: str
    where: str
    engine: str
    version: str
    engine_profile: str
    model: str
    gpu: str
    tp: int
    dtype: str
    replay: str
    metric: str
    value: float
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    batch_size: int | None = None
    workload: str | None = None
    num_requests: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    rate: str = "inf"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    num_scheduler_steps: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    served: bool = False
    # the engine's collective library where the run used another than its profile's
    # (engines.toml custom_allreduce); None: the profile's
    custom_allreduce: bool | None = None
    note: str = ""

    @property
    def role(self) -> str:
        return "held-out" if self.id in HELD_OUT else "fit"

    @property
    def rate_per_s(self) -> float:
        return math.inf if self.rate == "inf" else float(self.rate)

    @property
    def schedule_fixed(self) -> bool:
        """Whether the schedule is the same under any step times (static, or all at once)."""
        return self.replay == "static" or math.isinf(self.rate_per_s)

    def describe(self) -> str:
        load = (f"batch {self.batch_size}, {self.input_len}/{self.output_len} tokens"
                if self.replay == "static" else
                f"{self.num_requests} {self.workload} requests at {self.rate} req/s")
        precision = self.dtype + (" + fp8 weights" if self.quantization else "") + (
            " + fp8 KV" if self.kv_cache_dtype != "auto" else "")
        return (f"{self.engine} {self.version}, {self.model}, {self.tp} x {self.gpu}, "
                f"{precision}, {load}")


def load_measurements(directory: Path = MEASUREMENTS_DIR) -> list[Measurement]:
    """Every row of every measurements/*.toml, each with its file's [source] and
    [defaults] filled in."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    names = {f.name for f in dataclasses.fields(Measurement)}
    out = []
    for path in sorted(Path(directory).glob("*.toml")):
        data = tomllib.loads(path.read_text())
        source, defaults = data["source"], data.get("defaults", {})
        for row in data["measurement"]:
            row = {**defaults, **row, "source": source["url"], "source_key": source["key"],
                   "publisher": source["publisher"]}
            unknown = set(row) - names
            if unknown:
                raise ValueError(f"{path.name} row {row.get('id')}: unknown field(s) "
                                 f"{', '.join(sorted(unknown))}")
            row["quantization"] = row.get("quantization") or None
            out.append(Measurement(**row))
    ids = [m.id for m in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{directory}: measurement ids repeat")
    unknown = set(HELD_OUT) - set(ids)
    if unknown:
        raise ValueError(f"HELD_OUT names unknown rows: {', '.join(sorted(unknown))}")
    return out


# ---- the constants being judged -----------------------------------------------------

GPU_VALUES = {"flops": "flops_efficiency", "fp8_flops": "fp8_flops_efficiency",
              "bandwidth": "bandwidth_efficiency", "attention": "attention_efficiency",
              "kv_bandwidth": "kv_bandwidth_efficiency"}
# the GPU constants in seconds the fit moves
LATENCIES = ("allreduce_latency_s", "allreduce_hop_s", "custom_allreduce_latency_s",
             "kernel_gap_s")
# a fraction that 0 means "the same as another" in gpus.toml
SAME_AS = {"kv_bandwidth_efficiency": "bandwidth_efficiency",
           "fp8_flops_efficiency": "flops_efficiency"}


@dataclass
class Constants:
    """The GPU profiles and engine host terms a replay uses, by key (default: the
    shipped ones). `values()` names the fitted ones ("gpu", key, constant) or ("engine",
    key, constant), in their units (efficiencies as fractions)."""

    gpus: dict[str, GpuProfile] = field(default_factory=dict)
    engines: dict[str, EngineOverheads] = field(default_factory=dict)

    def gpu(self, key: str) -> GpuProfile:
        if key not in self.gpus:
            self.gpus[key] = load_gpu(key)
        return self.gpus[key]

    def engine(self, key: str) -> EngineOverheads:
        if key not in self.engines:
            self.engines[key] = load_engine(key)
        return self.engines[key]

    def values(self) -> dict[tuple, float]:
        out = {}
        for key, g in self.gpus.items():
            fit_key = FIT_GPU.get(key, key)
            for name in GPU_VALUES.values():
                if name == "fp8_flops_efficiency" and "fp8" not in g.peak_flops:
                    continue  # no fp8 GEMMs on this GPU
                value = getattr(g, name) or getattr(g, SAME_AS.get(name, name))
                out[("gpu", fit_key, name)] = value
            out[("gpu", fit_key, "allreduce_latency_s")] = g.allreduce_latency_s
            out[("gpu", fit_key, "allreduce_hop_s")] = g.allreduce_hop_s
            out[("gpu", fit_key, "custom_allreduce_latency_s")] = (
                g.custom_allreduce_latency_s or g.allreduce_latency_s)
            out[("gpu", fit_key, "kernel_gap_s")] = g.kernel_gap_s
        for key, e in self.engines.items():
            for name in HOST_TERMS:
                out[("engine", key, name)] = getattr(e, name)
        return out

    def with_values(self, values: dict[tuple, float]) -> Constants:
        gpus = {}
        for key, g in self.gpus.items():
            fit_key = FIT_GPU.get(key, key)
            gpus[key] = apply_overrides(g, {
                name: values[("gpu", fit_key, name)]
                for name in (*GPU_VALUES.values(), *LATENCIES)
                if ("gpu", fit_key, name) in values})
        engines = {key: dataclasses.replace(e, **{n: values.get(("engine", key, n),
                                                                 getattr(e, n))
                                                  for n in HOST_TERMS})
                   for key, e in self.engines.items()}
        return Constants(gpus, engines)

    def digest(self, m: Measurement) -> str:
        """A hash of the constants a replay of `m` reads (the replay cache's key)."""
        g, e = self.gpu(m.gpu), self.engine(m.engine_profile)
        text = repr((dataclasses.astuple(g), dataclasses.astuple(e)))
        return hashlib.sha1(text.encode()).hexdigest()


# ---- setting a measurement up -------------------------------------------------------


def requests_of(m: Measurement, vocab_size: int, scale: float = 1.0) -> list[SimRequest]:
    """The requests of a measurement (`scale` < 1: fewer of them, for a quick run)."""
    if m.replay == "static":
        return make_workload("random", m.batch_size, math.inf, vocab_size=vocab_size,
                             max_model_len=m.input_len + m.output_len,
                             input_len=m.input_len, output_len=m.output_len)
    n = max(50, int(m.num_requests * scale)) if scale < 1 else m.num_requests
    return make_workload(m.workload, n, m.rate_per_s, vocab_size=vocab_size,
                         max_model_len=serving_max_model_len(m), seed=0,
                         input_len=m.input_len or 1024, output_len=m.output_len or 128)


def serving_max_model_len(m: Measurement) -> int:
    if m.max_model_len:
        return m.max_model_len
    return max(4096, (m.input_len or 0) + (m.output_len or 0))


def engine_config(m: Measurement) -> EngineConfig:
    if m.replay == "static":
        # The whole batch's prompts in one step, then every decode together; the engine
        # was built for this batch, so the pool holds all of it.
        tokens = m.input_len + m.output_len
        return EngineConfig(batching="static", max_num_seqs=m.batch_size,
                            max_num_batched_tokens=m.batch_size * m.input_len,
                            max_model_len=tokens, enable_prefix_caching=False,
                            num_gpu_blocks_override=m.batch_size * blocks_for_tokens(
                                tokens, EngineConfig.block_size),
                            dtype=m.dtype)
    return EngineConfig(max_num_seqs=m.max_num_seqs,
                        max_num_batched_tokens=m.max_num_batched_tokens,
                        enable_chunked_prefill=m.enable_chunked_prefill,
                        enable_prefix_caching=False, max_model_len=serving_max_model_len(m),
                        gpu_memory_utilization=m.gpu_memory_utilization, dtype=m.dtype)


def engine_profile(m: Measurement, constants: Constants) -> EngineOverheads:
    """The engine profile `m` ran on, with the row's collective library if it names one."""
    engine = constants.engine(m.engine_profile)
    if m.custom_allreduce is None:
        return engine
    return dataclasses.replace(engine, custom_allreduce=m.custom_allreduce)


def engine_for(m: Measurement, constants: Constants, cost_model=None) -> SimulatedEngine:
    return SimulatedEngine(load_model(m.model), constants.gpu(m.gpu), engine_config(m),
                           tensor_parallel_size=m.tp, cost_model=cost_model,
                           quantization=m.quantization, kv_cache_dtype=m.kv_cache_dtype,
                           engine=engine_profile(m, constants), served=m.served,
                           num_scheduler_steps=m.num_scheduler_steps)


def cost_model_for(m: Measurement, constants: Constants) -> CostModel:
    """The cost model `m` is replayed with under `constants` (its engine's request term
    attached as `front_end_request_s`)."""
    cost_model = engine_for(m, constants).cost_model
    engine = constants.engine(m.engine_profile)
    cost_model.front_end_request_s = engine.front_end_request_s if m.served else 0.0
    return cost_model


__all__ = ["Constants", "HELD_OUT", "Measurement", "cost_model_for", "engine_for",
           "load_measurements"]
