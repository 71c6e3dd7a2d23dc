"""The time of one engine step, from what the step computes: a roofline per kernel family.

A step is rows of "q query tokens at the end of a context of c tokens" (a prefill chunk, a
decode: q = 1, a speculative verify: q = k + 1); l of a row's positions need logits. Its
composition is five sums (`StepComposition`):

    R = number of rows                    T = sum q      (query tokens)
    S = sum l      (logits rows)          C = sum c      (KV tokens read)
    A = sum (q c - q (q - 1) / 2)         query-key pairs: query j of a row attends the
                                          c - q + j + 1 keys up to itself (causal)

With P = layer_params, V H = lm_head_params (refserve/simulator/hardware.py), b bytes per
weight, kv = KV bytes per token, L layers, W = num_heads * head_dim and p GPUs of tensor
parallelism, one GPU's work is (WARMUP §8, per GPU):

    GEMMs      F_lin = (2 T P + 2 S V H) / p   FLOPs      B_lin = b (P + V H) / p   bytes
    attention  F_att = 4 L W A / p             FLOPs      B_kv  = kv / p * C        bytes
               (QK^T and PV: 2 FLOPs per multiply-add each; every cached K/V read once)

and the step takes

    t = max(F_lin / (peak e_flops), B_lin / (bandwidth e_bw))       GEMMs: compute or weights
      + max(F_att / (peak e_attn), B_kv / (bandwidth e_kv))         attention: compute or KV
      + 2 L [2 (p - 1) / p * T H b / link + latency]  (p > 1)       two ring all-reduces of
                                                                    the T x H activations
                                                                    per layer
      + launch                                                      kernel launches
      + cpu                                                         the host's share

    launch = 0 when the step replays a CUDA graph (every row a decode or a verify, at most
             max_graph_batch rows, enforce_eager off: vLLM captures decode batches only),
             else L * eager_layer_s: each layer's kernels launched one by one
    cpu    = step_overhead + row_overhead * R + sample_row * N + front_end_row * N (served)
             step_overhead: scheduling and the step's fixed host work; row_overhead:
             preparing each scheduled row's inputs and block table; sample_row: sampling,
             detokenizing and appending each token of the N rows that sample; front_end_row:
             an HTTP server streaming each of those tokens (served runs only: an API server
             process in vLLM V0 costs a third of the step, vLLM's v0.6.0 post)

The host's work is added to the GPU's, not overlapped with it, as in an engine that
schedules the next step after the last one returned (vLLM V0 without multi-step; a
published figure from an engine that overlaps them fits a smaller cpu term).

Precision. `dtype` is the activations' (and the attention's) dtype. `quantization="fp8"`
(vLLM's --quantization fp8) stores the weights in one byte and runs the GEMMs at the GPU's
fp8 peak; `kv_cache_dtype="fp8"` (--kv-cache-dtype fp8) stores K and V in one byte, which
halves B_kv (and doubles the pool, engine.py); the attention still computes in `dtype`.

Each `max` is one roofline: a kernel is bound by its compute or by its memory traffic,
whichever takes longer. A decode step at batch 1 is all weight bytes (t ~ B_lin / bw); a
2048-token prefill is all FLOPs (t ~ F_lin / peak). The efficiencies e_flops, e_bw, e_kv,
e_attn, the all-reduce latency and the host terms are the only fitted numbers
(step_fit.fit on measured steps; world_fit.fit on published measurements, `python -m
refserve.bench sim-world`); everything else is the model's shape and the GPU's data sheet.
e_kv, the fraction of the bandwidth the KV gather reaches, is e_bw unless fitted apart:
streaming weights through a GEMM and gathering a paged cache block by block are different
kernels (on the NumPy engine the gather is about 30x slower per byte than the weight read,
bench sim-fidelity; on the GPUs of the published rows it is faster than the weight read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from refserve.capacity import DTYPE_BYTES, kv_cache_dtype_bytes, weight_dtype_bytes

if TYPE_CHECKING:
    from refserve.scheduler import SchedulerOutput
    from refserve.simulator.engine_overheads import EngineOverheads
    from refserve.simulator.hardware import GpuProfile, ModelShape

# The largest decode batch vLLM captures as a CUDA graph (its default
# max_seq_len_to_capture aside): 512 in vLLM V1's cudagraph_capture_sizes (256 in V0).
MAX_GRAPH_BATCH = 512


@dataclass(frozen=True)
class StepComposition:
    """The five sums of a step (see the module docstring)."""

    num_rows: int = 0
    num_tokens: int = 0
    num_logits: int = 0
    context_tokens: int = 0
    attention_pairs: int = 0

    num_sampling_rows: int = 0   # N: rows that sample (l > 0)
    num_prefill_rows: int = 0    # rows with query tokens that need no logits (q > l)

    @classmethod
    def from_rows(cls, rows) -> StepComposition:
        """rows: (q query tokens, c context length after the step, l logits rows) each."""
        r = t = s = c = a = n = p = 0
        for q, ctx, logits in rows:
            if not 1 <= q <= ctx or not 0 <= logits <= q:
                raise ValueError(f"a row needs 1 <= q <= c and 0 <= l <= q, got "
                                 f"(q={q}, c={ctx}, l={logits})")
            r += 1
            t += q
            s += logits
            c += ctx
            a += q * ctx - q * (q - 1) // 2
            n += logits > 0
            p += q > logits
        return cls(r, t, s, c, a, n, p)

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepComposition:
        """The composition of a scheduler step: a row computes [start, start +
        num_scheduled_tokens);
        static batching's padding rows cost what a decode row costs."""
        return cls.from_rows((row.num_scheduled_tokens, row.end, row.num_logits)
                             for row in out.scheduled + out.padding)


