"""Simulated traffic: when requests arrive, what they send, how much they get back.

Everything is a function of the seed. Three independent random streams (arrivals, lengths,
token ids) make the arrival rate change only the arrival times: the same seed at rate 4 and
at rate 8 sends the same requests, twice as fast (what a binary search on the rate needs).

Arrivals (requests per second `rate`; gaps of a unit-rate process divided by the rate):
    poisson   exponential gaps (coefficient of variation 1)
    bursty    gamma gaps with coefficient of variation `burstiness` (> 1: clumps of
              requests, then lulls; shape 1 / cv^2, mean 1 / rate)
    rate = inf: everything arrives at t = 0 (an offline batch)

Workloads (token counts; "LN(m, s)" is a lognormal with mean m and sigma s, clipped):
    chat            the bench's chat: prompt U[16, 128], output LN(120, 0.8) in [16, 512]
    long-document   prompt U[2048, 6144] (a document), output LN(200, 0.6) in [32, 1024]
    long-context    prompt U[6144, 7424], output LN(640, 0.4) in [256, 1024]: each request
                    fills most of an 8192-token context (the OOM-at-peak war story)
    system-prompt   one shared 1500-token system prompt + a chat turn: prefix caching
                    stores its KV once instead of once per request
    multi-turn      conversations of 2-6 turns; turn k's prompt is turn k-1's prompt, its
                    answer and a new chat turn; turns 10 s apart on average (open loop)
    branching       trees: a 512-1024-token document, 2-4 branches of 64-256 tokens, 1-3
                    questions of 16-64 tokens per branch; the requests of a tree arrive
                    together (a radix of shared prefixes)
    random          vLLM's random dataset: input_len and output_len tokens, each spread
                    uniformly by +-range_ratio (refserve/benchmark_datasets.py)
    sharegpt        the built-in ShareGPT-like lengths (benchmark_datasets.SHAREGPT)
    dataset         the lengths of a ShareGPT JSON or a vLLM benchmark result JSON on disk
                    (`dataset_path`)
    trace           replay of a JSONL file (`load_trace`)

Output lengths are fixed by the workload (the model's tokens are not simulated): a request
carries the exact token ids it will be "sampled", so that a multi-turn follow-up really
contains its predecessor's answer and prefix caching hits for real. Ids are drawn from the
ordinary part of the vocabulary (>= 1000, skipping special tokens), as in the bench.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refserve import benchmark_datasets as datasets

ARRIVALS = ("poisson", "bursty")
WORKLOADS = ("chat", "long-document", "long-context", "system-prompt", "multi-turn",
             "branching", "random", "sharegpt", "dataset")
SYSTEM_PROMPT_TOKENS = 1500


@dataclass
class SimRequest:
    """One request: it arrives at `arrival_time` (s), sends `prompt_token_ids` and is
    answered with exactly `output_token_ids` (its max_tokens is their number). With
    speculative decoding each of its drafts is accepted with probability `spec_alpha`
    (None: the engine's default, --spec-alpha; refserve/simulator/outputs.py)."""

    request_id: str
    arrival_time: float
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    spec_alpha: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def _streams(seed: int) -> tuple[np.random.Generator, ...]:
    """arrivals, lengths, tokens: independent generators of one seed."""
    return tuple(np.random.default_rng([seed, i]) for i in range(3))


def unit_gaps(n: int, rng: np.random.Generator, arrival: str, burstiness: float) -> np.ndarray:
    """n inter-arrival gaps of mean 1 (a process of rate 1)."""
    if arrival == "poisson":
        return rng.exponential(1.0, n)
    if arrival == "bursty":
        if burstiness <= 0:
            raise ValueError(f"burstiness={burstiness!r}: must be > 0")
        shape = 1.0 / burstiness**2          # gamma: mean = shape * scale, cv = 1/sqrt(shape)
        return rng.gamma(shape, 1.0 / shape, n)
    raise ValueError(f"arrival={arrival!r}: choose one of {', '.join(ARRIVALS)}")


def arrival_times(n: int, rate: float, rng: np.random.Generator, arrival: str = "poisson",
                  burstiness: float = 4.0) -> np.ndarray:
    """Arrival times (s) of n requests at `rate` per second; the first arrives at 0."""
    if not rate > 0:
        raise ValueError(f"rate={rate!r}: must be > 0 requests per second (inf: all at once)")
    gaps = unit_gaps(n, rng, arrival, burstiness)
    if math.isinf(rate):
        return np.zeros(n)
    times = np.concatenate([[0.0], np.cumsum(gaps[1:])]) / rate
    return times


def lognormal_lengths(rng, n: int, mean: float, sigma: float, low: int, high: int) -> np.ndarray:
    """Integers from a lognormal of mean `mean` (mu = ln(mean) - sigma^2 / 2), clipped."""
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), low, high).astype(int)


