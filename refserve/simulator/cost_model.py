"""The time of one engine step, from what the step computes: a roofline per kernel family.

With the step's sums R, T, S, C, A, N, D, K, Q (composition.py), P = layer_params,
V H = lm_head_params (hardware.py), b bytes per weight, kv = KV bytes per token, L layers,
W = num_heads * head_dim and p GPUs of tensor parallelism, one GPU's work is (WARMUP §8):

    GEMMs      F_lin = (2 T P + 2 S V H) / p   FLOPs      B_lin = b (P + V H) / p   bytes
    attention  F_att = 4 L W / p x pairs       FLOPs      B_kv  = kv / p * C        bytes
               pairs = A                        exactly (the NumPy reference, "this machine")
               pairs = D + B^2 (K + TILE_OVERHEAD Q)   on a GPU (attention_tile = B > 0):
                       the tiles a FlashAttention-style kernel computes, the causal
                       diagonal ones in full, plus each query tile's fixed prologue and
                       epilogue (TILE_OVERHEAD below); decodes (q = 1) read their keys
                       without tiles

and the step takes, on the GPU,

    linear     max(c, w) + (1 - o) min(c, w)                           compute and weights
               c = F_lin / (peak e_flops), w = B_lin / (bandwidth e_bw),  o = gemm_overlap
    attention  max(F_att / (peak e_attn), B_kv / (bandwidth e_kv))     compute or KV cache
    allreduce  2 L [2 (p - 1) / p * T H b / link + latency(p)]  (p > 1)   two all-reduces
                                                                       of the T x H
                                                                       activations per layer
    kernels    L * KERNELS_PER_LAYER * kernel_gap                      each kernel's fixed
                                                                       cost (ramp-up, tail,
                                                                       the gap to the next)

The all-reduce's latency belongs to the collective library the engine calls
(`custom_allreduce`, engines.toml): NCCL's ring passes a small message around the ring
twice, 2 (p - 1) steps each paying a hop's latency (measured figures in bounds.toml),
while a custom one-shot all-reduce (vLLM's, SGLang's, TensorRT-LLM's, PyTorch's
intra-node one) has every GPU read every peer's buffer at once:

    NCCL ring   latency(p) = allreduce_latency_s + 2 (p - 1) allreduce_hop_s
    custom      latency(p) = custom_allreduce_latency_s

The GEMMs' two times overlap only in part: a GEMM whose compute and weight stream take
about as long (a short prefill, a decode batch of ~100 rows) takes longer than the larger
of the two. o = 1 is the roofline's max(); o = 0 loads, then computes. o is a property of
the GPU's GEMM kernels, measured on published per-kernel profiles (gpus.toml's
gemm_overlap: 0.41 on an A100, 0.37 on an H100), not fitted here.

and on the host (the engine's terms, engines.toml):

    launch     0 for a CUDA-graph replay (every row a decode or verify, at most
               max_graph_batch rows, enforce_eager off), else L * eager_layer_s
    schedule   scheduled * (step_overhead + row_overhead * R): one scheduler call and its
               inputs (0 on the continuation steps of a multi-step round)
    output     sample_row * N: sampling, detokenizing, stop checks of the rows that sample
    front_end  front_end_row * N (served runs only): the HTTP server streaming each token

The GPU work, the launches and the scheduler call run in series (the engine prepares the
next step after the last one returned). The front end is another process (vLLM 0.6's
API server and SGLang's tokenizer manager both run apart from the engine), and an engine
with asynchronous output processing (`async_output`: vLLM 0.6 processes step n's outputs
while step n + 1 runs) has the output work on a lane of its own, so

    t = max(serial, output if async_output, front_end)
    serial = linear + attention + allreduce + kernels + launch + schedule
             + (output unless async_output)

A token sampled in a step reaches its client the front end's time (`delivery_delay`)
after its outputs are processed: when the step ends, or with async_output when the next
step ends (the simulated engine holds them back; `output_lane` when no step follows).

Precision. `dtype` is the activations' (and the attention's) dtype. `quantization="fp8"`
(vLLM's --quantization fp8) stores the weights in one byte and runs the GEMMs at the GPU's
fp8 peak; `kv_cache_dtype="fp8"` stores K and V in one byte, which halves B_kv; the
attention still computes in `dtype`.

The fitted numbers are the efficiencies e_flops, e_bw, e_kv, e_attn, the all-reduce
latency, the kernel gap and the host terms; each has a physical range with its source
(bounds.toml, refserve/simulator/bounds.py) and the fit (world_fit.py) stays inside it.
Everything else is the model's shape, the GPU's data sheet and the two kernel constants
below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from refserve.capacity import DTYPE_BYTES, kv_cache_dtype_bytes, weight_dtype_bytes
from refserve.simulator.composition import ATTENTION_TILE, CompositionArrays, StepComposition

if TYPE_CHECKING:
    from refserve.simulator.engine_overheads import EngineOverheads
    from refserve.simulator.hardware import GpuProfile, ModelShape

# The largest decode batch vLLM captures as a CUDA graph (its default
# max_seq_len_to_capture aside): 512 in vLLM V1's cudagraph_capture_sizes (256 in V0).
MAX_GRAPH_BATCH = 512

# A query tile's fixed cost (loading its queries, the softmax's final rescale, writing its
# output), in units of one key-tile iteration. From the FlashAttention-3 forward pass at
# head dimension 128 on an H100, batch x length = 16K, 16 heads (pytorch/benchmark commit
# ff65cb6): 430.3, 517.1, 565.5, 590.2, 614.2, 620.7 TFLOP/s at lengths 512 ...
# 16384 (the benchmark's default, non-causal). With n = length / 128 key tiles per query
# tile, n / (n + 1.85) times one plateau (630 TFLOP/s) reproduces all six within 1.0%.
TILE_OVERHEAD = 1.85

# The kernels of one Llama layer outside the all-reduces, as vLLM runs it: the fused
# residual-add + RMSNorm, the QKV GEMM, rotary embedding, the KV-cache write, attention,
# the output GEMM, the second norm, the gate-up GEMM, SiLU-and-multiply, the down GEMM.
KERNELS_PER_LAYER = 10

STEP_HOST_TERMS = ("step_overhead_s", "row_overhead_s", "sample_row_s", "front_end_row_s",
                   "eager_layer_s")
GPU_TERMS = ("flops", "fp8_flops", "bandwidth", "attention", "kv_bandwidth",
             "allreduce_latency_s", "allreduce_hop_s", "custom_allreduce_latency_s",
             "kernel_gap_s")


def overlapped(compute, memory, overlap: float):
    """max(compute, memory) + (1 - overlap) min(compute, memory): two times of one kernel
    that overlap by the fraction `overlap` of the shorter (1: the roofline's max)."""
    if isinstance(compute, np.ndarray) or isinstance(memory, np.ndarray):
        return (np.maximum(compute, memory)
                + (1 - overlap) * np.minimum(compute, memory))
    return max(compute, memory) + (1 - overlap) * min(compute, memory)


def _max(a, b):
    """max of two numbers, or elementwise of arrays (the formulas take both)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return a if a >= b else b


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
    kernel_gap_s: float = 0.0      # the GPU's fixed seconds per kernel
    fp8_flops: float | None = None  # e_flops of fp8 GEMMs; None: the same as flops

    @property
    def kv(self) -> float:
        return self.bandwidth if self.kv_bandwidth is None else self.kv_bandwidth

    @property
    def fp8(self) -> float:
        return self.flops if self.fp8_flops is None else self.fp8_flops

    @classmethod
    def of(cls, gpu: GpuProfile, engine: EngineOverheads | None = None) -> Efficiencies:
        """The GPU's efficiencies; the host terms of `engine` (engines.toml) when given,
        else the GPU profile's own two overheads."""
        eff = cls(gpu.flops_efficiency, gpu.bandwidth_efficiency, gpu.attention_efficiency,
                  gpu.step_overhead_s, gpu.row_overhead_s,
                  kv_bandwidth=gpu.kv_bandwidth_efficiency or None,
                  kernel_gap_s=gpu.kernel_gap_s, fp8_flops=gpu.fp8_flops_efficiency or None)
        return eff if engine is None else engine.apply(eff)


class CostModel:
    """Step time of `model` on `tensor_parallel_size` x `gpu` in `dtype` (module docstring).

    `step_time(out)` is the simulator's interface: anything with that method (e.g. a replay
    of measured step times) can stand in for this class. Every formula takes a
    StepComposition or a CompositionArrays (many steps at once).
    """

    def __init__(self, model: ModelShape, gpu: GpuProfile, dtype: str,
                 tensor_parallel_size: int = 1, efficiencies: Efficiencies | None = None, *,
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 enforce_eager: bool = False, served: bool = False,
                 max_graph_batch: int = MAX_GRAPH_BATCH, kv_read_per_query_head: bool = False,
                 async_output: bool = False, custom_allreduce: bool = False):
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
        self.async_output = async_output
        self.custom_allreduce = custom_allreduce
        b_w = weight_dtype_bytes(dtype, quantization)   # refuses an unknown quantization
        b_kv = kv_cache_dtype_bytes(dtype, kv_cache_dtype)
        self.gemm_dtype = "fp8" if quantization == "fp8" else dtype
        self.gemm_value = "fp8_flops" if quantization == "fp8" else "flops"  # linearize's
        self.peak = gpu.peak(self.gemm_dtype)   # the GEMMs'
        self.attention_peak = gpu.peak(dtype)   # attention computes in the activations' dtype
        b = DTYPE_BYTES[dtype]
        p = self.tp
        # Per-token coefficients of the formulas, per GPU.
        self.flops_per_token = 2 * model.layer_params / p
        self.flops_per_logit = 2 * model.lm_head_params / p
        self.weight_bytes = b_w * (model.layer_params + model.lm_head_params) / p
        self.flops_per_pair = 4 * model.num_layers * model.attention_width / p
        self.tile = ATTENTION_TILE if gpu.attention_tile else 0
        self.kv_read_per_query_head = kv_read_per_query_head
        # An engine without a grouped-query kernel reads each KV head once per query head.
        group = model.num_heads // model.num_kv_heads if kv_read_per_query_head else 1
        self.kv_bytes_per_token = model.kv_bytes_per_token(b_kv, p) * group
        self.allreduce_bytes_per_token = model.hidden_size * b
        self.num_allreduces = 2 * model.num_layers if p > 1 else 0
        # the all-reduce latency's parts, each multiplying the GPU's constant of its name
        self.allreduce_parts = ({"custom_allreduce_latency_s": 1.0} if custom_allreduce else
                                {"allreduce_latency_s": 1.0, "allreduce_hop_s": 2.0 * (p - 1)})
        self.num_kernels = model.num_layers * KERNELS_PER_LAYER

    # ---- the formulas ----------------------------------------------------------------

    @property
    def gemm_efficiency(self) -> float:
        """e_flops of this model's GEMMs: the fp8 one with fp8 weights."""
        return self.eff.fp8 if self.quantization == "fp8" else self.eff.flops

    def attention_pairs(self, comp):
        """The query-key pairs the attention kernel computes (module docstring)."""
        if not self.tile:
            return comp.attention_pairs
        return comp.decode_pairs + self.tile**2 * (comp.attention_tiles
                                                   + TILE_OVERHEAD * comp.query_tiles)

    def work(self, comp) -> dict:
        """F_lin, B_lin, F_att, B_kv of one GPU, and the all-reduce bytes each GPU sends."""
        p = self.tp
        return {
            "linear_flops": self.flops_per_token * comp.num_tokens
                            + self.flops_per_logit * comp.num_logits,
            "linear_bytes": self.weight_bytes,
            "attention_flops": self.flops_per_pair * self.attention_pairs(comp),
            "kv_bytes": self.kv_bytes_per_token * comp.context_tokens,
            "allreduce_bytes": (self.num_allreduces * 2 * (p - 1) / p
                                * comp.num_tokens * self.allreduce_bytes_per_token),
        }

    def graphed(self, comp):
        """Whether the step replays a CUDA graph: decode / verify rows only (every query
        token needs logits), at most max_graph_batch of them, enforce_eager off."""
        if self.enforce_eager:
            return comp.num_prefill_rows * 0 != 0  # False, or an all-False array
        return (comp.num_prefill_rows == 0) & (comp.num_rows <= self.max_graph_batch)

    def host_terms(self, comp) -> dict:
        """The launch, schedule (with the sample work: "cpu"), output and front-end terms."""
        e = self.eff
        n = comp.num_sampling_rows
        launch = self.model.num_layers * e.eager_layer_s
        graphed = self.graphed(comp)
        launch = (np.where(graphed, 0.0, launch) if isinstance(graphed, np.ndarray)
                  else (0.0 if graphed else launch))
        schedule = comp.scheduled * (e.step_overhead_s + e.row_overhead_s * comp.num_rows)
        output = e.sample_row_s * n
        return {"launch": launch,
                "cpu": schedule + (0.0 if self.async_output else output),
                "output": output if self.async_output else 0.0 * output,
                "front_end": e.front_end_row_s * n if self.served else 0.0 * n}

    def terms(self, comp) -> dict:
        """Seconds of each term (module docstring); `time` combines them."""
        w = self.work(comp)
        e, gpu = self.eff, self.gpu
        memory = gpu.memory_bandwidth
        comm = 0.0 * comp.num_tokens
        if self.num_allreduces:
            comm = (w["allreduce_bytes"] / gpu.interconnect_bandwidth
                    + self.num_allreduces * self.allreduce_latency())
        return {
            "linear": overlapped(w["linear_flops"] / (self.peak * self.gemm_efficiency),
                                 w["linear_bytes"] / (memory * e.bandwidth),
                                 gpu.gemm_overlap),
            "attention": _max(w["attention_flops"] / (self.attention_peak * e.attention),
                              w["kv_bytes"] / (memory * e.kv)),
            "allreduce": comm,
            "kernels": self.num_kernels * e.kernel_gap_s + 0.0 * comp.num_tokens,
            **self.host_terms(comp),
        }

    def allreduce_latency(self) -> float:
        """latency(p) of one small all-reduce (module docstring)."""
        values = self.fitted_values()
        return sum(k * values[name] for name, k in self.allreduce_parts.items())

    @staticmethod
    def combine(t: dict):
        """The step time from its terms: the serial work or a parallel lane if longer."""
        serial = (t["linear"] + t["attention"] + t["allreduce"] + t["kernels"] + t["launch"]
                  + t["cpu"])
        return _max(_max(serial, t["output"]), t["front_end"])

    def time(self, comp):
        """Seconds of a step (0 for a step without rows); an array for CompositionArrays."""
        if isinstance(comp, CompositionArrays):
            return np.where(comp.num_rows > 0, self.combine(self.terms(comp)), 0.0)
        if comp.num_rows == 0:
            return 0.0
        return float(self.combine(self.terms(comp)))

    def delivery_delay(self, comp):
        """Seconds from a step's outputs being processed to its tokens reaching their
        clients: the front end's (module docstring)."""
        return self.host_terms(comp)["front_end"]

    def output_lane(self, comp):
        """Seconds of a step's asynchronous output processing (0 without async_output)."""
        return self.host_terms(comp)["output"]

    def step_time(self, out, scheduled: bool = True) -> float:
        """Seconds the scheduler step `out` takes on this hardware."""
        return self.time(StepComposition.of(out, scheduled))

    def out_delays(self, out) -> tuple[float, float]:
        """(delivery_delay, output_lane) of the scheduler step `out`."""
        if not (self.async_output or self.served):
            return 0.0, 0.0
        h = self.host_terms(StepComposition.of(out))
        return float(h["front_end"]), float(h["output"])

    # ---- the fit's linear form ---------------------------------------------------------

    def fitted_values(self) -> dict[str, float]:
        """The values `linearize` multiplies (1 / efficiency, or seconds)."""
        e = self.eff
        return {"flops": 1 / e.flops, "fp8_flops": 1 / e.fp8, "bandwidth": 1 / e.bandwidth,
                "attention": 1 / e.attention, "kv_bandwidth": 1 / e.kv,
                "allreduce_latency_s": self.gpu.allreduce_latency_s,
                "allreduce_hop_s": self.gpu.allreduce_hop_s,
                "custom_allreduce_latency_s": (self.gpu.custom_allreduce_latency_s
                                               or self.gpu.allreduce_latency_s),
                "kernel_gap_s": e.kernel_gap_s,
                **{k: getattr(e, k) for k in STEP_HOST_TERMS}}

    def linearize(self, comp) -> tuple:
        """The step time as `constant + sum(coefficient * value)` with the values of
        `fitted_values`, linear once each roofline's side and the longest lane are chosen
        (at the current values), so that `time == constant + sum(coef[k] * value[k])`. The
        constant is the all-reduces' bytes over the link."""
        w, e, gpu = self.work(comp), self.eff, self.gpu
        bw = gpu.memory_bandwidth
        zero = 0.0 * comp.num_tokens
        f_lin, b_lin = w["linear_flops"] / self.peak, w["linear_bytes"] / bw + zero
        f_att, b_kv = w["attention_flops"] / self.attention_peak, w["kv_bytes"] / bw
        lin_c = f_lin / self.gemm_efficiency >= b_lin / e.bandwidth
        att_c = f_att / e.attention >= b_kv / e.kv
        pick = np.where if isinstance(zero, np.ndarray) else (lambda c, a, b: a if c else b)
        n, rows = comp.num_sampling_rows + zero, comp.num_rows + zero
        sched = comp.scheduled + zero
        graphed = self.graphed(comp)
        shorter = 1 - gpu.gemm_overlap  # the shorter side's share (`overlapped`)
        gemm = pick(lin_c, f_lin, shorter * f_lin)
        serial = {"flops": zero if self.quantization == "fp8" else gemm,
                  "fp8_flops": gemm if self.quantization == "fp8" else zero,
                  "bandwidth": pick(lin_c, shorter * b_lin, b_lin),
                  "attention": pick(att_c, f_att, zero), "kv_bandwidth": pick(att_c, zero, b_kv),
                  **{name: self.num_allreduces * self.allreduce_parts.get(name, 0.0) + zero
                     for name in ("allreduce_latency_s", "allreduce_hop_s",
                                  "custom_allreduce_latency_s")},
                  "kernel_gap_s": self.num_kernels + zero,
                  "step_overhead_s": sched, "row_overhead_s": sched * rows,
                  "sample_row_s": zero if self.async_output else n, "front_end_row_s": zero,
                  "eager_layer_s": pick(graphed, zero, self.model.num_layers + zero)}
        constant = (w["allreduce_bytes"] / gpu.interconnect_bandwidth if self.num_allreduces
                    else zero)
        t = self.terms(comp)
        serial_time = t["linear"] + t["attention"] + t["allreduce"] + t["kernels"] + \
            t["launch"] + t["cpu"]
        lane_output = self.async_output & (t["output"] > serial_time) & (
            t["output"] >= t["front_end"])
        lane_front = (t["front_end"] > serial_time) & (t["front_end"] > t["output"])
        lane = lane_output | lane_front
        coef = {}
        for name, value in serial.items():
            lane_value = zero
            if name == "sample_row_s":
                lane_value = pick(lane_output, n, zero)
            elif name == "front_end_row_s":
                lane_value = pick(lane_front, n if self.served else zero, zero)
            coef[name] = pick(lane, lane_value, value)
        return pick(lane, zero, constant), coef

    def with_efficiencies(self, eff: Efficiencies, gpu: GpuProfile | None = None
                          ) -> CostModel:
        """The same model, precision and engine settings with other efficiencies (and,
        given one, another GPU profile)."""
        return CostModel(self.model, gpu or self.gpu, self.dtype, self.tp, eff,
                         quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
                         enforce_eager=self.enforce_eager, served=self.served,
                         max_graph_batch=self.max_graph_batch,
                         kv_read_per_query_head=self.kv_read_per_query_head,
                         async_output=self.async_output,
                         custom_allreduce=self.custom_allreduce)

    def describe(self) -> str:
        e = self.eff
        kv = "" if e.kv_bandwidth is None else f" (KV gather {e.kv_bandwidth:.1%})"
        precision = "".join([f", weights {self.quantization}" if self.quantization else "",
                             f", KV cache {self.kv_cache_dtype}"
                             if self.kv_cache_dtype != "auto" else ""])
        return (f"cost model: {self.tp} x {self.gpu.name}, {self.dtype}{precision}; GEMM "
                f"{self.gemm_efficiency:.0%} of {self.peak / 1e12:.3g} TFLOP/s, bandwidth "
                f"{e.bandwidth:.0%}"
                f"{kv} of {self.gpu.memory_bandwidth / 1e9:.0f} GB/s, attention "
                f"{e.attention:.0%}" + (f" (tiles of {self.tile})" if self.tile else "")
                + f", all-reduce {self.allreduce_latency() * 1e6:.1f} us "
                + f"({'custom' if self.custom_allreduce else 'NCCL ring'}), "
                f"{e.kernel_gap_s * 1e6:.2f} us per kernel; "
                f"host {e.step_overhead_s * 1e3:.2f} ms/step + {e.row_overhead_s * 1e6:.1f} "
                f"us/row + {e.sample_row_s * 1e6:.1f} us/sampled row"
                + (" (async)" if self.async_output else "")
                + (f" + {e.front_end_row_s * 1e6:.1f} us/streamed token" if self.served
                   else "")
                + (", eager (no CUDA graphs)" if self.enforce_eager else
                   f", CUDA graphs for decode batches <= {self.max_graph_batch}")
                + f", eager launch {e.eager_layer_s * 1e6:.1f} us/layer")


__all__ = ["CostModel", "Efficiencies", "StepComposition", "overlapped"]
