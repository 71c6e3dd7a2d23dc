"""After `scheduler.update`: what a step means for its callers, as `RequestOutput`s.

`update` already decided everything (which tokens and logprobs were appended, which sequences
stopped and why, where a stop string cuts the text: refserve/sequence.py). This module only
reports it, reading the `StepUpdate` it is given and the sequences, never the scheduler:

    count target passes        one per sampling row; a verify row's (proposed, accepted)
    stamp times                first token, finish
    build outputs              the cumulative `RequestOutput` of every request that got
                               tokens (vLLM's default output kind)

`LLMEngine.finish_step` calls `make_outputs` last in a step (and forgets finished requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refserve.metrics import RequestMetrics
from refserve.outputs import CompletionOutput, RequestOutput
from refserve.sampling_params import SamplingParams
from refserve.scheduler.output import SchedulerOutput, StepUpdate
from refserve.sequence import Sequence


@dataclass
class RequestState:
    """What the engine keeps of one request between steps."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seed: int | None = None  # its own seed, else one drawn from the engine's seed
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return (len(self.seqs) == self.params.n or self.seqs[0].is_finished) and all(
            s.is_finished for s in self.seqs)


def make_outputs(requests: dict[str, RequestState], out: SchedulerOutput,
                 update: StepUpdate, now: float) -> list[RequestOutput]:
    """One RequestOutput per request that got tokens in this step (see the module
    docstring); changes only the requests' metrics and their sequences' times."""
    touched: dict[str, RequestState] = {}
    for row in out.scheduled:
        req = requests.get(row.seq.request_id)
        if req is not None and row.seq.seq_id in update.appended:  # else aborted, or no tokens
            touched[req.request_id] = req
            # One target pass; a verify row adds its drafts proposed and accepted
            # (scheduler/drafts.py: count_verified), so output tokens = passes + accepted.
            req.metrics.num_target_passes += 1
            if (verified := update.verified.get(row.seq.seq_id)) is not None:
                req.metrics.num_spec_verify_steps += 1
                req.metrics.num_spec_proposed += verified[0]
                req.metrics.num_spec_accepted += verified[1]
    for req in touched.values():
        for seq in req.seqs:  # a child forked this step is one of them already
            if seq.first_token_time is None and seq.num_output_tokens > 0:
                seq.first_token_time = now
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
            if seq.is_finished and seq.finish_time is None:
                seq.finish_time = now
    return [make_output(req, now) for req in touched.values()]


def visible_text(seq: Sequence, hold: int) -> str:
    """The sequence's text as a caller may see it now: cut where a stop rule ended it, and
    while it runs, without the last `hold` characters (a stop string still being completed
    may cut them, and a streamed prefix must never show text the final output drops; vLLM's
    detokenizer holds back the same)."""
    text = seq.detokenizer.text if seq.detokenizer is not None else ""
    if seq.output_text_end is not None:
        return text[:seq.output_text_end]
    if hold and not seq.is_finished:
        return text[:max(0, len(text) - hold)]
    return text


def make_output(req: RequestState, now: float) -> RequestOutput:
    """The request's outputs so far (cumulative, as vLLM's default output kind); a finished
    request's metrics are completed first."""
    if req.finished:
        req.metrics.record_finish(req.seqs, now)
    params = req.params
    hold = (max(map(len, params.stop)) - 1
            if params.stop and not params.include_stop_str_in_output else 0)
    completions = []
    for i, seq in enumerate(sorted(req.seqs, key=lambda s: s.child_index)):
        lps = list(seq.output_logprobs) if params.logprobs is not None else None
        cumulative = (None if lps is None else float(sum(
            d[t].logprob for d, t in zip(lps, seq.output_token_ids))))
        completions.append(CompletionOutput(
            index=i, text=visible_text(seq, hold), token_ids=list(seq.output_token_ids),
            cumulative_logprob=cumulative, logprobs=lps,
            finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
        prompt_logprobs=req.prompt_logprobs, outputs=completions, finished=req.finished,
        metrics=req.metrics, num_cached_tokens=req.seqs[0].num_cached_tokens or 0)
