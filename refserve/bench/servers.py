"""The servers a bench talks to over HTTP: refserve's own, vLLM's, or any at a URL.

A `Target` is one OpenAI-compatible server the bench sends requests to. The bench either
starts it (a child process on a free loopback port, in its own process group so that
stopping it also stops the workers it spawned, as vLLM's engine core) or is given its URL
and only talks to it. Every server the bench starts is stopped when the `with` block ends,
whatever happened inside it (an error, Ctrl-C), and never listens beyond 127.0.0.1.

    port = free_port()
    with running("refserve", refserve_command(port, ["--max-num-seqs", "16"]), port,
                 timeout=180) as target:
        target.url, target.model          # http://127.0.0.1:PORT, "bench"
        target.metric_total("prefix_cache_hits_total")   # /metrics, any engine's prefix

vLLM runs from its own virtual environment (scripts/make_vllm_env.sh): its pins differ from
refserve's, and nothing of it is a refserve dependency. The bench starts it with that
environment's python, `-m vllm.entrypoints.openai.api_server` (what `vllm serve` runs).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SERVED_NAME = "bench"


@dataclass
class Target:
    """One server under test. `proc` is None for a server the bench was given by URL."""

    name: str
    url: str
    model: str
    proc: subprocess.Popen | None = None
    log: Path | None = None
    command: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value} (empty when the server has none)."""
        import httpx

        from refserve.entrypoints.prometheus import parse_metrics

        r = httpx.get(self.url + "/metrics", timeout=10)
        return parse_metrics(r.text) if r.status_code == 200 else {}

    def metric_total(self, suffix: str, metrics: dict[str, float] | None = None) -> float | None:
        """The sum of every sample whose name (labels aside) ends with `:<suffix>`: the same
        counter is `refserve:prefix_cache_hits_total` here and `vllm:prefix_cache_hits_total`
        (labelled by engine and model) in vLLM. None when the server has no such counter."""
        metrics = self.metrics() if metrics is None else metrics
        found = [v for k, v in metrics.items() if k.split("{")[0].endswith(":" + suffix)]
        return sum(found) if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(target: Target, timeout: float) -> None:
    """Poll /health until it answers 200; ValueError (with the log's tail) when the process
    exits first or `timeout` seconds pass."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if target.proc is not None and target.proc.poll() is not None:
            raise ValueError(f"the {target.name} server exited (code {target.proc.returncode})"
                             f":\n{_tail(target.log)}")
        try:
            if httpx.get(target.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise ValueError(f"the {target.name} server did not answer /health within {timeout:.0f} s"
                     f":\n{_tail(target.log)}")


def served_model(url: str) -> str:
    """The first model a server lists at /v1/models (what a request must name)."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=10)
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{url}/v1/models did not name a model ({e!r}): is an "
                         "OpenAI-compatible server running there?") from e


def _tail(log: Path | None, chars: int = 3000) -> str:
    if log is None or not log.exists():
        return "(no log)"
    return log.read_text(errors="replace")[-chars:]


def stop(target: Target, grace: float = 20.0) -> None:
    """SIGTERM to the server's whole process group, SIGKILL after `grace` seconds."""
    proc = target.proc
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


@contextmanager
def running(name: str, command: list[str], port: int, timeout: float, env: dict | None = None,
            log_dir: Path | None = None):
    """Start `command` (a server that will listen on 127.0.0.1:`port`), wait for /health,
    yield its Target, and stop it on the way out."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="refserve-bench-"))
    log = log_dir / f"{name}.log"
    print(f"{name} server: {' '.join(command)}\n  (log: {log})", flush=True)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    target = Target(name, f"http://127.0.0.1:{port}", SERVED_NAME, proc, log, command)
    try:
        wait_healthy(target, timeout)
        yield target
    finally:
        stop(target)


def refserve_command(port: int, extra: list[str], python: str | None = None) -> list[str]:
    import sys

    return [python or sys.executable, "-m", "refserve.serve", "--host", "127.0.0.1", "--port",
            str(port), "--served-model-name", SERVED_NAME, *extra]


def vllm_command(python: str, model: str, port: int, extra: list[str]) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
            *extra]


@contextmanager
def given(name: str, url: str):
    """A server the bench did not start: only its URL; never stopped by the bench."""
    url = url.rstrip("/")
    yield Target(name, url, served_model(url))
