"""The OpenAI-compatible HTTP API around one `AsyncEngine` (FastAPI).

    POST /v1/completions        prompt (string, token ids, or a list of either) → text
    POST /v1/chat/completions   messages → the chat template, applied here → text
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs (503 once it stopped or drains)
    GET  /metrics               Prometheus text (see prometheus.py)

A request's life, cheapest checks first, so that no request can stall the others:

    guards.py      Host, API key, body size (413) and body time (408), before FastAPI
    _json          Content-Type must be application/json (415); the body must be JSON that
                   Python can hold (400: not JSON, nested too deeply, a 5000-digit number)
    protocol.py    every field checked (400 naming the field)
    _check_limits  n <= max_num_seqs, prompts per request, and text that cannot fit
                   max_model_len refused BEFORE tokenizing (a token covers at most
                   `max_chars_per_token` characters, so longer text has too many tokens)
    tokenize       in a worker thread: a long prompt or chat template never blocks the
                   event loop (/health, other requests, streams)
    add_many       all of the request's prompts in one engine turn (503 + Retry-After when
                   the waiting queue is full or the server drains)
    respond        openai_outputs.py: one body, or server-sent events ending `data: [DONE]`

Any exception nobody expected still leaves as a 500 in OpenAI's error shape, never as
plain text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from refserve.entrypoints.async_engine import AsyncEngine, QueueFull
from refserve.entrypoints.guards import Guard
from refserve.entrypoints.openai_outputs import Context, collect, stream
from refserve.entrypoints.options import ServerOptions
from refserve.entrypoints.protocol import (
    APIError,
    GenerationRequest,
    error_body,
    new_id,
    parse_chat_request,
    parse_completion_request,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROUTES = "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics"
log = logging.getLogger("uvicorn.error")


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so the generator's `finally`
    (which aborts unfinished engine requests) runs as soon as the response ends, however
    it ends, instead of whenever the garbage collector gets to it."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: its vocabulary string's length (a
    byte-level BPE token string has one character per byte, and a text character is at
    least one byte; SentencePiece's byte tokens are longer than the byte they stand for),
    plus one for a space a tokenizer may add or drop."""
    return max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))) + 1