class _Tokens:
    """Synthetic token ids from the ordinary part of the vocabulary."""

    def __init__(self, rng: np.random.Generator, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size!r}: must be >= 2")
        self.rng, self.low, self.high = rng, min(1000, vocab_size // 2), vocab_size

    def __call__(self, n: int) -> list[int]:
        return self.rng.integers(self.low, self.high, int(n)).tolist()


def _fit(prompt: list[int], output: list[int], max_model_len: int
         ) -> tuple[list[int], list[int]]:
    """Cut prompt and output so that prompt + output <= max_model_len (each >= 1 token)."""
    if len(prompt) >= max_model_len:
        prompt = prompt[:max(1, max_model_len - max(1, min(len(output), 16)))]
    return prompt, output[:max(1, max_model_len - len(prompt))]


def make_workload(name: str, num_requests: int, rate: float, *, vocab_size: int,
                  max_model_len: int, seed: int = 0, arrival: str = "poisson",
                  burstiness: float = 4.0, input_len: int = 1024, output_len: int = 128,
                  range_ratio: float = 0.0, dataset_path: Path | None = None,
                  count_tokens=None) -> list[SimRequest]:
    """`num_requests` requests of workload `name` (see the module docstring), sorted by
    arrival time, each cut to fit max_model_len. input_len, output_len, range_ratio:
    "random"'s; dataset_path (and count_tokens, a tokenizer for a ShareGPT file's text):
    "dataset"'s."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)} "
                         "(or replay a JSONL trace)")
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests={num_requests!r}: must be an integer >= 1")
    if name == "dataset" and dataset_path is None:
        raise ValueError("workload 'dataset' needs a dataset_path (--dataset-path FILE)")
    rng_arrival, rng_len, rng_tok = _streams(seed)
    tokens = _Tokens(rng_tok, vocab_size)
    n = num_requests
    if name in ("random", "sharegpt", "dataset"):
        times = arrival_times(n, rate, rng_arrival, arrival, burstiness)
        if name == "random":
            prompt_lens, output_lens = datasets.random_lengths(rng_len, n, input_len,
                                                               output_len, range_ratio)
        elif name == "sharegpt":
            prompt_lens, output_lens = datasets.sharegpt_lengths(rng_len, n)
        else:
            prompt_lens, output_lens = datasets.file_lengths(dataset_path, rng_len, n,
                                                             count_tokens)
        specs = [(times[i], tokens(prompt_lens[i]), tokens(output_lens[i])) for i in range(n)]
    elif name in ("chat", "system-prompt", "long-document", "long-context"):
        times = arrival_times(n, rate, rng_arrival, arrival, burstiness)
        if name == "long-document":
            prompt_lens = rng_len.integers(2048, 6145, n)
            output_lens = lognormal_lengths(rng_len, n, 200, 0.6, 32, 1024)
        elif name == "long-context":
            prompt_lens = rng_len.integers(6144, 7425, n)
            output_lens = lognormal_lengths(rng_len, n, 640, 0.4, 256, 1024)
        else:
            prompt_lens = rng_len.integers(16, 129, n)
            output_lens = lognormal_lengths(rng_len, n, 120, 0.8, 16, 512)
        shared = tokens(SYSTEM_PROMPT_TOKENS) if name == "system-prompt" else []
        specs = [(times[i], shared + tokens(prompt_lens[i]), tokens(output_lens[i]))
                 for i in range(n)]
    elif name == "multi-turn":
        specs = _conversations(n, rate, rng_arrival, rng_len, tokens, arrival, burstiness,
                               max_model_len)
    else:
        specs = _trees(n, rate, rng_arrival, rng_len, tokens, arrival, burstiness)
    requests = []
    for i, (t, prompt, output) in enumerate(sorted(specs, key=lambda s: s[0])):
        prompt, output = _fit(prompt, output, max_model_len)
        requests.append(SimRequest(f"{name}-{i}", float(t), prompt, output))
    return requests


def _chat_answer(rng_len, tokens) -> list[int]:
    return tokens(lognormal_lengths(rng_len, 1, 120, 0.8, 16, 512)[0])


def _conversations(n, rate, rng_arrival, rng_len, tokens, arrival, burstiness, max_model_len):
    """(arrival, prompt, output ids) of multi-turn chats, n requests in all. A turn's
    prompt holds the previous prompt and its answer's exact ids; a conversation ends after
    2-6 turns or before it would exceed max_model_len."""
    mean_turns, think_s = 4.0, 10.0
    starts = arrival_times(n, rate / mean_turns, rng_arrival, arrival, burstiness)
    specs, conv = [], 0
    while len(specs) < n:
        history: list[int] = []
        t = starts[conv]
        conv += 1
        for _ in range(int(rng_len.integers(2, 7))):
            prompt = history + tokens(rng_len.integers(16, 129))
            answer = _chat_answer(rng_len, tokens)
            if len(specs) == n or (history and len(prompt) + len(answer) > max_model_len):
                break
            specs.append((t, prompt, answer))
            history = prompt + answer
            t += rng_arrival.exponential(think_s)
    return specs


def _trees(n, rate, rng_arrival, rng_len, tokens, arrival, burstiness):
    """(arrival, prompt, output ids) of branching requests, n in all: root + branch +
    question, the requests of one tree 0.2 s apart on average."""
    mean_leaves = 6.0
    starts = arrival_times(n, rate / mean_leaves, rng_arrival, arrival, burstiness)
    specs, tree = [], 0
    while len(specs) < n:
        root = tokens(rng_len.integers(512, 1025))
        t = starts[tree]
        tree += 1
        for _ in range(int(rng_len.integers(2, 5))):
            branch = root + tokens(rng_len.integers(64, 257))
            for _ in range(int(rng_len.integers(1, 4))):
                if len(specs) < n:
                    question = tokens(rng_len.integers(16, 65))
                    specs.append((t, branch + question, _chat_answer(rng_len, tokens)))
                    t += rng_arrival.exponential(0.2)
    return specs


# ---- replaying a trace -------------------------------------------------------------------


def load_trace(path: Path, *, vocab_size: int, max_model_len: int, seed: int = 0,
               rate: float | None = None) -> list[SimRequest]:
    """Requests from a JSONL trace, one object per line:

        {"timestamp": 0.0, "prompt_tokens": 512, "output_tokens": 128}
        {"timestamp": 0.4, "prompt_token_ids": [...], "output_tokens": 64, "request_id": "a"}
        {"timestamp": 0.9, "prompt_tokens": 300, "output_tokens": 50,
         "prefix_id": "sys", "prefix_tokens": 200, "spec_alpha": 0.8}

    timestamp: seconds (any start, any order); prompt_tokens: synthetic ids are drawn for
    it; prefix_id / prefix_tokens: requests naming the same prefix_id start with the same
    prefix_tokens ids (shared system prompts, so prefix caching hits); spec_alpha: this
    request's draft acceptance rate under speculative decoding. With `rate`, the
    timestamps are rescaled so that requests arrive at that mean rate.
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read trace {path}: {e.strerror}") from None
    _, _, rng_tok = _streams(seed)
    tokens = _Tokens(rng_tok, vocab_size)
    prefixes: dict[str, list[int]] = {}
    specs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"trace {path} line {number}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object")
        t = rec.get("timestamp")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"{where}: needs a numeric \"timestamp\" (seconds)")
        out = rec.get("output_tokens")
        if isinstance(out, bool) or not isinstance(out, int) or out < 1:
            raise ValueError(f"{where}: needs \"output_tokens\", an integer >= 1")
        prompt = _trace_prompt(rec, where, tokens, prefixes, vocab_size)
        rid = str(rec.get("request_id", f"trace-{len(specs)}"))
        alpha = rec.get("spec_alpha")
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(
                alpha, (int, float)) or not 0.0 <= alpha <= 1.0):
            raise ValueError(f"{where}: \"spec_alpha\" must be a number in [0, 1]")
        specs.append((float(t), rid, prompt, tokens(out), alpha))
    if not specs:
        raise ValueError(f"trace {path} holds no requests")
    specs.sort(key=lambda s: s[0])
    start = specs[0][0]
    scale = 1.0
    if rate is not None:
        span = specs[-1][0] - start
        if len(specs) > 1 and span > 0:
            scale = (len(specs) - 1) / rate / span
    requests = []
    for t, rid, prompt, output, alpha in specs:
        prompt, output = _fit(prompt, output, max_model_len)
        requests.append(SimRequest(rid, (t - start) * scale, prompt, output,
                                   None if alpha is None else float(alpha)))
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError(f"trace {path}: request_id values repeat")
    return requests


def _trace_prompt(rec: dict, where: str, tokens, prefixes: dict, vocab_size: int) -> list[int]:
    ids = rec.get("prompt_token_ids")
    if ids is not None:
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids)):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of ids "
                             f"in 0..{vocab_size - 1}")
        return list(ids)
    n = rec.get("prompt_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: needs \"prompt_tokens\" (an integer >= 1) or "
                         "\"prompt_token_ids\"")
    prefix_id = rec.get("prefix_id")
    if prefix_id is None:
        return tokens(n)
    k = rec.get("prefix_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"{where}: prefix_tokens must be an integer in 1..prompt_tokens")
    prefix = prefixes.setdefault(str(prefix_id), [])
    if len(prefix) < k:
        prefix.extend(tokens(k - len(prefix)))
    return prefix[:k] + tokens(n - k)
