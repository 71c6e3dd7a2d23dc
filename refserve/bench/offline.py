"""`compare --in-process`: the same workloads through each engine's offline API, no HTTP.

Each engine runs in a worker process of its own (bench/offline_worker.py: refserve from
this python, vLLM from its environment's), built once and kept for the whole run; the bench
sends it one workload at a time and reads back the wall time of the `LLM.generate` calls.
The engines alternate as the served comparison's do (refserve first in even rounds), each
idle while the other works. Per run: output tokens, seconds, tok/s, and ms per output
token (the decode workload's batch-1 figure: one request at a time, its 32-token prefill
included, about one decode step in 128).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

WORKER = Path(__file__).with_name("offline_worker.py")
ROOT = Path(__file__).resolve().parents[2]      # refserve's checkout, for the worker's path


class OfflineEngine:
    """A running worker: `run(requests, one_at_a_time)` -> {"seconds", "output_tokens"}."""

    def __init__(self, name: str, proc: subprocess.Popen, log: Path) -> None:
        self.name, self.proc, self.log = name, proc, log

    def _answer(self, timeout: float) -> dict:
        """The worker's next JSON answer (engines may print their own lines to stdout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.name} worker exited; its log ({self.log}) "
                                   f"ends:\n{self.log.read_text(errors='replace')[-3000:]}")
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    pass
        raise TimeoutError(f"the {self.name} worker gave no answer in {timeout:.0f} s")

    def run(self, requests: list[dict], one_at_a_time: bool) -> dict:
        self.proc.stdin.write(json.dumps({"requests": requests,
                                          "one_at_a_time": one_at_a_time}) + "\n")
        self.proc.stdin.flush()
        return self._answer(24 * 3600)


@contextmanager
def offline_engine(name: str, engine: str, python: str, model: str, args, env: dict,
                   timeout: float):
    """Start a worker for `engine` ("refserve" or "vllm"), wait until its LLM is built,
    yield it, and stop it (its whole process group) on the way out."""
    log = Path(tempfile.mkdtemp(prefix="refserve-bench-")) / f"{name}.log"
    command = [python, str(WORKER), engine, model, str(args.max_num_seqs),
               str(args.max_model_len), str(args.seed)]
    print(f"{name} (offline): {' '.join(command)}\n  (log: {log})", flush=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    with open(log, "wb") as sink:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=sink, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1",
                                     **({"PYTHONPATH": path} if engine == "refserve" else {}),
                                     **env})
    worker = OfflineEngine(name, proc, log)
    try:
        worker._answer(timeout)
        yield worker
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            except ProcessLookupError:
                pass


def measure(worker: OfflineEngine, workload: str, reqs: list[dict], rnd: int) -> dict:
    """One engine on one workload: the decode workload one request at a time, the others
    in one generate call."""
    print(f"{workload} round {rnd} {worker.name} (offline)...", flush=True)
    got = worker.run(reqs, one_at_a_time=workload == "decode")
    tokens, seconds = got["output_tokens"], got["seconds"]
    return {"workload": workload, "engine": worker.name, "round": rnd, "sent": len(reqs),
            "finished": len(reqs), "output_tokens": tokens, "seconds": seconds,
            "throughput_tok_s": tokens / seconds if seconds > 0 else 0.0,
            "ms_per_token": 1000 * seconds / tokens if tokens else None}


def workers(stack, args, model_dir: Path, peer_env: dict) -> list[OfflineEngine]:
    """[refserve, peer] workers, each stopped when `stack` closes."""
    mine = stack.enter_context(offline_engine("refserve", "refserve", sys.executable,
                                              str(model_dir), args, {}, args.startup_timeout))
    if args.peer == "refserve":
        peer = stack.enter_context(offline_engine("refserve-peer", "refserve", sys.executable,
                                                  str(model_dir), args, {},
                                                  args.startup_timeout))
    else:
        peer = stack.enter_context(offline_engine("vLLM", "vllm", args.peer_python,
                                                  str(model_dir), args, peer_env,
                                                  args.startup_timeout))
    for worker in (mine, peer):   # first-call costs (kernels loaded, graphs built) untimed
        worker.run([{"prompt": [1000 + i for i in range(8)], "max_tokens": 4}], False)
    return [mine, peer]
