"""CPU simulator of the CUDA built-ins the refserve kernels use (test-only)."""
