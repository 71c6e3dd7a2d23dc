"""`AsyncEngine`: one engine loop in a background thread, fed by asyncio request handlers.

Who touches what
    engine thread   the only caller of the `LLMEngine`. Each turn of its loop it applies the
                    queued adds and aborts, runs one `step()`, hands the outputs out and takes
                    a gauge snapshot for /metrics, all under `lock` (anyone else who wants to
                    read engine state takes the lock too).
    asyncio loop    (uvicorn's) never calls the engine and never waits for a step: it appends
                    an add or an abort to the inbox and wakes the engine thread. Outputs come
                    back on the caller's `asyncio.Queue`, put there with
                    `loop.call_soon_threadsafe` because asyncio queues are not thread-safe.
                    A request's prompts (a completion may batch several) are one add, so the
                    engine takes all of them in the same turn, or none.

Every request gets exactly one outcome (the `outcome` counter of `ServerMetrics`):
    rejected   its add failed: bad input (`ValueError`, HTTP 400) or the waiting queue already
               holds `max_waiting` sequences or the server is draining (`QueueFull`, 503)
    finished   its last `RequestOutput` (finished=True) was delivered
    aborted    the client went away: `abort()`; its KV blocks are freed at the next step
               boundary (a forward in flight cannot be interrupted)
    failed     a step raised for it: it is aborted and a `RequestFailed` is delivered (HTTP
               500); the other requests and the loop carry on. `stop()` fails whatever is
               still open the same way, with status 503 (the server is shutting down).
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from dataclasses import dataclass

from refserve.entrypoints.prometheus import ServerMetrics, engine_gauges
from refserve.sampling import SamplingParams


class QueueFull(Exception):
    """The waiting queue holds `max_waiting` sequences: come back later (HTTP 503)."""


@dataclass
class RequestFailed:
    """Delivered instead of an output when a step failed for this request (HTTP 500), or
    when the server shut down while it ran (503)."""
    request_id: str
    message: str
    status: int = 500


@dataclass
class _Add:
    """One HTTP request's engine requests: (request_id, prompt_token_ids, params) each."""
    requests: list[tuple[str, list[int], SamplingParams]]
    arrival_time: float
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future
    priority: int = 0


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Consumer:
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.sink.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine, max_waiting: int = 1024,
                 metrics: ServerMetrics | None = None) -> None:
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting!r}: must be an integer >= 1")
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics or ServerMetrics()
        self.lock = threading.Lock()            # held while the engine is touched
        self._inbox: list[_Add | _Abort] = []
        self._inbox_lock = threading.Lock()     # guards only the list swap
        self._wake = threading.Event()
        self._consumers: dict[str, _Consumer] = {}
        self._stopping = False
        self._closed = False                    # the loop has exited: posts are refused
        self.draining = False                   # begin_drain(): adds are refused (503)
        self._idle = threading.Event()          # set while no request is open
        self._idle.set()
        self._thread: threading.Thread | None = None
        self.num_steps_failed = 0
        self._snapshot()

    # ---------------------------------------------------------------- asyncio side
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="refserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop: every request still open gets a `RequestFailed` (status 503)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def begin_drain(self) -> None:
        """Refuse new requests from now on (QueueFull, HTTP 503); running ones go on."""
        self.draining = True

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is open (True) or `timeout` seconds passed (False)."""
        return self._idle.wait(timeout)

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  sink: asyncio.Queue, arrival_time: float | None = None,
                  priority: int = 0) -> None:
        """Queue one request; see `add_many`."""
        await self.add_many([(request_id, prompt_token_ids, params)], sink, arrival_time,
                            priority)

    async def add_many(self, requests: list[tuple[str, list[int], SamplingParams]],
                       sink: asyncio.Queue, arrival_time: float | None = None,
                       priority: int = 0) -> None:
        """Queue (request_id, prompt_token_ids, params) requests in one engine turn, all
        with `priority` (add_request's); returns once the engine took all of them. Outputs
        (and a `RequestFailed` if a step fails for one) then arrive on `sink`. Raises
        ValueError (bad input, the engine's message) or QueueFull; in both cases nothing
        of any of them is left."""
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        self._post(_Add(list(requests),
                        time.perf_counter() if arrival_time is None else arrival_time,
                        sink, loop, accepted, priority))
        await accepted

    def abort(self, request_ids: str | list[str]) -> None:
        """Stop requests (client gone): one id or a list, all in the engine's next turn.
        Safe to call for finished or unknown ids."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self._post(_Abort(ids))

    def _post(self, op) -> None:
        with self._inbox_lock:
            if not self._closed:
                self._inbox.append(op)
                self._wake.set()
                return
        if isinstance(op, _Add):  # the loop is gone: nobody else will ever answer it
            op.loop.call_soon_threadsafe(_settle, op.accepted,
                                         QueueFull("the server is shutting down"))

    @property
    def request_ids(self) -> list[str]:
        """Requests the engine holds for a consumer right now."""
        return list(self._consumers)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        while True:
            with self._inbox_lock:
                # Clear before taking the inbox: a post after the swap sets the event again,
                # so no wake-up is lost.
                self._wake.clear()
                ops, self._inbox = self._inbox, []
                self._closed = self._stopping  # later posts are answered by _post itself
            if self._stopping:
                self._shut_down(ops)
                self._idle.set()
                return
            with self.lock:
                for op in ops:
                    self._apply(op)
                busy = self.engine.has_unfinished_requests()
                if busy:
                    self._step()
                try:
                    self._snapshot()
                except Exception:  # noqa: BLE001 - stale gauges must not stop serving
                    traceback.print_exc()
                if self._consumers:
                    self._idle.clear()
                else:
                    self._idle.set()
            if not busy:
                self._wake.wait()

    def _apply(self, op) -> None:
        if isinstance(op, _Abort):
            for request_id in op.request_ids:
                self._consumers.pop(request_id, None)
                if self.engine.abort_request(request_id):
                    self.metrics.count_outcome("aborted")
            return
        added: list[str] = []
        try:
            # Sequences, not requests: an n-way request occupies n seats once it runs. The
            # queue is full when it already holds max_waiting; a request joins it whole.
            if self.draining:
                raise QueueFull("the server is shutting down; retry on another server")
            if self.engine.scheduler.num_waiting >= self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} sequences "
                                "waiting); retry later")
            for request_id, prompt_token_ids, params in op.requests:
                self.engine.add_request(request_id, prompt_token_ids, params,
                                        arrival_time=op.arrival_time, priority=op.priority)
                added.append(request_id)
        except Exception as e:  # noqa: BLE001 - any error belongs to this request alone
            # ValueError (bad input) and QueueFull are the caller's to fix: rejected.
            # Anything else is a server fault: failed (HTTP 500). All or nothing: the
            # prompts added before the one that failed are taken back.
            self.engine.abort_request(added)
            rejected = isinstance(e, (ValueError, QueueFull))
            for _ in op.requests:
                self.metrics.count_outcome("rejected" if rejected else "failed")
            op.loop.call_soon_threadsafe(_settle, op.accepted, e)
            return
        self._idle.clear()  # at once: a drain starting during this turn's step must wait
        # One dict update: a reader on another thread (request_ids) sees all of a
        # request's prompts or none of them, never a part.
        self._consumers.update({request_id: _Consumer(op.sink, op.loop)
                                for request_id, _, _ in op.requests})
        for _, prompt_token_ids, _ in op.requests:
            self.metrics.count_prompt_tokens(len(prompt_token_ids))
        op.loop.call_soon_threadsafe(_settle, op.accepted, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.num_steps_failed += 1
            # An EngineStepError names the requests of the failed batch; anything else
            # (nothing schedulable, a bug) leaves no one else to blame but all in flight.
            ids = getattr(e, "request_ids", None) or list(self._consumers)
            for request_id in ids:
                self._fail(request_id, f"the engine step failed: {e}")
            return
        delivered: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            consumer = self._consumers.get(out.request_id)
            if consumer is None:
                continue
            if out.finished:
                del self._consumers[out.request_id]
                self.metrics.observe_finished(out)
            delivered.setdefault(consumer.loop, []).append((consumer.sink, out))
        # One wake-up per event loop per step, not one per output: each is a write to the
        # loop's self-pipe, a system call on the engine thread (16 a step at 16 seats).
        for loop, items in delivered.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail(self, request_id: str, message: str, status: int = 500) -> None:
        consumer = self._consumers.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)  # frees its blocks; the pool stays consistent
        except Exception:  # noqa: BLE001 - the request is gone either way
            pass
        if consumer is not None:
            self.metrics.count_outcome("failed")
            consumer.put(RequestFailed(request_id, message, status))

    def _shut_down(self, ops) -> None:
        with self.lock:
            for op in ops:
                if isinstance(op, _Add):
                    for _ in op.requests:
                        self.metrics.count_outcome("rejected")
                    op.loop.call_soon_threadsafe(
                        _settle, op.accepted, QueueFull("the server is shutting down"))
            for request_id in list(self._consumers):
                self._fail(request_id, "the server is shutting down: this request did not "
                           "finish within the shutdown timeout", status=503)

    def _snapshot(self) -> None:
        """Gauges for /metrics, read without the lock (one attribute assignment)."""
        self.metrics.gauges = engine_gauges(self.engine)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: hand each output to its request's queue, in step order."""
    for sink, item in items:
        sink.put_nowait(item)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():  # the handler was cancelled (client gone) before the engine answered
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
