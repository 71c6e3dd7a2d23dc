"""Scheduling policies: the order in which waiting sequences are admitted, and whom to preempt.

vLLM's knob is `scheduling_policy`; refserve offers three values:

    fcfs      first come, first served: the waiting queue as it stands (a preempted sequence
              was put back at its head, so it goes first).
    lpm       longest prefix match first (SGLang's "lpm"): the waiting sequence with the most
              tokens already in the prefix cache goes first, ties in queue order. Admitting
              the sequences that share a cached prefix while it is cached turns more of
              their prefill into hits, and keeps that prefix from being evicted in between.
    priority  vLLM's `priority=` of generate / add_request: lower values go first, ties in
              queue order; and when the pool is short, the running sequence with the LOWEST
              priority (largest value) is preempted, the newest of them among equals.

The running batch is kept in the order in which its sequences get the step's budget, and the
preemption victim is always the LAST of it: fcfs and lpm append an admitted sequence (oldest
first, so the newest is preempted); priority inserts it after every running sequence of equal
or higher priority (`running_index`), so the most urgent are served first and the victim is
the newest of the least urgent. The victim is therefore never one already served this step
(vLLM instead visits in arrival order and un-schedules such a victim).

The admission rule itself does not change: the scheduler admits in the policy's order while
seats, budget and blocks allow, and the first sequence that does not fit stops admission for
the step. Nobody skips ahead except by the policy's order.

LPM's two safeguards.
  * Long queues fall back to fcfs (LPM_MAX_QUEUE = 128, SGLang's threshold): sorting costs a
    prefix lookup per waiting sequence per step, and a long queue means the engine is
    overloaded, where arrival order is the fairest thing left.
  * Starvation guard. Sorting by match length alone can pass over a sequence with no cached
    prefix forever, as long as sequences with a cached prefix keep arriving. So each waiting
    sequence counts the admission rounds in which a sequence that arrived after it (behind
    it in the queue) was admitted while it kept waiting. Once a sequence has been passed
    over `max_passes` times (default 4) it goes ahead of every sequence that has not, in
    queue order. Since admission never skips the first sequence that does not fit, nobody
    admitted later can pass it again: a sequence is passed over in at most max_passes
    rounds. Why 4: each pass costs the passed sequence at least one step of waiting, so 4
    bounds what lpm adds to its TTFT to a few steps, while leaving room to group the
    sequences of a shared prefix (what lpm is for). It is a constructor argument.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refserve.sequence import Sequence

from refserve.config import SCHEDULING_POLICIES

LPM_MAX_QUEUE = 128
LPM_MAX_PASSES = 4

PrefixMatchLength = Callable[["Sequence"], int]


class SchedulingPolicy:
    """First come, first served; the base of the other policies.

    `order` never changes the queue; the scheduler admits in the returned order, puts each
    admitted sequence at `running_index` in the running batch, and then reports the round
    with `on_admitted`, so that a policy with memory (lpm) can update it.
    """

    name = "fcfs"

    def order(self, waiting: SequenceOf[Sequence],
              prefix_match_length: PrefixMatchLength | None = None) -> list[Sequence]:
        """The admission order of `waiting` (head first); a permutation of it."""
        return list(waiting)

    def on_admitted(self, waiting: SequenceOf[Sequence], admitted: SequenceOf[Sequence]
                    ) -> None:
        """One admission round is over: `waiting` was the queue before it (head first) and
        `admitted` the sequences that left it."""

    def running_index(self, running: SequenceOf[Sequence], seq: Sequence) -> int:
        """Where an admitted `seq` joins `running` (kept in budget order, the victim last):
        at the end, the newest."""
        return len(running)


class LongestPrefixMatch(SchedulingPolicy):
    """SGLang's lpm with a fallback to fcfs above max_queue and a starvation guard (module
    docstring). `passes[seq_id]` counts the rounds a waiting sequence was passed over."""

    name = "lpm"

    def __init__(self, max_queue: int = LPM_MAX_QUEUE, max_passes: int | None = LPM_MAX_PASSES
                 ) -> None:
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r}: must be an integer >= 1")
        if max_passes is not None and (not isinstance(max_passes, int) or max_passes < 1):
            raise ValueError(f"max_passes={max_passes!r}: must be an integer >= 1, or None "
                             "(no starvation guard)")
        self.max_queue = max_queue
        self.max_passes = max_passes
        self.passes: dict[int, int] = {}

    def is_starved(self, seq: Sequence) -> bool:
        return self.max_passes is not None and self.passes.get(seq.seq_id, 0) >= self.max_passes

    def order(self, waiting: SequenceOf[Sequence],
              prefix_match_length: PrefixMatchLength | None = None) -> list[Sequence]:
        """Starved sequences first (queue order), then the rest by prefix-match length,
        longest first, ties in queue order; plain queue order above max_queue."""
        if len(waiting) > self.max_queue:
            return list(waiting)
        if prefix_match_length is None:
            raise ValueError("lpm needs prefix_match_length(seq): tokens of seq in the "
                             "prefix cache")
        # sorted() is stable, so equal keys keep their queue order.
        return sorted(waiting, key=lambda seq: (0, 0) if self.is_starved(seq)
                      else (1, -prefix_match_length(seq)))

    def on_admitted(self, waiting: SequenceOf[Sequence], admitted: SequenceOf[Sequence]
                    ) -> None:
        """Count a pass for each sequence still waiting behind which (later in the queue) a
        sequence was admitted; forget the ones that left the queue."""
        admitted_ids = {seq.seq_id for seq in admitted}
        last_admitted = max((i for i, seq in enumerate(waiting) if seq.seq_id in admitted_ids),
                            default=-1)
        self.passes = {
            seq.seq_id: self.passes.get(seq.seq_id, 0) + (i < last_admitted)
            for i, seq in enumerate(waiting) if seq.seq_id not in admitted_ids}


class PriorityPolicy(SchedulingPolicy):
    """vLLM's priority scheduling: `seq.priority`, lower first, ties in queue order; preempt
    the lowest priority (largest value), the newest among equals."""

    name = "priority"

    def order(self, waiting: SequenceOf[Sequence],
              prefix_match_length: PrefixMatchLength | None = None) -> list[Sequence]:
        return sorted(waiting, key=lambda seq: seq.priority)  # stable: ties keep queue order

    def running_index(self, running: SequenceOf[Sequence], seq: Sequence) -> int:
        """After every running sequence of equal or higher priority (a lower or equal
        value): `running` stays sorted by priority, ties oldest first."""
        return bisect.bisect_right([s.priority for s in running], seq.priority)


def make_policy(name: str, **kwargs) -> SchedulingPolicy:
    """The policy for EngineConfig.scheduling_policy `name` (one of SCHEDULING_POLICIES);
    kwargs go to its constructor (lpm: max_queue, max_passes)."""
    policies = {"fcfs": SchedulingPolicy, "lpm": LongestPrefixMatch, "priority": PriorityPolicy}
    if name not in policies:
        raise ValueError(f"scheduling_policy={name!r}: choose one of "
                         f"{', '.join(SCHEDULING_POLICIES)}")
    return policies[name](**kwargs)
