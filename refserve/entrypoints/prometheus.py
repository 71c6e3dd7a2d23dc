"""`/metrics`: the server's state in the Prometheus text exposition format (version 0.0.4).

    # HELP refserve:num_requests_running Sequences in the running batch.
    # TYPE refserve:num_requests_running gauge
    refserve:num_requests_running 3

A histogram is exposed as cumulative buckets: `name_bucket{le="x"}` counts observations
<= x (the `+Inf` bucket counts all of them), plus `name_sum` and `name_count`. So the
fraction of requests with TTFT <= 0.5 s is bucket{le="0.5"} / count, and a dashboard gets a
percentile by interpolating between buckets (histogram_quantile).

Names follow vLLM's `vllm:*` metrics with the `refserve:` prefix.
"""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
OUTCOMES = ("finished", "aborted", "rejected", "failed")

GAUGE_HELP = {
    "num_requests_running": "Sequences in the running batch.",
    "num_requests_waiting": "Sequences waiting to be admitted (preempted ones included).",
    "kv_cache_blocks_used": "KV blocks held by sequences (cached blocks with ref count 0 "
                            "are free).",
    "kv_cache_blocks_total": "KV blocks in the pool.",
    "prefix_cache_hit_rate": "Prefix-cache hit tokens / queried prompt tokens since start.",
}
COUNTER_GAUGES = {  # monotonic engine counters, exposed as counters
    "num_preemptions": "Recompute preemptions since start.",
    "num_steps": "Engine steps since start.",
    # vLLM's vllm:prefix_cache_queries / _hits, in tokens
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache since start.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache (not computed) since start.",
}


def engine_gauges(engine) -> dict[str, float]:
    """The engine's state now, by the names of GAUGE_HELP and COUNTER_GAUGES: what /metrics
    and `LLM.get_metrics()` report besides the per-request counts."""
    kv = engine.kv_cache_manager
    stats = engine.stats()
    queried = stats.get("prefix_cache_queried_tokens", 0)
    hits = stats.get("prefix_cache_hit_tokens", 0)
    return {
        "num_requests_running": engine.scheduler.num_running,
        "num_requests_waiting": engine.scheduler.num_waiting,
        "kv_cache_blocks_used": kv.num_held_blocks,
        "kv_cache_blocks_total": kv.num_blocks,
        "prefix_cache_hit_rate": hits / queried if queried else 0.0,
        "num_preemptions": stats.get("num_preemptions", 0),
        "num_steps": stats.get("num_steps", 0),
        "prefix_cache_queries": queried,
        "prefix_cache_hits": hits,
    }


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # the last one is (max bucket, +Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound falls in that bound's bucket (le = <=).
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> dict[str, int]:
        """{le: observations <= le} for every bound, "+Inf" last (it counts them all)."""
        out, total = {}, 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            total += n
            out["+Inf" if bound == float("inf") else repr(float(bound))] = total
        return out

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{le}"}} {n}' for le, n in self.cumulative().items()]
        out += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """Counters and histograms fed by the engine thread; `render()` reads them from the
    asyncio side. `gauges` is replaced whole by the engine thread after every step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.finish_reasons: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(TTFT_BUCKETS)
        self.gauges: dict[str, float] = {}

    def count_outcome(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def count_prompt_tokens(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens += n

    def observe_finished(self, out) -> None:
        """A request's final RequestOutput: its latencies and tokens."""
        m = out.metrics
        with self._lock:
            self.outcomes["finished"] += 1
            self.generation_tokens += sum(len(c.token_ids) for c in out.outputs)
            for c in out.outputs:
                reason = c.finish_reason or "unknown"
                self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            if m.tpot is not None:
                self.tpot.observe(m.tpot)
            if m.finish_time is not None:
                self.e2e.observe(m.finish_time - m.arrival_time)

    def request_counts(self) -> dict:
        """The per-request counts at one instant (taken under the lock): prompt_tokens,
        generation_tokens, finish_reasons {reason: n}, and for ttft, tpot and e2e each a
        (count, sum, cumulative buckets) triple."""
        with self._lock:
            return {"prompt_tokens": self.prompt_tokens,
                    "generation_tokens": self.generation_tokens,
                    "finish_reasons": dict(self.finish_reasons),
                    **{name: (h.count, h.sum, h.cumulative()) for name, h in
                       (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e))}}

    def render(self) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str) -> str:
            full = f"refserve:{name}"
            lines.extend([f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"])
            return full

        gauges = self.gauges
        with self._lock:
            for key, help_text in GAUGE_HELP.items():
                if key in gauges:
                    lines.append(f"{family(key, 'gauge', help_text)} {gauges[key]}")
            for key, help_text in COUNTER_GAUGES.items():
                if key in gauges:
                    lines.append(f"{family(key + '_total', 'counter', help_text)} "
                                 f"{gauges[key]}")
            name = family("requests_total", "counter",
                          "Requests by outcome: finished, aborted, rejected, failed.")
            lines += [f'{name}{{outcome="{k}"}} {v}' for k, v in self.outcomes.items()]
            name = family("request_success_total", "counter",
                          "Finished sequences by finish reason.")
            lines += [f'{name}{{finished_reason="{k}"}} {v}'
                      for k, v in sorted(self.finish_reasons.items())]
            for key, value, help_text in (
                    ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens admitted."),
                    ("generation_tokens_total", self.generation_tokens,
                     "Output tokens of finished requests.")):
                lines.append(f"{family(key, 'counter', help_text)} {value}")
            for key, hist, help_text in (
                    ("time_to_first_token_seconds", self.ttft, "TTFT: first token - arrival."),
                    ("time_per_output_token_seconds", self.tpot,
                     "TPOT: (finish - first token) / (output tokens - 1)."),
                    ("e2e_request_latency_seconds", self.e2e, "Finish - arrival.")):
                lines += hist.lines(family(key, "histogram", help_text))
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (labels included, as written) -> value; comments skipped. For tests and
    the load test, which read the server's own view."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