@dataclass(frozen=True)
class Efficiencies:
    """The fitted numbers: fractions of the peaks a kernel reaches, and the overheads."""

    flops: float
    bandwidth: float
    attention: float
    step_overhead_s: float
    row_overhead_s: float
    kv_bandwidth: float | None = None  # e_kv; None: the same as bandwidth
    sample_row_s: float = 0.0      # host seconds per sampling row (sampling, detokenizing)
    front_end_row_s: float = 0.0   # an HTTP front end's seconds per streamed token
    eager_layer_s: float = 0.0     # launch seconds per layer of a step without a CUDA graph

    @property
    def kv(self) -> float:
        return self.bandwidth if self.kv_bandwidth is None else self.kv_bandwidth

    @classmethod
    def of(cls, gpu: GpuProfile, engine: EngineOverheads | None = None) -> Efficiencies:
        """The GPU's efficiencies; the host terms of `engine` (engines.toml) when given,
        else the GPU profile's own two overheads."""
        eff = cls(gpu.flops_efficiency, gpu.bandwidth_efficiency, gpu.attention_efficiency,
                  gpu.step_overhead_s, gpu.row_overhead_s,
                  kv_bandwidth=gpu.kv_bandwidth_efficiency or None)
        return eff if engine is None else engine.apply(eff)


