"""Fitting the simulator's constants to published measurements (world.py's rows), each
inside its physical range (bounds.py).

A metric of a run is a sum of step times (world.py): with the run's schedule fixed, each
step time is linear in the fitted values once every roofline's side is chosen
(`CostModel.linearize`: 1 / efficiency, or seconds), so a metric's time is too:

    T_i(theta) = c_i + X_i . theta

The fitted values: per GPU chip, the GEMM, weight-read, KV-gather and attention
efficiencies, the all-reduce latency and the kernel gap; per engine, the host terms. `fit`
starts from the priors of bounds.toml (the pre-fit defaults) and alternates:

    1. simulate every row with the current constants (a row whose schedule cannot depend
       on the step times once per process: world.replay caches it);
    2. solve  min  sum_i ((T_i(theta) - T_i^published) / T_i^published)^2
                   + ridge * sum_j (ln theta_j - ln prior_j)^2
       over theta inside the ranges, by Levenberg-Marquardt in ln theta projected onto
       the box (the relative residuals weigh a 7 ms TTFT and a 5,000 tok/s throughput
       alike; the ridge keeps a value no row exercises at its prior), relinearizing until
       the roofline sides stop changing;

until the values move by less than TOLERANCE (the schedules of the online runs depend on
the step times). Deterministic: the same rows give the same constants.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from refserve.simulator.bounds import Bounds
from refserve.simulator.cost_model import GPU_TERMS, STEP_HOST_TERMS
from refserve.simulator.world import (
    FIT_GPU,
    GPU_VALUES,
    LATENCIES,
    Constants,
    Measurement,
    cost_model_for,
)
from refserve.simulator.world_replay import Replay, replay

TOLERANCE = 1e-3
RIDGE = 1e-3
# The last step of the shipped fit: every fit row's linear form at the shipped constants,
# with the ranges and priors it was solved in (tests/test_simulator_world.py solves it
# again and replays the rows that are cheap to replay).
FIT_RECORD = Path(__file__).with_name("world_fit_record.json")
# cost_model.linearize's value names -> the constant they are 1 / (an efficiency) or equal
LINEAR_NAME = {**{k: v for k, v in GPU_VALUES.items()}, **{k: k for k in LATENCIES},
               **{k: k for k in STEP_HOST_TERMS}}
INVERSE = set(GPU_VALUES.values())  # fitted as 1 / value


def to_theta(name: tuple, value: float) -> float:
    return 1.0 / value if name[2] in INVERSE else value


def from_theta(name: tuple, theta: float) -> float:
    return 1.0 / theta if name[2] in INVERSE else theta


def prior_constants(measurements: list[Measurement], bounds: Bounds | None = None
                    ) -> Constants:
    """The shipped profiles with every fitted constant at its prior (the pre-fit
    defaults): the start of every fit."""
    bounds = bounds or Bounds()
    constants = Constants()
    for m in measurements:
        constants.gpu(m.gpu), constants.engine(m.engine_profile)
    values = {name: bounds.range_of(name).prior for name in constants.values()}
    return constants.with_values(values)


def linear_form(replays: list[Replay], constants: Constants, names: list[tuple]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(X, c): T_i = c_i + X_i . theta for each replay's metric time, at `constants`'
    roofline sides (module docstring)."""
    x = np.zeros((len(replays), len(names)))
    c = np.zeros(len(replays))
    index = {name: j for j, name in enumerate(names)}
    for i, r in enumerate(replays):
        m = r.measurement
        cm = cost_model_for(m, constants)
        gpu_key = FIT_GPU.get(m.gpu, m.gpu)
        constant, coef = cm.linearize(r.steps)
        c[i] = r.weights @ constant
        for linear_name, values in coef.items():
            scope = ("gpu", gpu_key) if linear_name in GPU_TERMS else ("engine",
                                                                        m.engine_profile)
            name = (*scope, LINEAR_NAME[linear_name])
            if name in index:
                x[i, index[name]] += r.weights @ values
        sampled = r.steps.num_sampling_rows
        engine = ("engine", m.engine_profile)
        if cm.async_output and (*engine, "sample_row_s") in index:
            x[i, index[(*engine, "sample_row_s")]] += r.lane_weights @ sampled
        if cm.served and (*engine, "front_end_row_s") in index:
            x[i, index[(*engine, "front_end_row_s")]] += r.delay_weights @ sampled
        if m.served and (m.metric.startswith("ttft") or m.metric == "output_tokens_per_s"):
            if (*engine, "front_end_request_s") in index:
                x[i, index[(*engine, "front_end_request_s")]] += 1.0
    return x, c


