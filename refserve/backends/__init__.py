"""Backends: where the KV cache lives and how the paged-attention ops run.

    get_backend("numpy")  the NumPy reference backend (CPU)
    get_backend("cupy")   the CuPy/CUDA backend (not written yet: a later issue)
    get_backend("auto")   cupy when it exists and a GPU is usable, otherwise numpy

The model only ever sees the `Backend` interface (refserve/backends/base.py).
"""

from __future__ import annotations

from refserve.backends.attention_metadata import PAD_BLOCK, AttentionMetadata
from refserve.backends.base import Backend
from refserve.backends.numpy_backend import NumpyBackend
from refserve.config import BACKENDS

__all__ = ["PAD_BLOCK", "AttentionMetadata", "Backend", "NumpyBackend", "get_backend"]


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


def get_backend(name: str = "auto") -> Backend:
    """Return a backend by name: "numpy", "cupy" or "auto".

    Raises:
        ValueError: `name` is not one of config.BACKENDS.
        RuntimeError: "cupy" was asked for but cupy or a CUDA GPU is missing.
        NotImplementedError: "cupy" on a machine that could run it (the backend is not
            written yet).
    """
    if name == "numpy":
        return NumpyBackend()
    if name == "cupy":
        reason = _gpu_unavailable_reason()
        if reason is not None:
            raise RuntimeError(
                "backend='cupy' needs the gpu extra (pip install -e '.[gpu]') and a CUDA GPU; "
                f"none found: {reason}"
            )
        raise NotImplementedError(
            "backend='cupy': a CUDA GPU is available, but the CuPy backend is not written yet "
            "(a later issue); use backend='numpy'"
        )
    if name == "auto":
        # "auto" will pick cupy when a GPU is usable *and* the CuPy backend exists. It does
        # not exist yet, so auto is numpy everywhere (and does not pay for importing cupy).
        return NumpyBackend()
    raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(BACKENDS)}")
