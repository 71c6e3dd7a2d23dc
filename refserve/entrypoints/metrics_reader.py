"""`LLM.get_metrics()`: the engine's metrics as a list, in the shape of vLLM's
`vllm.v1.metrics.reader` (Counter, Gauge, Histogram, Vector: name, labels, values).

Names are vLLM's own (`vllm:num_preemptions`, `vllm:prefix_cache_hits`, ...), so code written
for `vllm.LLM(...).get_metrics()` finds the same metrics here; only those refserve measures
are listed:

    vllm:num_requests_running / _waiting      gauge      sequences running / waiting now
    vllm:kv_cache_usage_perc                  gauge      KV blocks held / blocks in the pool
    vllm:num_preemptions                      counter    recompute preemptions since start
    vllm:prefix_cache_queries / _hits         counter    prompt tokens looked up / found
    vllm:prompt_tokens / generation_tokens    counter    of finished requests
    vllm:request_success{finished_reason}     counter    finished sequences by reason
    vllm:time_to_first_token_seconds          histogram  TTFT per request
    vllm:request_time_per_output_token_seconds histogram TPOT per request
    vllm:e2e_request_latency_seconds          histogram  finish - arrival

A histogram's buckets are cumulative, {le: observations <= le} with "+Inf" holding all of
them, as Prometheus exposes them (and vLLM's reader returns them). Every metric carries the
labels vLLM puts on it: model_name and engine ("0": refserve runs one engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from refserve.entrypoints.prometheus import ServerMetrics

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Metric:
    """One metric: vLLM's name and its labels (key=value)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only goes up."""

    value: int


@dataclass
class Vector(Metric):
    """Integer counters in order (vLLM's spec-decode acceptance per draft position)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in cumulative buckets ({le: count <= le}, "+Inf" = count), their number
    and their sum."""

    count: int
    sum: float
    buckets: dict[str, int]


def metrics_snapshot(requests: ServerMetrics, gauges: dict[str, float],
                     model_name: str) -> list[Metric]:
    """The metrics now: `requests` (what finished requests were observed to take) and
    `gauges` (prometheus.engine_gauges of the engine)."""
    labels = {"model_name": model_name, "engine": "0"}
    used, total = gauges["kv_cache_blocks_used"], gauges["kv_cache_blocks_total"]
    out: list[Metric] = [
        Gauge("vllm:num_requests_running", dict(labels), float(gauges["num_requests_running"])),
        Gauge("vllm:num_requests_waiting", dict(labels), float(gauges["num_requests_waiting"])),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), used / total if total else 0.0),
        Counter("vllm:num_preemptions", dict(labels), int(gauges["num_preemptions"])),
        Counter("vllm:prefix_cache_queries", dict(labels), int(gauges["prefix_cache_queries"])),
        Counter("vllm:prefix_cache_hits", dict(labels), int(gauges["prefix_cache_hits"])),
    ]
    counts = requests.request_counts()
    out += [Counter("vllm:prompt_tokens", dict(labels), counts["prompt_tokens"]),
            Counter("vllm:generation_tokens", dict(labels), counts["generation_tokens"])]
    # Every reason refserve finishes with is listed, at 0 until seen (vLLM lists its own).
    reasons = {**dict.fromkeys(FINISH_REASONS, 0), **counts["finish_reasons"]}
    out += [Counter("vllm:request_success", {**labels, "finished_reason": reason}, n)
            for reason, n in reasons.items()]
    for name, key in (("vllm:time_to_first_token_seconds", "ttft"),
                      ("vllm:request_time_per_output_token_seconds", "tpot"),
                      ("vllm:e2e_request_latency_seconds", "e2e")):
        count, total_s, buckets = counts[key]
        out.append(Histogram(name, dict(labels), count, total_s, buckets))
    return out
