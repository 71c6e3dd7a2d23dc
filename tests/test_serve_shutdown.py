"""Shutdown drains instead of cutting: once it starts, new requests get 503 while the
running ones finish; whatever is still open at --shutdown-timeout ends with an error event
and `data: [DONE]`; SIGTERM takes that path and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from serve_utils import (
    DEADLINE_S,
    MODEL,
    PROMPT,
    ServerProcess,
    ServerThread,
    make_engine,
    wait_for,
)

pytestmark = pytest.mark.serving


def _events(url: str, body: dict, started: threading.Event | None = None) -> list[str]:
    """The data lines of one streamed completion, read until the server ends it."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=DEADLINE_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if started is not None:
                    started.set()
    return events


def _streams(url: str, body: dict, count: int):
    """`count` streams in threads; returns (results, all-started events, threads)."""
    results: list[list[str] | None] = [None] * count
    started = [threading.Event() for _ in range(count)]

    def run(i):
        results[i] = _events(url, body, started[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return results, started, threads


def _ended_by_shutdown(events: list[str]) -> bool:
    error = json.loads(events[-2]).get("error", {}) if len(events) >= 2 else {}
    return events[-1] == "[DONE]" and error.get("code") == 503 and "shutting down" in error.get(
        "message", "")


def test_drain_refuses_new_requests_and_lets_running_ones_finish(tiny_chat_llama):
    s = ServerThread(make_engine(tiny_chat_llama))
    gate = threading.Semaphore(0)
    original = s.engine.step

    def gated():
        assert gate.acquire(timeout=DEADLINE_S)
        return original()

    s.engine.step = gated
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
        results, started, threads = _streams(s.url, body, 1)
        wait_for(lambda: s.server.request_ids, "the stream to reach the engine")
        left = []
        drainer = threading.Thread(target=lambda: left.append(s.http.drain(DEADLINE_S)))
        drainer.start()
        wait_for(lambda: s.server.draining, "the drain to begin")
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "shutting down" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 503
        for _ in range(1000):
            gate.release()                  # now the running request may finish
        drainer.join(DEADLINE_S)
        threads[0].join(DEADLINE_S)
        assert left == [0]
        events = results[0]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    finally:
        s.engine.step = original
        for _ in range(10_000):
            gate.release()
        s.close()


def test_streams_still_open_at_the_timeout_end_with_an_error_event_and_done(long_tiny_chat_llama):
    s = ServerThread(make_engine(long_tiny_chat_llama, block_size=16))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
    results, started, threads = _streams(s.url, body, 3)
    try:
        for e in started:
            assert e.wait(DEADLINE_S)
        assert s.http.drain(timeout=0.2) == 3      # 4000 tokens each: none is done
        for t in threads:
            t.join(DEADLINE_S)
        assert all(_ended_by_shutdown(events) for events in results), [r[-2:] for r in results]
        assert not s.server.alive
    finally:
        s.close()


def test_sigterm_with_10_streams_open_ends_each_with_an_error_event_and_exits_0(
        long_tiny_chat_llama, tmp_path):
    proc = ServerProcess([str(long_tiny_chat_llama), "--served-model-name", MODEL, "--block-size",
                          "16", "--shutdown-timeout", "1"], tmp_path)
    try:
        proc.wait_healthy()
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
        results, started, threads = _streams(proc.url, body, 10)
        for e in started:
            assert e.wait(DEADLINE_S), proc.output()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.wait() == 0, proc.output()
        for t in threads:
            t.join(DEADLINE_S)
    finally:
        proc.stop()
    assert all(_ended_by_shutdown(events) for events in results), [r[-2:] for r in results]
    out = proc.output()
    assert "SIGTERM: draining" in out and "Traceback" not in out, out
