"""Parallel sampling's fork: a child sequence that shares every block of its running parent
(copy-on-write makes the shared last block private on the first write). The `Scheduler`
inherits `fork`; `update` calls it for each child a step's `SampledTokens.children` names.

The fork keeps the scheduler's invariants: the child holds blocks, runs right after its
parent and earlier siblings in `running`, and the parent's n seats become 1 + one per child,
so the seat count never changes. A child forked between `schedule()` and `update()` rides that
step (`_riders`): `update` advances it like its parent.
"""

from __future__ import annotations

from refserve.sequence import Sequence, SequenceStatus


class Forking:
    """The fork of parallel sampling (see the module docstring); uses the Scheduler's
    queues (`running`, `_by_id`, `_pending`, `_riders`) and KV manager."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Parallel sampling: `child` (made by `parent.fork()`) shares every block of the
        running `parent` and runs right after it (after any earlier children).

        Called between `schedule()` and `update()` of the step in which the parent samples
        (that is what `update` does with `SampledTokens.children`), the child rides that
        step: `update` advances it like the parent and appends its own token. Called at any
        other time, the child simply continues from its own state. The parent's n seats
        become 1 + one per child. Everything is checked before anything changes.
        """
        if self._by_id.get(parent.seq_id) is not parent or parent not in self.running:
            raise ValueError(f"fork: parent {parent.seq_id} is not running")
        if not self.kv_cache_manager.has_sequence(parent.seq_id):
            raise ValueError(f"fork: parent {parent.seq_id} has not been computed yet")
        if child.seq_id is None:
            child.seq_id = self.new_seq_id()
        if child.seq_id in self._by_id:
            raise ValueError(f"fork: sequence {child.seq_id} is already scheduled")
        rides = self._pending is not None and any(
            row.seq is parent for row in self._pending.scheduled)
        if rides and (child.num_computed_tokens != parent.num_computed_tokens
                      or child.token_ids != parent.token_ids):
            raise ValueError(f"fork between schedule() and update(): child {child.seq_id} "
                             "must copy the parent as scheduled (parent.fork() does)")
        # Validated: from here on nothing can fail.
        self.kv_cache_manager.fork(parent, child)
        parent.awaiting_fork = False
        child.awaiting_fork = False
        child.status = SequenceStatus.RUNNING
        index = self.running.index(parent) + 1
        while (index < len(self.running)
               and self.running[index].request_id == parent.request_id):
            index += 1
        self.running.insert(index, child)
        self._by_id[child.seq_id] = child
        if rides:
            self._riders.setdefault(parent.seq_id, []).append(child)
