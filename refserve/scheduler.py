"""The scheduler: which sequences compute which tokens in the next step.

Continuous batching (iteration-level scheduling, as in Orca and vLLM) rebuilds the batch
every step. There are no prefill and decode phases: every sequence's `num_computed_tokens`
chases its `num_tokens`, and a step gives each scheduled sequence its next `n` query tokens
[num_computed_tokens, num_computed_tokens + n). When they reach `num_tokens`, the logits of
the last one sample the next token.

One step of `Scheduler.schedule()` does, in this order:

    ADVANCE  running sequences, oldest first. Each gets
                 n = min(seq.num_tokens - seq.num_computed_tokens, budget_left)
             tokens: 1 for a decode, the next chunk of an unfinished prefill (chunked
             prefill). Its KV slots come from `kv_cache_manager.allocate_slots`.
    PREEMPT  when the pool has no free block for a running sequence, the NEWEST running
             sequence is preempted (recompute: its blocks are freed, it goes back to the
             HEAD of the waiting queue with its tokens kept, and is prefilled again when
             readmitted) and the allocation is retried. The newest may be the sequence
             itself.
    ADMIT    waiting sequences, first come first served, while the seats (max_num_seqs)
             and the token budget (max_num_batched_tokens) allow and the pool can hold
             their first chunk. The head of the queue that does not fit stops admission:
             nobody skips ahead, so nobody starves. Admission never preempts, and a step
             that had to preempt admits nobody (the pool just proved short).

`Scheduler.update()` then applies the model's sampled tokens and RETIRES finished sequences:
they leave the running batch and free their blocks in the same step.

Limits of one step (both hold for every `SchedulerOutput`):

    token budget  sum of scheduled query tokens <= max_num_batched_tokens
    seats         sum of seq.num_seats over running sequences <= max_num_seqs
                  (a parent of an n > 1 request that has not forked yet holds n seats)

Slot-steps measure how well the batch is used: one slot-step is one seat for one step. It is
*used* when a real sequence is computed in it and *wasted* when a finished sequence is still
computed as padding (only `StaticScheduler`, request-level batching, does that).

Run `python -m refserve.scheduler` to watch a tiny workload step by step.
"""

from __future__ import annotations

import collections
import zlib
from dataclasses import dataclass, field

