"""Sampling: how one token is drawn per row of logits (`Sampler`), vectorised across rows.

For each row, with its sequence's `SamplingParams`:

    x = logits after the logits processors (min_tokens, penalties: logits_processors.py)
    greedy (temperature < 1e-5, vLLM's cut-off):  argmax(x)
    otherwise:   p = softmax(x / T)
                 min_p:  keep t with p[t] >= min_p * max(p)
                 top_k:  keep t with x[t] >= the k-th largest x          (0 = off)
                 top_p:  renormalise over what is kept; keep t if the mass of the kept
                         tokens strictly more likely than t is < top_p   (the nucleus)
                 draw one token from p restricted to the kept set, renormalised.

Every rule keeps a tie with the last kept token (HF's and vLLM's `<` masks do too), so each
kept set is `x >= threshold` for one threshold per row: the nucleus is the smallest such set
whose mass reaches top_p. min_p and top_k commute (both keep a prefix of the sorted tokens);
top_p comes last because it measures mass after them.

How it is computed (the cost is a few passes over [rows, vocab] in float32):
  - one max and, for top-p rows, one exp-sum over the whole row (the softmax normaliser);
  - the kept set is found among the K largest logits, taken with `argpartition` (O(V)) and
    only those K sorted. K starts at top_k + 1 (or 256 for top-p / min-p: a trained model's
    nucleus is usually smaller) and grows 8x while the last candidate is still kept, since
    then the set may continue past it; when the K candidates hold less than half of the
    mass top_p asks for, the distribution is flat and the whole row is sorted (values only);
  - the draw is an inverse CDF over the kept tokens in token-id order, two-level (block
    sums, then inside one block) on long rows, so no length-V float64 array is built.

Randomness is per sequence: each sequence owns a `numpy.random.Generator` seeded from its
request's seed (child i of a parallel-sampling request uses seed + i) and draws exactly one
uniform per sampled token, none for greedy. Everything computed for a row depends only on
that row (the candidate count K included), so a seeded request produces the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from refserve.logits_processors import apply_min_tokens, apply_penalties
from refserve.logprobs import Logprob, compute_logprobs
from refserve.sampling_params import GREEDY_BELOW, SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingParams", "make_generator", "probabilities",
           "sample_from_logits", "inverse_cdf", "GREEDY_BELOW"]

_FIRST_CANDIDATES = 256  # first guess of K for top-p / min-p rows
_GROWTH = 8              # K grows by this factor while the kept set may extend past it
_BLOCK = 1024            # inverse-CDF block length


def make_generator(seed: int | None, child_index: int = 0) -> np.random.Generator:
    """The random stream of one sequence: child i of a seeded request uses seed + i, so
    `SamplingParams(n=4, seed=s)` child i draws exactly what `SamplingParams(seed=s + i)` does."""
    return np.random.default_rng(None if seed is None else seed + child_index)


def _filters(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0


def inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The index i where the running sum of `weights` first exceeds u * total (0 <= u < 1), so
    index i comes out with probability weights[i] / total and a zero weight never does.
    Two levels: float32 block sums, then a float64 running sum inside one block."""
    if len(weights) <= _BLOCK:
        cum = np.cumsum(weights, dtype=np.float64)
        return _first_above(cum, u * cum[-1])
    starts = np.arange(0, len(weights), _BLOCK)
    cum = np.cumsum(np.add.reduceat(weights, starts), dtype=np.float64)
    target = u * cum[-1]
    b = _first_above(cum, target)
    block = weights[starts[b]:starts[b] + _BLOCK]
    inside = np.cumsum(block, dtype=np.float64)
    return int(starts[b] + _first_above(inside, target - (cum[b - 1] if b else 0.0)))


def _first_above(cum: np.ndarray, target: float) -> int:
    """First i with cum[i] > target; if rounding left none, the last i that added mass."""
    i = int(np.searchsorted(cum, target, side="right"))
    if i < len(cum):
        return i
    return int(np.flatnonzero(np.diff(cum, prepend=0.0) > 0)[-1])


