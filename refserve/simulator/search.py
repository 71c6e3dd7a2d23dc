"""Capacity search: the highest arrival rate at which a configuration meets its SLOs.

A configuration meets the SLOs at rate r when, simulating the workload at r,

    p99 TTFT <= slo_ttft  and  p99 TPOT <= slo_tpot          (percentiles over requests)

and r is sustainable: below the saturation throughput mu, the requests per second the
engine completes with its batch kept full (measured by simulating the workload arriving
all at once: output tokens per second while requests are still waiting, divided by the
mean output length). Above mu the queue, and TTFT with it, grows without bound, however
short a simulation makes it look; a run of N requests hides that for a while, so the
search never goes above (1 - tolerance) mu.

The SLOs are those of a server under steady load, so a simulation must reach it: a
request holds its seat for about W seconds (its decode time at saturation), so the batch
fills within a few W of the first arrival and empties within W of the last. A simulation
at rate r therefore sends at least 6 r W requests (and at least num_requests), and the
percentiles are taken over the requests arriving in the steady window
[1.5 W, last arrival - W] (all of them when that window is shorter than 2 W). A short run
at a high rate would otherwise be judged on a batch that never filled.

Feasibility falls as the rate rises (the same requests arrive faster: workload.py scales
only the arrival times), so the highest feasible rate is found by bisection, as
Vidur-Search does: bracket [lo, hi] with lo feasible and hi not, halve until
(hi - lo) <= tolerance * hi.

Two things keep it fast:
  * a simulation stops as soon as the SLO is lost for sure: the p99 of N values exceeds
    the SLO once N - floor(0.99 (N - 1)) of them do (np.percentile interpolates between
    neighbours), and a request still waiting past slo_ttft counts as one of them;
  * `search` walks the knobs one at a time (coordinate search) and tests each candidate
    first at the best rate found so far: a candidate that cannot carry it is dropped
    after one or two simulations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from refserve.config import EngineConfig
from refserve.metrics import percentile
from refserve.simulator.engine import SimulatedEngine


@dataclass(frozen=True)
class SLO:
    ttft_p99: float
    tpot_p99: float

    def violations_allowed(self, n: int) -> int:
        """Values above the SLO that a p99 of n values can absorb (one more and it fails)."""
        return n - math.floor(0.99 * (n - 1)) - 1


@dataclass
class Evaluation:
    """One simulation of a configuration at one rate.

    In steady state a rate r serves r x mean output tokens per second, and a fraction
    `slo_attained` of the requests meet both SLOs: goodput = r x slo_attained. (The
    simulation's own elapsed time also holds the drain after the last arrival, which a
    server under steady load never has.)"""

    rate: float
    ok: bool
    ttft_p99: float | None = None
    tpot_p99: float | None = None
    slo_attained: float = 0.0
    mean_output_tokens: float = 0.0
    stopped_early: bool = False
    num_requests: int = 0   # simulated
    num_judged: int = 0     # in the steady window, whose percentiles count
    bound: str = "SLO"  # what stopped the rate from rising: "SLO" or "throughput"

    @property
    def output_tokens_per_s(self) -> float:
        return self.rate * self.mean_output_tokens

    @property
    def goodput_req_s(self) -> float:
        return self.rate * self.slo_attained


class _Watch:
    """on_step hook: stop once the SLO is lost for sure (module docstring), counting only
    the requests whose percentiles count (`judged`)."""

    def __init__(self, slo: SLO, judged: set[str]) -> None:
        self.slo, self.judged = slo, judged
        self.limit = slo.violations_allowed(len(judged))
        self.late_ttft = self.late_tpot = 0

    def __call__(self, engine, t_start, now, out, retired) -> bool:
        for seq in retired:
            if seq.request_id in self.judged:
                m = engine.metrics[seq.request_id]
                self.late_ttft += m.ttft > self.slo.ttft_p99
                self.late_tpot += (m.tpot or 0.0) > self.slo.tpot_p99
        if self.late_ttft > self.limit or self.late_tpot > self.limit:
            return True
        if out.step % 32 == 0:
            waiting_late = sum(1 for s in engine.scheduler.waiting if s.num_output_tokens == 0
                               and s.request_id in self.judged
                               and now - s.arrival_time > self.slo.ttft_p99)
            return self.late_ttft + waiting_late > self.limit
        return False


@dataclass(frozen=True)
class Saturation:
    """The configuration with its batch kept full: mu requests per second, each holding its
    seat service_s seconds (first token to finish, on average)."""

    mu: float
    service_s: float


@dataclass
class Candidate:
    """A configuration to plan: the engine knobs, the tensor-parallel degree and the
    precision (vLLM's --quantization and --kv-cache-dtype)."""

    config: EngineConfig
    tensor_parallel_size: int
    quantization: str | None = None
    kv_cache_dtype: str = "auto"

    def key(self) -> tuple:
        c = self.config
        return (self.tensor_parallel_size, c.max_num_seqs, c.max_num_batched_tokens,
                c.block_size, c.gpu_memory_utilization, c.enable_prefix_caching,
                c.enable_chunked_prefill, self.quantization, self.kv_cache_dtype)


@dataclass
class Planner:
    """Simulates candidates on `make_requests(rate, seed)` workloads under `slo`."""

    model: object
    gpu: object
    make_requests: object  # (rate, seed, num_requests) -> list[SimRequest]
    slo: SLO
    num_requests: int = 600
    max_requests: int = 20000
    seed: int = 0
    tolerance: float = 0.05
    max_simulations: int | None = None
    on_simulation: object = None  # called with (candidate, Evaluation) after each one
    engine_overheads: object = "vllm"  # an engines.toml entry or key; None: the GPU's own
    served: bool = False             # price an HTTP front end per streamed token
    num_scheduler_steps: int = 1     # vLLM V0's multi-step scheduling (multi_step.py)
    simulations: int = 0
    evaluations: dict = field(default_factory=dict)

    def engine(self, cand: Candidate) -> SimulatedEngine:
        return SimulatedEngine(self.model, self.gpu, cand.config,
                               tensor_parallel_size=cand.tensor_parallel_size,
                               quantization=cand.quantization,
                               kv_cache_dtype=cand.kv_cache_dtype,
                               engine=self.engine_overheads, served=self.served,
                               num_scheduler_steps=self.num_scheduler_steps)

    def evaluate(self, cand: Candidate, rate: float, seed: int | None = None) -> Evaluation:
        """Simulate `cand` at `rate` on the workload of `seed`; the percentiles are those of
        the steady window (module docstring)."""
        seed = self.seed if seed is None else seed
        memo = (cand.key(), rate, seed)
        if memo in self.evaluations:
            return self.evaluations[memo]
        w = self.saturation(cand).service_s
        n = max(self.num_requests, min(self.max_requests, math.ceil(6 * rate * w)))
        requests = self.make_requests(rate, seed, n)
        last = requests[-1].arrival_time
        judged = {r.request_id for r in requests
                  if 1.5 * w <= r.arrival_time <= last - w}
        if last - 2.5 * w < 2 * w or len(judged) < 10:
            judged = {r.request_id for r in requests}
        result = self.engine(cand).run(requests, on_step=_Watch(self.slo, judged))
        self.simulations += 1
        ms = [m for rid, m in result.metrics.items() if rid in judged]
        ttft = percentile([m.ttft for m in ms], 99)
        tpot = percentile([m.tpot for m in ms], 99)
        ok = (not result.stopped_early and len(ms) == len(judged) and ttft is not None
              and ttft <= self.slo.ttft_p99 and (tpot is None or tpot <= self.slo.tpot_p99))
        good = sum(1 for m in ms if m.ttft is not None and m.ttft <= self.slo.ttft_p99
                   and (m.tpot is None or m.tpot <= self.slo.tpot_p99))
        mean_output = sum(r.num_output_tokens for r in requests) / len(requests)
        ev = Evaluation(rate, ok, ttft, tpot, good / len(judged), mean_output,
                        result.stopped_early, num_requests=len(requests),
                        num_judged=len(judged))
        self.evaluations[memo] = ev
        if self.on_simulation is not None:
            self.on_simulation(cand, ev)
        return ev

    def saturation(self, cand: Candidate) -> Saturation:
        """mu: requests per second the configuration completes with its batch full (module
        docstring). At least 3 x max_num_seqs requests arrive at t = 0, so the queue stays
        full well past the first wave; the steps counted are those after the first request
        finished and while requests were still waiting."""
        key = ("saturation", cand.key(), self.seed)
        if key in self.evaluations:
            return self.evaluations[key]
        n = max(self.num_requests, 3 * cand.config.max_num_seqs)
        requests = self.make_requests(math.inf, self.seed, n)
        result = self.engine(cand).run(requests)
        self.simulations += 1
        ms = list(result.metrics.values())
        first_finish = min(m.finish_time for m in ms)
        tl = result.timeline
        steps = [k for k in range(len(tl["t"]))
                 if tl["t"][k] >= first_finish and tl["waiting"][k] > 0]
        if len(steps) < 10:
            steps = range(len(tl["t"]))  # never saturated for long: the whole run
        tokens = sum(tl["sampled"][k] for k in steps)
        seconds = sum(tl["t_end"][k] - tl["t"][k] for k in steps)
        mean_output = sum(r.num_output_tokens for r in requests) / n
        sat = Saturation(mu=tokens / seconds / mean_output,
                         service_s=sum(m.finish_time - m.first_token_time for m in ms) / n)
        self.evaluations[key] = sat
        return sat

    def max_rate(self, cand: Candidate, beat: float | None = None) -> Evaluation | None:
        """The highest rate <= (1 - tolerance) mu meeting the SLO, to `tolerance`. None if
        the candidate cannot carry beat * (1 + tolerance) (when `beat` is given), or does
        not meet the SLO even at a hundredth of mu."""
        hi = (1 - self.tolerance) * self.saturation(cand).mu
        if beat is not None:
            lo_rate = beat * (1 + self.tolerance)
            if lo_rate > hi:
                return None
        else:
            lo_rate = hi / 100
        best = self.evaluate(cand, lo_rate)
        if not best.ok:
            return None
        top = self.evaluate(cand, hi)
        if top.ok:  # sustainable up to saturation: the throughput is the limit
            return replace(top, bound="throughput")
        lo = best.rate
        while hi - lo > self.tolerance * hi:
            if self.max_simulations is not None and self.simulations >= self.max_simulations:
                break
            mid = math.sqrt(lo * hi) if hi / lo > 4 else (lo + hi) / 2
            ev = self.evaluate(cand, mid)
            if ev.ok:
                lo, best = mid, ev
            else:
                hi = mid
        return best

    def search(self, start: Candidate, knobs: dict[str, list]) -> tuple[Candidate, Evaluation
                                                                       | None, list]:
        """Coordinate search from `start`: for each knob (an EngineConfig field) try each
        value with the others at the best so far; keep whatever raises the max rate.
        Returns (best candidate, its Evaluation, [(candidate, Evaluation or None), ...])."""
        best_ev = self.max_rate(start)
        best, tried = start, [(start, best_ev)]
        seen = {start.key()}
        for name, values in knobs.items():
            for value in values:
                cand = _with(best, name, value)
                if cand.key() in seen:
                    continue
                seen.add(cand.key())
                try:
                    self.engine(cand)
                except ValueError:
                    continue  # does not fit (weights, or a pool too small for one sequence)
                ev = self.max_rate(cand, beat=best_ev.rate if best_ev else None)
                tried.append((cand, ev))
                if ev is not None and (best_ev is None or ev.rate > best_ev.rate):
                    best, best_ev = cand, ev
        return best, best_ev, tried

    def planned_rate(self, cand: Candidate, max_rate: float, headroom: float,
                     seeds: tuple[int, ...]) -> Evaluation | None:
        """The rate to plan for: max_rate * (1 - headroom), lowered by further steps of
        `headroom` until it meets the SLO on every one of `seeds` (other workloads than
        the one searched on). Returns the evaluation on the first seed."""
        rate = max_rate * (1 - headroom)
        for _ in range(8):
            evs = [self.evaluate(cand, rate, seed) for seed in seeds]
            if all(ev.ok for ev in evs):
                return evs[0]
            rate *= 1 - headroom
        return None


PRECISION_KNOBS = ("quantization", "kv_cache_dtype")


def _with(cand: Candidate, name: str, value) -> Candidate:
    """`cand` with one knob changed: an EngineConfig field or a precision knob."""
    if name in PRECISION_KNOBS:
        return replace(cand, **{name: value})
    return replace(cand, config=replace(cand.config, **{name: value}))
