"""A timeline of a run as Chrome trace-event JSON (open it in https://ui.perfetto.dev or
chrome://tracing): one track per request, one for the engine's steps.

Request tracks. Every request is, at each moment from its arrival to its finish, in exactly
one state, so its spans tile [arrival, finish] and their durations add up to its latency:

    waiting    arrived, never scheduled yet (queueing)
    prefill    one span per prefill chunk (the step that computed it); a recompute after a
               preemption is a prefill again
    decode     consecutive decode (or speculative verify) steps, merged into one span
    stalled    running, but given no tokens in a step (the token budget ran out)
    preempted  its blocks were taken back (recompute); waiting to be readmitted

The engine track has one span per step (args: rows, tokens, prefill / decode split, KV
blocks used) and counters for running, waiting and KV blocks.

`TraceRecorder` takes events, not engines: `arrive(request_id, t)`, `step(t_start, t_end,
out, ...)` with the scheduler's `SchedulerOutput`, `finish(request_id, t)`. The simulator
feeds it; `EngineTrace` feeds the same calls from real engines (`LLMEngine.observer`, with
time.perf_counter() times; the engine does not import this module), one recorder per
engine, all in one file: a bench scenario that runs several engines shows each as its own
pair of processes ("engine: LABEL", "requests: LABEL") on one time axis, from the first
arrival. A request of the real engine finishes at its `metrics.finish_time`, so its spans
add up to finish_time - arrival_time. An aborted request (`abort(request_id, t)`: a client
that left, a server shutting down) ends where it was aborted, marked by an "aborted" instant
event on its track.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

STATES = ("waiting", "prefill", "decode", "stalled", "preempted")
_ENGINE_PID, _REQUESTS_PID = 0, 1


@dataclass
class _Track:
    tid: int
    arrival: float
    state: str = "waiting"
    since: float = 0.0
    args: dict = field(default_factory=dict)
    spans: list[tuple[str, float, float, dict]] = field(default_factory=list)
    finished: float | None = None
    aborted: bool = False


class TraceRecorder:
    def __init__(self, origin: float = 0.0, label: str | None = None, index: int = 0) -> None:
        """`label` / `index`: the process names' suffix and this recorder's place when
        several share one file (`write_traces`)."""
        self.origin, self.label = origin, label
        self._engine_pid = _ENGINE_PID + 2 * index
        self._requests_pid = _REQUESTS_PID + 2 * index
        self._tracks: dict[str, _Track] = {}
        self._running: set[str] = set()       # requests in prefill / decode / stalled
        self._request_of: dict[int, str] = {}  # seq_id -> request_id
        self._steps: list[dict] = []
        self._counters: list[dict] = []
        self._last_counts: tuple | None = None
        self._end = origin

    # ---- events ------------------------------------------------------------------------

    def arrive(self, request_id: str, t: float) -> None:
        """A request id may come back once its earlier request finished (a server's
        client reusing one): the earlier track is kept as "ID #1", "ID #2", ..."""
        old = self._tracks.get(request_id)
        if old is not None:
            if old.finished is None:
                raise ValueError(f"trace: request {request_id!r} arrived twice")
            n = sum(k.startswith(f"{request_id} #") for k in self._tracks) + 1
            self._tracks[f"{request_id} #{n}"] = self._tracks.pop(request_id)
        self._tracks[request_id] = _Track(len(self._tracks) + 1, t, "waiting", t)
        self._end = max(self._end, t)

    def step(self, t_start: float, t_end: float, out, *, kv_blocks_used: int,
             kv_blocks_total: int, num_waiting: int) -> None:
        """One scheduler step `out` computed from t_start to t_end. Call it before the
        `finish` of the requests the step retired."""
        scheduled: dict[str, tuple[str, object]] = {}
        prefill_tokens = decode_rows = 0
        for row in out.scheduled:
            rid = row.seq.request_id
            self._request_of[row.seq.seq_id] = rid
            decoding = row.kind in ("decode", "verify")
            scheduled[rid] = ("decode" if decoding else "prefill", row)
            if decoding:
                decode_rows += 1
            else:
                prefill_tokens += row.num_scheduled_tokens
        for seq_id in out.preempted:
            rid = self._request_of.get(seq_id)
            if rid is not None:
                self._enter(rid, "preempted", t_start)
                self._running.discard(rid)
        for rid, (state, row) in scheduled.items():
            args = {"tokens": row.num_scheduled_tokens, "positions": f"[{row.start}, {row.end})"}
            self._enter(rid, state, t_start, new_span=state == "prefill", args=args)
            self._running.add(rid)
        for rid in self._running - scheduled.keys():
            self._enter(rid, "stalled", t_start)
        rows = len(scheduled)
        self._steps.append({
            "name": f"step {out.step}: {rows - decode_rows} prefill + {decode_rows} decode",
            "ph": "X", "pid": self._engine_pid, "tid": 0, "ts": self._us(t_start),
            "dur": self._us(t_end) - self._us(t_start),
            "args": {"rows": rows, "tokens": out.num_batched_tokens,
                     "prefill_tokens": prefill_tokens, "decode_rows": decode_rows,
                     "kv_blocks_used": kv_blocks_used, "kv_blocks_total": kv_blocks_total,
                     "waiting": num_waiting, "preempted": len(out.preempted)}})
        counts = (rows, num_waiting, kv_blocks_used)
        if counts != self._last_counts:
            self._last_counts = counts
            ts = self._us(t_start)
            self._counters.append({"name": "sequences", "ph": "C", "pid": self._engine_pid,
                                   "ts": ts, "args": {"scheduled": rows,
                                                      "waiting": num_waiting}})
            self._counters.append({"name": "KV blocks used", "ph": "C",
                                   "pid": self._engine_pid,
                                   "ts": ts, "args": {"blocks": kv_blocks_used}})
        self._end = max(self._end, t_end)

    def finish(self, request_id: str, t: float) -> None:
        """The request finished at t (its last span ends there)."""
        track = self._tracks[request_id]
        if track.finished is not None:
            raise ValueError(f"trace: request {request_id!r} finished twice")
        self._close(track, t)
        track.finished = t
        self._running.discard(request_id)
        self._end = max(self._end, t)

    def abort(self, request_id: str, t: float) -> None:
        """The request was aborted at t. Ignored for one this recorder never saw or that
        already finished (a finished request cannot be aborted)."""
        track = self._tracks.get(request_id)
        if track is None or track.finished is not None:
            return
        self.finish(request_id, t)
        track.aborted = True

    # ---- reading it back ---------------------------------------------------------------

    def knows(self, request_id: str) -> bool:
        return request_id in self._tracks

    def spans(self, request_id: str, with_args: bool = False) -> list[tuple]:
        """(state, start, end) of a request, in seconds (plus the span's args dict with
        `with_args`); an unfinished request's last span runs to the latest event."""
        track = self._tracks[request_id]
        spans = list(track.spans)
        if track.finished is None:
            spans.append((track.state, track.since, self._end, track.args))
        return spans if with_args else [span[:3] for span in spans]

    def to_json(self) -> dict:
        suffix = f": {self.label}" if self.label else ""
        events = [{"name": "process_name", "ph": "M", "pid": self._engine_pid,
                   "args": {"name": "engine" + suffix}},
                  {"name": "thread_name", "ph": "M", "pid": self._engine_pid, "tid": 0,
                   "args": {"name": "steps"}},
                  {"name": "process_name", "ph": "M", "pid": self._requests_pid,
                   "args": {"name": "requests" + suffix}}]
        events += self._steps + self._counters
        for rid, track in self._tracks.items():
            events.append({"name": "thread_name", "ph": "M", "pid": self._requests_pid,
                           "tid": track.tid, "args": {"name": rid}})
            for state, a, b, args in self.spans(rid, with_args=True):
                start = self._us(a)
                event = {"name": state, "cat": "request", "ph": "X",
                         "pid": self._requests_pid,
                         "tid": track.tid, "ts": start, "dur": self._us(b) - start}
                if args:
                    event["args"] = args
                events.append(event)
            if track.aborted:
                events.append({"name": "aborted", "cat": "request", "ph": "i", "s": "t",
                               "pid": self._requests_pid, "tid": track.tid,
                               "ts": self._us(track.finished)})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: Path) -> None:
        write_traces(path, [self])

    # ---- internals ---------------------------------------------------------------------

    def _us(self, t: float) -> float:
        return (t - self.origin) * 1e6

    def _enter(self, rid: str, state: str, t: float, new_span: bool = False,
               args: dict | None = None) -> None:
        track = self._tracks[rid]
        if track.state == state and not new_span:
            return
        self._close(track, t)
        track.state, track.since, track.args = state, t, args or {}

    @staticmethod
    def _close(track: _Track, t: float) -> None:
        if t > track.since:  # zero-length spans (scheduled on arrival) are left out
            track.spans.append((track.state, track.since, t, track.args))


