"""Backends: where the KV cache lives and how the data-plane ops run.

    get_backend("numpy")  the NumPy reference backend (CPU): every op the plainest
                          correct way, what the course reads (numpy_backend.py)
    get_backend("cpu")    the tuned CPU backend: the reference with the CPU speed-ups
                          (cpu_backend.py), proven equal to it by tests
    get_backend("cupy")   the CuPy/CUDA backend (refserve/backends/cupy_backend.py); a
                          RuntimeError naming the cause when no CUDA GPU is usable
    get_backend("auto")   cupy when a CUDA GPU is usable, otherwise cpu (the engine's
                          start-up line says which: "auto→cupy" or "auto→cpu")

"Usable" means: `import cupy` works (the `gpu` extra: cupy-cuda12x, or cupy-cuda13x for a
CUDA 13 driver; both import as `cupy`) and cupy sees at least one CUDA device.

The model only ever sees the `Backend` interface (refserve/backends/base.py).
"""

from __future__ import annotations

from refserve.backends.attention_metadata import PAD_BLOCK, AttentionMetadata
from refserve.backends.base import Backend
from refserve.backends.cpu_backend import CpuBackend
from refserve.backends.numpy_backend import NumpyBackend
from refserve.config import BACKENDS

__all__ = ["PAD_BLOCK", "AttentionMetadata", "Backend", "CpuBackend", "NumpyBackend",
           "get_backend"]


def _gpu_unavailable_reason() -> str | None:
    """Why CuPy cannot run here, or None when cupy imports and sees a CUDA device."""
    try:
        import cupy  # optional dependency: the `gpu` extra
    except Exception as exc:  # ImportError, or a broken CUDA install failing at import
        return f"cannot import cupy ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device, driver/runtime mismatch
        return f"cupy cannot query CUDA devices ({type(exc).__name__}: {exc})"
    if count == 0:
        return "cupy sees 0 CUDA devices"
    return None


def get_backend(name: str = "auto", **options) -> Backend:
    """Return a backend by name: "numpy", "cpu", "cupy" or "auto".

    `options` go to the CuPy backend's constructor (e.g. device=0, enforce_eager=True) and
    are ignored by the CPU backends.

    Raises:
        ValueError: `name` is not one of config.BACKENDS.
        RuntimeError: "cupy" was asked for but cupy or a CUDA GPU is missing (the message
            names the cause).
    """
    if name == "numpy":
        return NumpyBackend()
    if name == "cpu":
        return CpuBackend()
    if name in ("cupy", "auto"):
        reason = _gpu_unavailable_reason()
        if reason is None:
            from refserve.backends.cupy_backend import CupyBackend  # imports cupy

            return CupyBackend(**options)
        if name == "auto":
            return CpuBackend()
        raise RuntimeError(
            "backend='cupy' needs the gpu extra (pip install -e '.[gpu]') and a CUDA GPU; "
            f"none found: {reason}"
        )
    raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(BACKENDS)}")
