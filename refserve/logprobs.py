"""Logprobs: how likely the model found each token, in vLLM's output shape.

For one row of logits x (length V) the log-probabilities are the log-softmax

    logprob[t] = x[t] - logsumexp(x) = x[t] - (m + log(sum_j exp(x[j] - m))),  m = max(x)

taken over the RAW model logits: before penalties, temperature, top-k, top-p and min_p.
This is vLLM's default (`logprobs_mode="raw_logprobs"`): the number reports what the model
thinks, not the distribution the sampler happened to draw from, so it does not change with
the sampling settings and matches `torch.log_softmax(logits)` of the same model.

rank[t] = the number of tokens whose logprob is >= logprob[t] (vLLM's count), so the most
likely token has rank 1 and tied tokens share the larger rank. Ranks and the top-N order
compare the logits themselves (logprob is x minus a constant, so the order is the same, and
two logits that differ stay apart even where their float32 logprobs round to one value).

Per position the result is a dict {token_id: Logprob}, as vLLM's `SampleLogprobs` entries:
the chosen token first (the sampled token, or for prompt logprobs the prompt's next token),
always present even when it is not among the top N, then the top N by logprob (ties by
smaller token id). A token that is both appears once, so a dict has N or N + 1 entries.
N = 0 reports only the chosen token; N = -1 (vLLM's) every token of the vocabulary, so the
dict has exactly V entries and its probabilities sum to 1.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np


@dataclass
class Logprob:
    """One token's log-probability, its rank in the vocabulary (1 = most likely) and its
    text (None until a tokenizer fills it in). Field names are vLLM's."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float32 (max subtracted first, so no exp overflows)."""
    x = np.asarray(logits, dtype=np.float32)
    m = x.max(axis=-1, keepdims=True)
    shifted = x - m
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compute_logprobs(logits: np.ndarray, token_ids: SequenceOf[int],
                     num_logprobs: int | SequenceOf[int],
                     decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob]]:
    """For each row i of `logits` [N, V]: the logprob and rank of `token_ids[i]` plus the
    top `num_logprobs` (one int for all rows, or one per row) tokens of that row.

    `decode`, when given, maps a token id to its text for `Logprob.decoded_token`.
    A count of -1 means the whole vocabulary.
    """
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 2 or len(token_ids) != len(logits):
        raise ValueError(f"compute_logprobs: expected logits [N, V] and N token ids, got "
                         f"{logits.shape} and {len(token_ids)}")
    counts = ([int(num_logprobs)] * len(logits) if np.ndim(num_logprobs) == 0
              else [int(k) for k in num_logprobs])
    vocab = logits.shape[-1]
    lp = log_softmax(logits)
    token_ids = np.asarray(token_ids, dtype=np.int64)
    rows = np.arange(len(lp))
    chosen_lp = lp[rows, token_ids]
    chosen_rank = (logits >= logits[rows, token_ids][:, None]).sum(axis=-1)
    results = []
    for i, (k, tok) in enumerate(zip(counts, token_ids.tolist())):
        out = {tok: Logprob(float(chosen_lp[i]), int(chosen_rank[i]),
                            decode(tok) if decode else None)}
        k = vocab if k < 0 else min(k, vocab)
        if k:
            # Every token at least as likely as the k-th (partition: O(V)), so ties at the
            # cut are all seen and the smaller ids win; ranks are counted among them.
            kth = -np.partition(-logits[i], k - 1)[k - 1]
            cand = np.flatnonzero(logits[i] >= kth)
            vals = logits[i, cand]
            for j in np.lexsort((cand, -vals))[:k].tolist():
                t = int(cand[j])
                if t not in out:
                    out[t] = Logprob(float(lp[i, t]), int((vals >= vals[j]).sum()),
                                     decode(t) if decode else None)
        results.append(out)
    return results


def sampled_logprobs(logits: np.ndarray, token_ids: SequenceOf[int], params,
                     decode: Callable[[int], str] | None = None
                     ) -> list[dict[int, Logprob] | None]:
    """Per row of `logits` [N, V] (the raw logits the Sampler drew `token_ids` from): vLLM's
    {token_id: Logprob} of the sampled token and the top `params[i].logprobs`, or None for
    a row whose params did not ask (`logprobs=None`)."""
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[dict[int, Logprob] | None] = [None] * len(token_ids)
    if asked:
        found = compute_logprobs(np.asarray(logits)[asked], [token_ids[i] for i in asked],
                                 [params[i].logprobs for i in asked], decode)
        for i, d in zip(asked, found):
            result[i] = d
    return result


def prompt_logprobs(logits: np.ndarray, prompt_token_ids: SequenceOf[int], num_logprobs: int,
                    decode: Callable[[int], str] | None = None) -> list[dict[int, Logprob] | None]:
    """vLLM's `prompt_logprobs` for a whole prompt: entry j scores prompt token j given
    tokens 0..j-1, so it is read from the logits row of position j-1. Entry 0 is None (no
    context predicts the first token). `logits` holds one row per prompt position (the last
    row, which predicts the first output token, is not used)."""
    if len(logits) != len(prompt_token_ids):
        raise ValueError(f"prompt_logprobs: {len(logits)} logits rows for "
                         f"{len(prompt_token_ids)} prompt tokens")
    if len(prompt_token_ids) < 2:
        return [None] * len(prompt_token_ids)
    scored = compute_logprobs(np.asarray(logits)[:-1], list(prompt_token_ids)[1:],
                              num_logprobs, decode)
    return [None, *scored]
