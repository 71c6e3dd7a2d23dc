"""The tuned CPU backend (`backend="cpu"`, what `backend="auto"` picks without a GPU).

It is the NumPy reference (numpy_backend.py) with the ops a CPU runs faster another way
overridden; every other op is the reference's own. tests/test_backend_equality_cpu.py
proves each override equal to the reference, and tests/test_default_model.py the greedy
tokens of the real model identical on both.

Compiled kernels (numba, compiled.py; what runs wherever numba loads):

    linear           cpu_linear.py: tiles of weight rows, each streamed once per call for
                     all rows of x, dot products by vector lanes. Differs from the
                     reference's x @ W.T only in float rounding: the same products, summed
                     in another order.
    paged_attention  cpu_attention_kernel.py: decodes and verifies (up to MAX_QUERY_LEN
                     query tokens) read K and V straight from the blocks their table names;
                     prefill chunks in NumPy query tiles over OpenBLAS (cpu_attention.py,
                     measured faster there). Float rounding only (scores and sums in
                     another order).

NumPy forms (REFSERVE_CPU_KERNELS=numpy, or where numba cannot load; the start-up line
says which and why):

    linear           the few-row product forms, one per weight shape, chosen by a short
                     calibration when the weight is prepared (few_row_matmul.py).
    paged_attention  decode rows (q_len == 1) read their context through views of runs of
                     consecutive blocks, a run shared by several rows once for all of them,
                     partial softmaxes merged online; small leftovers gathered into one
                     batch; prefill chunks in query tiles that skip the keys after the tile
                     (cpu_attention.py).

Both:

    sampling_weights the nucleus found by bisection instead of a sort of the whole row
    and sample       (cpu_sampling.py). The same min_p and top_k sets and the same draw; the
                     top_p mass is summed in another order, so a token whose larger-logit
                     mass lies within float32 rounding of top_p may be kept by one and not
                     the other.

Threads: as many as the machine leaves CPUs free, re-measured twice a second
(cpu_threads.py), set for OpenBLAS and for the compiled kernels' parallel loops at every
step; REFSERVE_CPU_THREADS=N fixes N. The start-up line says which.
"""

from __future__ import annotations

import numpy as np

from refserve.backends import compiled
from refserve.backends.base import AttentionMetadata
from refserve.backends.cpu_attention import PagedAttention, chunk_attention
from refserve.backends.cpu_sampling import dense_weights, sample_tokens
from refserve.backends.cpu_threads import thread_policy
from refserve.backends.few_row_matmul import DenseWeight, fixed_plan
from refserve.backends.numpy_backend import NumpyBackend


