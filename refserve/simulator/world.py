"""The simulator against the world: published GPU measurements, replayed.

refserve/simulator/measurements/ holds one TOML file per public source; each row is a
number the source printed, with its settings. `replay` simulates a row with a set of
`Constants` (the GPU profiles and engine host terms: by default the shipped gpus.toml and
engines.toml) and returns the predicted number, and the metric's time as weighted steps,
so that the fit (world_fit.py) can price the same run under other constants without
simulating it again:

    T = sum_k w_k t_k + sum_k v_k delay_k + [front_end_request_s]     (seconds)

with t_k the k-th step's time, delay_k the time from its end to its tokens reaching the
client (cost_model.delivery_delay), w and v the metric's weights:

    output_tokens_per_s   all steps (w = 1) and the last delivery; value = tokens / T
    ttft_ms / ttft_p50_ms the median request's: the steps from its arrival (the first one
                          by the part after it) to the step that delivered its first token
    tpot_p50_ms           the median request's steps after its first delivery up to its
                          last, over its tokens - 1
    itl_p50_ms            the median inter-token gap: the steps between two deliveries

A run whose schedule cannot depend on the step times (a static batch; every request
arriving at once) is simulated once per process and priced anew for any constants
(`Replay.predict`); a run with arrivals over time is simulated again when the constants
change (`replay` caches by the constants it used).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from refserve.config import EngineConfig
from refserve.metrics import percentile
from refserve.simulator.composition import CompositionArrays, StepComposition
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

GPU_VALUES = {"flops": "flops_efficiency", "bandwidth": "bandwidth_efficiency",
              "attention": "attention_efficiency", "kv_bandwidth": "kv_bandwidth_efficiency"}


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
                value = getattr(g, name)
                if name == "kv_bandwidth_efficiency" and not value:
                    value = g.bandwidth_efficiency
                out[("gpu", fit_key, name)] = value
            out[("gpu", fit_key, "allreduce_latency_s")] = g.allreduce_latency_s
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
                name: values.get(("gpu", fit_key, name), getattr(g, name))
                for name in (*GPU_VALUES.values(), "allreduce_latency_s", "kernel_gap_s")})
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


# ---- replaying one measurement --------------------------------------------------------


class _Recorder:
    """A cost model that records every step's composition (for the fit)."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.steps: list[StepComposition] = []

    def step_time(self, out, scheduled: bool = True) -> float:
        comp = StepComposition.of(out, scheduled)
        self.steps.append(comp)
        return self.cost_model.time(comp)

    def out_delay(self, out) -> float:
        return self.cost_model.out_delay(out)


@dataclass
class Replay:
    """A simulated measurement (module docstring): `predicted` in the metric's unit; the
    metric's time as `weights` on the steps and `delay_weights` on their delivery
    delays; `published_seconds` the published number as that time."""

    measurement: Measurement
    predicted: float
    steps: CompositionArrays
    weights: np.ndarray
    delay_weights: np.ndarray
    cost_model: CostModel
    published_seconds: float
    tokens: int = 0          # output tokens of the run (throughput rows)
    constants_digest: str = ""

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return (self.predicted - self.measurement.value) / self.measurement.value

    def seconds(self, cost_model: CostModel) -> float:
        """The metric's time under `cost_model` (this run's schedule)."""
        m = self.measurement
        t = cost_model.time(self.steps)
        delay = cost_model.delivery_delay(self.steps)
        total = float(self.weights @ t + self.delay_weights @ delay)
        if m.served and (m.metric.startswith("ttft") or m.metric == "output_tokens_per_s"):
            total += cost_model.front_end_request_s  # the front end held the request
        return total

    def value_of(self, seconds: float) -> float:
        """The metric's value for a metric time."""
        if self.measurement.metric == "output_tokens_per_s":
            return self.tokens / seconds
        return seconds * 1e3

    def predict(self, constants: Constants) -> float:
        """The metric under other constants, on this run's schedule (exact for a
        schedule_fixed row; a first-order estimate for the others)."""
        return self.value_of(self.seconds(cost_model_for(self.measurement, constants)))


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
                            num_gpu_blocks_override=m.batch_size * -(-tokens // 16),
                            dtype=m.dtype)
    return EngineConfig(max_num_seqs=m.max_num_seqs,
                        max_num_batched_tokens=m.max_num_batched_tokens,
                        enable_chunked_prefill=m.enable_chunked_prefill,
                        enable_prefix_caching=False, max_model_len=serving_max_model_len(m),
                        gpu_memory_utilization=m.gpu_memory_utilization, dtype=m.dtype)


def engine_for(m: Measurement, constants: Constants, cost_model=None) -> SimulatedEngine:
    return SimulatedEngine(load_model(m.model), constants.gpu(m.gpu), engine_config(m),
                           tensor_parallel_size=m.tp, cost_model=cost_model,
                           quantization=m.quantization, kv_cache_dtype=m.kv_cache_dtype,
                           engine=constants.engine(m.engine_profile), served=m.served,
                           num_scheduler_steps=m.num_scheduler_steps)


def cost_model_for(m: Measurement, constants: Constants) -> CostModel:
    """The cost model `m` is replayed with under `constants` (its engine's request term
    attached as `front_end_request_s`)."""
    cost_model = engine_for(m, constants).cost_model
    engine = constants.engine(m.engine_profile)
    cost_model.front_end_request_s = engine.front_end_request_s if m.served else 0.0
    return cost_model


_RUNS: dict[tuple, tuple] = {}