def solve(x: np.ndarray, c: np.ndarray, target: np.ndarray, prior: np.ndarray,
          low: np.ndarray, high: np.ndarray, ridge: float = RIDGE, start=None,
          iterations: int = 300) -> np.ndarray:
    """argmin over low <= theta <= high of sum(((c + x theta - target) / target)^2)
    + ridge sum((ln theta - ln prior)^2), by damped Gauss-Newton in u = ln theta, each
    step projected onto the box (module docstring). `low` > 0."""
    lo, hi = np.log(low), np.log(high)
    u0 = np.log(prior)
    u = np.clip(np.log(start if start is not None else prior), lo, hi)
    lam = 1e-3

    def cost(u):
        r = (c + x @ np.exp(u) - target) / target
        return float(r @ r + ridge * np.sum((u - u0) ** 2))

    current = cost(u)
    for _ in range(iterations):
        theta = np.exp(u)
        r = (c + x @ theta - target) / target
        j = x * theta / target[:, None]
        g = j.T @ r + ridge * (u - u0)
        # variables pinned at a bound by a gradient pushing outward stay there
        free = ~(((u <= lo) & (g > 0)) | ((u >= hi) & (g < 0)))
        a = j.T @ j + ridge * np.eye(len(u))
        step = np.zeros_like(u)
        af = a[np.ix_(free, free)]
        step[free] = np.linalg.solve(af + lam * np.diag(np.diag(af) + 1e-12), -g[free])
        trial_u = np.clip(u + step, lo, hi)
        trial = cost(trial_u)
        if trial < current:
            moved = np.max(np.abs(trial_u - u)) if len(u) else 0.0
            u, current, lam = trial_u, trial, lam / 3
            if moved < 1e-9:
                break
        else:
            lam *= 10
            if lam > 1e12:
                break
    return np.exp(u)


@dataclass
class FitReport:
    constants: Constants
    rounds: int
    names: list[tuple]
    history: list[float] = field(default_factory=list)  # median |error| per round
    record: dict = field(default_factory=dict)  # the last step (FIT_RECORD's layout)


def load_record() -> dict:
    return json.loads(FIT_RECORD.read_text())


def write_record(record: dict) -> None:
    FIT_RECORD.write_text(json.dumps(record, indent=0) + "\n")


def fit(measurements: list[Measurement], constants: Constants | None = None,
        bounds: Bounds | None = None, max_rounds: int = 6, ridge: float = RIDGE,
        scale: float = 1.0, on_round=None) -> FitReport:
    """Fit the constants to `measurements` from `constants` (default: the priors), each
    inside its range (module docstring). `on_round(round, replays)` after each round's
    simulation."""
    bounds = bounds or Bounds()
    constants = constants or prior_constants(measurements, bounds)
    for m in measurements:  # load every profile the rows name
        constants.gpu(m.gpu), constants.engine(m.engine_profile)
    names = [n for n in sorted(constants.values())
             if bounds.range_of(n).high > bounds.range_of(n).low]
    ranges = [bounds.range_of(n) for n in names]
    theta_of = [(to_theta(n, r.low), to_theta(n, r.high)) for n, r in zip(names, ranges)]
    low = np.array([max(min(a, b), 1e-12) for a, b in theta_of])
    high = np.array([max(a, b) for a, b in theta_of])
    prior = np.clip([to_theta(n, r.prior) for n, r in zip(names, ranges)], low, high)
    report = FitReport(constants, 0, names)
    previous = None
    for k in range(max_rounds):
        replays = [replay(m, constants, scale) for m in measurements]
        report.history.append(float(np.median([abs(r.error) for r in replays])))
        if on_round is not None:
            on_round(k, replays)
        target = np.array([r.published_seconds for r in replays])
        values = constants.values()
        theta = np.clip([to_theta(n, max(values[n], 1e-12)) for n in names], low, high)
        for _ in range(10):  # relinearize until the roofline sides settle
            x, c = linear_form(replays, constants, names)
            new = solve(x, c, target, prior, low, high, ridge, start=theta)
            constants = constants.with_values(
                {n: from_theta(n, t) for n, t in zip(names, new)})
            settled = np.max(np.abs(new / theta - 1)) < TOLERANCE
            theta = new
            if settled:
                break
        report.rounds = k + 1
        if previous is not None and np.max(np.abs(theta / previous - 1)) < TOLERANCE:
            break
        previous = theta
    x, c = linear_form(replays, constants, names)
    report.constants = constants
    report.record = {
        "ids": [r.measurement.id for r in replays], "names": [list(n) for n in names],
        "x": _round(x), "c": _round(c), "target": _round(target), "prior": _round(prior),
        "low": _round(low), "high": _round(high), "theta": _round(theta), "ridge": ridge}
    return report


def _round(a) -> list:
    """Twelve significant digits: the record's JSON stays readable and exact enough."""
    return [float(f"{v:.12g}") for v in np.ravel(a)] if np.ndim(a) < 2 else [
        _round(row) for row in a]


__all__ = ["FIT_RECORD", "FitReport", "fit", "linear_form", "load_record", "prior_constants",
           "solve", "write_record"]
