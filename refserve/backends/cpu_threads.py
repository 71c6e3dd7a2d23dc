"""How many threads the tuned CPU backend computes with: the CPUs the machine leaves free.

WHY. A BLAS call on n threads splits its work n ways and waits for the slowest part. When
another process wants one of the cores, the thread on that core is preempted for whole
scheduler slices and every product of every layer waits for it at the barrier: measured on
the 2-core development machine, batch-1 decode went from 40 to 121 ms per token on two
OpenBLAS threads beside one busy-loop process, and from 58 to 63 ms on one. Two threads are
1.4x faster than one on idle cores; on a busy machine they collapse.

POLICY (`REFSERVE_CPU_THREADS`, default "auto"). Every INTERVAL seconds (the first time
FIRST_INTERVAL after the policy starts), from the steps of a running engine:

    free    = CPUs of this process's affinity mask - the CPU time other processes (and the
              hypervisor: steal) used on them over the interval, per second of it
    threads = max(1, floor(free + 1 - FREE_SHARE))   (a CPU counts when FREE_SHARE of it
              is free), at most the CPUs of the mask

and the compiled kernels' parallel loops run on that many threads (the backend sets numba's
count at every step); OpenBLAS then stays on one (`cap_blas`: two pools of threads on the
same cores starve each other). With the NumPy kernels OpenBLAS runs on that many, set from
the main thread only (`_limit_blas`). Counters come from /proc/stat (Linux); where it cannot
be read the policy keeps the mask's CPUs. Our own threads never count against us: the
process's CPU time (os.times) is taken out of the busy time.

`REFSERVE_CPU_THREADS=N` fixes N threads (N >= 1), with no measurement: what a benchmark
that wants a fixed configuration sets. vLLM's CPU build takes another way to the same end:
it binds one OpenMP thread per core to all cores but one, which it leaves to the front end.

The BLAS thread count is a setting of the whole process (one OpenBLAS per process), so there
is one policy per process, `thread_policy()`.
"""

from __future__ import annotations

import math
import os
import threading
import time

ENV = "REFSERVE_CPU_THREADS"
INTERVAL = 0.5     # seconds between two measurements of the free CPUs
FIRST_INTERVAL = 0.1  # the first one comes sooner: a busy neighbour already there when the
                      # policy starts would otherwise meet a whole interval of two-thread
                      # steps, each many times slower (10 ticks of /proc/stat per CPU: enough)
