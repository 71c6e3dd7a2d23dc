"""`HTTPServer`: uvicorn in a thread of its own, with limits on slow clients and a shutdown
that drains instead of cutting.

Why a thread: the main thread keeps the signals. SIGTERM / SIGINT then start `drain()`:

    1. stop admitting: new generation requests get 503 (Retry-After), /health says 503
    2. running requests may finish, for up to `shutdown_timeout` seconds
    3. then every request still open is ended by the engine loop: a stream gets an error
       event and `data: [DONE]`, a waiting client a 503 body; their KV blocks are freed
    4. uvicorn closes the idle connections and stops; the process exits 0

Slow clients: uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`) and the
number of connections (`limit_concurrency`), but not a client that sends its request head a
byte at a time. `_HeadTimeoutH11` adds that deadline: a connection must deliver a whole head
within `header_timeout` of opening (or of its previous response), else it gets a 408 and is
closed. The body's own deadline is guards.py's.

Closing after that 408 is a *lingering* close: the server shuts its sending side, then reads
and discards what the client still sends for up to `LINGER_S` before it closes the socket.
A plain close() with unread bytes in the kernel's receive buffer makes the kernel answer
with a TCP reset, and a reset can reach the client before it has read the 408: the client
then sees "connection reset by peer" instead of the error that says which flag cut it off.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from refserve.entrypoints.options import ServerOptions
from refserve.entrypoints.protocol import error_body

log = logging.getLogger("uvicorn.error")

LINGER_S = 2.0  # how long a cut-off client may go on sending before the socket is closed


class _HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for each request head (see the module
    docstring). Hooks: the head timer is armed when the connection opens and after each
    response, and disarmed as soon as h11 has parsed a head (a new request cycle began)."""

    header_timeout = 10.0  # set per server by HTTPServer (a subclass per server)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._lingering = False
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the 408 is sent: what the client still sends is read and dropped
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # before super(): a pipelined next head is parsed inside it
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            body = json.dumps(error_body(
                f"no complete request head within {self.header_timeout:g} s "
                "(--header-timeout)", "invalid_request_error")).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: "
                                 b"application/json\r\nconnection: close\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
            client = "{}:{}".format(*self.client) if self.client else "a client"
            log.warning("closed the connection of %s: no complete request head within %g s",
                        client, self.header_timeout)
            self._linger()
            return
        self.transport.close()

    def _linger(self) -> None:
        """Send FIN after the 408 (write_eof flushes first), drop further input, close
        when the client closes its side (eof_received) or after LINGER_S."""
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (IPv4 or IPv6 by the address); raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class HTTPServer:
    """Serve `app` on `sock` from a background thread (see the module docstring)."""

    def __init__(self, app, sock: socket.socket, options: ServerOptions, server,
                 log_level: str = "warning", log_config: dict | None = uvicorn.config.LOGGING_CONFIG
                 ) -> None:
        self.server = server  # the AsyncEngine: drain() stops its admissions and its loop
        self.options = options
        self.sock = sock
        self.port = sock.getsockname()[1]
        protocol = type("HeadTimeoutH11", (_HeadTimeoutH11,),
                        {"header_timeout": options.header_timeout})
        self.uv = uvicorn.Server(uvicorn.Config(
            app, http=protocol, log_level=log_level, log_config=log_config,
            timeout_keep_alive=options.keep_alive_timeout,
            limit_concurrency=options.limit_concurrency,
            # By the time uvicorn shuts down, drain() has ended every request: what is
            # left are idle connections, closed at once.
            timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]},
                                       name="refserve-http", daemon=True)

    def start(self, timeout: float = 60.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uv.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def drain(self, timeout: float | None = None) -> int:
        """Stop admitting, let running requests finish for up to `timeout` seconds
        (default: options.shutdown_timeout), end the rest, stop serving. Returns how many
        requests were still running when the time was up (0: all finished)."""
        timeout = self.options.shutdown_timeout if timeout is None else timeout
        self.server.begin_drain()
        finished = self.server.wait_idle(timeout)
        left = 0 if finished else len(self.server.request_ids)
        self.server.stop()   # ends every request still open (error event + [DONE])
        self.close()
        return left

    def close(self, timeout: float = 10.0) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