@dataclass
class SamplerOutput:
    """What `Sampler.sample_with_logprobs` returns: one token per row, and per row either
    None (logprobs not requested) or vLLM's {token_id: Logprob} for the sampled token."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


class Sampler:
    """Draws one token per row of logits, each row with its own sequence's params and
    generator (see the module docstring for the rules and their cost)."""

    def sample(self, logits: np.ndarray, params: Sequence[SamplingParams],
               generators: Sequence[np.random.Generator], *,
               prompt_token_ids: Sequence[Sequence[int]] | None = None,
               output_token_ids: Sequence[Sequence[int]] | None = None,
               eos_token_id: int | None = None) -> list[int]:
        """One token id per row of `logits` [N, V].

        prompt_token_ids / output_token_ids (one list per row) are needed only by rows whose
        params use penalties or min_tokens; eos_token_id only by min_tokens. The caller's
        `logits` are never modified."""
        x = self.process_logits(logits, params, prompt_token_ids, output_token_ids,
                                eos_token_id)
        if not len(x):
            return []
        greedy = [i for i, p in enumerate(params) if p.greedy]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        tokens = [0] * len(x)
        if greedy:
            argmax = np.argmax(x if len(greedy) == len(x) else x[greedy], axis=-1)
            for i, t in zip(greedy, argmax.tolist()):
                tokens[i] = t
        sampled = x if len(rows) == len(x) else x[rows]
        for i, (ids, weights) in zip(rows, self.distributions(sampled, [params[i] for i in rows])):
            k = inverse_cdf(weights, generators[i].random())   # the row's one uniform
            tokens[i] = k if ids is None else int(ids[k])
        return tokens

    def sample_with_logprobs(self, logits: np.ndarray, params: Sequence[SamplingParams],
                             generators: Sequence[np.random.Generator], *,
                             decode=None, **kwargs) -> SamplerOutput:
        """`sample`, plus for rows whose params ask for `logprobs=N` the top-N logprobs of
        the raw logits and the sampled token's (see logprobs.py); `decode(token_id) -> str`,
        when given, fills `Logprob.decoded_token`."""
        tokens = self.sample(logits, params, generators, **kwargs)
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: list[dict[int, Logprob] | None] = [None] * len(tokens)
        if asked:
            found = compute_logprobs(np.asarray(logits)[asked], [tokens[i] for i in asked],
                                     [params[i].logprobs for i in asked], decode)
            for i, d in zip(asked, found):
                logprobs[i] = d
        return SamplerOutput(tokens, logprobs)

    def process_logits(self, logits, params, prompt_token_ids=None, output_token_ids=None,
                       eos_token_id=None) -> np.ndarray:
        """The logits after min_tokens and the penalties, as float32; a copy when any row
        changes, else the caller's array itself."""
        x = np.asarray(logits, dtype=np.float32)
        if x.ndim != 2 or len(x) != len(params):
            raise ValueError(f"Sampler: expected logits [N, V] with one row per params, got "
                             f"{x.shape} for {len(params)} params")
        rows = [i for i, p in enumerate(params) if p.has_penalties or p.min_tokens]
        if not rows:
            return x
        x = x.copy()
        for i in rows:
            p = params[i]
            if output_token_ids is None or (p.repetition_penalty != 1.0
                                            and prompt_token_ids is None):
                raise ValueError("Sampler: SamplingParams with penalties or min_tokens need "
                                 "output_token_ids (and prompt_token_ids for "
                                 "repetition_penalty), one list per row")
            if p.min_tokens:
                apply_min_tokens(x[i], p, len(output_token_ids[i]), eos_token_id)
            if p.has_penalties:
                apply_penalties(x[i], p, prompt_token_ids[i] if prompt_token_ids else [],
                                output_token_ids[i])
        return x

    def distributions(self, x: np.ndarray, params: Sequence[SamplingParams]
                      ) -> list[tuple[np.ndarray | None, np.ndarray]]:
        """For each row of processed logits x [R, V]: (ids, weights), the kept token ids in
        increasing order (None: every token) and their unnormalised float32 probabilities
        exp((x - max) / T); the row's distribution is weights / sum(weights). A greedy row
        keeps only its argmax."""
        out: list[tuple[np.ndarray | None, np.ndarray]] = [
            (np.array([np.argmax(x[r])]), np.ones(1, np.float32)) if p.greedy else None
            for r, p in enumerate(params)]
        rows = [r for r, p in enumerate(params) if not p.greedy]
        if not rows:
            return out
        x = x if len(rows) == len(x) else x[rows]
        params = [params[r] for r in rows]
        row_max = x.max(axis=-1)
        inv_t = np.array([1.0 / p.temperature for p in params], dtype=np.float32)
        kept = _kept_ids(x, row_max, inv_t, params)
        for j, r in enumerate(rows):
            vals = x[j] if kept[j] is None else x[j, kept[j]]
            out[r] = (kept[j], np.exp((vals - row_max[j]) * inv_t[j]))
        return out


def _kept_ids(x, row_max, inv_t, params) -> list[np.ndarray | None]:
    """Per row the ids (increasing) kept by min_p, top_k and top_p; None for rows that
    filter nothing. Rows sharing a candidate count K are processed together."""
    vocab = x.shape[-1]
    kept: list[np.ndarray | None] = [None] * len(params)
    todo = {r: min(p.top_k + 1 if 0 < p.top_k < vocab else _FIRST_CANDIDATES, vocab)
            for r, p in enumerate(params) if _filters(p, vocab)}
    mass_cache: dict[int, float] = {}
    while todo:
        by_k: dict[int, list[int]] = {}
        for r, k in todo.items():
            by_k.setdefault(k, []).append(r)
        todo = {}
        for k, rows in by_k.items():
            found = _kept_among_top_k(x, rows, k, row_max, inv_t, params, mass_cache)
            for r, ids in zip(rows, found):
                if isinstance(ids, int):
                    todo[r] = ids                       # look again among more candidates
                else:
                    kept[r] = ids
    return kept


