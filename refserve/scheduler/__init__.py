"""The scheduler: which sequences compute which tokens in the next step.

    output.py      SchedulerOutput / ScheduledSequence (one step, printable) and
                   SampledTokens (what update() applies)
    base.py        the queues, ADVANCE with PREEMPT, UPDATE and RETIRE (shared)
    continuous.py  Scheduler: continuous (iteration-level) batching, ADMIT every step
    static.py      StaticScheduler: request-level batching, for comparison
    demo.py        a stub model; `python -m refserve.scheduler` prints a few steps
"""

from refserve.scheduler.base import SchedulerBase
from refserve.scheduler.continuous import Scheduler
from refserve.scheduler.demo import run_stub, stub_next_token
from refserve.scheduler.output import SampledTokens, ScheduledSequence, SchedulerOutput
from refserve.scheduler.static import StaticScheduler

__all__ = ["SampledTokens", "ScheduledSequence", "Scheduler", "SchedulerBase",
           "SchedulerOutput", "StaticScheduler", "run_stub", "stub_next_token"]
