"""Engine outputs → OpenAI responses: one whole body (`collect`) or server-sent events
(`stream`), for one HTTP request's engine requests (one per prompt, n choices each).

Choice numbering: prompt p's completions are choices p*n .. p*n + n-1, as OpenAI numbers them.

Whatever way a handler is left (finished, client gone, error, shutdown), every engine request
it added is finished or aborted: the `finally` blocks abort what has not finished, and
aborting frees a request's KV blocks at the engine's next step boundary.

Streams: text goes out as deltas (detokenize.py holds back what a stop string may still cut);
a token's logprobs go out with the first chunk sent after the token arrived, so the chunks'
logprobs concatenate to the whole response's. A stream always ends with `data: [DONE]`, an
error (a failed step, the server shutting down) as an `{"error": ...}` event just before it.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from refserve.entrypoints.async_engine import AsyncEngine, RequestFailed
from refserve.entrypoints.detokenize import DeltaTracker
from refserve.entrypoints.protocol import GenerationRequest, error_body
from refserve.entrypoints.responses import (
    Choice,
    chat_logprobs,
    chunk_body,
    completion_logprobs,
    response_body,
    usage,
    usage_chunk,
)

CLIENT_GONE = object()   # put on a sink when the client of a non-streaming request left


class Context:
    """What a response needs to know about the request it answers."""

    def __init__(self, req: GenerationRequest, response_id: str, model: str,
                 engine_ids: list[str], prompts: list[list[int]], prompt_texts: list[str],
                 n: int, stop: list[str]) -> None:
        self.req, self.kind, self.response_id, self.model = req, req.kind, response_id, model
        self.engine_ids, self.prompts, self.prompt_texts = engine_ids, prompts, prompt_texts
        self.prompt_index = {rid: i for i, rid in enumerate(engine_ids)}
        self.n, self.stop = n, stop
        self.prompt_tokens = sum(len(ids) for ids in prompts)

    def choice_index(self, request_id: str, completion_index: int) -> int:
        return self.prompt_index[request_id] * self.n + completion_index

    def logprobs(self, request_id: str, token_ids: list[int], positions, text_offset: int
                 ) -> dict | None:
        """OpenAI's logprobs of `token_ids` (None unless the request asked)."""
        if self.req.logprobs is None or positions is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(token_ids, positions, self.req.logprobs)
        return completion_logprobs(token_ids, positions, text_offset)

    def echo(self, out) -> tuple[str, dict | None]:
        """The prompt's text and (when asked) its logprobs, for `echo`."""
        p = self.prompt_index[out.request_id]
        return self.prompt_texts[p], self.logprobs(out.request_id, self.prompts[p],
                                                    out.prompt_logprobs, 0)

    def usage(self, completion_tokens: int, cached_tokens: int) -> dict:
        return usage(self.prompt_tokens, completion_tokens, cached_tokens)


def failure(item: RequestFailed) -> tuple[dict, int]:
    kind = "service_unavailable_error" if item.status == 503 else "server_error"
    return error_body(item.message, kind, None, item.status), item.status


