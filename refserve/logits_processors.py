"""Logits processors: rules that rewrite one sequence's row of logits before sampling.

They run on the raw logits, in vLLM's order, before temperature and before greedy argmax
(so they change greedy output too):

a. allowed_token_ids: every token NOT in the list gets logit -inf (a whitelist).
b. bad_words: each bad word is tokenized once per request, as it would appear at the start
   of the text and after a space (`bad_words_token_ids`, vLLM's rule: the spaced form only
   when it is a different token sequence of the same length). For each such sequence
   w_1..w_m: if the output so far ends with w_1..w_{m-1} (always, for m = 1), w_m gets -inf.
   So the word can never be completed; its first tokens alone stay allowed.
c. logit_bias: logit'[t] = logit[t] + bias[t] (OpenAI's: -100 bans a token in practice).
1. min_tokens: while fewer than `min_tokens` tokens were generated, EOS (unless ignore_eos)
   and every `stop_token_ids` entry get logit -inf, so the sequence cannot end yet.
2. repetition penalty r (HF / vLLM, CTRL paper): for every token that occurs in the prompt
   or the output so far,   logit' = logit / r  if logit > 0,  else logit * r.
   r > 1 makes seen tokens less likely whatever the logit's sign; r = 1 is off.
3. frequency penalty f and presence penalty p (OpenAI's definition), over OUTPUT tokens only:
       logit'[t] = logit[t] - f * count[t] - p * (count[t] > 0)
   where count[t] is how often t was generated. Negative values encourage repetition.

Each function edits `row` (a float32 vector of length vocab) in place and returns it;
`apply_processors` runs them in this order on a copy of a batch's rows (the Sampler's first
step, refserve/sampling/sampler.py).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from refserve.sampling_params import SamplingParams


def apply_allowed_token_ids(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Rule a: only `allowed_token_ids` keep their logits (ids past the row are ignored)."""
    keep = np.zeros(row.shape[-1], dtype=bool)
    ids = [t for t in params.allowed_token_ids if t < row.shape[-1]]
    keep[ids] = True
    row[~keep] = -np.inf
    return row


def bad_words_token_ids(bad_words: SequenceOf[str], tokenizer) -> list[list[int]]:
    """Rule b's token sequences: each word (leading spaces stripped) as it encodes at the
    start of a text, and with one leading space when that gives a different first token
    and the same number of tokens (a word-initial variant, not a split of the word)."""
    out: list[list[int]] = []
    for word in bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(list(bare))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(list(spaced))
    return out


def apply_bad_words(row: np.ndarray, token_ids: SequenceOf[SequenceOf[int]],
                    output_token_ids: SequenceOf[int]) -> np.ndarray:
    """Rule b: ban the token that would complete any bad-word sequence now."""
    out = list(output_token_ids)
    for seq in token_ids:
        head = list(seq[:-1])
        if len(head) <= len(out) and (not head or out[len(out) - len(head):] == head):
            row[seq[-1]] = -np.inf
    return row


def apply_logit_bias(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Rule c: add each token's bias to its logit."""
    ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
    row[ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
    return row


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


def apply_penalties(row: np.ndarray, params: SamplingParams, prompt_token_ids: SequenceOf[int],
                    output_token_ids: SequenceOf[int]) -> np.ndarray:
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


def apply_processors(x: np.ndarray, params: SequenceOf[SamplingParams], rows: SequenceOf[int],
                     prompt_token_ids=None, output_token_ids=None, eos_token_id=None,
                     bad_words_token_ids=None) -> np.ndarray:
    """A copy of the float32 logits `x` [N, V] after the processors above, in that order,
    of `rows`, the rows whose params use one. The per-row lists (one per row of x) are
    needed only by the rules that read them: output_token_ids by penalties, min_tokens and
    bad_words, prompt_token_ids by repetition_penalty, bad_words_token_ids by bad_words;
    ValueError names what is missing."""
    x = x.copy()
    for i in rows:
        p = params[i]
        needs_output = p.has_penalties or p.min_tokens or p.bad_words
        if (needs_output and output_token_ids is None) or (
                p.repetition_penalty != 1.0 and prompt_token_ids is None) or (
                p.bad_words and bad_words_token_ids is None):
            raise ValueError("Sampler: SamplingParams with penalties, min_tokens or "
                             "bad_words need output_token_ids (and prompt_token_ids for "
                             "repetition_penalty, bad_words_token_ids for bad_words), "
                             "one list per row")
        if p.allowed_token_ids is not None:
            apply_allowed_token_ids(x[i], p)
        if p.bad_words:
            apply_bad_words(x[i], bad_words_token_ids[i], output_token_ids[i])
        if p.min_tokens:
            apply_min_tokens(x[i], p, len(output_token_ids[i]), eos_token_id)
        if p.logit_bias:
            apply_logit_bias(x[i], p)
        if p.has_penalties:
            apply_penalties(x[i], p, prompt_token_ids[i] if prompt_token_ids else [],
                            output_token_ids[i])
    return x
