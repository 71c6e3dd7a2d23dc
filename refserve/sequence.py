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
    stop_reason, output_text_end   what the stop rules decided (below)

Invariant: 0 <= num_computed_tokens <= num_tokens, and num_computed_tokens == num_tokens only
between the step that computed the last token and the append of the token it sampled (or
after the sequence finished).

This module holds the three things a sequence is made of: its state (`Sequence`), its text
(`IncrementalDetokenizer`) and when it stops (`append_tokens`, the stop rules, applied by
`Scheduler.update` as it appends).

THE TEXT: incremental detokenization turns a growing list of output token ids into text in
O(new tokens) per step, instead of decoding the whole output again every step (O(L²) per
request).

A token is not always a whole character: byte-level BPE splits an emoji or a CJK character
across several tokens, and a lone piece decodes to the replacement character U+FFFD. And
some tokenizers decide a token's leading space from its left neighbour. So each step decodes
a short window that starts a few tokens back (`prefix_offset`):

    prefix = decode(ids[prefix_offset:read_offset])   text already emitted for this window
    full   = decode(ids[prefix_offset:])              the same window plus the new tokens
    if full is longer and does not end in U+FFFD:  emit full[len(prefix):], slide the window

Tokens whose text is still incomplete stay unread until a later token completes them.