async def _watch(request: Request, sink: asyncio.Queue) -> None:
    """Put CLIENT_GONE on `sink` once the client disconnects. The body has been read, so
    the next ASGI message can only be the disconnect (uvicorn also sends it once the
    response is complete; by then nobody reads the sink)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    sink.put_nowait(CLIENT_GONE)


async def collect(server: AsyncEngine, request: Request, sink: asyncio.Queue, ctx: Context):
    finals = {}
    watcher = asyncio.ensure_future(_watch(request, sink))
    try:
        while len(finals) < len(ctx.engine_ids):
            item = await sink.get()
            if item is CLIENT_GONE:
                return PlainTextResponse("", status_code=499)  # nobody reads it
            if isinstance(item, RequestFailed):
                body, status = failure(item)
                return JSONResponse(body, status_code=status)
            if item.finished:
                finals[item.request_id] = item
    finally:
        watcher.cancel()
        server.abort([rid for rid in ctx.engine_ids if rid not in finals])
    choices, completion_tokens = [], 0
    for rid in ctx.engine_ids:
        out = finals[rid]
        for c in out.outputs:
            text, offset, logprobs = c.text, 0, None
            if ctx.req.echo:
                prompt_text, prompt_lp = ctx.echo(out)
                text, offset = prompt_text + c.text, len(prompt_text)
            logprobs = ctx.logprobs(rid, c.token_ids, c.logprobs, offset)
            if ctx.req.echo and logprobs is not None:
                logprobs = {k: prompt_lp[k] + logprobs[k] for k in logprobs}
            choices.append(Choice(ctx.choice_index(rid, c.index), text, c.finish_reason,
                                  c.stop_reason, logprobs))
            completion_tokens += len(c.token_ids)
    cached = sum(finals[rid].num_cached_tokens for rid in ctx.engine_ids)
    return response_body(ctx.kind, ctx.response_id, ctx.model, choices,
                         ctx.usage(completion_tokens, cached))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _ChoiceStream:
    """One choice's progress in a stream: text sent, logprobs sent, tokens so far."""

    def __init__(self, stop: list[str]) -> None:
        self.tracker = DeltaTracker(stop)
        self.logprobs_sent = 0   # tokens whose logprobs went out
        self.offset = 0          # completions' text_offset of the next token
        self.num_tokens = 0
        self.done = False


async def stream(server: AsyncEngine, sink: asyncio.Queue, ctx: Context):
    created = int(time.time())
    choices: dict[int, _ChoiceStream] = {}
    done_requests: set[str] = set()
    cached = 0

    def chunk(choice: Choice, role: bool = False) -> str:
        body = chunk_body(ctx.kind, ctx.response_id, ctx.model, created, choice, role)
        if ctx.req.continuous_usage:
            body["usage"] = ctx.usage(sum(s.num_tokens for s in choices.values()), cached)
        return _sse(body)

    try:
        if ctx.kind == "chat":  # OpenAI opens each chat choice with its role
            for i in range(len(ctx.engine_ids) * ctx.n):
                yield chunk(Choice(i, None), role=True)
        while len(done_requests) < len(ctx.engine_ids):
            item = await sink.get()
            if isinstance(item, RequestFailed):
                yield _sse(failure(item)[0])
                break
            for c in item.outputs:
                index = ctx.choice_index(item.request_id, c.index)
                state = choices.get(index)
                if state is None:
                    state = choices[index] = _ChoiceStream(ctx.stop)
                    if ctx.req.echo:
                        text, logprobs = ctx.echo(item)
                        state.offset = len(text)
                        yield chunk(Choice(index, text, logprobs=logprobs))
                if state.done:
                    continue
                state.num_tokens = len(c.token_ids)
                finished = c.finish_reason is not None
                delta = state.tracker.delta(c.text, finished)
                if not (delta or finished):
                    continue   # its logprobs wait for the chunk that carries text
                new_ids = c.token_ids[state.logprobs_sent:]
                logprobs = ctx.logprobs(item.request_id, new_ids,
                                        c.logprobs[state.logprobs_sent:]
                                        if c.logprobs is not None else None, state.offset)
                if logprobs is not None and ctx.kind != "chat":
                    state.offset += sum(len(t) for t in logprobs["tokens"])
                state.logprobs_sent = len(c.token_ids)
                if finished:
                    state.done = True
                yield chunk(Choice(index, delta or None, c.finish_reason,
                                   c.stop_reason if finished else None, logprobs))
            if item.finished:
                done_requests.add(item.request_id)
                cached += item.num_cached_tokens
        else:
            if ctx.req.include_usage:
                yield _sse(usage_chunk(ctx.kind, ctx.response_id, ctx.model, created,
                                       ctx.usage(sum(s.num_tokens for s in choices.values()),
                                                 cached)))
        yield "data: [DONE]\n\n"
    finally:
        server.abort([rid for rid in ctx.engine_ids if rid not in done_requests])
