"""A sequence: one stream of tokens the engine is generating.

A request with `SamplingParams(n=4)` becomes one sequence that is prefilled once and then
forked into four (copy-on-write shares the prompt's blocks). Everything the scheduler and the
KV-cache manager need to know about a sequence lives here:

    token_ids            prompt + output so far: ACCEPTED tokens only (the history prefix
                         caching hashes, the stop rules read and an n-gram proposer
                         searches). Draft tokens never live here: they travel through one
                         step as values (refserve/scheduler/drafts.py).
    num_computed_tokens  how many of token_ids have their K/V in the cache. A step computes
                         tokens [num_computed_tokens, num_computed_tokens + n); when that
                         reaches num_tokens the last logits sample the next token.
    detokenizer          the output's text, grown token by token as tokens are appended
                         (None without a tokenizer); the stop rules read it
    generator            its own random stream (seed + child index; the engine's sampling
                         stage draws from it), and output_logprobs, one dict per output
                         token when the request asks for logprobs
    stop_reason, output_text_end   what the stop rules decided (scheduler/stop_rules.py)

Invariant: 0 <= num_computed_tokens <= num_tokens, and num_computed_tokens == num_tokens only
between the step that computed the last token and the append of the token it sampled (or
after the sequence finished).
"""

from __future__ import annotations

import enum

import numpy as np

from refserve.detokenizer import IncrementalDetokenizer
from refserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, arrival_time: float = 0.0,
                 seq_id: int | None = None) -> None:
        # None until the scheduler queues it: ids are per scheduler (per engine), so
        # re-running a notebook cell gives the same ids.
        self.seq_id: int | None = seq_id
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # vLLM's num_cached_tokens: prompt tokens found in the prefix cache when the sequence
        # was FIRST scheduled (None until then). A later readmission after preemption may
        # hit more of its own blocks; that saves recomputation but does not change this.
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        # vLLM's request priority (scheduling_policy="priority"): lower runs first.
        self.priority = 0
        self.detokenizer: IncrementalDetokenizer | None = None
        # The request's bad_words as token sequences (logits_processors.py), set by the engine.
        self.bad_words_token_ids: list[list[int]] = []
        self.stop_reason: int | str | None = None  # the stop string or stop token id
        self.output_text_end: int | None = None  # the visible text ends here (a stop)
        # Parallel sampling (n > 1): the index of this child, and whether this sequence is
        # a parent that still has to fork its n - 1 children (when it samples its first
        # token). Until then it reserves n seats in the running batch.
        self.child_index = 0
        self.awaiting_fork = sampling_params.n > 1
        self.generator: np.random.Generator | None = None
        self.output_logprobs: list[dict] = []
        # Times filled in by the engine (seconds, time.perf_counter clock).
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_seats(self) -> int:
        """Batch seats this sequence holds: n for a parent that will fork, else 1."""
        return self.sampling_params.n if self.awaiting_fork else 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def fork(self, seq_id: int | None = None, child_index: int = 0,
             generator: np.random.Generator | None = None) -> Sequence:
        """Child `child_index` of a parallel-sampling request: the same tokens and computed
        state, its own generator (its blocks are shared by the KV-cache manager's `fork`,
        not here)."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.sampling_params,
                         self.arrival_time, seq_id)
        child.child_index = child_index
        child.generator = generator
        child.output_logprobs = list(self.output_logprobs)
        child.output_token_ids = list(self.output_token_ids)
        child.token_ids = list(self.token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.priority = self.priority
        child.detokenizer = None if self.detokenizer is None else self.detokenizer.copy()
        child.bad_words_token_ids = self.bad_words_token_ids
        child.awaiting_fork = False
        child.first_token_time = self.first_token_time
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, "
                f"status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
