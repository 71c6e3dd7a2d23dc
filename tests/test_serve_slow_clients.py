"""Slow and idle clients cost the server a bounded amount: a request head or body that
trickles in is cut off (408), an upload abandoned mid-body logs one line (not a traceback),
and connections beyond --limit-concurrency are turned away (503)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
from serve_utils import DEADLINE_S, MODEL, PROMPT, ServerThread, make_engine, wait_for

pytestmark = pytest.mark.serving

HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"


@pytest.fixture(scope="module")
def strict(tiny_chat_llama):
    s = ServerThread(make_engine(tiny_chat_llama), header_timeout=0.5, body_timeout=0.5,
                     keep_alive_timeout=0.5, limit_concurrency=4)
    yield s
    s.close()


@pytest.fixture(scope="module")
def limited(tiny_chat_llama):
    """Four connections at most, and a head timeout long enough that the idle ones stay
    open however slow the machine is until the test closes them."""
    s = ServerThread(make_engine(tiny_chat_llama), header_timeout=60, limit_concurrency=4)
    yield s
    s.close()


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(DEADLINE_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_request_head_sent_a_byte_at_a_time_is_cut_off(strict):
    with socket.create_connection(("127.0.0.1", strict.port)) as sock:
        closed = threading.Event()

        def drip():  # a byte every 50 ms: each one arrives, the head never completes
            for byte in HEAD * 100:
                if closed.is_set():
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.05)

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        reply = _read_all(sock)
        closed.set()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--header-timeout" in reply


def test_a_client_cut_off_may_go_on_sending_without_a_reset(strict):
    """The 408 is followed by a lingering close: the server shuts its sending side and reads
    (and drops) what still comes. A plain close() answers those bytes with a TCP reset, which
    can destroy the 408 before the client reads it; here the reset shows as a failed send."""
    with socket.create_connection(("127.0.0.1", strict.port)) as sock:
        sock.sendall(HEAD[:20])
        reply = _read_all(sock)          # the 408, then the server's FIN
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        for _ in range(3):               # after a reset the second send fails
            sock.send(b"x")
            time.sleep(0.05)


def test_a_body_that_never_completes_is_a_408(strict):
    with socket.create_connection(("127.0.0.1", strict.port)) as sock:
        sock.sendall(HEAD + b"content-length: 100\r\n\r\n" + b'{"prompt": ')
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"--body-timeout" in reply


def test_an_abandoned_upload_logs_one_line_and_no_traceback(served, caplog):
    caplog.set_level(logging.INFO)
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(HEAD + b"content-length: 1000\r\n\r\n" + b'{"prompt": "x')
    wait_for(lambda: any("left before its request body" in r.getMessage()
                         for r in caplog.records), "the log line")
    r = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                         "max_tokens": 2})
    assert r.status_code == 200          # and the server serves on
    lines = [r for r in caplog.records if "left before its request body" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


def test_connections_beyond_the_limit_are_turned_away(limited):
    idle = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(4)]
    try:
        wait_for(lambda: len(limited.http.uv.server_state.connections) >= 4,
                 "the idle connections to be accepted")
        r = httpx.post(limited.url + "/v1/completions", json={"model": MODEL,
                                                              "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503
    finally:
        for s in idle:
            s.close()
    # Once the idle ones are gone, the server takes requests again.
    wait_for(lambda: httpx.post(limited.url + "/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 2}).status_code == 200,
        "a request to be served again", poll=0.2)


def test_the_limits_reach_uvicorn(strict):
    config = strict.http.uv.config
    assert config.timeout_keep_alive == 0.5 and config.limit_concurrency == 4
