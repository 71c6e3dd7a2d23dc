"""What a serving engine is judged by, per request and per run.

    TTFT  time to first token   = first_token_time - arrival_time   (prefill, compute-bound)
    TPOT  time per output token = (finish_time - first_token_time) / (output tokens - 1)
                                  of ONE sequence (decode, bandwidth-bound); with n > 1
                                  samples, sum of the sequences' decode times / sum of
                                  their (tokens - 1): they decode side by side, so dividing
                                  the request's time by all n samples' tokens would be n x
                                  too small
    throughput                  = output tokens / wall time
    prefix-cache hit rate       = hit tokens / queried prompt tokens
    slot-steps                  = batch seats × steps; "used" advanced a live sequence,
                                  "wasted" computed a finished one as padding (static batching)

Speculative decoding (terms of refserve/spec_decode/__init__.py):
    proposed / accepted         draft tokens sent to the target / kept
    draft acceptance rate       = accepted / proposed (vLLM's name). Not α, the per-token
                                  acceptance probability of the formula: drafts after a
                                  rejection count as proposed but were never tested, so at
                                  k = 4 and α = 0.3 the rate is about 10.6% (below)
    mean accepted length        = (accepted + verify steps) / verify steps: tokens emitted per
                                  verify pass, the recovered or bonus token included
                                  (vLLM's "mean acceptance length")
    target passes per token     = target passes that sampled for the request / output tokens
                                  (1.0 without speculation; below 1 is what speculation buys)

If each draft is accepted independently with probability α (Leviathan et al.), a verify
step with k drafts emits on average

    E[tokens per target pass] = 1 + α + α² + ... + α^k = (1 - α^(k+1)) / (1 - α)

(`expected_tokens_per_pass`), while accepted / proposed = α (1 - α^k) / (k (1 - α)).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from refserve.sequence import Sequence


class SpecRatios:
    """The speculative-decoding ratios of a request or a run, from its counters
    (num_spec_proposed / _accepted / _verify_steps, num_target_passes, num_output_tokens):

        draft acceptance rate   accepted / proposed   (not α: see the module docstring)
        mean accepted length    (accepted + verify steps) / verify steps   (tokens per verify)
        target passes / token   passes / output tokens   (1.0 without speculation)
    """

    @property
    def acceptance_rate(self) -> float | None:
        return spec_acceptance_rate(self.num_spec_proposed, self.num_spec_accepted)

    @property
    def mean_accepted_length(self) -> float | None:
        return spec_mean_accepted_length(self.num_spec_verify_steps, self.num_spec_accepted)

    @property
    def target_passes_per_output_token(self) -> float | None:
        return (self.num_target_passes / self.num_output_tokens
                if self.num_output_tokens else None)



@dataclass
class RequestMetrics(SpecRatios):
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0      # prefix-cache hit tokens
    num_preemptions: int = 0
    # Per-sequence decode time and tokens after the first, summed over the n samples (set
    # at finish by the engine); None: one sequence, TPOT from the request's own times.
    decode_time: float | None = None
    num_decode_tokens: int | None = None
    num_target_passes: int = 0      # steps in which one of its sequences sampled
    num_spec_verify_steps: int = 0  # ... of them verify steps (drafts were scored)
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None:
            return None
        if self.num_decode_tokens is not None:
            return self.decode_time / self.num_decode_tokens if self.num_decode_tokens else None
        if self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    def record_finish(self, seqs: Iterable[Sequence], now: float) -> None:
        """Complete the metrics of a request whose sequences all finished: the one rule of
        the engine (output_processor) and the simulator alike. Reads each sequence's
        `first_token_time` and `finish_time` (None: `now`), its tokens, cache hits and
        preemptions. TPOT is per sequence (module docstring): each decoding sequence adds
        its own finish - first token time and its tokens after the first."""
        seqs = list(seqs)
        self.finish_time = max(s.finish_time or now for s in seqs)
        self.num_output_tokens = sum(s.num_output_tokens for s in seqs)
        decoding = [s for s in seqs if s.num_output_tokens > 1
                    and s.first_token_time is not None]
        self.decode_time = sum((s.finish_time or now) - s.first_token_time for s in decoding)
        self.num_decode_tokens = sum(s.num_output_tokens - 1 for s in decoding)
        self.num_cached_tokens = seqs[0].num_cached_tokens or 0
        self.num_preemptions = sum(s.num_preemptions for s in seqs)

    def to_dict(self) -> dict:
        return {**asdict(self), "ttft": self.ttft, "tpot": self.tpot,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "target_passes_per_output_token": self.target_passes_per_output_token}


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """(1 - α^(k+1)) / (1 - α): tokens one verify step of k drafts emits on average, when
    each draft is accepted with probability α (k + 1 when α = 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r}: must be in [0, 1]")
    if k < 0:
        raise ValueError(f"k={k!r}: must be >= 0")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def spec_acceptance_rate(proposed: int, accepted: int) -> float | None:
    return accepted / proposed if proposed else None


