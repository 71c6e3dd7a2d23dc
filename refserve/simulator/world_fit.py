"""Fitting the simulator's constants to published measurements (world.py's rows).

Fitting a simulation. A metric of a run is a sum of step times: an offline throughput is
tokens / (sum of every step), a batch-1 TTFT is one step, a request's TPOT the steps
between its first and last token over its tokens - 1, a TTFT the steps from its arrival to
its first token (the step it arrived in counted by the part after its arrival). With the
schedule of the run fixed, each step time is linear in the fitted values
(`CostModel.features`: 1 / efficiency, or seconds), so a metric's time is too:

    T_i(theta) = sum_k w_ik (c_k + x_k . theta)        x_k: step k's coefficients

The fitted values: per GPU, the GEMM, weight-read, KV-gather and attention efficiencies
and the all-reduce latency; per engine, the host terms (engines.toml). `fit` alternates (as
`step_fit.fit` does for step profiles): simulate every row with the current constants,
record each metric's steps and weights, solve

    min_theta  sum_i ((T_i(theta) - T_i^published) / T_i^published)^2
               + ridge * sum_j (ln theta_j - ln prior_j)^2

over theta > 0 (Gauss-Newton in ln theta: the relative residuals weigh a 7 ms TTFT and a
5,000 tok/s throughput alike; the ridge keeps a constant no row exercises at its prior),
and again, until the predictions stop moving (the schedule depends on the step times).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refserve.simulator.engine_overheads import HOST_TERMS
from refserve.simulator.world import Constants, Measurement, Replay, replay


def _linear_rows(replays: list[Replay], names: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
    """(X, c): T_i = c_i + X_i . theta for each replay's metric time (module docstring)."""
    x = np.zeros((len(replays), len(names)))
    c = np.zeros(len(replays))
    index = {name: j for j, name in enumerate(names)}
    for i, r in enumerate(replays):
        m = r.measurement
        if m.served and m.metric.startswith("ttft"):  # the front end holds the request
            x[i, index[("engine", m.engine_profile, "front_end_request_s")]] += 1.0
        for comp, w in zip(r.steps, r.weights):
            if w == 0:
                continue
            constant, coef = r.cost_model.features(comp)
            c[i] += w * constant
            for name, value in coef.items():
                scope = ("engine", m.engine_profile) if name in HOST_TERMS else ("gpu", m.gpu)
                x[i, index[(*scope, name)]] += w * value
    return x, c


def solve(x: np.ndarray, c: np.ndarray, target: np.ndarray, prior: np.ndarray,
          ridge: float = 1e-3, iterations: int = 100) -> np.ndarray:
    """argmin over theta > 0 of sum(((c + x theta - target) / target)^2)
    + ridge sum((ln theta - ln prior)^2), by damped Gauss-Newton in u = ln theta."""
    u = np.log(prior)
    u0 = u.copy()
    lam = 1e-3

    def cost(u):
        r = (c + x @ np.exp(u) - target) / target
        return float(r @ r + ridge * np.sum((u - u0) ** 2))

    current = cost(u)
    for _ in range(iterations):
        theta = np.exp(u)
        r = (c + x @ theta - target) / target
        j = x * theta / target[:, None]
        a = j.T @ j + ridge * np.eye(len(u))
        g = j.T @ r + ridge * (u - u0)
        step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), -g)
        trial = cost(u + step)
        if trial < current:
            u, current, lam = u + step, trial, lam / 3
            if np.max(np.abs(step)) < 1e-6:
                break
        else:
            lam *= 10
    return np.exp(u)


@dataclass
class FitReport:
    constants: Constants
    rounds: int
    names: list[tuple]


def fit(measurements: list[Measurement], constants: Constants | None = None,
        rounds: int = 4, ridge: float = 1e-3, on_round=None) -> FitReport:
    """Fit the GPU efficiencies, all-reduce latencies and engine host terms to
    `measurements` (module docstring). `on_round(round, replays)` after each round."""
    constants = constants or Constants()
    for m in measurements:  # load every profile the rows name
        constants.gpu(m.gpu)
        constants.engine(m.engine_profile)
    # The KV gather gets its own efficiency, starting at the weight read's.
    constants = constants.with_values(constants.values())
    names = sorted(constants.values())
    for k in range(rounds):
        replays = [replay(m, constants) for m in measurements]
        if on_round is not None:
            on_round(k, replays)
        x, c = _linear_rows(replays, names)
        target = np.array([r.published_seconds for r in replays])
        values = constants.values()
        prior = np.array([max(values[n], 1e-9) for n in names])
        theta = solve(x, c, target, prior, ridge)
        constants = constants.with_values(dict(zip(names, theta)))
    return FitReport(constants, rounds, names)

