"""The simulated engine: refserve's real Scheduler and KVCacheManager on a virtual clock.

Only the model is replaced. One step is

    out = scheduler.schedule()           the real one: admit / advance / preempt, chunked
                                         prefill, prefix-cache hits, copy-on-write
    clock += cost_model.step_time(out)   instead of runner.forward + sampling
    scheduler.update(out, tokens)        the real one: append, hash full blocks, retire,
                                         free; the tokens are the request's own next ones

and requests join `waiting` when the clock passes their arrival time (the serving loop's
inbox). The KV pool is sized by the real engine's own rule (engine_setup.size_kv_pool) on
a modelled device (`simulated_device`): on a GPU, gpu_memory_utilization x memory - weights
/ tp - reserved - one step's activations; on the host profile, kv_cache_memory_bytes;
num_gpu_blocks_override wins over both. The token budget is resolved as the real engine
resolves it, on the backend the profile stands for (`simulated_backend`).

Per request it fills the real engine's `RequestMetrics` (arrival, first token and finish on
the virtual clock, cached tokens, preemptions), completed at finish by the engine's own
`RequestMetrics.record_finish` from the sequence, and per run `metrics.summarize`'s
`RunSummary`: the same TTFT / TPOT / KV peak / prefix hit rate / slot-step numbers, printed
by the same `format()`.

Speculative decoding (a speculative_config): `SimulatedSpeculation` (outputs.py) runs the
real `Speculator` before `schedule(proposals)` and draws each verify row's accepted length
from the request's acceptance rate alpha; the cost model prices the verify row (q = k + 1
query tokens, k + 1 logits rows) and, for a draft model, the draft passes. The draft model's
KV cache takes its share of the pool, split by bytes per token as in the real engine.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from dataclasses import dataclass, field

from refserve import capacity
from refserve.config import EngineConfig
from refserve.engine_setup import DeviceMemory, resolve_token_budget, size_kv_pool
from refserve.kv_cache import KVCacheManager
from refserve.metrics import RequestMetrics, RunSummary, summarize
from refserve.sampling_params import SamplingParams
from refserve.scheduler.factory import make_scheduler
from refserve.sequence import Sequence
from refserve.simulator.cost_model import CostModel, Efficiencies
from refserve.simulator.delivery import DeliverySteps
from refserve.simulator.engine_overheads import DEFAULT_ENGINE, EngineOverheads, load_engine
from refserve.simulator.hardware import GpuProfile, ModelShape
from refserve.simulator.multi_step import MultiStepRounds
from refserve.simulator.outputs import SimulatedSpeculation, SyntheticOutputs, draft_model_shape
from refserve.simulator.workload import SimRequest
from refserve.spec_decode.registry import resolve as resolve_proposer


def resolve_dtype(dtype: str, gpu: GpuProfile, model: ModelShape) -> str:
    """--dtype auto: the checkpoint's dtype on a GPU, float32 on the host (NumPy)."""
    if dtype != "auto":
        return dtype
    return "float32" if gpu.kind == "host" else model.dtype


def simulated_backend(gpu: GpuProfile) -> str:
    """The backend a profile stands for, whose defaults (token budget, prefill cap) the
    simulated engine takes as the real one would: the tuned CPU backend on the host
    profile ("this machine"), CuPy (vLLM's GPU defaults) on a GPU."""
    return "cpu" if gpu.kind == "host" else "cupy"


def simulated_device(model: ModelShape, gpu: GpuProfile, dtype: str, tensor_parallel_size: int,
                     draft: ModelShape | None = None, draft_has_own_weights: bool = False, *,
                     quantization: str | None = None) -> DeviceMemory | None:
    """One GPU's memory as the pool sizing sees it once the weights are loaded: the
    profile's memory, with this GPU's share of the weights (and of a draft model's own,
    unless it is the target's first layers) and the profile's reserved bytes in use. None
    on the host profile (the pool is kv_cache_memory_bytes, as on the CPU backends).
    `quantization="fp8"`: one byte per weight."""
    if gpu.kind == "host":
        return None
    b_w = capacity.weight_dtype_bytes(dtype, quantization)
    tp = tensor_parallel_size
    weights = model.total_params * b_w // tp
    if draft is not None and draft_has_own_weights:
        weights += draft.total_params * b_w // tp
    return DeviceMemory(gpu.memory_bytes, weights + gpu.reserved_bytes,
                        f"weights {capacity.format_bytes(weights)} per GPU, reserved "
                        f"{capacity.format_bytes(gpu.reserved_bytes)}")


