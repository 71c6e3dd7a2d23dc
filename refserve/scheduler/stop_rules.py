"""The stop rules: decided once, token by token, as `Scheduler.update` appends sampled tokens.

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

Stop strings need the text each token adds: `seq.detokenizer` (refserve/detokenizer.py) is
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

from refserve.sequence import Sequence, SequenceStatus


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
