"""Shared pieces of the server tests (tests/test_serve*.py): a real uvicorn server on a free
127.0.0.1 port, in this process (`ServerThread`) or as `python -m refserve.serve`
(`ServerProcess`), the tiny text model's fixtures, and waits that end on the event a test
is about (with a generous deadline) instead of on a wall-clock window. The fixtures that
build on them (tiny_chat_llama, served, offline) are in conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai

from refserve.engine import LLMEngine
from refserve.entrypoints.async_engine import AsyncEngine
from refserve.entrypoints.http_server import HTTPServer, bind
from refserve.entrypoints.openai_server import build_app
from refserve.entrypoints.options import ServerOptions
from refserve.entrypoints.prometheus import parse_metrics

MODEL = "tiny"
PROMPT = "The engine keeps a pool"
DEADLINE_S = 60.0   # generous: only a broken server takes this long


def wait_for(condition, what: str, timeout: float = DEADLINE_S, poll: float = 0.02):
    """Poll `condition()` until it returns something truthy; returns that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


class ServerThread:
    """The engine loop + uvicorn in this process, on a socket bound to 127.0.0.1:0."""

    def __init__(self, engine, max_waiting: int = 1024, **options) -> None:
        self.engine = engine
        self.options = ServerOptions(host="127.0.0.1", port=0, **options)
        self.server = AsyncEngine(engine, max_waiting=max_waiting)
        self.server.start()
        sock = bind("127.0.0.1", 0)
        # log_config=None: uvicorn's loggers propagate to the root, where caplog sees them.
        self.http = HTTPServer(build_app(self.server, MODEL, self.options), sock,
                               self.options, self.server, log_level="info", log_config=None)
        self.http.start()
        self.port = self.http.port
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics").text)

    def outcome(self, name: str) -> float:
        return self.metrics()[f'refserve:requests_total{{outcome="{name}"}}']

    def close(self) -> None:
        """Ends what is still open (error event + [DONE]) rather than cutting it."""
        if self.http.alive:
            self.http.drain(timeout=0)
        self.server.stop()


def make_engine(folder, **kw) -> LLMEngine:
    kw.setdefault("num_gpu_blocks_override", 512)
    kw.setdefault("block_size", 4)
    return LLMEngine(model=str(folder), progress=False, **kw)


def blocks_freed(server: ServerThread) -> dict | None:
    """The metrics once nothing holds a KV block, runs or waits; else None."""
    m = server.metrics()
    idle = (m["refserve:kv_cache_blocks_used"] == 0 and m["refserve:num_requests_running"] == 0
            and m["refserve:num_requests_waiting"] == 0)
    return m if idle else None


def assert_blocks_freed(server: ServerThread, timeout: float = DEADLINE_S) -> dict:
    return wait_for(lambda: blocks_freed(server), "the KV blocks to be freed", timeout)


class ServerProcess:
    """`python -m refserve.serve ...` on a free port; stdout and stderr go to one file."""

    def __init__(self, args: list[str], tmp_path, env: dict | None = None) -> None:
        with bind("127.0.0.1", 0) as s:
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
        self.log = open(self.log_path, "wb")
        if "--port" not in args:
            args = [*args, "--port", str(self.port)]
        self.proc = subprocess.Popen([sys.executable, "-m", "refserve.serve", *args],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        def up():
            assert self.proc.poll() is None, self.output()
            try:
                return httpx.get(self.url + "/health").status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, "the server to come up", poll=0.2)

    def wait(self) -> int:
        """The exit code, once the process ended by itself."""
        try:
            return self.proc.wait(DEADLINE_S)
        finally:
            self.log.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(DEADLINE_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()
