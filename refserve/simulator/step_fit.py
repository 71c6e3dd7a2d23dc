"""Fitting the cost model's efficiencies to measured steps, and replaying measured step
times: the two ways a real engine's timings enter the simulator (bench sim-fidelity,
tests/test_simulator_fidelity.py). The formulas being fitted are cost_model.py's."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from refserve.simulator.cost_model import CostModel, StepComposition


@dataclass(frozen=True)
class FitResult:
    cost_model: CostModel
    num_samples: int
    rms_relative_error: float
    max_relative_error: float
    iterations: int


def fit(cost_model: CostModel, profile, max_iterations: int = 50,
        separate_kv: bool = False) -> FitResult:
    """Fit the efficiencies and overheads of `cost_model` to measured steps.

    `profile`: (StepComposition, seconds) pairs of one model at one tensor-parallel degree.
    Writing x_f = 1 / (peak e_flops), x_b = 1 / (bandwidth e_bw), x_a = 1 / (peak e_attn),
    x_k = 1 / (bandwidth e_kv) (= x_b unless `separate_kv`), the model is

        t = [F_lin x_f, B_lin x_b] + max(F_att x_a, B_kv x_k) + o_step + o_row R + comm

    with [c, w] = max(c, w) + (1 - o) min(c, w), the GPU's gemm_overlap o held as it is
    (cost_model.overlapped; o = 1 on "this machine": the max).

    Which side of each `max` binds is the roofline's question. Given that choice per sample,
    t is linear in theta = (x_f, x_a, x_b, o_step, o_row, x_k), so this alternates:

        1. with the current theta, mark each sample's GEMMs and attention compute- or
           memory-bound;
        2. solve the least-squares problem on RELATIVE errors (each equation divided by
           the measured t, so a 30 ms prefill and a 3 ms decode count alike) with
           theta >= 0: the best of the unconstrained solutions on every support (there
           are only 2^6 of them);
        3. stop when the marks no longer change.

    A parameter no sample exercises (its column is all zero, e.g. attention compute in a
    profile of pure decodes) keeps its prior value. An efficiency above 1 means the peak in
    the profile is too low for this machine. The start point is the cost model's own
    efficiencies, so the fit refines the priors.
    """
    samples = [(c, float(t)) for c, t in profile]
    if len(samples) < 2:
        raise ValueError(f"fit needs at least 2 measured steps, got {len(samples)}")
    if any(t <= 0 for _, t in samples):
        raise ValueError("fit: every measured step time must be > 0 seconds")
    gpu, e = cost_model.gpu, cost_model.eff
    peak, bw = cost_model.peak, gpu.memory_bandwidth
    works = [cost_model.work(c) for c, _ in samples]
    f_lin = np.array([w["linear_flops"] / peak for w in works])
    b_lin = np.array([w["linear_bytes"] / bw for w in works])
    f_att = np.array([w["attention_flops"] / peak for w in works])
    b_kv = np.array([w["kv_bytes"] / bw for w in works])
    rows = np.array([c.num_rows for c, _ in samples], dtype=float)
    t = np.array([s for _, s in samples])
    # What this fit leaves as it is: the all-reduces, the launches and the host terms
    # other than o_step + o_row R.
    comm = np.array([_unfitted_seconds(cost_model, c) for c, _ in samples])
    theta = np.array([1 / e.flops, 1 / e.attention, 1 / e.bandwidth, e.step_overhead_s,
                      e.row_overhead_s, 1 / e.kv])
    shorter = 1 - gpu.gemm_overlap
    marks, iterations = None, 0
    while iterations < max_iterations:
        iterations += 1
        lin_compute = f_lin * theta[0] >= b_lin * theta[2]
        att_compute = f_att * theta[1] >= b_kv * theta[5]
        new_marks = (tuple(lin_compute), tuple(att_compute))
        if new_marks == marks:
            break
        marks = new_marks
        kv = np.where(att_compute, 0.0, b_kv)
        x = np.stack([np.where(lin_compute, f_lin, shorter * f_lin),
                      np.where(att_compute, f_att, 0.0),
                      np.where(lin_compute, shorter * b_lin, b_lin)
                      + (0.0 if separate_kv else kv),
                      np.ones_like(t), rows, kv if separate_kv else np.zeros_like(t)],
                     axis=1)
        theta = _nonnegative_lstsq(x / t[:, None], (t - comm) / t, theta)
        if not separate_kv:
            theta[5] = theta[2]
    # The terms this fit leaves as they are (sampling, launches, kernel gaps) keep their
    # values: they are in `comm` above.
    fitted = dataclasses.replace(
        e, flops=1 / theta[0], attention=1 / theta[1], bandwidth=1 / theta[2],
        step_overhead_s=float(theta[3]), row_overhead_s=float(theta[4]),
        kv_bandwidth=float(1 / theta[5]) if separate_kv else None)
    model = cost_model.with_efficiencies(fitted)
    predicted = np.array([model.time(c) for c, _ in samples])
    rel = (predicted - t) / t
    return FitResult(model, len(samples), float(np.sqrt(np.mean(rel**2))),
                     float(np.max(np.abs(rel))), iterations)


def _unfitted_seconds(cost_model: CostModel, comp: StepComposition) -> float:
    terms, e = cost_model.terms(comp), cost_model.eff
    return (terms["allreduce"] + terms["kernels"] + terms["launch"] + terms["cpu"]
            - e.step_overhead_s - e.row_overhead_s * comp.num_rows)


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, prior: np.ndarray,
                       ridge: float = 1e-6) -> np.ndarray:
    """argmin ||x theta - y||^2 + ridge ||u - u_prior||^2 over theta >= 0, u being theta in
    units where each column of x has norm 1: the best unconstrained solution over every
    support that comes out nonnegative. The tiny ridge only matters where the data cannot
    tell parameters apart (e.g. a fixed overhead and the weight read of decodes that all
    read the same weights): among equally good fits it picks the one nearest the prior.
    Columns that are all zero keep `prior`; an efficiency is never set to infinity (a
    theta of 0 for x_f, x_a or x_b falls back to the prior)."""
    used = [j for j in range(x.shape[1]) if np.any(x[:, j] != 0)]
    fixed = [j for j in range(x.shape[1]) if j not in used]
    target = y - x[:, fixed] @ prior[fixed] if fixed else y
    norms = np.linalg.norm(x[:, used], axis=0)
    xs = x[:, used] / norms
    u_prior = prior[used] * norms
    best, best_err = None, np.inf
    for size in range(len(used), 0, -1):
        for support in itertools.combinations(range(len(used)), size):
            cols = list(support)
            a = np.vstack([xs[:, cols], np.sqrt(ridge) * np.eye(len(cols))])
            b = np.concatenate([target, np.sqrt(ridge) * u_prior[cols]])
            sol, *_ = np.linalg.lstsq(a, b, rcond=None)
            if np.any(sol < 0):
                continue
            off = [k for k in range(len(used)) if k not in support]
            err = float(np.sum((a @ sol - b) ** 2) + ridge * np.sum(u_prior[off] ** 2))
            if err < best_err:
                best, best_err = dict(zip(cols, sol)), err
    theta = prior.copy()
    for k, j in enumerate(used):
        value = best.get(k, 0.0) / norms[k] if best is not None else prior[j]
        theta[j] = value if value > 0 or j in (3, 4) else prior[j]
    return theta


def replay(step_times) -> ReplayedSteps:
    """A stand-in cost model that returns measured step times in order (for checking the
    simulator's schedule against a real run fed the same times)."""
    return ReplayedSteps(list(step_times))


@dataclass
class ReplayedSteps:
    times: list[float]
    index: int = 0

    def step_time(self, out) -> float:
        if self.index >= len(self.times):
            raise ValueError(f"replay: the simulation ran more steps than the "
                             f"{len(self.times)} measured ones")
        self.index += 1
        return self.times[self.index - 1]


__all__ = ["FitResult", "ReplayedSteps", "fit", "replay"]