from refserve.capacity import blocks_for_tokens
from refserve.kv_cache.kv_cache_manager import KVCacheManager, NoFreeBlocksError
from refserve.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One row of a step: `seq` computes query tokens [start, start + num_tokens).

    samples     start + num_tokens == seq.num_tokens: the last row's logits sample a token.
    is_padding  static batching only: a finished sequence that still holds its seat. The
                runner recomputes position start == num_computed_tokens - 1 and writes its
                K/V nowhere (slot -1); nothing is sampled.
    block_ids   the sequence's block table for this step (a copy: what the runner sends to
                the attention kernel, and what the printout shows).
    """

    seq: Sequence
    num_tokens: int
    start: int
    samples: bool
    is_padding: bool = False
    block_ids: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def kind(self) -> str:
        """padding | chunk (a prefill piece that samples nothing) | decode | prefill."""
        if self.is_padding:
            return "padding"
        if not self.samples:
            return "chunk"
        if self.num_tokens == 1 and self.start >= self.seq.num_prompt_tokens:
            return "decode"
        return "prefill"


@dataclass
class SchedulerOutput:
    """What one step computes, plus what changed to get there.

    admitted / preempted   sequence ids that joined / left the running batch in this step
    block_copies           copy-on-write (src, dst) block pairs to copy before the forward
    num_batched_tokens     sum of num_tokens over `scheduled` (<= max_num_batched_tokens)
    The remaining fields are the limits and the occupancy after scheduling, for printing.
    """

    step: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    max_num_batched_tokens: int = 0
    num_seats_used: int = 0
    max_num_seqs: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def __str__(self) -> str:
        head = f"step {self.step}: {len(self.scheduled)} scheduled"
        if self.admitted:
            head += f" | admitted {self.admitted}"
        if self.preempted:
            head += f" | preempted {self.preempted}"
        if self.block_copies:
            copies = ", ".join(f"{src}->{dst}" for src, dst in self.block_copies)
            head += f" | copy-on-write {copies}"
        lines = [head, "   seq  request       kind     tokens  positions      blocks"]
        for row in self.scheduled:
            positions = f"[{row.start}, {row.end})"
            lines.append(f"  {row.seq.seq_id:>4}  {row.seq.request_id:<12.12}  {row.kind:<7}"
                         f"  {row.num_tokens:>6}  {positions:<13}  {_short(row.block_ids)}")
        lines.append(f"  budget {self.num_batched_tokens}/{self.max_num_batched_tokens} tokens"
                     f" | seats {self.num_seats_used}/{self.max_num_seqs}"
                     f" | free blocks {self.num_free_blocks}/{self.num_blocks}")
        return "\n".join(lines)


def _short(block_ids: list[int], keep: int = 8) -> str:
    if len(block_ids) <= keep:
        return str(block_ids)
    return f"[{', '.join(map(str, block_ids[:keep - 2]))}, ..., {block_ids[-1]}]" \
           f" ({len(block_ids)} blocks)"


class _SchedulerBase:
    """What both schedulers share: the queues, advancing with preemption, update and retire.

    Invariants between calls:
      * `waiting` (FIFO, head first) holds WAITING sequences; none of them holds blocks.
      * `running` (oldest first) holds RUNNING sequences; sum of num_seats <= max_num_seqs.
      * a sequence holds blocks in the KV-cache manager iff its id is in `_holding`.
      * finished sequences are in neither queue (StaticScheduler keeps them in `padding`
        until their batch ends).
    """

    batching = ""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_cache_manager: KVCacheManager, max_model_len: int,
                 eos_token_id: int | None = None) -> None:
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id

        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._by_id: dict[int, Sequence] = {}  # every unfinished sequence
        self._holding: set[int] = set()  # ids of sequences that hold KV blocks
        self._pending: SchedulerOutput | None = None  # scheduled, not yet updated
        self._riders: dict[int, list[Sequence]] = {}  # parent id -> children forked mid-step

        self.num_steps = 0
        self.slot_steps_used = 0
        self.slot_steps_wasted = 0
        self.num_preemptions = 0

    # ---- queries ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_seats_used(self) -> int:
        return sum(seq.num_seats for seq in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.kv_cache_manager.block_size)

    # ---- requests in and out ------------------------------------------------------------

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a new sequence at the tail of `waiting`.

        Raises ValueError if it could never run: an empty prompt, a prompt longer than
        max_model_len, more blocks than the whole pool, or more seats than max_num_seqs.
        """
        if seq.seq_id in self._by_id:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.value}, not waiting")
        self.check_fits(seq.num_tokens, seq.num_seats)
        self._by_id[seq.seq_id] = seq
        self.waiting.append(seq)

    def check_fits(self, num_prompt_tokens: int, num_seats: int = 1) -> None:
        """Raise ValueError if a prompt could never run: empty, longer than max_model_len,
        more blocks than the whole pool (prompt + the first sampled token), or more seats
        (SamplingParams.n) than max_num_seqs. Changes nothing; the engine calls it to vet a
        request before queuing anything."""
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if num_prompt_tokens > self.max_model_len:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        needed = self._blocks_needed(num_prompt_tokens + 1)
        if needed > self.kv_cache_manager.num_blocks:
            kv = self.kv_cache_manager
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens and needs {needed} KV "
                             f"blocks, more than the whole KV pool: the whole pool is "
                             f"{kv.num_blocks} blocks of {kv.block_size} tokens; give it more "
                             "memory (kv_cache_memory / num_gpu_blocks)")
        if num_seats > self.max_num_seqs:
            raise ValueError(f"SamplingParams.n={num_seats} is more than max_num_seqs="
                             f"{self.max_num_seqs} batch seats")

    def abort(self, seq_id: int) -> Sequence | None:
        """Stop a waiting, preempted or running sequence now; its blocks are freed at once.
        Returns the sequence, or None if no unfinished sequence has this id."""
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self._free(seq)
            self._on_running_left()
        seq.status = SequenceStatus.FINISHED_ABORTED
        return seq

    def finish(self, seq_id: int, status: SequenceStatus) -> Sequence | None:
        """Retire a sequence the engine decided is done (a stop string): like a finish found
        by `update`. Returns the sequence, or None if no unfinished sequence has this id."""
        if not status.is_finished:
            raise ValueError(f"finish() needs a finished status, got {status}")
        seq = self._by_id.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            del self._by_id[seq_id]
            self.waiting.remove(seq)
            seq.status = status
        else:
            self._retire(seq, status)
        return seq

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Parallel sampling: `child` (made by `parent.fork()`) shares every block of the
        running `parent` and runs right after it (after any earlier children).

        Called between `schedule()` and `update()` of the step in which the parent samples,
        the child rides that step: `update` advances it like the parent and appends
        `sampled_token_ids[child.seq_id]`. Called at any other time, the child simply
        continues from its own state. The parent's n seats become 1 + one per child.
        """
        if self._by_id.get(parent.seq_id) is not parent or parent not in self.running:
            raise ValueError(f"fork: parent {parent.seq_id} is not running")
        if parent.seq_id not in self._holding:
            raise ValueError(f"fork: parent {parent.seq_id} has not been computed yet")
        if child.seq_id in self._by_id:
            raise ValueError(f"fork: sequence {child.seq_id} is already scheduled")
        self.kv_cache_manager.fork(parent, child)
        self._holding.add(child.seq_id)
        parent.forked = True
        child.forked = True
        child.status = SequenceStatus.RUNNING
        index = self.running.index(parent) + 1
        while (index < len(self.running)
               and self.running[index].request_id == parent.request_id):
            index += 1
        self.running.insert(index, child)
        self._by_id[child.seq_id] = child
        if self._pending is None:
            return
        for row in self._pending.scheduled:
            if row.seq is parent and not row.is_padding:
                if child.num_computed_tokens != row.start:
                    raise ValueError(f"fork between schedule() and update(): child "
                                     f"{child.seq_id} must copy the parent as scheduled "
                                     f"(num_computed_tokens={row.start})")
                self._riders.setdefault(parent.seq_id, []).append(child)

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    def update(self, output: SchedulerOutput,
               sampled_token_ids: dict[int, list[int]]) -> list[Sequence]:
        """Apply one computed step; return the sequences retired by it.

        `output` must be the latest `schedule()` result; one that was never applied (its
        forward failed) is abandoned by the next `schedule()`, which redoes its work.

        For each scheduled, non-padding sequence: num_computed_tokens += num_tokens, newly
        full blocks go to the prefix cache, and if it sampled, its token(s) are appended and
        the stop rules checked. A retired sequence leaves `running` and (continuous
        batching) frees its blocks now. Sequences aborted or finished after `schedule()`
        are skipped.
        """
        if output.scheduled and output is not self._pending:
            raise ValueError(f"update() got step {output.step}, which is not the output of "
                             "the last schedule() or was already applied")
        self._pending = None
        riders, self._riders = self._riders, {}
        retired: list[Sequence] = []
        for row in output.scheduled:
            if row.is_padding:
                continue
            for seq in [row.seq, *riders.get(row.seq.seq_id, [])]:
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # aborted or finished since schedule()
                seq.num_computed_tokens += row.num_tokens
                self.kv_cache_manager.cache_full_blocks(seq)
                if not row.samples:
                    continue
                if seq.seq_id not in sampled_token_ids:
                    raise KeyError(f"update(): no sampled token for sequence {seq.seq_id}")
                status = self._append_tokens(seq, sampled_token_ids[seq.seq_id])
                if status is not None:
                    self._retire(seq, status)
                    retired.append(seq)
        return retired

    def _append_tokens(self, seq: Sequence, token_ids: list[int]) -> SequenceStatus | None:
        """Append sampled tokens until one of them finishes the sequence.

        Stop rules, checked after each token (a stop token wins over a length limit):
          FINISHED_STOPPED  the token is in stop_token_ids, or is eos and not ignore_eos
          FINISHED_LENGTH   num_output_tokens >= max_tokens or num_tokens >= max_model_len
        """
        params = seq.sampling_params
        for token_id in token_ids:
            seq.append_token(token_id)
            if token_id in params.stop_token_ids or (
                    token_id == self.eos_token_id and not params.ignore_eos):
                return SequenceStatus.FINISHED_STOPPED
            if (seq.num_output_tokens >= params.max_tokens
                    or seq.num_tokens >= self.max_model_len):
                return SequenceStatus.FINISHED_LENGTH
        return None

    # ---- building blocks of schedule() --------------------------------------------------

    def _begin_step(self) -> SchedulerOutput:
        out = SchedulerOutput(step=self.num_steps)
        if self._pending is not None:
            # The last step was never applied (its forward failed): nothing was computed,
            # every sequence keeps its blocks, and this step schedules the same work again.
            # Its copy-on-write copies may not have run, so they are carried over (running a
            # copy twice is harmless: no forward wrote to either block in between).
            out.block_copies.extend(self._pending.block_copies)
            self._pending = None
            self._riders = {}
        return out

    def _end_step(self, out: SchedulerOutput) -> SchedulerOutput:
        out.num_batched_tokens = sum(row.num_tokens for row in out.scheduled)
        assert out.num_batched_tokens <= self.max_num_batched_tokens
        assert self.num_seats_used <= self.max_num_seqs
        out.max_num_batched_tokens = self.max_num_batched_tokens
        out.num_seats_used = self.num_seats_used
        out.max_num_seqs = self.max_num_seqs
        out.num_free_blocks = self.kv_cache_manager.num_free_blocks
        out.num_blocks = self.kv_cache_manager.num_blocks
        padding = sum(row.is_padding for row in out.scheduled)
        self.slot_steps_used += len(out.scheduled) - padding
        self.slot_steps_wasted += padding
        self.num_steps += 1
        if out.scheduled:
            self._pending = out
        return out

    def _advance(self, out: SchedulerOutput, budget: int) -> int:
        """ADVANCE every running sequence, oldest first, while budget is left; a sequence
        the pool cannot serve preempts the newest running ones. Returns the budget left."""
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = self._schedule_or_preempt(seq, budget, out)
            if num_tokens == 0:
                break  # seq preempted itself: it was the newest, nobody runs after it
            budget -= num_tokens
            index += 1
        return budget

    def _schedule_or_preempt(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Give running `seq` its next tokens; on NoFreeBlocksError preempt the NEWEST
        running sequence and retry. Returns the tokens scheduled, 0 if seq was preempted."""
        while True:
            try:
                return self._allocate_and_schedule(seq, budget, out)
            except NoFreeBlocksError:
                victim = self.running[-1]  # the newest running sequence
                if victim is seq and self._holding <= {seq.seq_id}:
                    raise RuntimeError(
                        f"sequence {seq.seq_id} alone cannot fit its {seq.num_tokens} tokens "
                        f"in the KV pool ({self.kv_cache_manager.num_blocks} blocks of "
                        f"{self.kv_cache_manager.block_size}); the engine must size the pool "
                        f"for max_model_len={self.max_model_len}") from None
                self._preempt(victim, out)
                if victim is seq:
                    return 0

    def _allocate_and_schedule(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Allocate KV slots for seq's next min(remaining, budget) tokens and add its row.

        The first allocation after (re)admission first reuses prefix-cache hits: the hit
        tokens count as computed and are not scheduled. Raises NoFreeBlocksError (nothing
        changed) if the pool is short. Returns the number of tokens scheduled.
        """
        kv = self.kv_cache_manager
        if seq.seq_id in self._holding:
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            copies = kv.allocate_slots(seq, num_tokens)
        else:
            computed_blocks, hit_tokens = kv.get_computed_blocks(seq)
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens - hit_tokens, budget)
            copies = kv.allocate_slots(seq, num_tokens, computed_blocks=computed_blocks)
            self._holding.add(seq.seq_id)
            seq.num_computed_tokens += hit_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = hit_tokens
        start = seq.num_computed_tokens
        out.block_copies.extend(copies)
        out.scheduled.append(ScheduledSequence(
            seq, num_tokens, start, samples=start + num_tokens == seq.num_tokens,
            block_ids=list(kv.get_block_ids(seq.seq_id))))
        return num_tokens

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preemption by recompute: free every block, forget the computed KV, and put the
        sequence at the HEAD of the waiting queue. Its tokens (prompt and output so far)
        stay in seq.token_ids and are prefilled again on readmission."""
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq.seq_id)
        self._on_running_left()

    def _retire(self, seq: Sequence, status: SequenceStatus) -> None:
        """RETIRE: a finished sequence leaves the running batch in the step it finished."""
        seq.status = status
        self.running.remove(seq)
        del self._by_id[seq.seq_id]
        self._release(seq)
        self._on_running_left()

    def _release(self, seq: Sequence) -> None:
        """What happens to a retired sequence's blocks: continuous batching frees them now."""
        self._free(seq)

    def _on_running_left(self) -> None:
        """Hook: a sequence just left `running` (retired, aborted or preempted)."""

    def _free(self, seq: Sequence) -> None:
        if seq.seq_id in self._holding:
            self._holding.discard(seq.seq_id)
            self.kv_cache_manager.free(seq)