def _kept_among_top_k(x, rows, k, row_max, inv_t, params, mass_cache
                      ) -> list[np.ndarray | int]:
    """The kept ids of `rows`, looking only at each row's k largest logits. A row whose kept
    set includes its smallest candidate may continue past it: for it, the next k to try."""
    vocab = x.shape[-1]
    sub = x if rows == list(range(len(x))) else x[rows]
    if k < vocab:
        cand = np.argpartition(sub, vocab - k, axis=-1)[:, vocab - k:]   # k largest, any order
        cand_vals = np.take_along_axis(sub, cand, axis=-1)
    else:
        cand, cand_vals = None, sub
    desc = np.sort(cand_vals, axis=-1)[:, ::-1]                         # largest first
    m, it = row_max[rows][:, None], inv_t[rows][:, None]
    e = np.exp((desc - m) * it)                   # p * Z, so e[:, 0] = 1 (the argmax)
    top_k = np.array([params[r].top_k for r in rows])
    min_p = np.array([params[r].min_p for r in rows], dtype=np.float32)
    top_p = np.array([params[r].top_p for r in rows], dtype=np.float32)
    g = np.arange(len(rows))
    # top_k and min_p: a prefix of the sorted candidates (ties with the k-th kept).
    kth = np.where((top_k > 0) & (top_k < vocab), desc[g, np.clip(top_k, 1, k) - 1], -np.inf)
    keep = (desc >= kth[:, None]) & (e >= min_p[:, None])
    count = keep.sum(axis=-1)
    covered = np.ones(len(rows), dtype=np.float32)   # share of the top_p mass in view
    nucleus_rows = np.flatnonzero(top_p < 1.0)
    if len(nucleus_rows):
        # Renormalise over the top_k / min_p set S, then keep the nucleus of it. S's mass
        # comes from the candidates when S ends inside them, else from the whole row.
        mass = (e * keep).sum(axis=-1)
        past = nucleus_rows[keep[nucleus_rows, -1]] if k < vocab else nucleus_rows[:0]
        new = [j for j in past if rows[j] not in mass_cache]
        if new:
            found = _mass_of_kept_set(sub if len(new) == len(rows) else sub[new], m[new],
                                      it[new], kth[new], min_p[new])
            mass_cache.update(zip((rows[j] for j in new), found.tolist()))
        mass[past] = [mass_cache[rows[j]] for j in past]
        p = np.where(keep, e, 0) / mass[:, None]
        before = np.cumsum(p, axis=-1) - p        # mass of the tokens ranked before each
        in_nucleus = keep & (before < top_p[:, None])
        count[nucleus_rows] = in_nucleus[nucleus_rows].sum(axis=-1)
        covered = (before[:, -1] + p[:, -1]) / top_p
    threshold = desc[g, count - 1]                # smallest kept logit; ties with it kept
    out: list[np.ndarray | int] = []
    for j, r in enumerate(rows):
        if k == vocab:
            out.append(np.flatnonzero(x[r] >= threshold[j]))
        elif desc[j, -1] >= threshold[j]:         # the last candidate is kept: look further
            # Less than half the nucleus in view means a flat distribution: take the row.
            out.append(min(k * _GROWTH, vocab) if covered[j] >= 0.5 else vocab)
        else:
            out.append(np.sort(cand[j][cand_vals[j] >= threshold[j]]))
    return out


def _mass_of_kept_set(x, m, inv_t, kth, min_p) -> np.ndarray:
    """Per row of x [G, V]: sum of exp((x - m) / T) over the tokens top_k and min_p keep
    (the softmax normaliser of that set), one vectorised pass over the rows."""
    e = x - m
    if np.any(inv_t != 1):
        e *= inv_t
    np.exp(e, out=e)
    if np.all(kth == -np.inf) and not np.any(min_p):
        return e.sum(axis=-1)
    return np.where((x >= kth[:, None]) & (e >= min_p[:, None]), e, 0).sum(axis=-1)


def sample_from_logits(logits: np.ndarray, params: SamplingParams,
                       generator: np.random.Generator) -> int:
    """Draw one token id from one row of logits (the rule in the module docstring)."""
    return Sampler().sample(np.asarray(logits, dtype=np.float32)[None], [params], [generator])[0]


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution `Sampler` draws from for one row of (processed) logits, as a dense
    float64 vector: softmax(logits / T) restricted to the min_p / top_k / top_p set and
    renormalised; tokens outside get probability 0. Greedy: all mass on the argmax."""
    x = np.asarray(logits, dtype=np.float32)[None]
    probs = np.zeros(x.shape[-1])
    ((ids, weights),) = Sampler().distributions(x, [params])
    w = weights.astype(np.float64)
    probs[slice(None) if ids is None else ids] = w / w.sum()
    return probs