@dataclass
class SimResult:
    """A finished simulation: per-request metrics (in arrival order), the run summary, and
    one timeline sample per step: start and end time, scheduled rows, tokens sampled,
    sequences waiting after it was scheduled, KV blocks used. `itl`: every inter-token
    latency, the time from one step that gave a request tokens to its next one (stalls,
    preemptions and the recompute included; a verify row's tokens arrive together)."""

    metrics: dict[str, RequestMetrics]
    summary: RunSummary
    timeline: dict[str, list] = field(default_factory=dict)
    num_steps: int = 0
    wall_seconds: float = 0.0
    stopped_early: bool = False
    itl: array = field(default_factory=lambda: array("d"))
    delivery: DeliverySteps = field(default_factory=lambda: DeliverySteps())

    @property
    def steps_per_second(self) -> float:
        return self.num_steps / self.wall_seconds if self.wall_seconds > 0 else 0.0


class SimulatedEngine:
    def __init__(self, model: ModelShape, gpu: GpuProfile, config: EngineConfig | None = None,
                 *, tensor_parallel_size: int = 1, cost_model=None,
                 outputs: SyntheticOutputs | None = None, spec_alpha: float = 0.7,
                 spec_seed: int = 0, quantization: str | None = None,
                 kv_cache_dtype: str = "auto",
                 engine: EngineOverheads | str | None = DEFAULT_ENGINE,
                 served: bool = False, num_scheduler_steps: int = 1, **kwargs) -> None:
        """`config`: the real engine's EngineConfig (vLLM's knob names); or its fields as
        keywords. `cost_model`: anything with `step_time(out) -> seconds` (default: the
        roofline CostModel of this model on tensor_parallel_size x gpu, with `engine`'s
        host terms (an engines.toml entry or its key, by default vLLM's; None, and always
        on the host profile: the profile's own two overheads), its
        HTTP front end when `served`, and config.enforce_eager). `quantization` and
        `kv_cache_dtype`: vLLM's --quantization fp8 and --kv-cache-dtype fp8 (weights,
        KV cache in one byte: the pool and the cost model both see them). With a
        speculative_config, `spec_alpha` is the acceptance rate of requests that do not
        set their own (SimRequest.spec_alpha) and `spec_seed` seeds the accept draws.
        `num_scheduler_steps`: vLLM V0's multi-step scheduling (multi_step.py)."""
        config = config or EngineConfig(**kwargs)
        # The token budget and prefill cap the real engine would resolve on the backend
        # the profile stands for.
        self.config = config = resolve_token_budget(config, simulated_backend(gpu))[0]
        spec = config.speculative_config
        if spec is not None and outputs is not None:
            raise ValueError("give outputs= or a speculative_config, not both")
        runs_a_model = False
        if spec is not None:  # its proposer and options, checked before anything else
            proposer_cls, spec = resolve_proposer(spec, config)
            self.config = config = dataclasses.replace(config, speculative_config=spec)
            runs_a_model = proposer_cls.runs_a_model
        self.num_scheduler_steps = MultiStepRounds(num_scheduler_steps).num_scheduler_steps
        if num_scheduler_steps > 1 and spec is not None:
            raise ValueError("num_scheduler_steps > 1 with a speculative_config: vLLM's "
                             "multi-step scheduling does not run speculative decoding; "
                             "choose one")
        if config.preemption_mode == "swap":
            raise ValueError("preemption_mode='swap': the simulator prices no host <-> "
                             "device copies, so it runs recompute preemption only; "
                             "compare the two on the real engine (python -m refserve.bench "
                             "preemption)")
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r}: must be >= 1")
        if gpu.kind == "host" and tensor_parallel_size > 1:
            raise ValueError("tensor parallelism needs GPUs; the host profile has one CPU")
        self.model, self.gpu, self.tensor_parallel_size = model, gpu, tensor_parallel_size
        self.dtype = resolve_dtype(config.dtype, gpu, model)
        gpu.peak(self.dtype)  # refuses a dtype the profile has no peak for
        self.max_model_len = config.max_model_len or model.max_position_embeddings
        contiguous = config.kv_cache_layout == "contiguous"
        draft = draft_model_shape(spec, model) if runs_a_model else None
        self.quantization, self.kv_cache_dtype = quantization, kv_cache_dtype
        if isinstance(engine, str):
            engine = load_engine(engine) if gpu.kind == "gpu" else None
        device = simulated_device(model, gpu, self.dtype, tensor_parallel_size, draft,
                                  draft is not None and spec.options["model"] != "self",
                                  quantization=quantization)
        try:
            pool = size_kv_pool(
                config, model.pool_shape, capacity.DTYPE_BYTES[self.dtype],
                self.max_model_len, device, draft.pool_shape if draft is not None else None,
                kv_dtype_bytes=capacity.kv_cache_dtype_bytes(self.dtype, kv_cache_dtype),
                tensor_parallel_size=tensor_parallel_size)
        except ValueError as e:  # the memory is short: say which model on which GPUs
            if device is None or config.num_gpu_blocks_override is not None:
                raise
            raise ValueError(f"{model.name} on {tensor_parallel_size} x {gpu.name}: {e}; use "
                             "more GPUs (--tensor-parallel-size) or a larger one") from None
        self.num_blocks, self.block_size = pool.num_blocks, pool.block_size
        self.pool_sized_by = pool.knob
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks, self.block_size,
            enable_prefix_caching=config.enable_prefix_caching and not contiguous,
            prefix_caching_policy=config.prefix_caching_policy)
        self.scheduler = make_scheduler(config, self.kv_cache_manager, self.max_model_len,
                                        model.eos_token_id)
        self.cost_model = cost_model or CostModel(
            model, gpu, self.dtype, tensor_parallel_size, Efficiencies.of(gpu, engine),
            quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            enforce_eager=config.enforce_eager, served=served,
            kv_read_per_query_head=engine is not None and engine.kv_read_per_query_head,
            async_output=engine is not None and engine.async_output,
            custom_allreduce=engine is not None and engine.custom_allreduce)
        if spec is not None:
            outputs = SimulatedSpeculation(spec, self.cost_model, self.max_model_len,
                                           config.max_num_batched_tokens, spec_alpha,
                                           spec_seed)
        self.outputs = outputs or SyntheticOutputs()
        # A served run's HTTP front end holds each request this long before the engine
        # sees it (receiving, parsing, tokenizing): part of its TTFT.
        self.front_end_request_s = engine.front_end_request_s if served and engine else 0.0
        self.clock = 0.0
        self.metrics: dict[str, RequestMetrics] = {}

    def describe(self) -> str:
        tokens = self.num_blocks * self.block_size
        return (f"KV cache {self.num_blocks} blocks x {self.block_size} tokens = {tokens} "
                f"tokens per GPU (sized by {self.pool_sized_by}) | max_num_seqs "
                f"{self.config.max_num_seqs}, max_num_batched_tokens "
                f"{self.config.max_num_batched_tokens}"
                + (f" (a prefill at most {self.config.long_prefill_token_threshold})"
                   if self.config.long_prefill_token_threshold else "")
                + ", prefix caching "
                f"{'on' if self.kv_cache_manager.enable_prefix_caching else 'off'}, "
                f"max_model_len {self.max_model_len}, tensor parallel "
                f"{self.tensor_parallel_size}, chunked prefill "
                f"{'on' if self.config.enable_chunked_prefill else 'off (prefill-first)'}"
                + (f", weights {self.quantization}" if self.quantization else "")
                + (f", KV cache {self.kv_cache_dtype}" if self.kv_cache_dtype != "auto"
                   else "") + self._describe_speculation())

    def _describe_speculation(self) -> str:
        spec = self.config.speculative_config
        if spec is None:
            return ""
        draft = (f" {self.outputs.draft_model.name}"
                 if getattr(self.outputs, "draft_cost", None) is not None else "")
        return (f" | speculative decoding {spec.method}{draft}, k = {spec.k}, adaptive "
                f"{'on' if spec.adaptive else 'off'}, per-token acceptance probability α "
                f"{self.outputs.alpha:g} unless a request sets its own")

    def check_requests(self, requests: list[SimRequest]) -> None:
        """Raise ValueError naming the first request that could never run here."""
        seen = set()
        for r in requests:
            if r.request_id in seen:
                raise ValueError(f"request_id {r.request_id!r} appears twice")
            seen.add(r.request_id)
            if not r.output_token_ids:
                raise ValueError(f"request {r.request_id!r} asks for no output tokens")
            try:
                self.scheduler.check_fits(r.num_prompt_tokens, 1)
            except ValueError as e:
                raise ValueError(f"request {r.request_id!r}: {e}") from None

    def run(self, requests: list[SimRequest], *, progress: bool = False, recorder=None,
            on_step=None, check_invariants: bool = False) -> SimResult:
        """Simulate until every request finished (or `on_step` returns True: stopped early).

        recorder          a trace.TraceRecorder (or anything with its arrive / step /
                          finish methods)
        on_step(engine, t_start, t_end, out, retired)   called after every step
        check_invariants  kv_cache_manager.check_invariants() after every step (tests)

        A step's tokens reach their client when its multi-step round ends (every step,
        without multi-step) and its outputs are processed (with the cost model's
        async_output, when the next step ends), plus the cost model's `delivery_delay` (an
        HTTP front end): TTFT, TPOT and the inter-token latencies are the client's.
        """
        requests = sorted(requests, key=lambda r: r.arrival_time)
        delay = self.front_end_request_s
        self.check_requests(requests)
        sched, kv = self.scheduler, self.kv_cache_manager
        outputs, cost_model = self.outputs, self.cost_model
        out_delays = getattr(cost_model, "out_delays", lambda out: (0.0, 0.0))
        held = getattr(cost_model, "async_output", False)  # deliver when the next step ends
        rounds = MultiStepRounds(self.num_scheduler_steps)
        # Live while it runs: on_step may read every request's metrics so far.
        metrics = self.metrics = {}
        request_of: dict[int, SimRequest] = {}   # seq_id -> its request
        last_token: dict[int, float] = {}        # seq_id -> when its client last got tokens
        pending: dict[int, Sequence] = {}        # seq_id -> sequence: tokens not delivered yet
        finishing: list[Sequence] = []           # retired, finished when delivered
        deferred = None  # (pending, finishing, sampling step, its out) held for the next step

        def deliver(batch_pending, batch_finishing, t_client, at, sampled_at):
            for seq_id, seq in batch_pending.items():
                m = metrics[seq.request_id]
                if m.first_token_time is None:  # the client's times, as the engine stamps
                    m.first_token_time = seq.first_token_time = t_client
                else:
                    itl.append(t_client - last_token[seq_id])
                steps.deliver(seq.request_id, at, sampled_at)
                last_token[seq_id] = t_client
            for seq in batch_finishing:
                last_token.pop(seq.seq_id, None)
                seq.finish_time = t_client
                metrics[seq.request_id].record_finish([seq], t_client)
                if recorder is not None:
                    recorder.finish(seq.request_id, t_client)

        def flush(now):
            """Deliver held outputs when no step follows: after their output lane."""
            front, lane = out_delays(deferred[3])
            steps.lane.add(deferred[2])
            deliver(deferred[0], deferred[1], now + lane + front, deferred[2], deferred[2])
        steps = DeliverySteps()
        itl = array("d")
        timeline = {"t": [], "t_end": [], "scheduled": [], "sampled": [], "waiting": [],
                    "kv_blocks_used": []}
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(requests), unit="req", desc="simulating", mininterval=0.5)
        peak, i, n, stopped, k = 0, 0, len(requests), False, -1
        wall0 = time.perf_counter()
        now = self.clock = requests[0].arrival_time + delay if requests else 0.0
        while True:
            while i < n and requests[i].arrival_time + delay <= now:
                r = requests[i]
                seq = Sequence(r.request_id, r.prompt_token_ids,
                               SamplingParams(max_tokens=r.num_output_tokens, ignore_eos=True),
                               r.arrival_time)
                sched.add_sequence(seq)
                request_of[seq.seq_id] = r
                metrics[r.request_id] = RequestMetrics(arrival_time=r.arrival_time,
                                                       num_prompt_tokens=r.num_prompt_tokens)
                if recorder is not None:
                    recorder.arrive(r.request_id, r.arrival_time)
                i += 1
            if not sched.has_unfinished():
                if deferred is not None:
                    flush(now)
                    deferred = None
                if i == n:
                    break
                now = requests[i].arrival_time + delay  # idle until the next arrival
                continue
            proposals, draft_seconds = outputs.propose(sched.running, request_of)
            out, scheduled = rounds.schedule(sched, proposals)  # raises if nothing to do
            used = kv.num_held_blocks  # fullest now: nothing retired yet
            peak = max(peak, used)
            t_start = now
            seconds = (cost_model.step_time(out) if scheduled
                       else cost_model.step_time(out, scheduled=False))
            now = self.clock = now + draft_seconds + seconds
            k += 1
            sampled = {}
            for row in out.scheduled:
                if row.num_logits:
                    seq = row.seq
                    sampled[seq.seq_id] = outputs.sample(row, request_of[seq.seq_id])
            update = sched.update(out, sampled)
            outputs.observe(update)
            retired = update.retired
            for row in out.scheduled:
                seq = row.seq
                if seq.seq_id in sampled:
                    pending[seq.seq_id] = seq
                    m = metrics[seq.request_id]
                    m.num_target_passes += 1
                    verified = update.verified.get(seq.seq_id)
                    if verified is not None:  # output_processor.make_outputs's counts
                        m.num_spec_verify_steps += 1
                        m.num_spec_proposed += verified[0]
                        m.num_spec_accepted += verified[1]
            finishing.extend(retired)
            if recorder is not None:
                recorder.step(t_start, now, out, kv_blocks_used=used,
                              kv_blocks_total=kv.num_blocks, num_waiting=sched.num_waiting)
            if deferred is not None:  # processed while this step ran
                deliver(deferred[0], deferred[1], now + out_delays(deferred[3])[0], k,
                        deferred[2])
                deferred = None
            if rounds.round_ends(sched):
                if held:
                    deferred = (dict(pending), list(finishing), k, out)
                else:
                    deliver(pending, finishing, now + out_delays(out)[0], k, k)
                pending.clear()
                finishing.clear()
            timeline["t"].append(t_start)
            timeline["t_end"].append(now)
            timeline["scheduled"].append(len(out.scheduled))
            timeline["sampled"].append(sum(map(len, sampled.values())))
            timeline["waiting"].append(sched.num_waiting)
            timeline["kv_blocks_used"].append(used)
            if check_invariants:
                kv.check_invariants()
            if bar is not None and retired:
                bar.update(len(retired))
            if on_step is not None and on_step(self, t_start, now, out, retired):
                stopped = True
                break
        if deferred is not None:  # stopped early
            flush(now)
        if bar is not None:
            bar.close()
        wall = time.perf_counter() - wall0
        start = requests[0].arrival_time if requests else 0.0
        summary = summarize(list(metrics.values()), now - start, {
            "num_steps": sched.num_steps, "slot_steps_used": sched.slot_steps_used,
            "slot_steps_wasted": sched.slot_steps_wasted, "kv_blocks_peak": peak,
            "kv_blocks_total": kv.num_blocks,
            "prefix_cache_queried_tokens": kv.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": kv.prefix_cache_hit_tokens})
        if self.config.speculative_config is not None:
            summary.speculative_method = self.config.speculative_config.method
        return SimResult(metrics, summary, timeline, sched.num_steps, wall, stopped, itl,
                         steps)
