"""Sampling: one token per row of logits (`Sampler`), each row with its own `SamplingParams`.

    x = logits after the logits processors (allowed_token_ids, bad_words, min_tokens,
        logit_bias, penalties: logits_processors.py)             host-side control code
    greedy (temperature < GREEDY_BELOW = 1e-5, vLLM's cut-off):  argmax(x)     here
    otherwise, THE NUCLEUS (the backend's op `sampling_weights`):
                 e = exp((x - max x) · (1/T))                  p up to a constant
                 min_p:  keep t with e[t] >= min_p             (p[t] >= min_p · max p)
                 top_k:  keep t with x[t] >= the k-th largest x          (0 = off)
                 top_p:  keep t iff, over the tokens min_p and top_k keep, the mass of
                         those with a larger logit than t is < top_p of their total
               weights = e on the kept tokens, 0 elsewhere
    the draw (the backend's op `sample`):  token = min{t : c_t > u · c_{V-1}}, c the running
                 sum of the weights in token-id order (float64), u the row's uniform.

TIES are decided on the logits, once for every rule: tokens with equal logits are kept or
dropped together (HF's and vLLM's `<` masks keep a tie with the last kept token too), and
tokens with different logits are ranked by them even where their float32 probabilities
round to the same value (logits 5e-42 and 0 with top_p = 0.5: the nucleus is the first
token alone, though both have probability 0.5). So each kept set is `x >= threshold` for one
threshold per row: the nucleus is the smallest such set whose mass reaches top_p. min_p and
top_k commute (both keep a prefix of the tokens ranked by logit); top_p comes last because
it measures mass after them.

The nucleus has one implementation per backend (the reference: a sort per row,
numpy_backend.py), and everything that samples calls it: this Sampler through
`backend.sample`, and speculative decoding's p and q through `backend.sampling_weights`
(warping.py), so a verify row keeps exactly the set a plain row keeps. This
file is the control around the draw: the processors (logits_processors.py), greedy rows'
argmax, one uniform per sampled row from the row's generator, the per-row settings as
arrays. The sampled token's logprobs are logprobs.py's (`sampled_logprobs`).

Randomness is per sequence: each sequence owns a `numpy.random.Generator` seeded from its
request's seed (child i of a parallel-sampling request uses seed + i) and draws exactly one
uniform per sampled token, none for greedy. The draw of a row depends only on that row and
its uniform, so a seeded request produces the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from refserve.logits_processors import apply_processors
from refserve.sampling_params import GREEDY_BELOW, SamplingParams

__all__ = ["Sampler", "SamplingParams", "make_generator", "draw_arguments",
           "nucleus_arguments", "GREEDY_BELOW"]


def make_generator(seed: int | None, child_index: int = 0) -> np.random.Generator:
    """The random stream of one sequence: child i of a seeded request uses seed + i, so
    `SamplingParams(n=4, seed=s)` child i draws exactly what `SamplingParams(seed=s + i)` does."""
    return np.random.default_rng(None if seed is None else seed + child_index)


def nucleus_arguments(params: SequenceOf[SamplingParams]) -> dict[str, np.ndarray]:
    """`backend.sampling_weights`'s per-row arrays for sampled (non-greedy) rows with
    `params`: temperature, top_k (0: off), top_p, min_p, in row order."""
    return {
        "temperature": np.array([p.temperature for p in params], dtype=np.float64),
        "top_k": np.array([max(p.top_k, 0) for p in params], dtype=np.int64),
        "top_p": np.array([p.top_p for p in params], dtype=np.float32),
        "min_p": np.array([p.min_p for p in params], dtype=np.float32),
    }


def draw_arguments(params: SequenceOf[SamplingParams],
                   generators: SequenceOf[np.random.Generator]) -> dict[str, np.ndarray]:
    """`backend.sample`'s per-row arrays: `nucleus_arguments`, and each row's one uniform,
    drawn from its generator, in row order."""
    uniforms = np.array([g.random() for g in generators], dtype=np.float64)
    return {**nucleus_arguments(params), "uniforms": uniforms}


class Sampler:
    """Draws one token per row of logits, each row with its own sequence's params and
    generator, the draw itself by `backend.sample` (see the module docstring)."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def sample(self, logits: np.ndarray, params: SequenceOf[SamplingParams],
               generators: SequenceOf[np.random.Generator], *,
               prompt_token_ids: SequenceOf[SequenceOf[int]] | None = None,
               output_token_ids: SequenceOf[SequenceOf[int]] | None = None,
               eos_token_id: int | None = None,
               bad_words_token_ids: SequenceOf[SequenceOf[SequenceOf[int]]] | None = None
               ) -> list[int]:
        """One token id per row of `logits` [N, V].

        prompt_token_ids / output_token_ids (one list per row) are needed only by rows whose
        params use penalties, min_tokens or bad_words; eos_token_id only by min_tokens;
        bad_words_token_ids (per row, logits_processors.bad_words_token_ids) only by
        bad_words. The caller's `logits` are never modified."""
        x = np.asarray(logits, dtype=np.float32)
        if x.ndim != 2 or len(x) != len(params):
            raise ValueError(f"Sampler: expected logits [N, V] with one row per params, got "
                             f"{x.shape} for {len(params)} params")
        processed = [i for i, p in enumerate(params) if p.rewrites_logits or p.min_tokens]
        if processed:  # on a copy: the caller's logits stay as they are
            x = apply_processors(x, params, processed, prompt_token_ids, output_token_ids,
                                 eos_token_id, bad_words_token_ids)
        tokens = np.zeros(len(x), dtype=np.int64)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            tokens[greedy] = np.argmax(x[greedy], axis=-1)     # the first maximum
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:  # (no copy of the logits when every row samples)
            drawn = self.backend.sample(x if len(rows) == len(x) else x[rows], **draw_arguments(
                [params[i] for i in rows], [generators[i] for i in rows]))
            tokens[rows] = self.backend.to_numpy(drawn)
        return tokens.tolist()
