"""The tuned CPU backend's thread policy (refserve/backends/cpu_threads.py): as many threads
as the machine leaves CPUs free, measured from /proc/stat minus the process's own CPU time;
REFSERVE_CPU_THREADS=N fixes N. Driven by a fake clock and fake counters: nothing is timed.
"""

from __future__ import annotations

import pytest
from threadpoolctl import threadpool_info

from refserve.backends import CpuBackend
from refserve.backends import cpu_threads as ct


class FakeMachine:
    """A clock and busy / own CPU-second counters the test advances by hand."""

    def __init__(self, readable=True):
        self.now, self.busy_total, self.own_total, self.readable = 0.0, 100.0, 10.0, readable

    def run(self, seconds, ours, others):
        """`seconds` pass with `ours` CPUs busy with this process, `others` with others."""
        self.now += seconds
        self.busy_total += seconds * (ours + others)
        self.own_total += seconds * ours

    def policy(self, fixed=None, cpus=2):
        return ct.ThreadPolicy(fixed, list(range(cpus)), clock=lambda: self.now,
                               busy=lambda c: self.busy_total if self.readable else None,
                               own=lambda: self.own_total)


def blas_threads() -> int:
    return next(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")


@pytest.fixture(autouse=True)
def restore_blas_threads():
    before = blas_threads()
    yield
    from threadpoolctl import threadpool_limits

    threadpool_limits(before, user_api="blas")


@pytest.mark.parametrize("free,cpus,threads", [
    (2.0, 2, 2), (1.8, 2, 2), (1.75, 2, 2), (1.7, 2, 1), (1.0, 2, 1), (0.0, 2, 1),
    (-0.5, 2, 1), (16.0, 16, 16), (14.9, 16, 15), (14.7, 16, 14), (3.0, 2, 2)])
def test_a_cpu_counts_when_three_quarters_of_it_is_free(free, cpus, threads):
    assert ct.threads_for(free, cpus) == threads


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back():
    """Idle machine: both CPUs. A busy-loop neighbour (one CPU of others' time, whatever we
    use): one thread at the next measurement. It leaves: two again. Our own threads never
    count against us, however busy they are."""
    m = FakeMachine()
    policy = m.policy()
    assert policy.threads() == 2 and blas_threads() == 2
    m.run(0.6, ours=2.0, others=0.0)
    assert policy.threads() == 2 and policy.free_cpus == pytest.approx(2.0)
    m.run(0.6, ours=1.4, others=0.6)       # the neighbour squeezed in beside two threads
    assert policy.threads() == 1 and blas_threads() == 1
    m.run(0.6, ours=1.0, others=1.0)       # ... and now has its own core
    assert policy.threads() == 1 and policy.free_cpus == pytest.approx(1.0)
    m.run(0.6, ours=1.0, others=0.05)      # gone (a little noise left)
    assert policy.threads() == 2 and blas_threads() == 2
    assert policy.changes == 2


def test_it_measures_at_most_once_per_interval():
    m = FakeMachine()
    policy = m.policy()
    m.run(ct.FIRST_INTERVAL, ours=2.0, others=0.0)
    assert policy.threads() == 2 and policy.free_cpus == pytest.approx(2.0)   # the first
    m.run(ct.INTERVAL / 2, ours=0.0, others=2.0)
    assert policy.threads() == 2 and policy.free_cpus == pytest.approx(2.0)   # too early
    m.run(ct.INTERVAL / 2, ours=0.0, others=2.0)
    assert policy.threads() == 1                                # the whole interval counts


def test_a_neighbour_busy_before_the_start_takes_a_thread_at_the_first_measurement():
    """The first measurement comes FIRST_INTERVAL after the start, not a whole INTERVAL:
    two threads beside a busy loop make every step many times slower meanwhile."""
    assert ct.FIRST_INTERVAL < ct.INTERVAL
    m = FakeMachine()
    policy = m.policy()
    m.run(ct.FIRST_INTERVAL / 2, ours=0.0, others=1.0)
    assert policy.threads() == 2 and policy.free_cpus is None   # too early to measure
    m.run(ct.FIRST_INTERVAL / 2, ours=0.0, others=1.0)
    assert policy.threads() == 1


def test_a_fixed_count_is_never_measured():
    m = FakeMachine()
    policy = m.policy(fixed=3)
    m.run(5.0, ours=0.0, others=2.0)
    assert policy.threads() == 3 and policy.free_cpus is None and blas_threads() == 3
    assert "REFSERVE_CPU_THREADS=3" in policy.describe()


def test_without_proc_stat_it_keeps_the_mask_and_says_so():
    m = FakeMachine(readable=False)
    policy = m.policy(cpus=2)
    m.run(5.0, ours=0.0, others=2.0)
    assert policy.threads() == 2 and not policy.adaptive
    assert "not adapted" in policy.describe()


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("auto", None),
                                            (" AUTO ", None), ("1", 1), ("12", 12)])
def test_the_setting_parses(value, expected):
    assert ct.parse_setting(value) == expected


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_setting_names_the_variable(value):
    with pytest.raises(ValueError, match="REFSERVE_CPU_THREADS"):
        ct.parse_setting(value)


def test_busy_seconds_reads_the_busy_columns_of_the_masks_cpus(tmp_path, monkeypatch):
    """user nice system idle iowait irq softirq steal: all but idle and iowait, of the
    CPUs asked for only, in clock ticks."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 1 1 1 1 1 1 1 0 0\n"
                    "cpu0 10 20 30 1000 500 1 2 3 0 0\n"
                    "cpu1 100 0 0 9 9 0 0 0 0 0\n"
                    "intr 5 5\n")
    monkeypatch.setattr(ct.os, "sysconf", lambda name: 100)
    assert ct.busy_seconds([0], str(stat)) == pytest.approx((10 + 20 + 30 + 1 + 2 + 3) / 100)
    assert ct.busy_seconds([0, 1], str(stat)) == pytest.approx(1.66)
    assert ct.busy_seconds([2], str(stat)) is None          # a CPU missing from the file
    assert ct.busy_seconds([0], str(tmp_path / "nope")) is None


def test_the_engine_says_its_threads_at_start_up():
    backend = CpuBackend()
    kernels, threads = backend.startup_note().split(" | ")
    assert kernels.startswith("kernels: ") and threads.startswith("threads: ")
    assert "REFSERVE_CPU_THREADS" in threads
    assert ct.thread_policy() is backend.threads is CpuBackend().threads   # one per process


def test_openblas_is_set_from_the_main_thread_only_and_capped():
    """A count change made on another thread (a server's engine thread) leaves OpenBLAS as
    the main thread set it (OpenBLAS ignores it there and slows down); a cap applies at
    once."""
    import threading

    policy = ct.ThreadPolicy(fixed=2)
    assert blas_threads() == 2
    other = threading.Thread(target=policy._set, args=(1,))
    other.start()
    other.join()
    assert policy._count == 1 and blas_threads() == 2
    policy.cap_blas(1)
    assert blas_threads() == 1
    policy._set(2)
    assert blas_threads() == 1          # capped whatever the count
