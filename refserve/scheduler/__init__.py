"""The scheduler: which sequences compute which tokens in the next step.

    scheduler.py          Scheduler: continuous (iteration-level) batching: ADVANCE with
                          PREEMPT, ADMIT, then UPDATE and RETIRE once the model ran; add,
                          abort, and parallel sampling's fork (copy-on-write children)
    static.py             StaticScheduler: request-level batching, for comparison
    prefill_first.py      PrefillFirstScheduler: vLLM V0's schedule (no chunked prefill)
    output.py             SchedulerOutput / RowPlan / ScheduledSequence (one step, printable),
                          SampledTokens (what update() applies), StepUpdate (what it decided)
    scheduling_policy.py  fcfs / lpm / priority: admission order and the preemption victim
    factory.py            make_scheduler: the one an EngineConfig asks for (engine, simulator)
    step_retry.py         a step that was never applied: what is undone, what is carried
    swapping.py           preemption_mode="swap": victims' KV to the host pool and back
    fits.py               could a request ever run? (checked before it is queued)
    drafts.py             a draft token's life (speculative decoding): propose, trim, verify
    demo.py               a stub model; `python -m refserve.scheduler` prints a few steps
"""

from refserve.scheduler.demo import run_stub, stub_next_token
from refserve.scheduler.drafts import Proposal
from refserve.scheduler.output import (
    ChildDraw,
    SampledTokens,
    ScheduledSequence,
    SchedulerOutput,
    StepUpdate,
)
from refserve.scheduler.scheduler import Scheduler
from refserve.scheduler.static import StaticScheduler

__all__ = ["ChildDraw", "Proposal", "SampledTokens", "ScheduledSequence", "Scheduler",
           "SchedulerOutput", "StaticScheduler", "StepUpdate", "run_stub", "stub_next_token"]
