"""What one scheduler step decides (`SchedulerOutput`), row by row (`ScheduledSequence`), what
the engine hands back once the model ran (`SampledTokens`), and what `update` made of it
(`StepUpdate`).

A row is "q query tokens over a paged context": `seq` computes the tokens at positions
[start, start + num_scheduled_tokens) of `seq.token_ids + row.draft_token_ids`. Its last
`num_logits` rows need logits:

    num_logits = 0      a prefill chunk that does not reach the end of the prompt, or a
                        static-batching padding row (`SchedulerOutput.padding`)
    num_logits = 1      the row reaches the last token: one token is sampled from it
    num_logits = k + 1  a speculative verify: the last real token plus k draft tokens; the
                        target's k + 1 distributions decide how many drafts are accepted

Printing a `SchedulerOutput` shows the step as a table (the notebooks do exactly that).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from refserve.kv_cache.kv_cache_manager import BlockCounts

if TYPE_CHECKING:
    import numpy as np

    from refserve.sequence import Sequence


class RowPlan(NamedTuple):
    """A sequence's next row as `Scheduler._plan_row` plans it, before its slots are
    allocated (the `ScheduledSequence` it becomes is below)."""

    start: int                    # first position computed (prefix-cache hits skipped)
    num_scheduled_tokens: int     # query tokens, drafts included
    computed_blocks: list[int]    # prefix-cache hit blocks to attach (first allocation)
    num_hit_tokens: int           # the tokens those blocks cover (get_computed_blocks)
    drafts: tuple[int, ...]       # the drafts the row verifies after its real tokens

    @property
    def end(self) -> int:
        return self.start + self.num_scheduled_tokens


@dataclass
class ScheduledSequence:
    """One row of a step: `seq` computes query tokens [start, start + num_scheduled_tokens).