def spec_mean_accepted_length(verify_steps: int, accepted: int) -> float | None:
    return (accepted + verify_steps) / verify_steps if verify_steps else None


def percentile(values, q: float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


@dataclass
class RunSummary(SpecRatios):
    num_requests: int
    num_output_tokens: int
    num_prompt_tokens: int
    elapsed: float
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    kv_blocks_peak: int
    kv_blocks_total: int
    prefix_hit_rate: float | None
    num_preemptions: int
    num_steps: int
    slot_steps_used: int
    slot_steps_wasted: int
    num_target_passes: int = 0
    num_spec_verify_steps: int = 0
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    speculative_method: str | None = None  # set by LLM.generate when the engine speculates

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed if self.elapsed > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "output_tokens_per_s": self.output_tokens_per_s,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "target_passes_per_output_token": self.target_passes_per_output_token}

    def format_speculation(self) -> str:
        """'spec ngram: draft acceptance rate 61.0% (122/200 drafts accepted), mean
        accepted length 2.53, target passes per output token 0.40' ('' when the run did
        not speculate). The rate is accepted / proposed, not α."""
        if self.speculative_method is None and not self.num_spec_proposed:
            return ""
        rate = self.acceptance_rate
        length = self.mean_accepted_length
        passes = self.target_passes_per_output_token
        return (f"spec {self.speculative_method or ''}: draft acceptance rate "
                f"{'-' if rate is None else f'{rate:.1%}'} ({self.num_spec_accepted}/"
                f"{self.num_spec_proposed} drafts accepted), mean accepted length "
                f"{'-' if length is None else f'{length:.2f}'}, target passes per output "
                f"token {'-' if passes is None else f'{passes:.2f}'}")

    def format(self) -> str:
        def ms(x):
            return "-" if x is None else f"{x * 1000:.0f} ms"

        hit = "-" if self.prefix_hit_rate is None else f"{self.prefix_hit_rate:.1%}"
        return (
            f"{self.num_requests} requests, {self.num_output_tokens} output tokens in "
            f"{self.elapsed:.2f} s = {self.output_tokens_per_s:.1f} tok/s | "
            f"TTFT p50 {ms(self.ttft_p50)} p99 {ms(self.ttft_p99)} | "
            f"TPOT p50 {ms(self.tpot_p50)} p99 {ms(self.tpot_p99)} | "
            f"KV blocks peak {self.kv_blocks_peak}/{self.kv_blocks_total} | "
            f"prefix hit rate {hit} | preemptions {self.num_preemptions} | "
            f"steps {self.num_steps}, slot-steps used {self.slot_steps_used} "
            f"wasted {self.slot_steps_wasted}"
            + (f" | {self.format_speculation()}" if self.format_speculation() else ""))


def summarize(metrics: list[RequestMetrics], elapsed: float, engine_stats: dict) -> RunSummary:
    ttfts = [m.ttft for m in metrics]
    tpots = [m.tpot for m in metrics]
    queried = engine_stats.get("prefix_cache_queried_tokens", 0)
    return RunSummary(
        num_requests=len(metrics),
        num_output_tokens=sum(m.num_output_tokens for m in metrics),
        num_prompt_tokens=sum(m.num_prompt_tokens for m in metrics),
        elapsed=elapsed,
        ttft_p50=percentile(ttfts, 50), ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50), tpot_p99=percentile(tpots, 99),
        kv_blocks_peak=engine_stats.get("kv_blocks_peak", 0),
        kv_blocks_total=engine_stats.get("kv_blocks_total", 0),
        prefix_hit_rate=(engine_stats.get("prefix_cache_hit_tokens", 0) / queried
                         if queried else None),
        num_preemptions=sum(m.num_preemptions for m in metrics),
        num_steps=engine_stats.get("num_steps", 0),
        slot_steps_used=engine_stats.get("slot_steps_used", 0),
        slot_steps_wasted=engine_stats.get("slot_steps_wasted", 0),
        num_target_passes=sum(m.num_target_passes for m in metrics),
        num_spec_verify_steps=sum(m.num_spec_verify_steps for m in metrics),
        num_spec_proposed=sum(m.num_spec_proposed for m in metrics),
        num_spec_accepted=sum(m.num_spec_accepted for m in metrics),
    )