class Scheduler(_SchedulerBase):
    """Continuous batching: the batch is rebuilt every step (see the module docstring)."""

    batching = "continuous"

    def schedule(self) -> SchedulerOutput:
        """ADVANCE running sequences (preempting the newest when the pool is short), then
        ADMIT waiting ones, unless this step preempted."""
        out = self._begin_step()
        budget = self._advance(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._admit(out, budget)
        return self._end_step(out)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """ADMIT waiting sequences first-come-first-served.

        The admission rule: the HEAD of `waiting` joins `running` if
          * a seat is free:      seats used + seq.num_seats <= max_num_seqs,
          * budget is left:      it gets min(tokens to compute, budget_left) > 0 tokens,
          * the pool holds them: allocate_slots succeeds (after prefix-cache hits).
        Otherwise admission stops for this step; nobody behind the head is considered.
        """
        seats_used = self.num_seats_used
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats_used + seq.num_seats > self.max_num_seqs:
                break
            try:
                num_tokens = self._allocate_and_schedule(seq, budget, out)
            except NoFreeBlocksError:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats_used += seq.num_seats
            out.admitted.append(seq.seq_id)
            budget -= num_tokens


class StaticScheduler(_SchedulerBase):
    """Request-level (static) batching, as served before iteration-level scheduling.

    * A batch forms only when none is running: up to max_num_seqs seats of waiting sequences,
      first come first served, as many as the pool can hold for their whole generation
      (prompt + max_tokens, since static systems reserved it up front), at least one.
    * Its members are prefilled (token budget and chunking as in `Scheduler`) and decoded
      together. Nobody joins until the whole batch has finished.
    * A finished member is retired (returned by `update`) but keeps its seat and its blocks:
      it sits in `padding` and is still computed each step as a wasted decode row
      (`is_padding=True`) until the batch ends, when all its blocks are freed.
    """

    batching = "static"

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_cache_manager: KVCacheManager, max_model_len: int,
                 eos_token_id: int | None = None) -> None:
        super().__init__(max_num_seqs, max_num_batched_tokens, kv_cache_manager,
                         max_model_len, eos_token_id)
        self.padding: list[Sequence] = []  # finished members of the current batch

    @property
    def num_seats_used(self) -> int:
        return sum(seq.num_seats for seq in self.running) + len(self.padding)

    def schedule(self) -> SchedulerOutput:
        out = self._begin_step()
        if not self.running and not self.padding:
            self._form_batch(out)
        budget = self._advance(out, self.max_num_batched_tokens)
        kv = self.kv_cache_manager
        for seq in self.padding:
            if budget == 0 or seq.num_computed_tokens == 0:
                continue
            out.scheduled.append(ScheduledSequence(
                seq, 1, seq.num_computed_tokens - 1, samples=False, is_padding=True,
                block_ids=list(kv.get_block_ids(seq.seq_id))))
            budget -= 1
        return self._end_step(out)

    def _form_batch(self, out: SchedulerOutput) -> None:
        """Take waiting sequences, head first, while seats last and the pool can reserve
        blocks for their whole generation (the first one always joins)."""
        free_blocks = self.kv_cache_manager.num_free_blocks
        reserved = 0
        seats = 0
        while self.waiting:
            seq = self.waiting[0]
            final_len = min(seq.num_prompt_tokens + seq.sampling_params.max_tokens,
                            self.max_model_len)
            need = seq.num_seats * self._blocks_needed(final_len)
            if seats + seq.num_seats > self.max_num_seqs:
                break
            if self.running and reserved + need > free_blocks:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq.seq_id)
            seats += seq.num_seats
            reserved += need

    def _release(self, seq: Sequence) -> None:
        self.padding.append(seq)  # keeps its seat and its blocks until the batch ends

    def _on_running_left(self) -> None:
        if not self.running:  # the batch has ended
            for seq in self.padding:
                self._free(seq)
            self.padding.clear()


