"""sim-fidelity: how far the simulator is from the real engine, measured in the same run.

1. FIT. A short profiling run of the real engine (this machine, the tuned CPU backend): batches
   of 1..16 requests with prompts of 24..500 tokens (and one of 700), so its steps range
   from one decode row to full-budget prefill chunks mixed with decodes. Every step's
   composition and wall time (LLMEngine.observer) go to `step_fit.fit`, which sets the
   efficiencies and overheads of the "this machine" profile (peak FLOP/s and bandwidth
   measured by the roofline bench's ceilings); steps that another process interrupted
   (far slower than the fit predicts) are left out and the fit redone (`robust_fit`).
   The CPU share this process got (CPU seconds per busy wall second) is printed for the fit
   and for each test workload: when they differ, the machine changed between them. A second
   table does the same with the cost model fitted on each step's CPU time and the
   simulated times divided by the CPU share measured during each real run: the cost
   model's own error, with the other processes' share of the machine taken out.
2. TEST, on other workloads (never fit on what is tested): each runs twice, on the real
   engine (requests added when the wall clock passes their arrival time) and on the
   simulator with the fitted cost model (the same prompts, the real run's output tokens,
   the same arrival times and engine config: the same Scheduler and KVCacheManager
   classes with the same pool):

       batching   requests all at t = 0, long-tailed outputs, max_num_seqs 8
       chunked    short requests decoding while a long prompt is prefilled in chunks
       prefix     a shared system prompt, prefix caching on
       poisson    chat-like requests arriving as a Poisson process, below capacity

   and reports the relative error (simulated - real) / real of the output throughput, TTFT
   p50 / p99 and TPOT p50 / p99. The issue's target: every error <= 10%, the median <= 5%.

Timings on a shared machine are noisy, and the fit is measured once, before the tests: when
other processes load the machine more (or less) during a test than during the fit, the
errors show it. The load average (`uptime`) is printed at the start and after each
workload. `--trace FILE` draws each real run and its simulation side by side (Perfetto).
The fitted efficiencies are printed too: on a GPU (scripts/gpu_check.sh) they are what a
profile in gpus.toml should be corrected to.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from refserve.bench.common import print_table, pyplot, save_figure, traced
from refserve.bench.workloads import make_workload, poisson_arrivals
from refserve.metrics import summarize
from refserve.sampling import SamplingParams

HELP = "the simulator's error against the real engine (throughput, TTFT, TPOT)"
POSITIVE = ("scale",)
METRICS = (("throughput", "output_tokens_per_s"), ("ttft_p50", "ttft_p50"),
           ("ttft_p99", "ttft_p99"), ("tpot_p50", "tpot_p50"), ("tpot_p99", "tpot_p99"))
TARGET_MAX, TARGET_MEDIAN = 0.10, 0.05


def add_arguments(s) -> None:
    s.add_argument("--scale", type=float, default=1.0,
                   help="multiply every workload's request count and lengths (--quick: 0.35)")


def apply_quick(args) -> None:
    args.scale = min(args.scale, 0.2)


@dataclass
class Request:
    request_id: str
    arrival: float            # seconds after the run starts
    prompt: list[int]
    max_tokens: int


class StepProfile:
    """An LLMEngine observer: (StepComposition, wall seconds) of every step in `samples`,
    and (StepComposition, CPU seconds this process spent since the previous step or
    arrival) in `cpu_samples`."""

    def __init__(self) -> None:
        from refserve.simulator.cost_model import StepComposition

        self._of = StepComposition.of
        self.samples: list = []
        self.cpu_samples: list = []
        self._cpu = time.process_time()

    def arrive(self, request_id, t) -> None:
        self._cpu = time.process_time()  # add_request's own work is not a step's

    def abort(self, request_id, t) -> None:
        pass  # an aborted request leaves no step behind

    def step(self, t_start, t_end, out, update, outputs) -> None:
        cpu, self._cpu = time.process_time() - self._cpu, time.process_time()
        if out.scheduled:
            comp = self._of(out)
            self.samples.append((comp, t_end - t_start))
            if cpu > 0:
                self.cpu_samples.append((comp, cpu))


class _Scaled:
    """A cost model whose step times are divided by `cpu_share` (CPU seconds to wall)."""

    def __init__(self, cost_model, cpu_share: float) -> None:
        self.cost_model, self.cpu_share = cost_model, cpu_share
        self.model, self.gpu = cost_model.model, cost_model.gpu

    def step_time(self, out) -> float:
        return self.cost_model.step_time(out) / self.cpu_share


@dataclass
class Run:
    outputs: dict          # request_id -> its finished RequestOutput
    elapsed: float         # first arrival to last finish, seconds
    cpu_share: float       # CPU seconds this process got per second of wall time, idle
                           # waits left out (1.0: nobody else took the core)
    start: float           # perf_counter time of t = 0 (arrivals are relative to it)


def drive(engine, requests: list[Request]) -> Run:
    """Run `requests` on the real engine, each added once the wall clock passes its arrival
    (between steps, as a server's loop does; idle until the next one)."""
    pending = sorted(requests, key=lambda r: r.arrival)
    finished, i, slept = {}, 0, 0.0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            engine.add_request(r.request_id, r.prompt, SamplingParams(
                max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0),
                arrival_time=t0 + r.arrival)
            i += 1
        if not engine.has_unfinished_requests():
            ts = time.perf_counter()
            time.sleep(max(0.0, pending[i].arrival - (ts - t0)))
            slept += time.perf_counter() - ts
            continue
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    busy = time.perf_counter() - t0 - slept
    start = t0 + pending[0].arrival
    return Run(finished, max(o.metrics.finish_time for o in finished.values()) - start,
               (time.process_time() - cpu0) / busy if busy > 0 else 1.0, t0)


def _tokens(rng, n: int, vocab: int) -> list[int]:
    low = min(1000, vocab // 2)
    return rng.integers(low, vocab, int(n)).tolist()


def profile_requests(scale: float, vocab: int, seed: int) -> list[list[Request]]:
    """The fitting run's phases: batches of 1..16 (prompts of 24..500 tokens, 16 decodes) and
    a long prompt chunked under 4 decodes."""
    rng = np.random.default_rng([seed, 1])
    phases = []
    # Prompt lengths shrink below scale 0.5 (the quick run), never below 24 tokens.
    size = lambda n: max(24, round(n * min(1.0, 2 * scale)))  # noqa: E731
    # (batch, prompt lengths): the contexts do not grow with the batch, so the fit can tell
    # the per-row cost from the per-context-token (KV gather) cost.
    for b, (lo, hi) in ((1, (24, 200)), (2, (24, 200)), (4, (300, 500)), (8, (24, 200)),
                        (16, (24, 100))):
        phases.append([Request(f"p{b}-{j}", 0.0,
                               _tokens(rng, rng.integers(size(lo), size(hi) + 1), vocab),
                               max(8, round(16 * scale))) for j in range(b)])
    long = [Request(f"long-{j}", 0.0, _tokens(rng, 24, vocab), max(8, round(40 * scale)))
            for j in range(4)]
    long.append(Request("long", 0.05, _tokens(rng, size(700), vocab), 4))
    phases.append(long)
    return phases


def workloads_to_test(scale: float, vocab: int, seed: int) -> dict[str, tuple[dict, list]]:
    """name -> (engine config, requests): the module docstring's four workloads."""
    rng = np.random.default_rng([seed, 2])
    n = lambda x: max(2, round(x * scale))  # noqa: E731
    wl = make_workload(n(16), seed + 11, vocab, mean_output=max(8, round(48 * scale)),
                       output_range=(4, 256))
    batching = [Request(f"b{i}", 0.0, p, m)
                for i, (p, m) in enumerate(zip(wl.prompts, wl.output_lens))]
    chunked = [Request(f"c{i}", 0.0, _tokens(rng, rng.integers(16, 33), vocab),
                       n(96)) for i in range(4)]
    chunked.append(Request("c-long", 0.1, _tokens(rng, n(1024), vocab), 8))
    system = _tokens(rng, 256, vocab)
    prefix = [Request(f"s{i}", 0.0, system + _tokens(rng, rng.integers(16, 33), vocab), 16)
              for i in range(n(12))]
    chat = make_workload(n(16), seed + 12, vocab, mean_output=max(8, round(48 * scale)),
                         output_range=(4, 256))
    # Below the engine's capacity on a 2-core CPU (~20 output tokens/s, so ~0.4 requests/s
    # of 48-token answers): an overloaded queue turns any small error into a large TTFT one.
    times = poisson_arrivals(len(chat.prompts), 0.25 / scale, seed + 13)
    poisson = [Request(f"q{i}", t, p, m)
               for i, (t, p, m) in enumerate(zip(times, chat.prompts, chat.output_lens))]
    base = dict(enable_prefix_caching=False, max_num_seqs=8, max_num_batched_tokens=256)
    return {"batching": (base, batching),
            "chunked": ({**base, "max_num_batched_tokens": 64}, chunked),
            "prefix": ({**base, "enable_prefix_caching": True, "max_num_seqs": 4}, prefix),
            "poisson": (base, poisson)}


def make_engine(args, observer=None, **config):
    from refserve.engine import LLMEngine

    engine = LLMEngine(model=args.model, backend="cpu", progress=False, **config)
    # Warm-up outside the measurement: first calls allocate and pick BLAS kernels.
    warm = [Request(f"warm{i}", 0.0, [1000 + i] * 40, 4) for i in range(2)]
    # (the warm-up's Run is thrown away)
    drive(engine, warm)
    engine.observer = observer
    return engine


INTERRUPTED = 0.6   # a step that took more than 1 / 0.6 = 1.67x the fit's prediction


def robust_fit(cost_model, samples, rounds: int = 2):
    """`step_fit.fit` (with a separate KV-gather efficiency), then refit without the steps
    it under-predicts by more than 1 / INTERRUPTED: on a shared machine another process
    only ever adds time, and a least-squares fit follows those few interrupted steps (one
    256-token prefill measured 0.6 s in one step and 1.5 s in another). Returns the fit and
    how many steps were left out."""
    from refserve.simulator.step_fit import fit

    kept = list(samples)
    result = fit(cost_model, kept, separate_kv=True)
    for _ in range(rounds):
        predicted = result.cost_model
        trimmed = [(c, t) for c, t in kept if predicted.time(c) >= INTERRUPTED * t]
        if len(trimmed) == len(kept) or len(trimmed) < len(samples) // 2:
            break
        kept = trimmed
        result = fit(cost_model, kept, separate_kv=True)
    return result, len(samples) - len(kept)


def simulate(engine, cost_model, requests: list[Request], outputs: dict, recorder=None):
    """The same requests on the simulator: the real engine's pool, config and tokens."""
    from refserve.config import EngineConfig
    from refserve.simulator import SimRequest, SimulatedEngine

    c = engine.config
    config = EngineConfig(
        max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
        long_prefill_token_threshold=c.long_prefill_token_threshold,
        block_size=c.block_size, max_model_len=engine.max_model_len,
        enable_prefix_caching=c.enable_prefix_caching, dtype="float32",
        num_gpu_blocks_override=engine.num_blocks)
    sim = SimulatedEngine(cost_model.model, cost_model.gpu, config, cost_model=cost_model)
    reqs = [SimRequest(r.request_id, r.arrival, r.prompt,
                       list(outputs[r.request_id].outputs[0].token_ids)) for r in requests]
    return sim.run(reqs, recorder=recorder).summary


def run(args) -> dict:
    from refserve.bench.roofline import measure_ceilings
    from refserve.simulator.cost_model import CostModel
    from refserve.simulator.hardware import host_profile, load_model

    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (uptime) on "
          f"{os.cpu_count()} CPUs", flush=True)
    print("measuring this machine's ceilings (float32 matmul, array copy)...", flush=True)
    gpu = host_profile(measure_ceilings(1024, 128))
    profile = StepProfile()
    engine = make_engine(args, profile, max_num_seqs=16, max_num_batched_tokens=256,
                         enable_prefix_caching=False)
    shape = load_model(str(engine.model_path))
    vocab = shape.vocab_size
    t0 = time.perf_counter()
    shares = [drive(engine, phase).cpu_share
              for phase in profile_requests(args.scale, vocab, args.seed)]
    fit_share = float(np.mean(shares))
    fitted, dropped = robust_fit(CostModel(shape, gpu, "float32"), profile.samples)
    cm = fitted.cost_model
    cpu_fit, _ = robust_fit(CostModel(shape, gpu, "float32"), profile.cpu_samples)
    print(f"fit: {len(profile.samples)} steps profiled in {time.perf_counter() - t0:.1f} s, "
          f"{dropped} interrupted ones left out; on the {fitted.num_samples} kept: rms "
          f"relative error {fitted.rms_relative_error:.1%}, max "
          f"{fitted.max_relative_error:.1%}; this process got {fit_share:.0%} of a CPU\n"
          f"{cm.describe()}\nCPU-time fit: rms relative error "
          f"{cpu_fit.rms_relative_error:.1%}, max {cpu_fit.max_relative_error:.1%}",
          flush=True)
    del engine
    rows = []
    for name, (config, requests) in workloads_to_test(args.scale, vocab, args.seed).items():
        engine = traced(args, make_engine(args, None, **config), f"real: {name}")
        run_ = drive(engine, requests)
        outputs = run_.outputs
        real = summarize([o.metrics for o in outputs.values()], run_.elapsed, {})
        tracer = getattr(args, "tracer", None)
        sim = simulate(engine, cm, requests, outputs, None if tracer is None else
                       tracer.add_simulation(f"simulated: {name}", run_.start))
        sim_cpu = simulate(engine, _Scaled(cpu_fit.cost_model, run_.cpu_share), requests,
                           outputs)
        row = {"workload": name, "requests": len(requests), "steps": sim.num_steps,
               "load_average": os.getloadavg()[0], "cpu_share": run_.cpu_share}
        for label, attr in METRICS:
            r, s, c = getattr(real, attr), getattr(sim, attr), getattr(sim_cpu, attr)
            row[f"real_{label}"], row[f"sim_{label}"], row[f"sim_cpu_{label}"] = r, s, c
            row[f"err_{label}"] = (s - r) / r if r and s is not None else None
            row[f"err_cpu_{label}"] = (c - r) / r if r and c is not None else None
        rows.append(row)
        print(f"  {name}: real {real.format()}", flush=True)
        del engine
    errors = [abs(row[f"err_{label}"]) for row in rows for label, _ in METRICS
              if row[f"err_{label}"] is not None]
    median, worst = float(np.median(errors)), float(np.max(errors))
    table = [{"workload": row["workload"], "load": f"{row['load_average']:.2f}",
              "cpu": f"{row['cpu_share']:.0%}",
              **{label: _pct(row[f"err_{label}"]) for label, _ in METRICS}} for row in rows]
    print()
    print_table(table, [("workload", "workload", "")] +
                [(label, label + " err", "") for label, _ in METRICS] +
                [("load", "load avg", ""), ("cpu", "CPU share", "")])
    verdict = ("meets" if worst <= TARGET_MAX and median <= TARGET_MEDIAN else "misses")
    print(f"\nerrors (simulated - real) / real: median {median:.1%}, max {worst:.1%} -> "
          f"{verdict} the target (every error <= {TARGET_MAX:.0%}, median <= "
          f"{TARGET_MEDIAN:.0%}); load average at the end {os.getloadavg()[0]:.2f}; this "
          f"process got {fit_share:.0%} of a CPU during the fit (CPU share: during each "
          f"workload)")
    cpu_errors = [abs(row[f"err_cpu_{label}"]) for row in rows for label, _ in METRICS
                  if row[f"err_cpu_{label}"] is not None]
    print("\nthe same, fitted on each step's CPU time and scaled by the CPU share of each run "
          "(what the cost model would predict on a machine nobody else loads):")
    print_table([{"workload": row["workload"], **{label: _pct(row[f"err_cpu_{label}"])
                                                 for label, _ in METRICS}} for row in rows],
                [("workload", "workload", "")] +
                [(label, label + " err", "") for label, _ in METRICS])
    cpu_median, cpu_worst = float(np.median(cpu_errors)), float(np.max(cpu_errors))
    print(f"median {cpu_median:.1%}, max {cpu_worst:.1%}")
    e = cm.eff
    return {"load_average_start": list(load), "load_average_end": list(os.getloadavg()),
            "cpu_share_fit": fit_share,
            "ceilings": {"peak_flops": gpu.peak("float32"),
                         "memory_bandwidth": gpu.memory_bandwidth},
            "fit": {"num_steps": fitted.num_samples, "num_steps_left_out": dropped,
                    "rms_relative_error": fitted.rms_relative_error,
                    "max_relative_error": fitted.max_relative_error,
                    "efficiencies": {"flops": e.flops, "bandwidth": e.bandwidth,
                                     "attention": e.attention,
                                     "kv_bandwidth": e.kv_bandwidth,
                                     "step_overhead_s": e.step_overhead_s,
                                     "row_overhead_s": e.row_overhead_s}},
            "rows": rows, "median_abs_error": median, "max_abs_error": worst,
            "cpu_time_fit": {"rms_relative_error": cpu_fit.rms_relative_error,
                             "median_abs_error": cpu_median, "max_abs_error": cpu_worst},
            "meets_target": verdict == "meets"}


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1%}"


def plot(result: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [label for label, _ in METRICS]
    width = 0.8 / max(len(result["rows"]), 1)
    for i, row in enumerate(result["rows"]):
        values = [100 * (row[f"err_{label}"] or 0.0) for label in labels]
        ax.bar(np.arange(len(labels)) + i * width, values, width, label=row["workload"])
    for y in (-100 * TARGET_MAX, 100 * TARGET_MAX):
        ax.axhline(y, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(np.arange(len(labels)) + width * (len(result["rows"]) - 1) / 2, labels)
    ax.set_ylabel("simulated - real (% of real)")
    ax.set_title(f"simulator fidelity: median |error| {result['median_abs_error']:.1%}, "
                 f"max {result['max_abs_error']:.1%}")
    ax.legend()
    save_figure(fig, result, path)
