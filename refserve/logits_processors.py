"""Logits processors: rules that rewrite one sequence's row of logits before sampling.

They run on the raw logits, in vLLM's order, before temperature and before greedy argmax
(so they change greedy output too):

1. min_tokens: while fewer than `min_tokens` tokens were generated, EOS (unless ignore_eos)
   and every `stop_token_ids` entry get logit -inf, so the sequence cannot end yet.
2. repetition penalty r (HF / vLLM, CTRL paper): for every token that occurs in the prompt
   or the output so far,   logit' = logit / r  if logit > 0,  else logit * r.
   r > 1 makes seen tokens less likely whatever the logit's sign; r = 1 is off.
3. frequency penalty f and presence penalty p (OpenAI's definition), over OUTPUT tokens only:
       logit'[t] = logit[t] - f * count[t] - p * (count[t] > 0)
   where count[t] is how often t was generated. Negative values encourage repetition.

Each function edits `row` (a float32 vector of length vocab) in place and returns it; the
caller passes a copy if it must keep the model's logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from refserve.sampling_params import SamplingParams


def apply_min_tokens(row: np.ndarray, params: SamplingParams, num_output_tokens: int,
                     eos_token_id: int | None) -> np.ndarray:
    """Rule 1: forbid the tokens that would end the sequence before `min_tokens`."""
    if num_output_tokens >= params.min_tokens:
        return row
    banned = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        banned.append(eos_token_id)
    banned = [t for t in banned if 0 <= t < row.shape[-1]]
    row[banned] = -np.inf
    return row


def apply_penalties(row: np.ndarray, params: SamplingParams, prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int]) -> np.ndarray:
    """Rules 2 and 3 (repetition, then frequency and presence)."""
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([np.asarray(prompt_token_ids, dtype=np.int64),
                                         np.asarray(output_token_ids, dtype=np.int64)]))
        r = np.float32(params.repetition_penalty)
        vals = row[seen]
        row[seen] = np.where(vals > 0, vals / r, vals * r)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and len(
            output_token_ids):
        tokens, counts = np.unique(np.asarray(output_token_ids, dtype=np.int64),
                                   return_counts=True)
        row[tokens] -= (np.float32(params.frequency_penalty) * counts.astype(np.float32)
                        + np.float32(params.presence_penalty))
    return row