# ---- demo: python -m refserve.scheduler -------------------------------------------------

def stub_next_token(request_id: str, position: int) -> int:
    """A stand-in model: the token sampled at `position` is a fixed function of the request
    and the position, so every request's output is known before it runs."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % 1000 + 10


def run_stub(scheduler: _SchedulerBase, requests: list[tuple[str, int, int]],
             verbose: bool = True) -> dict[str, list[int]]:
    """Run (request_id, prompt_len, max_tokens) requests to completion with the stub model;
    returns each request's output tokens."""
    from refserve.sampling import SamplingParams

    for request_id, prompt_len, max_tokens in requests:
        prompt = [1 + (i * 7) % 50 for i in range(prompt_len)]
        scheduler.add_sequence(Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens)))
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        sampled = {row.seq.seq_id: [stub_next_token(row.seq.request_id, row.end)]
                   for row in out.scheduled if row.samples}
        retired = scheduler.update(out, sampled)
        if verbose:
            print(out)
            for seq in retired:
                print(f"  retired {seq.seq_id} ({seq.request_id}): {seq.status.value}, "
                      f"{seq.num_output_tokens} tokens, {seq.num_preemptions} preemptions")
            print()
        for seq in retired:
            outputs[seq.request_id] = seq.output_token_ids
    return outputs


def _demo() -> None:
    requests = [("A", 40, 6), ("B", 7, 12), ("C", 12, 3), ("D", 5, 9), ("E", 20, 4)]
    results = {}
    for cls in (Scheduler, StaticScheduler):
        print(f"=== {cls.__name__} ({cls.batching} batching): max_num_seqs=3, "
              f"max_num_batched_tokens=16, 12 blocks of 4 tokens ===\n")
        kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
        scheduler = cls(max_num_seqs=3, max_num_batched_tokens=16, kv_cache_manager=kv,
                        max_model_len=64)
        outputs = run_stub(scheduler, requests)
        results[cls.batching] = (outputs, scheduler)
    print("=== summary ===")
    for name, (_, s) in results.items():
        print(f"{name:>10}: {s.num_steps} steps, slot-steps used {s.slot_steps_used}, "
              f"wasted {s.slot_steps_wasted}, preemptions {s.num_preemptions}")
    same = results["continuous"][0] == results["static"][0]
    print(f"same outputs: {same}")


if __name__ == "__main__":
    _demo()