def write_traces(path: Path, recorders: list[TraceRecorder]) -> None:
    """Several recorders (give each its own `index`) in one Chrome trace-event file."""
    events = [e for r in recorders for e in r.to_json()["traceEvents"]]
    doc = {"traceEvents": events, "displayTimeUnit": "ms"}
    Path(path).write_text(json.dumps(doc, separators=(",", ":")) + "\n")


class EngineTrace:
    """`--trace` for real engines: `attach(engine, label)` makes a recorder the engine's
    observer (LLMEngine.observer: arrive / step); `write(path)` writes them all. Times are
    the engine's time.perf_counter() ones, relative to the first arrival of any engine."""

    def __init__(self) -> None:
        self.recorders: list[TraceRecorder] = []
        self._origin: float | None = None

    def attach(self, engine, label: str | None = None):
        """Trace `engine` (an LLMEngine, or an LLM: its llm_engine) from now on; returns
        what it was given."""
        target = getattr(engine, "llm_engine", engine)
        origin = 0.0 if self._origin is None else self._origin  # the file's one time axis
        recorder = TraceRecorder(origin, label, len(self.recorders))
        self.recorders.append(recorder)
        target.observer = _Observer(self, recorder, target)
        return engine

    def add_simulation(self, label: str, start: float) -> TraceRecorder:
        """A recorder for a simulation (virtual clock from 0) drawn on this file's axis as
        if it had started at perf_counter time `start`: a real run and its simulation side
        by side (bench sim-fidelity)."""
        origin = (start if self._origin is None else self._origin) - start
        recorder = TraceRecorder(origin, label, len(self.recorders))
        recorder._end = 0.0
        self.recorders.append(recorder)
        return recorder

    def write(self, path: Path) -> None:
        write_traces(path, self.recorders)

    def _first_arrival(self, t: float) -> None:
        if self._origin is None:
            self._origin = t
            for r in self.recorders:
                r.origin = r._end = t


class _Observer:
    """One engine's observer: the engine's calls, translated into TraceRecorder events."""

    def __init__(self, trace: EngineTrace, recorder: TraceRecorder, engine) -> None:
        self.trace, self.recorder = trace, recorder
        self.kv, self.scheduler = engine.kv_cache_manager, engine.scheduler

    def arrive(self, request_id: str, t: float) -> None:
        self.trace._first_arrival(t)
        self.recorder.arrive(request_id, t)

    def abort(self, request_id: str, t: float) -> None:
        self.recorder.abort(request_id, t)

    def step(self, t_start, t_end, out, update, outputs) -> None:
        # A request added before the trace was attached starts its track when first seen.
        for row in out.scheduled:
            if not self.recorder.knows(row.seq.request_id):
                self.arrive(row.seq.request_id, t_start)
        # KV blocks after the step (retired sequences' blocks already freed); the
        # simulator samples them before the retirements.
        self.recorder.step(t_start, t_end, out, kv_blocks_used=self.kv.num_held_blocks,
                           kv_blocks_total=self.kv.num_blocks,
                           num_waiting=self.scheduler.num_waiting)
        for o in outputs:
            if o.finished:
                self.recorder.finish(o.request_id, o.metrics.finish_time)