def build_app(server: AsyncEngine, model_name: str,
              options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    engine = server.engine
    docs = {} if options.docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="refserve", summary="OpenAI-compatible API over refserve's engine",
                  **docs)
    app.add_middleware(Guard, options=options)
    app.state.server = server
    # One worker: tokenizing is CPU work that would otherwise run on the event loop; a
    # queue of one keeps the tokenizer to one caller at a time (the engine thread only
    # decodes).
    tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refserve-tokenize")
    char_limit = (engine.max_model_len * max_chars_per_token(engine.tokenizer)
                  if engine.tokenizer is not None else None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = (f"no route {request.method} {request.url.path}; see {ROUTES}"
                   if exc.status_code in (404, 405) else str(exc.detail))
        return JSONResponse(error_body(message, kind, None, exc.status_code),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # A bug, not the client's doing: uvicorn still logs the traceback after this.
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}: "
                                       f"{exc}", "server_error", None, 500), status_code=500)

    @app.get("/health")
    async def health():
        if not server.alive or server.draining:
            state = "draining" if server.alive else "engine loop stopped"
            return JSONResponse({"status": state}, status_code=503)
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
        body = await _json(request)
        return await _generate(request, parse_completion_request(body, options.max_logprobs))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        return await _generate(request, parse_chat_request(body, options.max_logprobs))

    # ---------------------------------------------------------------- one request
    def _check_limits(req: GenerationRequest) -> None:
        """Refuse what cannot be served before paying for it (tokenizing, the engine)."""
        n = req.sampling["n"]
        if n > engine.config.max_num_seqs:
            raise APIError(f"'n' is {n}, more than this server's max_num_seqs="
                           f"{engine.config.max_num_seqs} batch seats", "n")
        if len(req.prompts) > options.max_prompts_per_request:
            raise APIError(f"'prompt' holds {len(req.prompts)} prompts, more than this "
                           f"server's limit of {options.max_prompts_per_request} per request "
                           "(--max-prompts-per-request); split it", "prompt")
        field = "messages" if req.kind == "chat" else "prompt"
        if req.sampling.get("truncate_prompt_tokens") is not None:
            return      # any length may be cut to its last k tokens
        texts = ([sum(len(m["content"]) for m in req.messages)] if req.kind == "chat" else
                 [len(p) for p in req.prompts if isinstance(p, str)])
        for chars in texts:
            if char_limit is not None and chars > char_limit:
                raise APIError(f"This model's maximum context length is "
                               f"{engine.max_model_len} tokens; the {field} has {chars} "
                               f"characters, more than {engine.max_model_len} tokens can "
                               "hold. Shorten it.", field)

    def _prompt_token_ids(req: GenerationRequest) -> tuple[list[list[int]], list[str]]:
        """Token ids (and, for echo, the text) of each prompt. Runs in the worker thread."""
        field = "messages" if req.kind == "chat" else "prompt"
        try:
            if req.kind == "chat":
                tok = engine.tokenizer
                if tok is None or not getattr(tok, "chat_template", None):
                    raise ValueError(f"the model {model_name} has no chat template; use "
                                     "/v1/completions")
                text = tok.apply_chat_template(req.messages, tokenize=False,
                                               add_generation_prompt=True)
                prompts, texts = [engine.encode(text)], [text]
            else:
                prompts = [engine.encode(p) if isinstance(p, str) else p for p in req.prompts]
                texts = [p if isinstance(p, str) else _decode(p) for p in req.prompts] \
                    if req.echo else [""] * len(prompts)
        except ValueError as e:
            raise APIError(str(e), field) from e
        keep = req.sampling.get("truncate_prompt_tokens")
        if keep is not None:      # vLLM's: before the length checks, so a long prompt fits
            if keep != -1 and keep < 1:
                raise APIError(f"'truncate_prompt_tokens' must be an integer >= 1, or -1 (the "
                               f"last max_model_len tokens), got {keep}",
                               "truncate_prompt_tokens")
            keep = engine.max_model_len if keep == -1 else keep
            prompts = [ids[-keep:] for ids in prompts]
        for ids in prompts:
            if len(ids) == 0:
                raise APIError("the prompt encodes to no tokens", field)
            if len(ids) > engine.max_model_len:
                raise APIError(f"This model's maximum context length is "
                               f"{engine.max_model_len} tokens; the prompt has {len(ids)} "
                               "tokens. Shorten it.", field)
        return prompts, texts

    def _decode(ids: list[int]) -> str:
        if engine.tokenizer is None:
            return ""
        vocab = engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids holds an unknown token id; valid ids are "
                             f"0..{vocab - 1}")
        return engine.tokenizer.decode(ids)

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
        if server.draining:
            raise _unavailable("the server is shutting down; retry on another server")
        if req.model is not None and req.model != model_name:
            raise APIError(f"The model '{req.model}' does not exist; this server serves "
                           f"'{model_name}'", "model", status=404, code="model_not_found")
        _check_limits(req)
        prompts, texts = await asyncio.get_running_loop().run_in_executor(
            tokenize_pool, _prompt_token_ids, req)
        params = [req.sampling_params(_max_tokens(req, len(ids))) for ids in prompts]
        response_id = new_id(req.kind)
        engine_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        sink: asyncio.Queue = asyncio.Queue()
        try:
            await server.add_many(list(zip(engine_ids, prompts, params)), sink,
                                  arrival_time=arrival, priority=req.priority)
        except BaseException as e:
            # An abort queued after the add (the client left while it was in flight)
            # undoes it; aborting ids the engine never took is a no-op.
            server.abort(engine_ids)
            if isinstance(e, QueueFull):
                raise _unavailable(str(e)) from e
            if isinstance(e, ValueError):
                # "SamplingParams.<field>=...: why" names its field (a token id outside
                # the vocabulary), "priority=..." the priority; the rest is the prompt's.
                text = str(e).split(": ", 1)[-1] if str(e).startswith("prompt ") else str(e)
                name = (text.split("=", 1)[0].removeprefix("SamplingParams.")
                        if text.startswith("SamplingParams.") else
                        "priority" if text.startswith("priority=") else
                        "messages" if req.kind == "chat" else "prompt")
                raise APIError(str(e), name) from e
            if isinstance(e, Exception):
                raise APIError(f"the engine could not take the request: {e}", None,
                               status=500, type="server_error") from e
            raise
        ctx = Context(req, response_id, model_name, engine_ids, prompts, texts,
                      params[0].n, params[0].stop)
        if req.stream:
            return _ClosingStreamingResponse(stream(server, sink, ctx),
                                             media_type="text/event-stream")
        return await collect(server, request, sink, ctx)

    return app


def _unavailable(message: str) -> APIError:
    return APIError(message, None, status=503, type="service_unavailable_error",
                    headers={"Retry-After": "1"})


async def _json(request: Request) -> dict:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        # Also a CSRF guard: a web page can POST text/plain cross-site without asking,
        # but not application/json.
        raise APIError(f"Content-Type {media or 'missing'!r}: send the body as JSON with "
                       "'Content-Type: application/json'", None, status=415)
    try:
        raw = await request.body()
    except ClientDisconnect:
        client = request.client
        log.warning("client %s left before its request body was complete",
                    f"{client.host}:{client.port}" if client else "?")
        raise APIError("the client left mid-body", None, status=400) from None
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError("the request body is JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        # JSONDecodeError is a ValueError; so is Python's limit on integer digits.
        raise APIError(f"the request body is not valid JSON: {e}") from None
