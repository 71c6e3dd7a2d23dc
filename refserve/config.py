"""`EngineConfig`: every knob of the engine, with vLLM's names, checked once at start-up.

| knob | meaning |
| --- | --- |
| block_size | tokens per KV block (PagedAttention page size) |
| num_gpu_blocks | force the pool size in blocks (otherwise sized from memory) |
| gpu_memory_utilization | fraction of free GPU memory the engine may use (GPU backends) |
| kv_cache_memory | bytes of host memory for the KV pool on the NumPy backend |
| max_model_len | longest sequence (prompt + output) a request may reach |
| max_num_seqs | seats in the running batch (continuous-batching slot cap) |
| max_num_batched_tokens | token budget of one step (longer prompts: chunked prefill) |
| enable_prefix_caching | reuse full KV blocks of an identical prompt prefix |
| batching | "continuous" (iteration-level) or "static" (request-level, for comparison) |
| kv_cache_layout | "paged", or "contiguous": the naive baseline, one max_model_len block |
| dtype | weights and KV cache: auto (float32 on NumPy), float32, float16, bfloat16 |

Only the logits are upcast to float32, whatever the dtype. `BACKENDS` and `DTYPES` are the
one list of each: `get_backend`, the CLIs and the validation here all read them.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "numpy", "cupy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
BATCHING = ("continuous", "static")
KV_CACHE_LAYOUTS = ("paged", "contiguous")


@dataclass
class EngineConfig:
    model: str | None = None
    backend: str = "auto"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int = 2 * 1024**3
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    batching: str = "continuous"
    kv_cache_layout: str = "paged"
    speculative_config: dict | None = None
    dtype: str = "auto"

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")

        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.batching not in BATCHING:
            raise ValueError(f"batching={self.batching!r}: choose one of {', '.join(BATCHING)}")
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout={self.kv_cache_layout!r}: choose one of "
                             f"{', '.join(KV_CACHE_LAYOUTS)}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "kv_cache_memory"):
            positive_int(name)
        for name in ("num_gpu_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                positive_int(name)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r}: "
                             "must be in (0, 1]")
        if self.speculative_config is not None:
            raise NotImplementedError("speculative_config: speculative decoding is not "
                                      "implemented yet in this version of refserve")