class CpuBackend(NumpyBackend):
    """The reference with the CPU speed-ups of the module docstring."""

    name = "cpu"

    def __init__(self, matmul: str | None = None, kernels: str | None = None) -> None:
        """`kernels`: "compiled" (numba's kernels, an error where numba cannot load),
        "numpy" (NumPy and OpenBLAS only) or None: REFSERVE_CPU_KERNELS, by default compiled
        where numba loads (compiled.py). `matmul`, with NumPy kernels: one few-row form for
        every weight (few_row_matmul.FORMS, e.g. "plain" to time the products as one gemv /
        sgemm each); None: REFSERVE_MATMUL, else calibrated per weight shape."""
        choice = kernels or ("numpy" if matmul is not None else compiled.setting())
        if choice not in compiled.CHOICES:
            raise ValueError(f"kernels={kernels!r}: choose one of "
                             f"{', '.join(compiled.CHOICES)}")
        if choice == "compiled" and not compiled.available():
            raise RuntimeError("compiled CPU kernels asked for, but "
                               f"{compiled.unavailable_reason()}")
        self.compiled = choice != "numpy" and compiled.available()
        self._plan = None if matmul is None else fixed_plan(matmul)
        self._attention = PagedAttention()
        self.threads = thread_policy()  # one per process: BLAS threads are the process's
        self._tasks_key: bytes | None = None     # the step the attention tasks are for
        self._tasks: np.ndarray | None = None
        if self.compiled:
            from refserve.backends import cpu_attention_kernel, cpu_linear
            from refserve.backends.cpu_forward import fused_forward

            self._forward = fused_forward

            self._weight = cpu_linear.PackedWeight
            self._kernels = cpu_attention_kernel

    def startup_note(self) -> str:
        """The kernels and the threads, for the engine's start-up line."""
        if self.compiled:
            kernels = "kernels: compiled (numba: linear)"
        else:
            why = compiled.unavailable_reason() or f"{compiled.ENV}=numpy"
            kernels = f"kernels: NumPy ({why})"
        return f"{kernels} | {self.threads.describe()}"

    def forward(self, model, inputs, kv_caches) -> np.ndarray:
        """Compiled: the fused forward of cpu_forward.py, with the kernels' threads set for
        this step from the thread policy (numba's count is per calling thread: the
        engine's). NumPy forms: the reference's forward."""
        if not self.compiled:
            return super().forward(model, inputs, kv_caches)
        compiled.set_threads(self.threads.threads())
        return self._forward(model, inputs.input_ids, inputs.positions, inputs.attn, kv_caches,
                             inputs.logits_indices)

    # ------------------------------------------------------------ dense products

    def prepare_weight(self, weight: np.ndarray):
        """Compiled: W [out, in] packed into panels once (cpu_linear.py). NumPy
        forms: stored in the layout of its shape's plan (calibrated on first use of the
        shape, then cached per process): see few_row_matmul.py."""
        if self.compiled:
            return self._weight(weight)
        return DenseWeight(weight, self._plan)

    def weight_matrix(self, weight):
        """W [out, in]. Compiled: its rows read from the panels (cpu_linear.PackedRows:
        `rows[ids]`, `np.asarray(rows)`); NumPy forms: the stored array or a transposed view
        of it. Never a copy of the table."""
        return weight.rows if self.compiled else weight.out_in

    def linear(self, x: np.ndarray, weight) -> np.ndarray:
        """x · Wᵀ by the compiled kernel (cpu_linear.py) or by the form the weight's plan
        names for x's row count. Differs from the reference's x @ W.T only in float
        rounding (the same products, another order). The NumPy forms ask the thread policy
        for the thread count (a clock read; a measurement twice a second)."""
        if self.compiled:
            return weight(x)
        return weight(x, self.threads.threads())

    # ------------------------------------------------------- paged_attention

    def paged_attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                        attn: AttentionMetadata, scale: float) -> np.ndarray:
        """q `[T, H, D]` -> out `[T, H, D]`, same dtype. See `Backend.paged_attention`.
        Compiled: decodes and verifies by cpu_attention_kernel.py, prefill chunks by
        cpu_attention.py's tiles. NumPy forms (and a head size that is no whole number of
        vectors, or a cache that is not one contiguous array): cpu_attention.py, decode rows
        through block views merged by online softmax, chunks gathered."""
        # Cast once to q's dtype: a float64 scale would silently promote every score matrix.
        scale = q.dtype.type(scale)
        if not (self.compiled and q.shape[2] % self._kernels.LANES == 0
                and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            return self._attention(q, k_cache, v_cache, attn, scale)
        qsl = np.asarray(attn.query_start_loc)
        key = qsl.tobytes()
        if key != self._tasks_key:      # every layer of a step has the same tasks
            self._tasks, self._tasks_key = self._kernels.attention_tasks(qsl), key
        tasks, long = self._tasks
        out = np.empty(q.shape, dtype=np.float32)
        if len(tasks):
            self._kernels.paged_attention_kernel(
                np.ascontiguousarray(q), k_cache, v_cache, np.asarray(attn.block_tables),
                np.asarray(attn.context_lens), qsl, tasks, scale, out)
        for i in long:
            start, end = int(qsl[i]), int(qsl[i + 1])
            out[start:end] = chunk_attention(q[start:end], k_cache, v_cache,
                                             attn.block_tables_cpu[i],
                                             int(attn.context_lens_cpu[i]), scale)
        return out

    # ---------------------------------------------------------------- sampling

    def sampling_weights(self, logits, temperature, top_k, top_p, min_p) -> np.ndarray:
        """See `Backend.sampling_weights` and cpu_sampling.py (the nucleus by bisection)."""
        return dense_weights(logits, temperature, top_k, top_p, min_p)

    def sample(self, logits, temperature, top_k, top_p, min_p, uniforms) -> np.ndarray:
        """See `Backend.sample`: the inverse CDF over cpu_sampling.py's kept tokens only."""
        return sample_tokens(logits, temperature, top_k, top_p, min_p, uniforms)