vLLM's three text options (SamplingParams):
  skip_special_tokens (True)   special tokens (EOS, chat markers) decode to nothing; False:
                               to their text ("<|im_end|>")
  spaces_between_special_tokens (True)  with skip_special_tokens=False, whether two ADJACENT
                               special (added) tokens may be separated the way the
                               tokenizer's own decode separates them (some decoders, e.g.
                               WordPiece, put a space between any two tokens). False: the
                               second one's text follows the first with no space (vLLM's
                               fast-tokenizer rule). A byte-level BPE tokenizer (SmolLM2's)
                               puts no space there, so both give the same text for it.
  detokenize (True)            False: the engine gives the sequence no detokenizer at all.
Special tokens never count toward "there is new text": a window that adds only skipped
special tokens emits nothing.

THE STOP RULES, decided once, token by token, as `Scheduler.update` appends sampled tokens.

A step appends 1 token per sampling row, or up to k + 1 after a speculative verify. Every
token is appended and checked on its own, in order, so a verify step that emits five tokens
stops exactly where five plain steps would have: at the token that completes a stop string,
or that is EOS / a stop token id, or that reaches a length limit. The tokens after it are
never appended (their K/V slots are rolled back like rejected drafts, scheduler/drafts.py).

For output token number i (1-based), checked right after it is appended:

    FINISHED_LENGTH   i >= max_tokens (None: no limit but max_model_len), or the sequence
                      reached max_model_len tokens                       always checked
    FINISHED_STOPPED  the token is EOS (unless ignore_eos) or in stop_token_ids, or the text
                      now ends a stop string                       only when i > min_tokens

vLLM's order: a stop (id or string) found on the token that also reaches a length limit wins
and the finish reason is "stop"; nothing stops before min_tokens tokens exist (vLLM checks
none of the stop conditions until then; the min_tokens logits processor keeps EOS and stop
ids from being sampled, and the text of the first min_tokens tokens can only be the start of
a stop string, never its end).

Stop strings need the text each token adds: `seq.detokenizer` (the incremental detokenizer) is
brought up to date after every token, so its text grows token by token. A match must end in
the text this token added (earlier text was checked before). If the token completes several
stop strings, the match that starts EARLIEST in the text wins (the first one a reader sees;
not the first in the list), and the text is cut before it (after it with
include_stop_str_in_output). A stop token id's own text is left out of the output the same
way. What was decided is recorded on the sequence:

    seq.stop_reason      the stop string, or the stop token id (None: EOS or a length limit)
    seq.output_text_end  where the visible text ends (None: the whole decoded text)

A sequence without a detokenizer (no tokenizer, or detokenize=False) has no text, so its
stop strings are never checked.
"""

from __future__ import annotations

import enum
import functools

import numpy as np

from refserve.sampling_params import SamplingParams

# How many already-emitted tokens the window keeps on its left: enough context for the
# tokenizer to place spaces the way a full decode would.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The text of one sequence's output tokens, grown a few tokens at a time.

    Invariant: `text` == decode(ids[:read_offset]) for the tokenizers refserve loads
    (tested against a full decode), and `update` only ever appends to it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Added-token ids (chat markers, EOS...), read only for the no-spaces rule; without
        # that rule `decode` is the tokenizer's own.
        self._added: frozenset[int] = frozenset()
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added = frozenset(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        if not self._added and tokenizer is not None:
            self.decode = functools.partial(tokenizer.decode,
                                            skip_special_tokens=skip_special_tokens)
        self.text = ""
        self.prefix_offset = 0  # first token of the decode window
        self.read_offset = 0  # tokens before this one are in `text`

    def copy(self) -> IncrementalDetokenizer:
        """An independent detokenizer in the same state (a forked child's text)."""
        other = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens,
                                       self.spaces_between_special_tokens)
        other.text, other.prefix_offset, other.read_offset = (
            self.text, self.prefix_offset, self.read_offset)
        return other

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` under the no-spaces rule (without it, `__init__` makes
        `decode` the tokenizer's own): the ids are cut between every two adjacent added
        tokens, each piece decoded alone and the pieces joined with nothing, so no separator
        can appear between those two."""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        pieces, start = [], 0
        for i in range(1, len(token_ids)):
            if token_ids[i] in self._added and token_ids[i - 1] in self._added:
                pieces.append(decode(token_ids[start:i], skip_special_tokens=skip))
                start = i
        pieces.append(decode(token_ids[start:], skip_special_tokens=skip))
        return "".join(pieces)

    def update(self, token_ids: list[int]) -> str:
        """Bring `text` up to date with `token_ids` (the whole output so far, of which only
        the tail after `read_offset` is new); returns the newly emitted text."""
        if self.tokenizer is None or len(token_ids) <= self.read_offset:
            return ""
        prefix = self.decode(token_ids[self.prefix_offset:self.read_offset])
        full = self.decode(token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character (or only special tokens): wait
        delta = full[len(prefix):]
        self.text += delta
        self.read_offset = len(token_ids)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        return delta


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)

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


def append_tokens(seq: Sequence, token_ids: list[int], eos_token_id: int | None,
                  max_model_len: int, logprobs: dict | None = None) -> SequenceStatus | None:
    """Append `token_ids` one at a time, applying the stop rules after each; stop at the
    first token that finishes the sequence. Returns the finish status (None: it runs on).
    `logprobs`: the sampled token's (a row asking for logprobs samples one token)."""
    if logprobs is not None:
        seq.output_logprobs.append(logprobs)
    params = seq.sampling_params
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
    detok = seq.detokenizer
    for token_id in token_ids:
        text_before = len(detok.text) if detok is not None else 0
        seq.append_token(token_id)
        if detok is not None:
            detok.update(seq.output_token_ids)
        if seq.num_output_tokens > params.min_tokens:
            # BEGIN EXERCISE stop_rules: stop ids and EOS, then stop strings in the new text
            # ... a stop returns FINISHED_STOPPED with seq.stop_reason and output_text_end set
            if token_id in params.stop_token_ids or (
                    token_id == eos_token_id and not params.ignore_eos):
                if token_id != eos_token_id or params.ignore_eos:
                    seq.stop_reason = token_id
                if detok is not None and not params.include_stop_str_in_output:
                    seq.output_text_end = text_before
                return SequenceStatus.FINISHED_STOPPED
            if params.stop and detok is not None:
                match = find_stop_string(detok.text, text_before, params.stop)
                if match is not None:
                    at, stop = match
                    seq.stop_reason = stop
                    seq.output_text_end = (at + len(stop) if params.include_stop_str_in_output
                                           else at)
                    return SequenceStatus.FINISHED_STOPPED
            # END EXERCISE
        if seq.num_output_tokens >= max_tokens or seq.num_tokens >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH
    return None


def find_stop_string(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest-starting stop string that ends at or after text[new_from] (i.e. in the
    text the last token added), as (start index, string); None if there is none.

    A string of length L ending in the new text starts at or after new_from - L + 1, so
    each search starts there: the whole history is never searched again."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, new_from - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best
