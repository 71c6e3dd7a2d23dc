"""What `LLM.generate` and `LLMEngine.step` return: vLLM's `RequestOutput` / `CompletionOutput`.

Field names and meanings are vLLM's (vllm/outputs.py), so code that reads vLLM's outputs reads
these unchanged:

| RequestOutput field | meaning |
| --- | --- |
| request_id, prompt, prompt_token_ids | the request as given (prompt is None for token ids) |
| prompt_logprobs | None unless asked; else per prompt token None (the first) or {id: Logprob} |
| outputs | one CompletionOutput per sample (n of them), in sample order |
| finished | every sample has finished |
| num_cached_tokens | prompt tokens served from the prefix cache (their KV was not computed) |
| metrics | refserve's per-request timings (TTFT, TPOT, preemptions); vLLM's is None by default |

| CompletionOutput field | meaning |
| --- | --- |
| index | the sample's index, 0..n-1 |
| text, token_ids | the text (cut before a stop string unless include_stop_str_in_output), ids |
| cumulative_logprob | sum of the sampled tokens' logprobs; None unless logprobs were requested |
| logprobs | None unless SamplingParams.logprobs; else per generated token {token_id: Logprob} |
| finish_reason | "stop", "length", "abort", or None while running |
| stop_reason | the stop string or stop token id that ended it; None for EOS, length or running |
"""

from __future__ import annotations

from dataclasses import dataclass

from refserve.logprobs import Logprob
from refserve.metrics import RequestMetrics

# vLLM's aliases for one position's logprobs and a whole sequence of them.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None   # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None  # refserve's (vLLM's is None by default)
    num_cached_tokens: int = 0
