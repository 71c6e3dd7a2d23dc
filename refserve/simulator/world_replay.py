"""Replaying a published measurement on the simulator (world.py's rows).

`replay` simulates a row with a set of `Constants` (the GPU profiles and engine host
terms: by default the shipped gpus.toml and engines.toml) and returns the predicted
number, and the metric's time as weighted steps, so that the fit (world_fit.py) can price
the same run under other constants without simulating it again:

    T = sum_k w_k t_k + sum_k v_k delay_k + [front_end_request_s]     (seconds)

with t_k the k-th step's time, delay_k the time from its outputs' processing to its
tokens reaching the client (cost_model.delivery_delay, and output_lane where no step
followed an async_output step), w and v the metric's weights:

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
import math
from dataclasses import dataclass

import numpy as np

from refserve.metrics import percentile
from refserve.simulator.composition import CompositionArrays, StepComposition
from refserve.simulator.cost_model import CostModel
from refserve.simulator.world import (
    Constants,
    Measurement,
    cost_model_for,
    engine_for,
    requests_of,
)


class _Recorder:
    """A cost model that records every step's composition (for the fit)."""

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.steps: list[StepComposition] = []

    def step_time(self, out, scheduled: bool = True) -> float:
        comp = StepComposition.of(out, scheduled)
        self.steps.append(comp)
        return self.cost_model.time(comp)

    def out_delays(self, out) -> tuple[float, float]:
        return self.cost_model.out_delays(out)


@dataclass
class Replay:
    """A simulated measurement (module docstring): `predicted` in the metric's unit; the
    metric's time as `weights` on the steps, `delay_weights` on their delivery delays
    (the front end's) and `lane_weights` on their output lanes (a delivery after an
    async_output step with no step after it); `published_seconds` the published number
    as that time."""

    measurement: Measurement
    predicted: float
    steps: CompositionArrays
    weights: np.ndarray
    delay_weights: np.ndarray
    lane_weights: np.ndarray
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
        lane = cost_model.output_lane(self.steps)
        total = float(self.weights @ t + self.delay_weights @ delay
                      + self.lane_weights @ lane)
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
    weights, delays, lanes = np.zeros(len(t1)), np.zeros(len(t1)), np.zeros(len(t1))
    delivered = result.delivery
    metrics = result.metrics
    tokens = 0

    def delay(delivery, share):
        """A delivery (at, sampled)'s delay terms, `share` times."""
        delays[delivery[1]] += share
        if delivery[1] in delivered.lane:
            lanes[delivery[1]] += share

    if m.metric == "output_tokens_per_s":
        tokens = sum(x.num_output_tokens for x in metrics.values())
        weights[:] = 1.0
        delay(max(delivered.last.values()), 1.0)
    elif m.metric in ("ttft_ms", "ttft_p50_ms"):
        for rid in _middle(list(metrics), lambda r: metrics[r].ttft):
            share = 0.5 if len(metrics) % 2 == 0 else 1.0
            seen = metrics[rid].arrival_time + cost_model.front_end_request_s
            first = delivered.first[rid]
            span = (t1 > seen) & (np.arange(len(t1)) <= first[0])
            part = span.astype(float)
            k = int(np.argmax(span))
            if span.any() and t0[k] < seen:  # arrived mid-step
                part[k] = (t1[k] - seen) / (t1[k] - t0[k])
            weights += share * part
            delay(first, share)
    elif m.metric == "tpot_p50_ms":
        decoding = [r for r, x in metrics.items() if x.tpot is not None]
        share = 0.5 if len(decoding) % 2 == 0 else 1.0
        for rid in _middle(decoding, lambda r: metrics[r].tpot):
            a, b = delivered.first[rid], delivered.last[rid]
            per_token = share / (metrics[rid].num_output_tokens - 1)
            weights[a[0] + 1:b[0] + 1] += per_token
            delay(b, per_token)
            delay(a, -per_token)
    elif m.metric == "itl_p50_ms":
        gaps = np.asarray(delivered.gaps, dtype=np.int64).reshape(-1, 4)
        order = np.argsort(np.asarray(result.itl), kind="stable")
        share = 0.5 if len(gaps) % 2 == 0 else 1.0
        for j in _middle(list(range(len(gaps))), None, order):
            a, b = gaps[j][:2], gaps[j][2:]
            weights[a[0] + 1:b[0] + 1] += share
            delay(b, share)
            delay(a, -share)
    else:
        raise ValueError(f"measurement {m.id}: unknown metric {m.metric!r}")
    r = Replay(m, 0.0, steps, weights, delays, lanes, cost_model, 0.0, tokens)
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


__all__ = ["Replay", "replay", "run_key"]
