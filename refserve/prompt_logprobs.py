"""vLLM's prompt_logprobs: the log-probability of every prompt token given the ones before,
from one extra forward of the prompt through a scratch KV cache of its own (the serving pool
and the prefix cache are untouched)."""

from __future__ import annotations

from refserve.capacity import blocks_for_tokens
from refserve.logprobs import compute_logprobs
from refserve.model_runner import ModelRunner
from refserve.sampling_params import SamplingParams
from refserve.scheduler.output import ScheduledSequence, SchedulerOutput
from refserve.sequence import Sequence


def score_prompt(engine, token_ids: list[int], num_logprobs: int) -> list:
    """vLLM's prompt_logprobs: entry j is {token_id: Logprob} for prompt token j given
    tokens 0..j-1 (entry 0 is None), from one extra forward of the prompt through a
    scratch KV cache of its own (so the serving pool and prefix cache are untouched),
    in chunks of max_num_batched_tokens so the logits stay [chunk, vocab]."""
    n, bs = len(token_ids), engine.block_size
    num_blocks = blocks_for_tokens(n, bs)
    runner = ModelRunner(engine.model, engine.backend, num_blocks, bs)
    seq = Sequence("prompt-logprobs", token_ids, SamplingParams())
    chunk = engine.config.max_num_batched_tokens
    result: list = [None]
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        out = SchedulerOutput(step=0, scheduled=[ScheduledSequence(
            seq=seq, start=start, num_scheduled_tokens=size, num_logits=size,
            block_ids=list(range(num_blocks)))])
        logits = runner.forward(runner.prepare(out))
        # Row i predicts prompt token start + i + 1 (the prompt's last row predicts none).
        targets = token_ids[start + 1:start + size + 1]
        result += compute_logprobs(logits[:len(targets)], targets, num_logprobs,
                                   engine.decode_token)
    return result
