"""The scheduler: which sequences compute which tokens in the next step.

    output.py      SchedulerOutput / ScheduledSequence (one step, printable), SampledTokens
                   (what update() applies) and StepUpdate (what update() decided)
    base.py        the queues, ADVANCE with PREEMPT, UPDATE and RETIRE (shared)
    continuous.py  Scheduler: continuous (iteration-level) batching, ADMIT every step
    static.py      StaticScheduler: request-level batching, for comparison
    factory.py     make_scheduler: the one an EngineConfig asks for (engine and simulator)
    policy.py      scheduling_policy: fcfs / lpm / priority admission order, the victim
    row_plan.py    a row's tokens under the budget (hits, chunk, drafts) and its logits
    step_retry.py  the copies of a step that was never applied, carried into the next
    swapping.py    preemption_mode="swap": victims' KV to the host pool and back
    fits.py        could a request ever run? (checked before it is queued)
    stop_rules.py  when a sequence stops, decided token by token as update() appends
    drafts.py      a draft token's life (speculative decoding): propose, trim, verify, roll back
    demo.py        a stub model; `python -m refserve.scheduler` prints a few steps
"""

from refserve.scheduler.base import SchedulerBase
from refserve.scheduler.continuous import Scheduler
from refserve.scheduler.demo import run_stub, stub_next_token
from refserve.scheduler.drafts import Proposal
from refserve.scheduler.output import (
    SampledTokens,
    ScheduledSequence,
    SchedulerOutput,
    StepUpdate,
)
from refserve.scheduler.static import StaticScheduler

__all__ = ["Proposal", "SampledTokens", "ScheduledSequence", "Scheduler", "SchedulerBase",
           "SchedulerOutput", "StaticScheduler", "StepUpdate", "run_stub", "stub_next_token"]
