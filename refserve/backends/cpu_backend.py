"""The tuned CPU backend (`backend="cpu"`, what `backend="auto"` picks without a GPU).

It is the NumPy reference (numpy_backend.py) with the ops a CPU runs faster another way
overridden; every other op is the reference's own. tests/test_backend_equality_cpu.py
proves each override equal to the reference, and tests/test_default_model.py the greedy
tokens of the real model identical on both.

Compiled kernels (numba, compiled.py; what runs wherever numba loads):

    forward          cpu_forward.py: the reference's layers with RMSNorm and the residual
                     add, RoPE and the KV write, SiLU-and-multiply each one compiled loop
                     (cpu_fused.py).
    linear           cpu_linear.py: the weight packed once into panels, each streamed from
                     memory once per call for all rows of x. Differs from the reference's
                     x @ W.T only in float rounding: the same products, summed in another
                     order.
    paged_attention  cpu_attention_kernel.py: decodes and verifies (up to MAX_QUERY_LEN
                     query tokens) read K and V straight from the blocks their table names;
                     prefill chunks in NumPy query tiles over OpenBLAS (cpu_attention.py,
                     measured faster there). Float rounding only (scores and sums in
                     another order).

NumPy (REFSERVE_CPU_KERNELS=numpy, or where numba cannot load; the start-up line says which
and why):

    linear           the reference's x @ W.T (one OpenBLAS gemv or sgemm).
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

import refserve.backends.compiled as compiled
from refserve.backends.base import AttentionMetadata
from refserve.backends.cpu_attention import PagedAttention, chunk_attention
from refserve.backends.cpu_sampling import dense_weights, sample_tokens
from refserve.backends.cpu_threads import thread_policy
from refserve.backends.numpy_backend import NumpyBackend


class CpuBackend(NumpyBackend):
    """The reference with the CPU speed-ups of the module docstring."""

    name = "cpu"

    def __init__(self, kernels: str | None = None) -> None:
        """`kernels`: "compiled" (numba's kernels, an error where numba cannot load),
        "numpy" (NumPy and OpenBLAS only) or None: REFSERVE_CPU_KERNELS, by default compiled
        where numba loads (compiled.py)."""
        choice = kernels or compiled.setting()
        if choice not in compiled.CHOICES:
            raise ValueError(f"kernels={kernels!r}: choose one of "
                             f"{', '.join(compiled.CHOICES)}")
        if choice == "compiled" and not compiled.available():
            raise RuntimeError("compiled CPU kernels asked for, but "
                               f"{compiled.unavailable_reason()}")
        self.compiled = choice != "numpy" and compiled.available()
        self._attention = PagedAttention()
        self.threads = thread_policy()  # one per process: BLAS threads are the process's
        self._tasks_key: bytes | None = None     # the step the attention tasks are for
        self._tasks: tuple | None = None
        if self.compiled:                        # numba is imported here, not at import
            import refserve.backends.cpu_attention_kernel as cpu_attention_kernel
            import refserve.backends.cpu_forward as cpu_forward
            import refserve.backends.cpu_linear as cpu_linear

            self.threads.cap_blas(1)             # here: only the main thread can set it

            self._linear, self._kernels = cpu_linear, cpu_attention_kernel
            self._forward = cpu_forward.fused_forward

    def startup_note(self) -> str:
        """The kernels and the threads, for the engine's start-up line."""
        if self.compiled:
            kernels = ("kernels: compiled (numba; linear over weights packed in panels of "
                       f"{self._linear.PANEL}, paged decode attention, fused norms/RoPE/SiLU)")
        else:
            why = compiled.unavailable_reason() or f"{compiled.ENV}=numpy"
            kernels = f"kernels: NumPy ({why})"
        return f"{kernels} | {self.threads.describe()}"

    def forward(self, model, inputs, kv_caches) -> np.ndarray:
        """One step on the thread policy's count of threads, asked once per step (a clock
        read; a measurement twice a second) and set for OpenBLAS and for numba's parallel
        loops (numba's count is per calling thread: the engine's); with the compiled kernels
        OpenBLAS stays on the one thread `__init__` capped it to
        (cpu_threads.ThreadPolicy.cap_blas). Compiled: the fused forward of cpu_forward.py;
        NumPy: the reference's forward."""
        threads = self.threads.threads()
        if not self.compiled:
            return super().forward(model, inputs, kv_caches)
        compiled.set_threads(threads)
        return self._forward(model, inputs.input_ids, inputs.positions, inputs.attn, kv_caches,
                             inputs.logits_indices)

    # ------------------------------------------------------------ dense products

    def prepare_weight(self, weight: np.ndarray):
        """Compiled: W [out, in] packed into panels once (cpu_linear.PackedWeight). NumPy:
        the reference's W as it is."""
        return self._linear.PackedWeight(weight) if self.compiled else weight

    def weight_matrix(self, weight):
        """W [out, in], never a copy of the table. Compiled: its rows read from the panels
        (cpu_linear.PackedRows: `rows[ids]`, `np.asarray(rows)`); NumPy: W itself."""
        return weight.rows if self.compiled else weight

    def linear(self, x: np.ndarray, weight) -> np.ndarray:
        """x · Wᵀ. Compiled: cpu_linear.py's kernel, which differs from the reference's
        x @ W.T only in float rounding (the same products, summed in k order with fused
        multiply-adds). NumPy: the reference's x @ W.T."""
        return weight(x) if self.compiled else x @ weight.T

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
