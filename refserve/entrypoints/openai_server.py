"""The OpenAI-compatible HTTP API around one `AsyncEngine` (FastAPI).

    POST /v1/completions        prompt (string, token ids, or a list of either) → text
    POST /v1/chat/completions   messages → the chat template, applied here → text
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs
    GET  /metrics               Prometheus text (see prometheus.py)

A request's life: parse and check every field (400 naming the field), tokenize, check the
prompt against max_model_len (400), hand it to the engine loop (503 with Retry-After when the
waiting queue is full), then either wait for the final outputs or stream server-sent events
in OpenAI's chunk format, ending with `data: [DONE]`. Whatever way the handler is left
(finished, client gone, error), every engine request it added is finished or aborted:
aborting frees the request's KV blocks at the engine's next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from refserve.entrypoints.async_engine import AsyncEngine, QueueFull, RequestFailed
from refserve.entrypoints.detokenize import DeltaTracker
from refserve.entrypoints.protocol import (
    APIError,
    GenerationRequest,
    chunk_body,
    error_body,
    new_id,
    parse_chat_request,
    parse_completion_request,
    response_body,
    usage_chunk,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.25            # how often a non-streaming handler checks its client


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so the generator's `finally`
    (which aborts unfinished engine requests) runs as soon as the response ends, however
    it ends, instead of whenever the garbage collector gets to it."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def build_app(server: AsyncEngine, model_name: str) -> FastAPI:
    engine = server.engine
    app = FastAPI(title="refserve", summary="OpenAI-compatible API over refserve's engine")
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = (f"no route {request.method} {request.url.path}; see /v1/completions, "
                   "/v1/chat/completions, /v1/models, /health, /metrics"
                   if exc.status_code in (404, 405) else str(exc.detail))
        return JSONResponse(error_body(message, kind, None, exc.status_code),
                            status_code=exc.status_code)

    @app.get("/health")
    async def health():
        if not server.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()),
            "owned_by": "refserve", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, parse_completion_request(await _json(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, parse_chat_request(await _json(request)))

    # ---------------------------------------------------------------- one request
    def _prompt_token_ids(req: GenerationRequest) -> list[list[int]]:
        field = "messages" if req.kind == "chat" else "prompt"
        try:
            if req.kind == "chat":
                tok = engine.tokenizer
                if tok is None or not getattr(tok, "chat_template", None):
                    raise ValueError(f"the model {model_name} has no chat template; use "
                                     "/v1/completions")
                text = tok.apply_chat_template(req.messages, tokenize=False,
                                               add_generation_prompt=True)
                prompts = [engine.encode(text)]
            else:
                prompts = [engine.encode(p) if isinstance(p, str) else p for p in req.prompts]
        except ValueError as e:
            raise APIError(str(e), field) from e
        for ids in prompts:
            if len(ids) == 0:
                raise APIError("the prompt encodes to no tokens", field)
            if len(ids) > engine.max_model_len:
                raise APIError(f"This model's maximum context length is "
                               f"{engine.max_model_len} tokens; the prompt has {len(ids)} "
                               "tokens. Shorten it.", field)
        return prompts

    def _max_tokens(req: GenerationRequest, prompt_len: int) -> int:
        room = engine.max_model_len - prompt_len
        if req.max_tokens is None:
            if req.kind == "chat":
                return max(room, 1)
            return max(min(DEFAULT_COMPLETION_MAX_TOKENS, room), 1)
        if req.max_tokens > room:
            raise APIError(f"This model's maximum context length is {engine.max_model_len} "
                           f"tokens; the prompt has {prompt_len} and max_tokens asks for "
                           f"{req.max_tokens} more. Lower max_tokens to at most {room}.",
                           "max_tokens")
        return req.max_tokens

    async def _generate(request: Request, req: GenerationRequest):
        arrival = time.perf_counter()
        if req.model is not None and req.model != model_name:
            raise APIError(f"The model '{req.model}' does not exist; this server serves "
                           f"'{model_name}'", "model", status=404, code="model_not_found")
        prompts = _prompt_token_ids(req)
        params = [req.sampling_params(_max_tokens(req, len(ids))) for ids in prompts]
        response_id = new_id(req.kind)
        engine_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        sink: asyncio.Queue = asyncio.Queue()
        try:
            for rid, ids, sp in zip(engine_ids, prompts, params):
                await server.add(rid, ids, sp, sink, arrival_time=arrival)
        except BaseException as e:
            # All of them, the one in flight included: an abort queued after its add undoes
            # it, and aborting an id the engine never took is a no-op.
            for rid in engine_ids:
                server.abort(rid)
            if isinstance(e, QueueFull):
                raise APIError(str(e), None, status=503, type="service_unavailable_error",
                               headers={"Retry-After": "1"}) from e
            if isinstance(e, ValueError):
                raise APIError(str(e), "messages" if req.kind == "chat" else "prompt") from e
            if isinstance(e, Exception):
                raise APIError(f"the engine could not take the request: {e}", None,
                               status=500, type="server_error") from e
            raise
        n = params[0].n
        context = _Context(req, response_id, model_name, engine_ids, n,
                           sum(len(ids) for ids in prompts), params[0].stop)
        if req.stream:
            return _ClosingStreamingResponse(_stream(server, sink, context),
                                             media_type="text/event-stream")
        return await _collect(server, request, sink, context)

    return app


async def _json(request: Request) -> dict:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from e


class _Context:
    """What a response needs to know about the request it answers."""

    def __init__(self, req: GenerationRequest, response_id: str, model: str,
                 engine_ids: list[str], n: int, prompt_tokens: int, stop: list[str]) -> None:
        self.kind, self.response_id, self.model = req.kind, response_id, model
        self.include_usage = req.include_usage
        self.engine_ids = engine_ids
        self.prompt_index = {rid: i for i, rid in enumerate(engine_ids)}
        self.n, self.prompt_tokens, self.stop = n, prompt_tokens, stop

    def choice_index(self, request_id: str, completion_index: int) -> int:
        # Prompt p's completions are choices p*n .. p*n + n-1, as OpenAI numbers them.
        return self.prompt_index[request_id] * self.n + completion_index


async def _collect(server: AsyncEngine, request: Request, sink: asyncio.Queue,
                   ctx: _Context):
    finals = {}
    try:
        while len(finals) < len(ctx.engine_ids):
            try:
                item = await asyncio.wait_for(sink.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:  # (TimeoutError itself only from 3.11 on)
                if await request.is_disconnected():
                    return PlainTextResponse("", status_code=499)  # nobody reads it
                continue
            if isinstance(item, RequestFailed):
                return JSONResponse(error_body(item.message, "server_error"), status_code=500)
            if item.finished:
                finals[item.request_id] = item
    finally:
        for rid in ctx.engine_ids:
            if rid not in finals:
                server.abort(rid)
    choices, completion_tokens = [], 0
    for rid in ctx.engine_ids:
        for c in finals[rid].outputs:
            choices.append((ctx.choice_index(rid, c.index), c.text, c.finish_reason))
            completion_tokens += len(c.token_ids)
    return response_body(ctx.kind, ctx.response_id, ctx.model, choices, ctx.prompt_tokens,
                         completion_tokens)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(server: AsyncEngine, sink: asyncio.Queue, ctx: _Context):
    created = int(time.time())
    trackers: dict[int, DeltaTracker] = {}
    done_choices: set[int] = set()
    done_requests: set[str] = set()
    completion_tokens = 0
    try:
        if ctx.kind == "chat":  # OpenAI opens each chat choice with its role
            for i in range(len(ctx.engine_ids) * ctx.n):
                yield _sse(chunk_body("chat", ctx.response_id, ctx.model, created, i, None,
                                      None, role=True))
        while len(done_requests) < len(ctx.engine_ids):
            item = await sink.get()
            if isinstance(item, RequestFailed):
                yield _sse(error_body(item.message, "server_error", None, 500))
                return
            for c in item.outputs:
                index = ctx.choice_index(item.request_id, c.index)
                if index in done_choices:
                    continue
                finished = c.finish_reason is not None
                tracker = trackers.setdefault(index, DeltaTracker(ctx.stop))
                delta = tracker.delta(c.text, finished)
                if delta or finished:
                    yield _sse(chunk_body(ctx.kind, ctx.response_id, ctx.model, created, index,
                                          delta or None, c.finish_reason if finished else None))
                if finished:
                    done_choices.add(index)
                    completion_tokens += len(c.token_ids)
            if item.finished:
                done_requests.add(item.request_id)
        if ctx.include_usage:
            yield _sse(usage_chunk(ctx.kind, ctx.response_id, ctx.model, created,
                                   ctx.prompt_tokens, completion_tokens))
        yield "data: [DONE]\n\n"
    finally:
        for rid in ctx.engine_ids:
            if rid not in done_requests:
                server.abort(rid)