(`num_scheduled_tokens` is this step's count for the row; `seq.num_tokens` is the
sequence's total.)

    num_logits  how many of the row's last query tokens need logits (see the module
                docstring); 0 for a prefill chunk or padding.
    block_ids   the sequence's block table for this step (a copy: what the runner sends to
                the attention kernel, and what the printout shows).
    draft_token_ids   a speculative verify row's drafts, computed after the last real token
                (scheduler/drafts.py); () for every other row.

    Invariant (the scheduler builds every row in one place, `Scheduler._add_row`):
    num_scheduled_tokens >= 1, 0 <= num_logits <= num_scheduled_tokens, and a row with
    drafts verifies all of them: num_logits == len(draft_token_ids) + 1.
    """

    seq: Sequence
    start: int
    num_scheduled_tokens: int
    num_logits: int
    block_ids: list[int] = field(default_factory=list)
    draft_token_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_scheduled_tokens

    @property
    def kind(self) -> str:
        """chunk (a prefill piece that samples nothing) | decode | verify | prefill."""
        if not self.num_logits:
            return "chunk"
        if self.num_logits > 1:
            return "verify"
        if self.num_scheduled_tokens == 1 and self.start >= self.seq.num_prompt_tokens:
            return "decode"
        return "prefill"


@dataclass
class SchedulerOutput:
    """What one step computes, plus what changed to get there.

    scheduled              the rows computed for real
    padding                static batching only: finished sequences that still hold their
                           seat, recomputed at position start (= num_computed_tokens - 1)
                           with their K/V written nowhere; nothing is sampled (static.py)
    admitted / preempted   sequence ids that joined / left the running batch in this step
    block_copies           copy-on-write (src, dst) block pairs to copy before the forward
    swap_out / swap_in     swap preemption's (device, host) / (host, device) block copies,
                           run before block_copies (scheduler/swapping.py)
    num_batched_tokens     sum of num_scheduled_tokens over `scheduled` and `padding`
                           (<= max_num_batched_tokens)
    The remaining fields are the seats and limits, and the pool after scheduling (`blocks`),
    for printing.
    """

    step: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    padding: list[ScheduledSequence] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_batched_tokens: int = 0
    max_num_batched_tokens: int = 0
    num_seats_used: int = 0
    max_num_seqs: int = 0
    blocks: BlockCounts = BlockCounts(held=0, evictable=0, free=0, total=0)

    @property
    def num_logits(self) -> int:
        """Logits rows the forward returns: the sum of num_logits over the rows."""
        return sum(row.num_logits for row in self.scheduled)

    def __str__(self) -> str:
        head = f"step {self.step}: {len(self.scheduled)} scheduled"
        if self.admitted:
            head += f" | admitted {self.admitted}"
        if self.preempted:
            head += f" | preempted {self.preempted}"
        if self.block_copies:
            copies = ", ".join(f"{src}->{dst}" for src, dst in self.block_copies)
            head += f" | copy-on-write {copies}"
        if self.swap_out:
            head += f" | swap out {len(self.swap_out)} blocks"
        if self.swap_in:
            head += f" | swap in {len(self.swap_in)} blocks"
        lines = [head, "   seq  request       kind     tokens  positions      logits  blocks"]
        rows = [(row, row.kind) for row in self.scheduled]
        for row, kind in rows + [(row, "padding") for row in self.padding]:
            positions = f"[{row.start}, {row.end})"
            drafts = f"  drafts {list(row.draft_token_ids)}" if row.draft_token_ids else ""
            lines.append(f"  {row.seq.seq_id:>4}  {row.seq.request_id:<12.12}  {kind:<7}"
                         f"  {row.num_scheduled_tokens:>6}  {positions:<13}  {row.num_logits:>6}  "
                         f"{_short(row.block_ids)}{drafts}")
        lines.append(f"  budget {self.num_batched_tokens}/{self.max_num_batched_tokens} tokens"
                     f" | seats {self.num_seats_used}/{self.max_num_seqs}"
                     f" | blocks held {self.blocks.held}, cached {self.blocks.evictable}"
                     f", free {self.blocks.free} of {self.blocks.total}")
        return "\n".join(lines)


def _short(block_ids: list[int], keep: int = 8) -> str:
    if len(block_ids) <= keep:
        return str(block_ids)
    return f"[{', '.join(map(str, block_ids[:keep - 2]))}, ..., {block_ids[-1]}]" \
           f" ({len(block_ids)} blocks)"


@dataclass(frozen=True)
class ChildDraw:
    """The first token of child i (1..n-1) of a parallel-sampling request, drawn from its
    parent's logits row with the child's own generator (now advanced by that draw, the
    child's from then on), and that token's logprobs when the request asks for them."""

    token_id: int
    generator: np.random.Generator
    logprobs: dict | None = None


@dataclass
class SampledTokens:
    """What the engine's sampling stage hands to `Scheduler.update`.

    token_ids   seq_id -> the tokens to append (1 per sampling row; 1..k+1 after a
                speculative verify: the accepted drafts, then a recovered or bonus token).
                Never empty.
    logprobs    seq_id -> the sampled token's logprobs (refserve/logprobs.py); None, or
                no entry, when its request did not ask for them.
    children    parent seq_id -> the `ChildDraw` of each child 1..n-1 of a parallel-sampling
                request that sampled its first token this step. `update` forks the children
                (sharing the parent's blocks) only when it applies the step, so a step that
                fails before `update` leaves no child behind.
    """

    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, dict | None] = field(default_factory=dict)
    children: dict[int, list[ChildDraw]] = field(default_factory=dict)


@dataclass
class StepUpdate:
    """What `Scheduler.update` decided for one step: the only record of it the engine reads.

    appended  seq_id -> the tokens actually appended, after the stop rules: a prefix of the
              sampled tokens (shorter when a stop came inside a verify row's run)
    verified  seq_id of a verify row -> (drafts proposed, drafts accepted), as the metrics
              count them (scheduler/drafts.py: count_verified)
    forked    children created for parallel sampling (n > 1), in creation order
    retired   sequences that finished in this step (status set, seat given back)
    """

    appended: dict[int, list[int]] = field(default_factory=dict)
    verified: dict[int, tuple[int, int]] = field(default_factory=dict)
    forked: list[Sequence] = field(default_factory=list)
    retired: list[Sequence] = field(default_factory=list)
