"""Build refserve's .cu kernels with g++ against cuda_sim.h and launch them through ctypes.

`SimModule.run(launch)` executes a `refserve.backends.cuda_launch.Launch` record: the same
kernel name, grid, block and argument list the CuPy backend hands to `cupy.RawModule`, with
NumPy arrays in place of CuPy arrays. The shared object is cached under
$REFSERVE_KERNEL_CACHE (default ~/.cache/refserve/cuda_sim), keyed by a hash of every input
of the build (sources, header, kernel list, compiler and flags), so an edit rebuilds it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from refserve.backends.cuda_launch import KERNEL_DIR, KERNEL_FILES, Launch

SIM_DIR = Path(__file__).parent
CXX_FLAGS = ["-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing",
             "-Wno-unknown-pragmas"]


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "refserve" / "cuda_sim"
    return Path(os.environ.get("REFSERVE_KERNEL_CACHE", default))


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def translation_unit(names: list[str]) -> str:
    """The C++ file compiled: header, the unchanged kernel sources, a registry of `names`."""
    includes = "\n".join(f'#include "{f}"' for f in KERNEL_FILES)
    entries = ",\n".join(f'  CUDA_SIM_KERNEL("{n}", {n})' for n in names)
    return f'#include "cuda_sim.h"\n{includes}\n\nCUDA_SIM_ENTRY_POINT(\n{entries}\n)\n'


def build(names: list[str]) -> Path:
    """Compile (or reuse) the shared object exposing kernels `names`; returns its path."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    source = translation_unit(names)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256()
    for part in [source, version, " ".join(CXX_FLAGS)]:
        digest.update(part.encode())
    for path in sorted(SIM_DIR.glob("*.h")) + [KERNEL_DIR / f for f in KERNEL_FILES]:
        digest.update(path.name.encode() + path.read_bytes())
    out_dir = cache_dir() / digest.hexdigest()[:16]
    lib = out_dir / "libcudasim.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "kernels_sim.cpp"
        src.write_text(source)
        tmp_lib = Path(tmp) / "libcudasim.so"
        cmd = [cxx, *CXX_FLAGS, f"-I{SIM_DIR}", f"-I{KERNEL_DIR}", str(src), "-o", str(tmp_lib)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"g++ failed ({' '.join(cmd)}):\n{result.stderr[-6000:]}")
        os.replace(tmp_lib, lib)  # atomic: a concurrent build never sees half a file
    return lib


def _pack(arg) -> tuple[ctypes._SimpleCData, int, bytes]:
    """(ctypes value, size, kind) of one kernel argument, as CuPy would pass it."""
    if isinstance(arg, np.ndarray):
        return ctypes.c_void_p(arg.ctypes.data), 8, b"p"
    if isinstance(arg, np.int32):
        return ctypes.c_int32(int(arg)), 4, b"i"
    if isinstance(arg, np.int64):
        return ctypes.c_int64(int(arg)), 8, b"i"
    if isinstance(arg, np.float32):
        return ctypes.c_float(float(arg)), 4, b"f"
    if isinstance(arg, np.float64):
        return ctypes.c_double(float(arg)), 8, b"f"
    # CuPy would send a Python int as 8 bytes and a float as a double: never what an
    # `int` / `float` parameter expects, so the packing must wrap every scalar explicitly.
    raise TypeError(f"kernel argument {arg!r} ({type(arg).__name__}): pass an ndarray or a "
                    "NumPy scalar (np.int32 / np.int64 / np.float32)")


class SimModule:
    """The kernels `names`, compiled for the CPU simulator."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self._lib = ctypes.CDLL(str(build(self.names)))
        fn = self._lib.cuda_sim_launch
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [
            ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
            ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
        self._launch = fn

    def run(self, launch: Launch) -> None:
        """Execute one launch record; raises RuntimeError if the kernel rejects its args."""
        packed = [_pack(a) for a in launch.args]
        values = [p[0] for p in packed]
        params = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        sizes = (ctypes.c_int * len(values))(*[p[1] for p in packed])
        kinds = b"".join(p[2] for p in packed)
        error = ctypes.create_string_buffer(512)
        rc = self._launch(launch.kernel.encode(), *launch.grid, *launch.block, len(values),
                          params, sizes, kinds, error, len(error))
        if rc != 0:
            raise RuntimeError(f"{launch.kernel}: {error.value.decode()}")

    def run_all(self, launches) -> None:
        for launch in launches:
            if launch is not None:
                self.run(launch)
