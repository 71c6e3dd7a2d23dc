"""The tuned CPU backend's one compiled library: numba, loaded once, or why it could not be.

WHY A COMPILER. The tuned CPU backend's hot loops (the few-row linear, paged attention
straight from the blocks, the fused elementwise steps) are loop nests that NumPy can only
run as a chain of whole-array calls, each a pass over memory, and BLAS only as kernels that
repack the weight at every call. numba (an LLVM JIT for Python loops over NumPy arrays,
with wheels for every common platform) compiles each loop nest once for this CPU, with its
widest vector instructions. It is the only compiled dependency of the CPU backend; the
reference backend (`backend="numpy"`) never imports it.

    jit(parallel=...)   numba.njit with the options every kernel here shares:
                        cache=True (machine code kept on disk, below), nogil=True (a
                        server thread keeps running while a kernel computes), and fastmath
                        limited to {"reassoc", "contract"}: a float sum may be reordered
                        (vectorised) and a multiply-add fused, which changes only rounding;
                        infinities and NaNs keep their meaning (attention masks with -inf)
    prange              numba.prange: the iterations of a parallel loop are split between
                        the threads `set_threads` allows
    set_threads(n)      the threads of the next parallel loops of the calling thread (the
                        thread policy's count, cpu_threads.py); numba's setting is per
                        calling thread, so the backend sets it at every step

THE DISK CACHE. numba keeps a kernel's machine code beside its source file
(`__pycache__`, keyed on the source and the CPU), so the first start-up compiles (seconds)
and every later one loads (milliseconds). Where that folder is not writable (a system-wide
install) and NUMBA_CACHE_DIR is unset, the cache goes to `$REFSERVE_HOME/numba-cache`
(REFSERVE_HOME defaults to ~/.cache/refserve, where the model is cached too).

FALLBACK. Where numba cannot be imported (no wheel for the platform, a broken install) or
`REFSERVE_CPU_KERNELS=numpy` asks for it, `unavailable_reason()` says why, `jit` leaves the
functions as plain Python (never called), and the CPU backend runs NumPy products instead;
its start-up line says which.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

ENV = "REFSERVE_CPU_KERNELS"
CHOICES = ("auto", "compiled", "numpy")
FASTMATH = frozenset({"reassoc", "contract"})


def setting() -> str:
    """REFSERVE_CPU_KERNELS: "auto" (unset: compiled where numba loads), "compiled" (numba
    or an error) or "numpy" (the NumPy products). Raises ValueError naming the variable."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: choose one of {', '.join(CHOICES)}")
    return value


def cache_dir_for(package_dir: Path, environ=os.environ) -> Path | None:
    """Where numba should keep this package's machine code: None for numba's own choice
    (NUMBA_CACHE_DIR if set, else `__pycache__` beside the sources, when writable), else
    `$REFSERVE_HOME/numba-cache`."""
    if environ.get("NUMBA_CACHE_DIR") or os.access(package_dir, os.W_OK):
        return None
    home = Path(environ.get("REFSERVE_HOME", Path.home() / ".cache" / "refserve"))
    return home / "numba-cache"


@cache
def _load():
    """(numba, None) or (None, why not). Imported once, on first use, not at
    `import refserve`: the reference backend never pays for it."""
    if setting() == "numpy":
        return None, f"{ENV}=numpy"
    try:
        import numba
    except Exception as exc:  # ImportError, or a broken LLVM failing at import
        if setting() == "compiled":
            raise RuntimeError(f"{ENV}=compiled but numba cannot be imported "
                               f"({type(exc).__name__}: {exc}); pip install numba") from exc
        return None, (f"numba cannot be imported ({type(exc).__name__}: {exc}); "
                      "`pip install numba` gives the compiled kernels")
    where = cache_dir_for(Path(__file__).parent)
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
        numba.config.CACHE_DIR = str(where)
    return numba, None


def unavailable_reason() -> str | None:
    """Why the compiled kernels cannot run here, or None when they can."""
    return _load()[1]


def available() -> bool:
    return _load()[0] is not None


def jit(parallel: bool = False, inline: bool = False):
    """Decorator: numba.njit with the module's options (module docstring); the plain
    function where numba is unavailable. `inline`: a helper compiled into each caller (a
    call across compiled functions otherwise costs the inner loop a few percent)."""
    numba = _load()[0]
    if numba is None:
        return lambda function: function
    return numba.njit(cache=True, nogil=True, fastmath=set(FASTMATH), parallel=parallel,
                      error_model="numpy", inline="always" if inline else "never")


def __getattr__(name: str):
    """`prange`: numba.prange (which numba recognises by identity inside a kernel), or
    range for the plain Python fallback."""
    if name == "prange":
        numba = _load()[0]
        return range if numba is None else numba.prange
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def set_threads(count: int) -> None:
    """The number of threads the calling thread's next parallel kernels use: `count`, at
    most numba's pool (NUMBA_NUM_THREADS, the CPUs at start-up)."""
    numba = _load()[0]
    if numba is not None:
        numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))
