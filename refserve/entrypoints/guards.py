"""Who may talk to the server and how much they may send: one ASGI middleware in front of
the FastAPI app, so a refused request costs no parsing, no tokenizing and no engine time.

Every HTTP request passes these checks in order (answers in OpenAI's error shape):

    Host header   a loopback-bound server answers only loopback names (DNS rebinding,
                  see ServerOptions.host_allowed)                                      403
    API key       with an api_key, every /v1/* route needs `Authorization: Bearer <key>`,
                  compared in constant time (hmac.compare_digest); /health and /metrics
                  stay open, as in vLLM                                                401
    body size     a Content-Length above max_request_bytes is refused before reading;
                  a chunked body is counted as it arrives                              413
    body time     the whole body must arrive within body_timeout of the request head   408

The last two wrap `receive`: they raise `APIError`, which reaches the route that is reading
the body and leaves through the app's APIError handler like any other client error.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from refserve.entrypoints.options import ServerOptions
from refserve.entrypoints.protocol import APIError, error_body


class Guard:
    def __init__(self, app, options: ServerOptions) -> None:
        self.app, self.options = app, options

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        opts = self.options
        if not opts.host_allowed(headers.get("host")):
            allowed = ("loopback names only (localhost, 127.0.0.1, ::1)"
                       if opts.allowed_hosts is None else ", ".join(opts.allowed_hosts))
            await reply(send, 403, f"Host {headers.get('host')!r} is not allowed: this "
                        f"server answers {allowed}; start it with --allowed-hosts to widen "
                        "that", "permission_denied")
            return
        path = scope["path"]
        if opts.api_key is not None and (path == "/v1" or path.startswith("/v1/")):
            if not _key_matches(headers.get("authorization"), opts.api_key):
                await reply(send, 401, "Incorrect or missing API key: send the header "
                            "'Authorization: Bearer <key>' with the key the server was "
                            "started with", "invalid_request_error", code="invalid_api_key",
                            headers=[(b"www-authenticate", b"Bearer")])
                return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                await reply(send, 400, f"Content-Length {length!r} is not a byte count",
                            "invalid_request_error")
                return
            if int(length) > opts.max_request_bytes:
                await reply(send, 413, _too_large(int(length), opts.max_request_bytes),
                            "invalid_request_error")
                return
        await self.app(scope, _limited(receive, opts.max_request_bytes, opts.body_timeout),
                       send)


def _headers(scope) -> dict[str, str]:
    # latin-1 is the byte-for-byte decoding HTTP header values use; the last one wins.
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _key_matches(authorization: str | None, key: str) -> bool:
    scheme, _, given = (authorization or "").partition(" ")
    # compare_digest takes as long for a wrong key as for a right one: no timing oracle.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode("utf-8", "surrogatepass"), key.encode("utf-8", "surrogatepass"))


def _too_large(size: int, limit: int) -> str:
    return (f"the request body is {size} bytes, more than the server's limit of {limit} "
            "bytes (--max-request-bytes)")


def _limited(receive, limit: int, timeout: float):
    """`receive`, refusing a body longer than `limit` bytes (413) or slower than `timeout`
    seconds in total (408). Once the body is complete, messages pass through untouched
    (the app then waits on receive for the client's disconnect)."""
    state = {"received": 0, "done": False, "deadline": None}

    async def guarded():
        if state["done"]:
            return await receive()
        loop = asyncio.get_running_loop()
        if state["deadline"] is None:
            state["deadline"] = loop.time() + timeout
        try:
            message = await asyncio.wait_for(receive(), max(state["deadline"] - loop.time(), 0))
        except asyncio.TimeoutError:
            state["done"] = True
            raise APIError(f"the request body did not arrive within {timeout:g} s "
                           "(--body-timeout)", None, status=408) from None
        if message["type"] == "http.request":
            state["received"] += len(message.get("body", b""))
            if state["received"] > limit:
                state["done"] = True
                raise APIError(_too_large(state["received"], limit), None, status=413)
            state["done"] = not message.get("more_body", False)
        return message

    return guarded


async def reply(send, status: int, message: str, type: str, code: str | None = None,
                headers: list | None = None) -> None:
    """Answer with OpenAI's error body from below the app (no FastAPI involved)."""
    body = json.dumps(error_body(message, type, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
