"""Sequences in and out of a scheduler from outside a step: `add_sequence` queues a new one
(after checking it could ever run), `abort` stops one at once. The `Scheduler` inherits both;
the step itself (schedule, update, and retiring inside update) is scheduler.py's.
"""

from __future__ import annotations

from refserve.scheduler.fits import check_fits
from refserve.sequence import Sequence, SequenceStatus


class Intake:
    """add_sequence / check_fits / abort (see the module docstring); uses the Scheduler's
    queues (`waiting`, `running`, `_by_id`), its limits, swapper and KV manager."""

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a new sequence at the tail of `waiting`; give it an id if it has none.
        Raises ValueError if it could never run (see `fits.check_fits`)."""
        if seq.seq_id is not None and seq.seq_id in self._by_id:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.value}, not waiting")
        self.check_fits(seq.num_tokens, seq.num_seats)
        if seq.seq_id is None:
            seq.seq_id = self.new_seq_id()
        self._by_id[seq.seq_id] = seq
        self.waiting.append(seq)

    def check_fits(self, num_prompt_tokens: int, num_seats: int = 1) -> None:
        """Raise ValueError if a prompt could never run here (see `fits.check_fits`)."""
        kv = self.kv_cache_manager
        check_fits(num_prompt_tokens, num_seats, max_model_len=self.max_model_len,
                   max_num_seqs=self.max_num_seqs, num_blocks=kv.num_blocks,
                   block_size=kv.block_size)

    def abort(self, seq_id: int) -> Sequence | None:
        """Stop a waiting, preempted or running sequence now; its blocks are freed at once.
        Returns the sequence, or None if no unfinished sequence has this id."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            if self.swapper is not None:
                self.swapper.release(seq)
        else:
            self.running.remove(seq)
            self.kv_cache_manager.release(seq)
            self._on_running_left()
        seq.status = SequenceStatus.FINISHED_ABORTED
        return seq
