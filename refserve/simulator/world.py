"""The simulator against the world: published GPU measurements replayed, and the fit of the
cost model's constants to them.

`measurements.toml` holds each published number with its settings and source. `replay`
simulates one of them with the built-in profiles (gpus.toml for the GPU, engines.toml for
the engine's host terms) and returns the predicted number, with the metric's time as
weighted steps; `world_fit.fit` chooses the constants that make the rows it is given
agree; `HELD_OUT` names the rows the fit never sees, on which the fitted constants are
judged (`python -m refserve.bench sim-world`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from refserve.config import EngineConfig
from refserve.metrics import percentile
from refserve.simulator.cost_model import CostModel, StepComposition
from refserve.simulator.engine import SimulatedEngine
from refserve.simulator.engine_overheads import HOST_TERMS, EngineOverheads, load_engine
from refserve.simulator.hardware import GpuProfile, apply_overrides, load_gpu, load_model
from refserve.simulator.workload import SimRequest, make_workload

MEASUREMENTS_FILE = Path(__file__).with_name("measurements.toml")

# The rows the fit never sees, chosen before fitting: one of each kind of number (static
# batch throughput, batch-1 TTFT, online median TPOT and TTFT, offline throughput) on
# each GPU and for each engine, at settings between those of the fit rows (the middle
# batch sizes and lengths of a table, the second arrival rate of an online run).
HELD_OUT = (
    "trt-a100-7b-2048-128",        # A100 fp16, long prompt / short output, static batch
    "trt-a100-70b-128-2048",       # A100 fp16, 70B TP4, short prompt / long output
    "trt-h100-7b-128-2048",        # H100 fp8 weights + KV, decode-heavy
    "trt-h100-70b-2048-2048-tp2",  # H100 fp8, 70B TP2, long both ways
    "trt-a100-70b-ttft-2048",      # a batch-1 prefill on 4 x A100
    "trt-h100-7b-ttft-2048",       # a batch-1 prefill on an H100 in fp8
    "sglang-a100-8b-rate8-tpot",   # prefill-first schedule under Poisson load
    "sglang-h100-70b-rate8-ttft",  # its TTFT on 4 x H100
    "vllm-h100-70b-rate8-tpot",    # vLLM 0.6 on 4 x H100
    "vllm-a100-8b-offline",        # vLLM 0.6 offline throughput on an A100
)

METRIC_UNITS = {"output_tokens_per_s": "tok/s", "ttft_ms": "ms", "ttft_p50_ms": "ms",
                "tpot_p50_ms": "ms"}


@dataclass(frozen=True)
class Measurement:
    """One published number (measurements.toml's fields)."""

    id: str
    source: str
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
    served: bool = False
    note: str = ""

    @property
    def role(self) -> str:
        return "held-out" if self.id in HELD_OUT else "fit"

    @property
    def rate_per_s(self) -> float:
        return math.inf if self.rate == "inf" else float(self.rate)

    def describe(self) -> str:
        load = (f"batch {self.batch_size}, {self.input_len}/{self.output_len} tokens"
                if self.replay == "static" else
                f"{self.num_requests} {self.workload} requests at {self.rate} req/s")
        precision = self.dtype + (" + fp8 weights" if self.quantization else "") + (
            " + fp8 KV" if self.kv_cache_dtype != "auto" else "")
        return (f"{self.engine} {self.version}, {self.model}, {self.tp} x {self.gpu}, "
                f"{precision}, {load}")


def load_measurements(path: Path = MEASUREMENTS_FILE) -> list[Measurement]:
    """Every row of measurements.toml (an array of [[measurement]] tables)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    rows = tomllib.loads(Path(path).read_text())["measurement"]
    out = []
    for row in rows:
        row = dict(row)
        row["quantization"] = row.get("quantization") or None
        out.append(Measurement(**row))
    ids = [m.id for m in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: measurement ids repeat")
    unknown = set(HELD_OUT) - set(ids)
    if unknown:
        raise ValueError(f"HELD_OUT names unknown rows: {', '.join(sorted(unknown))}")
    return out


# ---- the constants being judged -----------------------------------------------------


@dataclass
class Constants:
    """The GPU profiles and engine host terms a replay uses, by key (default: the
    built-in ones)."""

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

    # Fitted values by name: ("gpu", key, name) or ("engine", key, name).
    def values(self) -> dict[tuple, float]:
        out = {}
        for key, g in self.gpus.items():
            out[("gpu", key, "flops")] = 1 / g.flops_efficiency
            out[("gpu", key, "bandwidth")] = 1 / g.bandwidth_efficiency
            out[("gpu", key, "attention")] = 1 / g.attention_efficiency
            out[("gpu", key, "kv_bandwidth")] = 1 / (g.kv_bandwidth_efficiency
                                                     or g.bandwidth_efficiency)
            out[("gpu", key, "allreduce_latency_s")] = g.allreduce_latency_s
        for key, e in self.engines.items():
            for name in HOST_TERMS:
                out[("engine", key, name)] = getattr(e, name)
        return out

    def with_values(self, values: dict[tuple, float]) -> Constants:
        gpus = {}
        for key, g in self.gpus.items():
            gpus[key] = apply_overrides(g, {
                "flops_efficiency": min(1.0, 1 / values[("gpu", key, "flops")]),
                "bandwidth_efficiency": min(1.0, 1 / values[("gpu", key, "bandwidth")]),
                "attention_efficiency": min(1.0, 1 / values[("gpu", key, "attention")]),
                "kv_bandwidth_efficiency": min(1.0, 1 / values[("gpu", key, "kv_bandwidth")]),
                "allreduce_latency_s": values[("gpu", key, "allreduce_latency_s")]})
        engines = {key: dataclasses.replace(e, **{n: values[("engine", key, n)]
                                                  for n in HOST_TERMS})
                   for key, e in self.engines.items()}
        return Constants(gpus, engines)


# ---- replaying one measurement --------------------------------------------------------


class _Recorder:
    """A cost model that records every step's composition (for the fit)."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.steps: list[StepComposition] = []

    def step_time(self, out) -> float:
        comp = StepComposition.of(out)
        self.steps.append(comp)
        return self.cost_model.time(comp)


@dataclass
class Replay:
    """A simulated measurement: `predicted` in the metric's unit, and the metric's time
    as weighted steps (`weights[k]` of `steps[k]`), `published_seconds` the published
    number as that time."""

    measurement: Measurement
    predicted: float
    steps: list[StepComposition]
    weights: np.ndarray
    cost_model: CostModel
    published_seconds: float

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return (self.predicted - self.measurement.value) / self.measurement.value


def requests_of(m: Measurement, vocab_size: int, scale: float = 1.0) -> list[SimRequest]:
    """The requests of a measurement (`scale` < 1: fewer of them, for a quick run)."""
    if m.replay == "static":
        return make_workload("random", m.batch_size, math.inf, vocab_size=vocab_size,
                             max_model_len=m.input_len + m.output_len,
                             input_len=m.input_len, output_len=m.output_len)
    n = max(50, int(m.num_requests * scale))
    return make_workload(m.workload, n, m.rate_per_s, vocab_size=vocab_size,
                         max_model_len=4096, seed=0)


def engine_for(m: Measurement, constants: Constants, cost_model: CostModel | None = None
               ) -> SimulatedEngine:
    model, gpu = load_model(m.model), constants.gpu(m.gpu)
    if m.replay == "static":
        # The whole batch's prompts in one step, then every decode together; the engine
        # was built for this batch, so the pool holds all of it.
        tokens = m.input_len + m.output_len
        config = EngineConfig(batching="static", max_num_seqs=m.batch_size,
                              max_num_batched_tokens=m.batch_size * m.input_len,
                              max_model_len=tokens, enable_prefix_caching=False,
                              num_gpu_blocks_override=m.batch_size * -(-tokens // 16),
                              dtype=m.dtype)
    else:
        config = EngineConfig(max_num_seqs=m.max_num_seqs,
                              max_num_batched_tokens=m.max_num_batched_tokens,
                              enable_chunked_prefill=m.enable_chunked_prefill,
                              enable_prefix_caching=False, max_model_len=4096,
                              dtype=m.dtype)
    return SimulatedEngine(model, gpu, config, tensor_parallel_size=m.tp,
                           cost_model=cost_model, quantization=m.quantization,
                           kv_cache_dtype=m.kv_cache_dtype,
                           engine=constants.engine(m.engine_profile), served=m.served)


def replay(m: Measurement, constants: Constants | None = None, scale: float = 1.0
           ) -> Replay:
    """Simulate measurement `m` with `constants` (default: the built-in profiles)."""
    constants = constants or Constants()
    probe = engine_for(m, constants)  # sizes the pool, builds the cost model
    recorder = _Recorder(probe.cost_model)
    engine = engine_for(m, constants, cost_model=recorder)
    requests = requests_of(m, probe.model.vocab_size, scale)
    result = engine.run(requests)
    tl = result.timeline
    t0, t1 = np.array(tl["t"]), np.array(tl["t_end"])
    ms = list(result.metrics.values())
    weights = np.zeros(len(recorder.steps))
    if m.metric == "output_tokens_per_s":
        tokens = sum(x.num_output_tokens for x in ms)
        elapsed = t1[-1] - t0[0]
        predicted, published = tokens / elapsed, tokens / m.value
        weights[:] = 1.0
    elif m.metric in ("ttft_ms", "ttft_p50_ms"):
        median = _median_request(ms, lambda x: x.ttft)
        predicted = 1e3 * percentile([x.ttft for x in ms], 50)
        published = m.value / 1e3
        seen = median.arrival_time + engine.front_end_request_s  # the engine's arrival
        span = (t1 > seen) & (t1 <= median.first_token_time + 1e-12)
        weights[span] = 1.0
        first = np.argmax(span)
        if span.any() and t0[first] < seen:  # arrived mid-step
            weights[first] = (t1[first] - seen) / (t1[first] - t0[first])
    elif m.metric == "tpot_p50_ms":
        decoding = [x for x in ms if x.tpot is not None]
        median = _median_request(decoding, lambda x: x.tpot)
        predicted = 1e3 * percentile([x.tpot for x in decoding], 50)
        published = m.value / 1e3
        span = (t1 > median.first_token_time + 1e-12) & (t1 <= median.finish_time + 1e-12)
        weights[span] = 1.0 / (median.num_output_tokens - 1)
    else:
        raise ValueError(f"measurement {m.id}: unknown metric {m.metric!r}")
    return Replay(m, float(predicted), recorder.steps, weights, probe.cost_model,
                  float(published))


def _median_request(ms, key):
    ranked = sorted(ms, key=key)
    return ranked[(len(ranked) - 1) // 2]
