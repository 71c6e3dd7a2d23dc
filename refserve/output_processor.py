"""After `scheduler.update`: what the engine makes of a step for its callers.

For every sequence that got tokens: register forked children, extend its text by
incremental detokenization (refserve/detokenizer.py), apply stop strings (also on the token
that finished it by length), stamp first-token and finish times, and build the cumulative
`RequestOutput`s (vLLM's default output kind). `LLMEngine.step()` calls `postprocess` last.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from refserve.detokenizer import IncrementalDetokenizer
from refserve.metrics import RequestMetrics
from refserve.outputs import CompletionOutput, RequestOutput
from refserve.sampling_params import SamplingParams
from refserve.scheduler.output import SampledTokens, SchedulerOutput
from refserve.sequence import Sequence, SequenceStatus


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seed: int | None = None  # its own seed, else one drawn from the engine's seed
    seqs: list[Sequence] = field(default_factory=list)
    generators: dict[int, np.random.Generator] = field(default_factory=dict)
    stop_text_len: dict[int, int] = field(default_factory=dict)  # seq_id → text cut at stop
    stop_reason: dict[int, int | str] = field(default_factory=dict)  # seq_id → string / id
    logprobs: dict[int, list] = field(default_factory=dict)  # seq_id → one dict per token
    prompt_logprobs: list | None = None
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return (len(self.seqs) == self.params.n or self.seqs[0].is_finished) and all(
            s.is_finished for s in self.seqs)


def postprocess(engine, out: SchedulerOutput, sampled: SampledTokens,
                 now: float) -> list[RequestOutput]:
    """After update: register forked children, extend each sequence's text by its new
    tokens (incremental detokenization), apply stop strings, stamp times; return one
    RequestOutput per request that got tokens, and forget finished requests."""
    for child in out.forked:
        req = engine.requests[child.request_id]
        req.seqs.append(child)
        parent_id = req.seqs[0].seq_id
        req.generators[child.seq_id] = sampled.generators[(parent_id, child.child_index)]
        lp = engine._new_logprobs.pop((parent_id, child.child_index), None)
        if lp is not None:
            engine._new_logprobs[child.seq_id] = lp
    touched: dict[str, RequestState] = {}
    got_tokens = [row.seq for row in out.scheduled if row.seq.seq_id in sampled.token_ids]
    for seq in got_tokens + out.forked:
        req = engine.requests.get(seq.request_id)
        if req is None:
            continue  # aborted since schedule()
        touched[req.request_id] = req
        advance_text(engine, req, seq, now)
    for req in touched.values():
        if req.finished:
            m = req.metrics
            m.finish_time = max(s.finish_time or now for s in req.seqs)
            m.num_output_tokens = sum(s.num_output_tokens for s in req.seqs)
            # TPOT is per sequence: the n samples decode side by side, so their time
            # between tokens is each one's, not the total over n.
            decoding = [s for s in req.seqs if s.num_output_tokens > 1
                        and s.first_token_time is not None]
            m.decode_time = sum(s.finish_time - s.first_token_time for s in decoding)
            m.num_decode_tokens = sum(s.num_output_tokens - 1 for s in decoding)
            m.num_cached_tokens = req.seqs[0].num_cached_tokens
            m.num_preemptions = sum(s.num_preemptions for s in req.seqs)
    outputs = [make_output(req) for req in touched.values()]
    for req in touched.values():
        if req.finished:
            del engine.requests[req.request_id]
    return outputs

def advance_text(engine, req: RequestState, seq: Sequence, now: float) -> None:
    """New tokens of `seq`: first-token time, text, stop strings, finish time.

    Stop strings are checked on every new token once min_tokens output tokens exist
    (vLLM), also on the one that finished the sequence by length (max_tokens /
    max_model_len): a stop string it completes still cuts the text and makes the finish
    reason "stop", as in vLLM. The text is cut before the stop string, or after it with
    include_stop_str_in_output; stop_reason is the matched string, or the stop token id
    that ended the sequence (None for EOS and length).
    """
    lp = engine._new_logprobs.pop(seq.seq_id, None)
    if lp is not None:
        req.logprobs.setdefault(seq.seq_id, []).append(lp)
    if seq.first_token_time is None and seq.num_output_tokens > 0:
        seq.first_token_time = now
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
    detok = req.detokenizers.get(seq.seq_id)
    if detok is None:
        detok = req.detokenizers[seq.seq_id] = IncrementalDetokenizer(engine.tokenizer)
    old_len = len(detok.text)
    detok.update(seq.output_token_ids)
    params = req.params
    stops = params.stop
    if (stops and seq.seq_id not in req.stop_text_len
            and seq.num_output_tokens >= params.min_tokens):
        text = detok.text
        # Only a match that ends in the new text is new: start the search far enough
        # back for the longest stop string to straddle the old/new boundary.
        since = max(0, old_len - max(map(len, stops)) + 1)
        hits = [(i, st) for i, st in ((text.find(st, since), st) for st in stops)
                if i >= 0]
        if hits:
            at, stop = min(hits)
            keep = len(stop) if params.include_stop_str_in_output else 0
            req.stop_text_len[seq.seq_id] = at + keep
            req.stop_reason[seq.seq_id] = stop
            if seq.is_finished:  # finished by length on this very token
                seq.status = SequenceStatus.FINISHED_STOPPED
            else:
                engine.scheduler.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
    if (seq.status == SequenceStatus.FINISHED_STOPPED and seq.seq_id not in req.stop_reason
            and seq.output_token_ids):
        last = seq.output_token_ids[-1]
        eos = last == engine.eos_token_id and not params.ignore_eos
        if not eos and last in params.stop_token_ids:
            req.stop_reason[seq.seq_id] = last
    if seq.is_finished and seq.finish_time is None:
        seq.finish_time = now

def make_output(req: RequestState) -> RequestOutput:
    """The request's outputs so far (cumulative, as vLLM's default output kind).

    While a sequence runs, the text holds back the last len(longest stop string) - 1
    characters (as vLLM's detokenizer does): a stop string still being completed may
    cut them, and a streamed prefix must never show text the final output drops."""
    params = req.params
    hold = (max(map(len, params.stop)) - 1
            if params.stop and not params.include_stop_str_in_output else 0)
    completions = []
    for i, seq in enumerate(sorted(req.seqs, key=lambda s: s.child_index)):
        detok = req.detokenizers.get(seq.seq_id)
        text = detok.text if detok is not None else ""
        if seq.seq_id in req.stop_text_len:
            text = text[:req.stop_text_len[seq.seq_id]]
        elif hold and not seq.is_finished:
            text = text[:max(0, len(text) - hold)]
        lps = req.logprobs.get(seq.seq_id) if params.logprobs is not None else None
        if params.logprobs is not None:
            lps = lps or []
        cumulative = (None if lps is None else float(sum(
            d[t].logprob for d, t in zip(lps, seq.output_token_ids))))
        completions.append(CompletionOutput(
            i, text, list(seq.output_token_ids), cumulative, lps,
            seq.status.finish_reason, req.stop_reason.get(seq.seq_id)))
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                         req.prompt_logprobs, completions, req.finished, req.metrics,
                         req.seqs[0].num_cached_tokens)
