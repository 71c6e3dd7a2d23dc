"""OpenAI's response shapes: whole responses, streamed chunks, usage, and logprobs.

    completions  choices[i] = {index, text, logprobs, finish_reason, stop_reason}
                 logprobs   = {tokens, token_logprobs, top_logprobs, text_offset}, one entry
                              per token (with echo the prompt's tokens come first, the very
                              first with logprob None: nothing predicts it)
    chat         choices[i] = {index, message: {role, content}, logprobs, finish_reason,
                              stop_reason}
                 logprobs   = {content: [{token, logprob, bytes, top_logprobs: [{token,
                              logprob, bytes}, ...]}, ...]}
    usage        {prompt_tokens, completion_tokens, total_tokens,
                  prompt_tokens_details: {cached_tokens}}   cached: prefix-cache hit tokens

The logprob numbers are the engine's (`CompletionOutput.logprobs`, refserve/logprobs.py):
per position a dict {token_id: Logprob} holding the chosen token first, then the top N.
Completions report that whole dict as top_logprobs, as vLLM does; chat reports the N most
likely only (OpenAI's meaning of top_logprobs). A logprob of -inf is sent as -9999.0 (JSON
has no infinity; vLLM's value).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from refserve.logprobs import Logprob

LOGPROB_FLOOR = -9999.0


@dataclass
class Choice:
    """One choice of a response, or one choice's delta in a streamed chunk."""
    index: int
    text: str | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: dict | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_body(kind: str, request_id: str, model: str, choices: list[Choice],
                  totals: dict) -> dict:
    if kind == "chat":
        rows = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                 "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason} for c in choices]
        obj = "chat.completion"
    else:
        rows = [{"index": c.index, "text": c.text, "logprobs": c.logprobs,
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                for c in choices]
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model,
            "choices": rows, "usage": totals}


def chunk_body(kind: str, request_id: str, model: str, created: int, choice: Choice,
               role: bool = False) -> dict:
    """One streamed delta of one choice (`role`: chat's opening chunk)."""
    row = {"index": choice.index}
    if kind == "chat":
        row["delta"] = {"role": "assistant", "content": ""} if role else (
            {} if choice.text is None else {"content": choice.text})
        obj = "chat.completion.chunk"
    else:
        row["text"] = choice.text or ""
        obj = "text_completion"
    row.update(logprobs=choice.logprobs, finish_reason=choice.finish_reason,
               stop_reason=choice.stop_reason)
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [row]}


def usage_chunk(kind: str, request_id: str, model: str, created: int, totals: dict) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the totals."""
    return {"id": request_id, "object": "chat.completion.chunk" if kind == "chat"
            else "text_completion", "created": created, "model": model, "choices": [],
            "usage": totals}


# ---- logprobs --------------------------------------------------------------------------

def _value(lp: Logprob) -> float:
    return max(lp.logprob, LOGPROB_FLOOR)


def _text(token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return f"token_id:{token_id}"


def _top(position: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The n most likely entries of one position's dict, most likely first. The dict holds
    the chosen token first, then the top n: n + 1 entries exactly when the chosen token is
    not among the top n."""
    entries = list(position.items())
    if len(entries) > n:
        entries = entries[1:]
    return sorted(entries, key=lambda e: (-e[1].logprob, e[0]))[:n]


def completion_logprobs(token_ids: list[int], positions: list[dict | None],
                        text_offset: int = 0) -> dict:
    """Legacy completions logprobs of `token_ids` (positions[i] belongs to token_ids[i];
    None for an unpredicted first prompt token). `text_offset`: where the first token's
    text starts in the choice's text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position else None
        text = _text(token_id, chosen)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if chosen is None else _value(chosen))
        out["top_logprobs"].append(None if position is None else {
            _text(t, lp): _value(lp) for t, lp in position.items()})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def _chat_entry(token_id: int, lp: Logprob) -> dict:
    text = _text(token_id, lp)
    return {"token": text, "logprob": _value(lp),
            "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(token_ids: list[int], positions: list[dict], top_n: int) -> dict:
    """Chat logprobs of `token_ids`: the chosen token's entry and its top_n alternatives."""
    content = []
    for token_id, position in zip(token_ids, positions):
        entry = _chat_entry(token_id, position[token_id])
        entry["top_logprobs"] = [_chat_entry(t, lp) for t, lp in _top(position, top_n)]
        content.append(entry)
    return {"content": content}
