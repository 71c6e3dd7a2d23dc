"""The CuPy backend: the KV cache on a CUDA GPU, the paged-attention ops as RawKernels.

The kernels are the .cu files in `kernels/` (their headers give every pointer's shape and the
grid layout); what to launch, with which grid and arguments, is decided by the pure functions
of `cuda_launch.py`, which the test suite runs on the CPU through a CUDA simulator. This file
only turns those `Launch` records into `cupy.RawModule` calls, so it stays small:

    forward          a pure decode step replays a CUDA graph (cuda_graphs.py); the others
                     run the model's forward eagerly
    write_kv         write_kv_kernel (16-byte rows, slot -1 skipped)
    copy_blocks      copy_blocks_kernel; a chain of copies (some dst is also a src) falls
                     back to a gather-then-scatter, which reads every source first
    swap_out/in      cudaMemcpyAsync between the device cache and pinned host blocks, one
                     copy per run of consecutive blocks, on the current stream
    paged_attention  decode rows (0 .. num_decodes-1): v1 or v2 + reduce, by
                     cuda_launch.choose_partitioning on host scalars;
                     the other rows (prefill chunks, verify): varlen_paged_attention_kernel
    rejection_sample rejection_sample_kernel: the speculative accept / residual step, tokens
                     bit-identical to the NumPy op for the same uniforms
    linear           x @ W.T, a cupy matmul (cuBLAS)
    sampling_weights the reference's sampling_weights / sample_tokens with cupy (a sort per
    and sample       row on the device): only the token ids leave the GPU

Nothing here reads a device value back to the host during a forward: every grid size comes
from array shapes and the AttentionMetadata host scalars.

dtype: float16 by default ("auto"), float32 for exact comparison with NumPy. The kernels also
support bfloat16, but CuPy has no bfloat16 dtype for the model's dense math, so
resolve_dtype refuses it for now.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import refserve.backends.cuda_launch as cl
from refserve.backends.base import Backend, check_swap, contiguous_runs
from refserve.backends.numpy_backend import sample_tokens, sampling_weights

_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}


def load_module(cupy: Any):
    """All kernels of kernels/*.cu in one RawModule, with every template instantiation the
    backend launches named up front (compiled once by NVRTC, then cached by CuPy)."""
    code = "\n".join(cl.kernel_source(f) for f in cl.KERNEL_FILES)
    return cupy.RawModule(code=code, options=("-std=c++17",),
                          name_expressions=cl.name_expressions())


class CupyBackend(Backend):
    """Caches are cupy arrays on one GPU; the data-plane ops are the kernels in kernels/."""

    name = "cupy"

    def __init__(self, device: int = 0, partition_size: int = cl.PARTITION_SIZE,
                 enforce_eager: bool = False) -> None:
        import cupy  # optional dependency: the `gpu` extra

        self.xp = cupy
        self._device = cupy.cuda.Device(device)
        self._device.use()
        self.num_sms = int(self._device.attributes["MultiProcessorCount"])
        self._module = load_module(cupy)
        self._partition_size = partition_size
        self._workspace: dict[str, Any] = {}  # v2 scratch, see _v2_workspace
        self.enforce_eager = enforce_eager  # True: never capture CUDA graphs
        self._graphs: dict[int, Any] = {}   # id(kv_caches) -> DecodeGraphs (see forward)

    # ------------------------------------------------------------------ arrays

    def to_device(self, array: Any):
        return self.xp.asarray(array)

    def to_numpy(self, array: Any) -> np.ndarray:
        return self.xp.asnumpy(array)

    def resolve_dtype(self, dtype: str) -> np.dtype:
        if dtype == "auto":
            return np.dtype(np.float16)
        if dtype == "bfloat16":
            raise ValueError("dtype='bfloat16' is not supported by the cupy backend yet "
                             "(CuPy has no bfloat16 arrays); use float16 or float32")
        return super().resolve_dtype(dtype)

    def free_device_memory(self) -> int | None:
        free, _ = self.xp.cuda.runtime.memGetInfo()
        return int(free) + int(self.xp.get_default_memory_pool().free_bytes())

    def total_device_memory(self) -> int | None:
        return int(self.xp.cuda.runtime.memGetInfo()[1])

    def forward(self, model, inputs, kv_caches):
        """See Backend.forward: a pure decode step replays a CUDA graph of the whole forward
        (cuda_graphs.py) unless enforce_eager; every other step, or one whose capture
        failed, runs the model's forward on device copies of the inputs."""
        graphs = None if self.enforce_eager else self._decode_graphs(model, kv_caches)
        logits = graphs.run(inputs) if graphs is not None else None
        if logits is None:
            to_device = self.to_device
            logits = model.forward(to_device(inputs.input_ids), to_device(inputs.positions),
                                   inputs.attn, kv_caches, to_device(inputs.logits_indices))
        return logits

    def _decode_graphs(self, model, kv_caches):
        """The CUDA graphs of one runner's decode steps (one model over one KV cache: the
        target's, or a draft model's), made on its first forward and captured lazily, per
        padded batch size and context bucket. Keyed by the cache list, which the graphs
        hold, so its id is never reused while the entry lives."""
        from refserve.backends.cuda_graphs import CupyCapturer, DecodeGraphs

        graphs = self._graphs.get(id(kv_caches))
        if graphs is None:
            block_size = kv_caches[0][0].shape[1]
            graphs = self._graphs[id(kv_caches)] = DecodeGraphs(
                model, self, kv_caches, block_size, CupyCapturer(self.xp),
                partition_size=self._partition_size)
        return graphs

    def _run(self, launch: cl.Launch | None) -> None:
        if launch is not None:
            self._module.get_function(launch.kernel)(launch.grid, launch.block, launch.args)

    # ------------------------------------------------------------ data plane

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        """See Backend.write_kv; k / v may be strided views of the fused qkv projection."""
        self._run(cl.write_kv_launch(k, v, k_cache, v_cache, slot_mapping))

    def copy_blocks(self, k_cache, v_cache, src_to_dst) -> None:
        """See Backend.copy_blocks. The pairs are checked on the host (a device array is read
        back: a few bytes, on copy-on-write steps only, before the forward)."""
        pairs = np.ascontiguousarray(
            src_to_dst.get() if hasattr(src_to_dst, "get") else src_to_dst,
            dtype=np.int64).reshape(-1, 2)
        if len(pairs) == 0:
            return
        if cl.copy_pairs_are_independent(pairs, k_cache.shape[0]):
            self._run(cl.copy_blocks_launch(k_cache, v_cache, self.xp.asarray(pairs)))
            return
        src, dst = self.xp.asarray(pairs[:, 0]), self.xp.asarray(pairs[:, 1])
        k_cache[dst] = k_cache[src]  # the right side is a gather: a copy made before writing
        v_cache[dst] = v_cache[src]

    # ------------------------------------------------------------ swapping

    def host_zeros(self, shape, dtype):
        """See Backend.host_zeros: pinned memory. The copy engine reads and writes
        page-locked memory directly, without a staging copy, which is what lets
        cudaMemcpyAsync return before the copy is done."""
        import cupyx

        return cupyx.zeros_pinned(shape, dtype=dtype)

    def swap_out(self, k_cache, v_cache, host_k, host_v, block_mapping) -> None:
        """See Backend.swap_out: rows (device, host), device -> pinned host, asynchronous."""
        self._swap(k_cache, v_cache, host_k, host_v, block_mapping, to_host=True)

    def swap_in(self, k_cache, v_cache, host_k, host_v, block_mapping) -> None:
        """See Backend.swap_in: rows (host, device), pinned host -> device, asynchronous."""
        self._swap(k_cache, v_cache, host_k, host_v, block_mapping, to_host=False)

    def _swap(self, k_cache, v_cache, host_k, host_v, block_mapping, to_host: bool) -> None:
        """One cudaMemcpyAsync per run of consecutive blocks and per cache, on the current
        stream: it runs after the kernels already enqueued (a swap-out reads the KV the last
        forward wrote) and before the ones enqueued later (the next forward may reuse a
        swapped-out block, and reads a swapped-in one). The host is not blocked."""
        runtime = self.xp.cuda.runtime
        pairs = check_swap(k_cache, host_k, block_mapping, to_host)
        check_swap(v_cache, host_v, pairs, to_host)
        for array in (k_cache, v_cache, host_k, host_v):
            if not array.flags.c_contiguous:
                raise ValueError("swap: caches and host blocks must be C-contiguous")
        block_bytes = k_cache[0].nbytes
        kind = runtime.memcpyDeviceToHost if to_host else runtime.memcpyHostToDevice
        stream = self.xp.cuda.get_current_stream().ptr
        for device_cache, host_cache in ((k_cache, host_k), (v_cache, host_v)):
            device_ptr, host_ptr = device_cache.data.ptr, host_cache.ctypes.data
            src_base, dst_base = (device_ptr, host_ptr) if to_host else (host_ptr, device_ptr)
            for src, dst, count in contiguous_runs(pairs):
                runtime.memcpyAsync(dst_base + dst * block_bytes, src_base + src * block_bytes,
                                    count * block_bytes, kind, stream)

    def paged_attention(self, q, k_cache, v_cache, attn, scale: float):
        """See Backend.paged_attention: decode rows first through v1/v2, then varlen."""
        dtype = _DTYPE_NAMES.get(np.dtype(q.dtype))
        if dtype is None:
            raise ValueError(f"paged_attention: q has dtype {q.dtype}; the cupy backend runs "
                             f"{', '.join(_DTYPE_NAMES.values())}")
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        out = self.xp.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
        arrays = (q, k_cache, v_cache, attn.block_tables, attn.context_lens,
                  attn.query_start_loc)
        num_decodes = attn.num_decodes
        if num_decodes > 0:
            part = cl.choose_partitioning(num_decodes, num_heads, num_kv_heads,
                                          attn.max_decode_context_len, self.num_sms,
                                          self._partition_size)
            if part.use_v2:
                work = self._v2_workspace(num_decodes, num_heads, head_dim, part.max_partitions)
                for launch in cl.decode_v2_launches(out, *arrays, scale, num_decodes, part,
                                                    work["tmp_out"], work["max_logits"],
                                                    work["exp_sums"], dtype):
                    self._run(launch)
            else:
                self._run(cl.decode_v1_launch(out, *arrays, scale, num_decodes, dtype))
        if num_decodes < attn.num_seqs:
            self._run(cl.varlen_launch(out, *arrays, scale, attn.num_seqs,
                                       num_decodes, dtype))
        return out

    def _v2_workspace(self, num_seqs: int, num_heads: int, head_dim: int,
                      max_partitions: int) -> dict[str, Any]:
        """float32 scratch for v2: the leading part of one growing flat buffer per name.

        Reused by every layer and step: kernels on one stream run in order, so a layer's
        reduce has read the scratch before the next layer's v2 kernel overwrites it.
        """
        work = {}
        for name, shape in cl.v2_workspace_shapes(num_seqs, num_heads, head_dim,
                                                  max_partitions).items():
            size = int(np.prod(shape))
            buffer = self._workspace.get(name)
            if buffer is None or buffer.size < size:
                buffer = self._workspace[name] = self.xp.empty(size, dtype=np.float32)
            work[name] = buffer[:size].reshape(shape)
        return work

    # ------------------------------------------------------------ dense products

    def linear(self, x, weight):
        """x @ W.T as a cupy matmul (cuBLAS), W [out, in] as loaded."""
        return x @ weight.T

    # ------------------------------------------------------ speculative decoding

    def rejection_sample(self, draft_token_ids, draft_probs, target_probs, accept_uniforms,
                         draw_uniforms):
        """See Backend.rejection_sample: one thread block per row (kernels/rejection_sample.cu),
        the same tokens as the NumPy reference for the same uniforms. Only shapes are checked
        on the host; the ids and uniforms are trusted (they stay on the device)."""
        xp = self.xp
        drafts = xp.ascontiguousarray(xp.asarray(draft_token_ids), dtype=np.int64)
        target = xp.asarray(target_probs)
        # float16 probabilities widen exactly to float32; float32 / float64 are read as given.
        prob_dtype = np.float64 if target.dtype == np.float64 else np.float32
        target = xp.ascontiguousarray(target, dtype=prob_dtype)
        draft = (None if draft_probs is None
                 else xp.ascontiguousarray(xp.asarray(draft_probs), dtype=prob_dtype))
        accept_u = xp.ascontiguousarray(xp.asarray(accept_uniforms), dtype=np.float64)
        draw_u = xp.ascontiguousarray(xp.asarray(draw_uniforms), dtype=np.float64)
        batch, k = drafts.shape
        output = xp.empty((batch, k + 1), dtype=np.int64)
        num_accepted = xp.empty(batch, dtype=np.int64)
        self._run(cl.rejection_sample_launch(output, num_accepted, drafts, draft, target,
                                             accept_u, draw_u))
        return output, num_accepted

    # --------------------------------------------------------------------- sampling

    def sampling_weights(self, logits, temperature, top_k, top_p, min_p):
        """See Backend.sampling_weights: the reference's own code with cupy, on the device."""
        xp = self.xp
        return sampling_weights(xp, xp.asarray(logits), xp.asarray(temperature),
                                xp.asarray(top_k), xp.asarray(top_p), xp.asarray(min_p))

    def sample(self, logits, temperature, top_k, top_p, min_p, uniforms):
        """See Backend.sample: the reference's own code (numpy_backend.sample_tokens, a sort
        per row) run with cupy on the device; only the B token ids are left to copy back."""
        xp = self.xp
        return sample_tokens(xp, xp.asarray(logits), xp.asarray(temperature),
                             xp.asarray(top_k), xp.asarray(top_p), xp.asarray(min_p),
                             xp.asarray(uniforms))