FREE_SHARE = 0.75  # a CPU counts as free when others used at most 1 - FREE_SHARE of it
# Columns of a /proc/stat cpu line that are busy time (user nice system idle iowait irq
# softirq steal ...): everything but idle and iowait; guest time is inside user already.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask; all of them where the OS has no
    masks)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def busy_seconds(cpus: list[int], stat_path: str = "/proc/stat") -> float | None:
    """CPU seconds spent busy on `cpus` since boot, from /proc/stat; None where it cannot be
    read (not Linux, or a CPU missing from it)."""
    wanted = {f"cpu{c}" for c in cpus}
    ticks = 0
    found = 0
    try:
        with open(stat_path) as f:
            for line in f:
                name, *values = line.split()
                if name in wanted:
                    ticks += sum(int(values[i]) for i in _BUSY_COLUMNS if i < len(values))
                    found += 1
    except (OSError, ValueError):
        return None
    if found != len(wanted):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds this process has used (all its threads)."""
    t = os.times()
    return t.user + t.system


def threads_for(free_cpus: float, num_cpus: int) -> int:
    """The thread count for `free_cpus` free CPUs out of `num_cpus` (module docstring)."""
    return max(1, min(num_cpus, math.floor(free_cpus + 1 - FREE_SHARE)))


def parse_setting(value: str | None) -> int | None:
    """REFSERVE_CPU_THREADS: None for "auto" (or unset / empty), else a thread count >= 1.
    Raises ValueError naming the variable."""
    value = (value or "").strip().lower()
    if value in ("", "auto"):
        return None
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise ValueError(f"{ENV}={value!r}: give a number of threads >= 1, or auto")


class ThreadPolicy:
    """The process's thread count (module docstring). `threads()` is cheap: it measures at
    most once per INTERVAL and changes the BLAS setting only when the count changes."""

    def __init__(self, fixed: int | None = None, cpus: list[int] | None = None,
                 clock=time.monotonic, busy=busy_seconds, own=own_seconds) -> None:
        self.cpus = cpus if cpus is not None else allowed_cpus()
        self.fixed = fixed
        self._clock, self._busy, self._own = clock, busy, own
        self._blas = None  # threadpoolctl's BLAS controllers, found on first use
        self._count = 0
        self.blas_cap: int | None = None     # at most this many BLAS threads (cap_blas)
        self._blas_set: int | None = None    # the count last given to OpenBLAS
        self.free_cpus: float | None = None  # the last measurement (None: not measured)
        self.changes = 0                     # how often the count changed
        self._last = self._sample()
        self._set(fixed if fixed is not None else len(self.cpus))

    @property
    def adaptive(self) -> bool:
        return self.fixed is None and self._last[1] is not None

    def threads(self) -> int:
        """The thread count to compute with now, re-measured when INTERVAL has passed."""
        due = INTERVAL if self.free_cpus is not None else FIRST_INTERVAL
        if self.adaptive and self._clock() - self._last[0] >= due:
            now = self._sample()
            (t0, busy0, own0), (t1, busy1, own1) = self._last, now
            self._last = now
            if busy1 is not None:
                others = max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9)
                self.free_cpus = len(self.cpus) - others
                self._set(threads_for(self.free_cpus, len(self.cpus)))
        return self._count

    def describe(self) -> str:
        """For the start-up line, e.g. 'threads: 2 (auto: the free CPUs of 2 in the
        affinity mask, measured every 0.5 s; REFSERVE_CPU_THREADS=N fixes N)'."""
        cpus = len(self.cpus)
        if self.fixed is not None:
            return f"threads: {self.fixed} ({ENV}={self.fixed}; {cpus} CPUs in the mask)"
        if not self.adaptive:
            return (f"threads: {self._count} (the CPUs of the affinity mask; /proc/stat "
                    f"unreadable, so not adapted to load; {ENV}=N fixes N)")
        return (f"threads: {self._count} now (auto: the free CPUs of the {cpus} in the "
                f"affinity mask, measured every {INTERVAL:g} s; {ENV}=N fixes N)")

    def _sample(self):
        return self._clock(), self._busy(self.cpus), self._own()

    def _set(self, count: int) -> None:
        if count == self._count:
            return
        if self._count:
            self.changes += 1
        self._count = count
        self._limit_blas()

    def cap_blas(self, cap: int) -> None:
        """OpenBLAS on at most `cap` threads from now on, whatever the count: the compiled
        kernels run the count on numba's threads, and a second pool of threads spinning
        beside them takes the cores from both (measured in the server: a prefill chunk's
        NumPy attention took 23 ms a layer instead of under 1 ms)."""
        self.blas_cap = cap
        self._limit_blas()

    def _limit_blas(self) -> None:
        """Give OpenBLAS the count (capped), from the main thread only: a change made from
        another thread did not apply and slowed its products 5-10x (measured, OpenBLAS
        0.3.31), so a server's engine thread leaves OpenBLAS as the main thread set it."""
        count = self._count if self.blas_cap is None else min(self._count, self.blas_cap)
        if count == self._blas_set or threading.current_thread() is not threading.main_thread():
            return
        self._blas_set = count
        if self._blas is None:
            import numpy  # noqa: F401  (BLAS is loaded with NumPy: make sure it is there)
            from threadpoolctl import ThreadpoolController

            self._blas = ThreadpoolController().select(user_api="blas")
        self._blas.limit(limits=count)


_POLICY: ThreadPolicy | None = None


def thread_policy() -> ThreadPolicy:
    """The process's policy, made on first use from REFSERVE_CPU_THREADS."""
    global _POLICY
    if _POLICY is None:
        _POLICY = ThreadPolicy(parse_setting(os.environ.get(ENV)))
    return _POLICY