class CostModel:
    """Step time of `model` on `tensor_parallel_size` x `gpu` in `dtype` (module docstring).

    `step_time(out)` is the simulator's interface: anything with that method (e.g. a replay
    of measured step times) can stand in for this class.
    """

    def __init__(self, model: ModelShape, gpu: GpuProfile, dtype: str,
                 tensor_parallel_size: int = 1, efficiencies: Efficiencies | None = None, *,
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 enforce_eager: bool = False, served: bool = False,
                 max_graph_batch: int = MAX_GRAPH_BATCH, kv_read_per_query_head: bool = False):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r}: must be >= 1")
        self.model, self.gpu, self.dtype = model, gpu, dtype
        self.tp = tensor_parallel_size
        self.eff = efficiencies or Efficiencies.of(gpu)
        self.quantization, self.kv_cache_dtype = quantization, kv_cache_dtype
        self.enforce_eager, self.served = enforce_eager, served
        self.max_graph_batch = max_graph_batch
        b_w = weight_dtype_bytes(dtype, quantization)   # refuses an unknown quantization
        b_kv = kv_cache_dtype_bytes(dtype, kv_cache_dtype)
        self.gemm_dtype = "fp8" if quantization == "fp8" else dtype
        self.peak = gpu.peak(self.gemm_dtype)   # the GEMMs'
        self.attention_peak = gpu.peak(dtype)   # attention computes in the activations' dtype
        b = DTYPE_BYTES[dtype]
        p = self.tp
        # Per-token coefficients of the formulas, per GPU.
        self.flops_per_token = 2 * model.layer_params / p
        self.flops_per_logit = 2 * model.lm_head_params / p
        self.weight_bytes = b_w * (model.layer_params + model.lm_head_params) / p
        self.flops_per_pair = 4 * model.num_layers * model.attention_width / p
        self.kv_read_per_query_head = kv_read_per_query_head
        # An engine without a grouped-query kernel reads each KV head once per query head.
        group = model.num_heads // model.num_kv_heads if kv_read_per_query_head else 1
        self.kv_bytes_per_token = model.kv_bytes_per_token(b_kv, p) * group
        self.allreduce_bytes_per_token = model.hidden_size * b
        self.num_allreduces = 2 * model.num_layers if p > 1 else 0

    # ---- the formulas ----------------------------------------------------------------

    def work(self, comp: StepComposition) -> dict[str, float]:
        """F_lin, B_lin, F_att, B_kv of one GPU, and the all-reduce bytes each GPU sends."""
        p = self.tp
        return {
            "linear_flops": self.flops_per_token * comp.num_tokens
                            + self.flops_per_logit * comp.num_logits,
            "linear_bytes": self.weight_bytes,
            "attention_flops": self.flops_per_pair * comp.attention_pairs,
            "kv_bytes": self.kv_bytes_per_token * comp.context_tokens,
            "allreduce_bytes": (self.num_allreduces * 2 * (p - 1) / p
                                * comp.num_tokens * self.allreduce_bytes_per_token),
        }

    def graphed(self, comp: StepComposition) -> bool:
        """Whether the step replays a CUDA graph: decode / verify rows only (every query
        token needs logits), at most max_graph_batch of them, enforce_eager off."""
        return (not self.enforce_eager and comp.num_prefill_rows == 0
                and comp.num_rows <= self.max_graph_batch)

    def host_terms(self, comp: StepComposition) -> dict[str, float]:
        """The launch and cpu terms (module docstring), in seconds."""
        e = self.eff
        n = comp.num_sampling_rows
        return {
            "launch": 0.0 if self.graphed(comp) else self.model.num_layers * e.eager_layer_s,
            "cpu": (e.step_overhead_s + e.row_overhead_s * comp.num_rows + e.sample_row_s * n
                    + (e.front_end_row_s * n if self.served else 0.0)),
        }

    def terms(self, comp: StepComposition) -> dict[str, float]:
        """Seconds of each term of the step time; their sum is `time(comp)`."""
        w = self.work(comp)
        e, gpu = self.eff, self.gpu
        compute = self.peak * e.flops
        memory = gpu.memory_bandwidth * e.bandwidth
        comm = 0.0
        if self.num_allreduces:
            comm = (w["allreduce_bytes"] / gpu.interconnect_bandwidth
                    + self.num_allreduces * gpu.allreduce_latency_s)
        return {
            "linear": max(w["linear_flops"] / compute, w["linear_bytes"] / memory),
            "attention": max(w["attention_flops"] / (self.attention_peak * e.attention),
                             w["kv_bytes"] / (gpu.memory_bandwidth * e.kv)),
            "allreduce": comm,
            **self.host_terms(comp),
        }

    def features(self, comp: StepComposition) -> tuple[float, dict[str, float]]:
        """The step time as `constant + sum(coefficient * value)`, linear in the fitted
        numbers once each roofline's side is chosen (at the current efficiencies):

            value of "flops", "bandwidth", "attention", "kv_bandwidth": 1 / efficiency
            value of "allreduce_latency_s" and of each host term: seconds

        so that `time(comp) == constant + sum(coef[k] * value[k])` (`fitted_values`). The
        constant is the all-reduces' bytes over the link."""
        w, e, gpu = self.work(comp), self.eff, self.gpu
        bw = gpu.memory_bandwidth
        f_lin, b_lin = w["linear_flops"] / self.peak, w["linear_bytes"] / bw
        f_att, b_kv = w["attention_flops"] / self.attention_peak, w["kv_bytes"] / bw
        lin_compute = f_lin / e.flops >= b_lin / e.bandwidth
        att_compute = f_att / e.attention >= b_kv / e.kv
        coef = dict.fromkeys(("flops", "bandwidth", "attention", "kv_bandwidth"), 0.0)
        coef["flops" if lin_compute else "bandwidth"] += f_lin if lin_compute else b_lin
        kv_key = "bandwidth" if e.kv_bandwidth is None else "kv_bandwidth"
        coef["attention" if att_compute else kv_key] += f_att if att_compute else b_kv
        n = comp.num_sampling_rows
        coef.update(allreduce_latency_s=float(self.num_allreduces), step_overhead_s=1.0,
                    row_overhead_s=float(comp.num_rows), sample_row_s=float(n),
                    front_end_row_s=float(n) if self.served else 0.0,
                    eager_layer_s=0.0 if self.graphed(comp) else float(self.model.num_layers))
        constant = (w["allreduce_bytes"] / gpu.interconnect_bandwidth if self.num_allreduces
                    else 0.0)
        return constant, coef

    def fitted_values(self) -> dict[str, float]:
        """The values `features` multiplies (1 / efficiency, or seconds)."""
        e = self.eff
        return {"flops": 1 / e.flops, "bandwidth": 1 / e.bandwidth,
                "attention": 1 / e.attention, "kv_bandwidth": 1 / e.kv,
                "allreduce_latency_s": self.gpu.allreduce_latency_s,
                **{k: getattr(e, k) for k in ("step_overhead_s", "row_overhead_s",
                                              "sample_row_s", "front_end_row_s",
                                              "eager_layer_s")}}

    def time(self, comp: StepComposition) -> float:
        if comp.num_rows == 0:
            return 0.0
        return sum(self.terms(comp).values())

    def step_time(self, out: SchedulerOutput) -> float:
        """Seconds the scheduler step `out` takes on this hardware."""
        return self.time(StepComposition.of(out))

    def with_efficiencies(self, eff: Efficiencies, gpu: GpuProfile | None = None
                          ) -> CostModel:
        """The same model, precision and engine settings with other efficiencies (and,
        given one, another GPU profile)."""
        return CostModel(self.model, gpu or self.gpu, self.dtype, self.tp, eff,
                         quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
                         enforce_eager=self.enforce_eager, served=self.served,
                         max_graph_batch=self.max_graph_batch,
                         kv_read_per_query_head=self.kv_read_per_query_head)

    def describe(self) -> str:
        e = self.eff
        kv = "" if e.kv_bandwidth is None else f" (KV gather {e.kv_bandwidth:.1%})"
        precision = "".join([f", weights {self.quantization}" if self.quantization else "",
                             f", KV cache {self.kv_cache_dtype}"
                             if self.kv_cache_dtype != "auto" else ""])
        return (f"cost model: {self.tp} x {self.gpu.name}, {self.dtype}{precision}; GEMM "
                f"{e.flops:.0%} of {self.peak / 1e12:.3g} TFLOP/s, bandwidth {e.bandwidth:.0%}"
                f"{kv} of {self.gpu.memory_bandwidth / 1e9:.0f} GB/s, attention "
                f"{e.attention:.0%}, all-reduce {self.gpu.allreduce_latency_s * 1e6:.1f} us; "
                f"host {e.step_overhead_s * 1e3:.2f} ms/step + {e.row_overhead_s * 1e6:.1f} "
                f"us/row + {e.sample_row_s * 1e6:.1f} us/sampled row"
                + (f" + {e.front_end_row_s * 1e6:.1f} us/streamed token" if self.served
                   else "")
                + (", eager (no CUDA graphs)" if self.enforce_eager else
                   f", CUDA graphs for decode batches <= {self.max_graph_batch}")
                + f", eager launch {e.eager_layer_s * 1e6:.1f} us/layer")


__all__ = ["CostModel", "Efficiencies", "StepComposition"]