def run_key(m: Measurement) -> Measurement:
    """`m` without what only says which number of the run it is (its id, metric, value):
    the rows of one run share one simulation."""
    return dataclasses.replace(m, id="", where="", metric="", value=0.0, note="")


def replay(m: Measurement, constants: Constants | None = None, scale: float = 1.0
           ) -> Replay:
    """Simulate measurement `m` with `constants` (default: the shipped profiles). A
    schedule_fixed run is simulated once per process and scale, another run once per
    constants and scale; the rows of one run share its simulation."""
    constants = constants or Constants()
    digest = constants.digest(m)
    key = (run_key(m), scale) if m.schedule_fixed else (run_key(m), scale, digest)
    if key not in _RUNS:
        _RUNS[key] = _simulate(m, constants, scale)
    steps, result, run_digest = _RUNS[key]
    cost_model = cost_model_for(m, constants)
    r = _metric(m, steps, result, cost_model)
    r.constants_digest = digest
    if run_digest == digest:
        _check_against_simulation(m, r, result)
    return r


def _simulate(m: Measurement, constants: Constants, scale: float) -> tuple:
    """(the steps' compositions, the SimResult, the constants' digest) of `m`'s run."""
    recorder = _Recorder(cost_model_for(m, constants))
    engine = engine_for(m, constants, cost_model=recorder)
    result = engine.run(requests_of(m, engine.model.vocab_size, scale))
    return CompositionArrays.of(recorder.steps), result, constants.digest(m)


def _metric(m: Measurement, steps: CompositionArrays, result, cost_model: CostModel
            ) -> Replay:
    """The Replay of measurement `m` on its run (the weights of the module docstring)."""
    t0, t1 = np.array(result.timeline["t"]), np.array(result.timeline["t_end"])
    weights, delays = np.zeros(len(t1)), np.zeros(len(t1))
    delivered = result.delivery
    metrics = result.metrics
    tokens = 0
    if m.metric == "output_tokens_per_s":
        tokens = sum(x.num_output_tokens for x in metrics.values())
        weights[:] = 1.0
        delays[max(delivered.last.values())] = 1.0
    elif m.metric in ("ttft_ms", "ttft_p50_ms"):
        for rid in _middle(list(metrics), lambda r: metrics[r].ttft):
            share = 0.5 if len(metrics) % 2 == 0 else 1.0
            seen = metrics[rid].arrival_time + cost_model.front_end_request_s
            first = delivered.first[rid]
            span = (t1 > seen) & (np.arange(len(t1)) <= first)
            part = span.astype(float)
            k = int(np.argmax(span))
            if span.any() and t0[k] < seen:  # arrived mid-step
                part[k] = (t1[k] - seen) / (t1[k] - t0[k])
            weights += share * part
            delays[first] += share
    elif m.metric == "tpot_p50_ms":
        decoding = [r for r, x in metrics.items() if x.tpot is not None]
        share = 0.5 if len(decoding) % 2 == 0 else 1.0
        for rid in _middle(decoding, lambda r: metrics[r].tpot):
            a, b = delivered.first[rid], delivered.last[rid]
            per_token = share / (metrics[rid].num_output_tokens - 1)
            weights[a + 1:b + 1] += per_token
            delays[b] += per_token
            delays[a] -= per_token
    elif m.metric == "itl_p50_ms":
        gaps = np.asarray(delivered.gaps, dtype=np.int64).reshape(-1, 2)
        order = np.argsort(np.asarray(result.itl), kind="stable")
        share = 0.5 if len(gaps) % 2 == 0 else 1.0
        for j in _middle(list(range(len(gaps))), None, order):
            a, b = gaps[j]
            weights[a + 1:b + 1] += share
            delays[b] += share
            delays[a] -= share
    else:
        raise ValueError(f"measurement {m.id}: unknown metric {m.metric!r}")
    r = Replay(m, 0.0, steps, weights, delays, cost_model, 0.0, tokens)
    r.predicted = r.value_of(r.seconds(cost_model))
    r.published_seconds = (tokens / m.value if m.metric == "output_tokens_per_s"
                           else m.value / 1e3)
    return r


def _middle(ids: list, key, order=None) -> list:
    """The one (odd count) or two (even count) members whose mean is the median, as
    np.percentile(..., 50) takes it."""
    ranked = [ids[i] for i in order] if order is not None else sorted(ids, key=key)
    n = len(ranked)
    return [ranked[(n - 1) // 2]] if n % 2 else [ranked[n // 2 - 1], ranked[n // 2]]


def _check_against_simulation(m: Measurement, r: Replay, result) -> None:
    """The weighted steps must give back the simulated metric (the fit relies on it)."""
    s = result.summary
    if m.metric == "output_tokens_per_s":
        return
    simulated = {"ttft_ms": percentile([x.ttft for x in result.metrics.values()], 50),
                 "ttft_p50_ms": percentile([x.ttft for x in result.metrics.values()], 50),
                 "tpot_p50_ms": percentile([x.tpot for x in result.metrics.values()
                                            if x.tpot is not None], 50),
                 "itl_p50_ms": percentile(list(result.itl), 50)}[m.metric]
    if simulated is None or not math.isclose(r.predicted, 1e3 * simulated, rel_tol=1e-6,
                                             abs_tol=1e-9):
        raise AssertionError(f"{m.id}: weighted steps give {r.predicted:.6g} ms, the "
                             f"simulation {simulated} s ({s.format()})")


__all__ = ["Constants", "HELD_OUT", "Measurement", "Replay", "load_measurements", "replay"]
