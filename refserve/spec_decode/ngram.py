"""The n-gram proposer (prompt lookup, speculative_config method "ngram"): draft tokens
copied from earlier in the context.

Text that quotes, edits or repeats its prompt continues the way an earlier passage did.
So take the last n tokens of the context (the suffix), find where they occurred before, and
propose the tokens that followed there. The rule:

    the LONGEST suffix n in [min_n, max_n] that occurs earlier wins (a longer match is
    stronger evidence the passage repeats); of its occurrences (each must end before the
    last token; it may overlap the suffix, as in a repeating pattern) take the MOST RECENT
    (the latest copy is the likeliest to be repeated, e.g. the passage being edited right
    now) and propose up to k tokens that followed it (fewer near the end of the context);
    nothing matched: propose nothing (the request decodes normally this step).

`propose` finds it by growing n from 1: the occurrences of the length-n suffix are those of
the length-(n-1) suffix whose token n back also matches, so each n costs one vectorized
compare, and the last n (<= max_n) with an occurrence is the longest. Cost: O(len · max_n).

Its q is one-hot at each proposed token, so `rejection_sample(..., draft_probs=None)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from refserve.scheduler.drafts import Proposal
from refserve.spec_decode.proposer import Proposer


def propose(token_ids: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for a context `token_ids` (see the module docstring)."""
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k={k!r}: must be an integer >= 1 (num_speculative_tokens)")
    if not isinstance(min_n, (int, np.integer)) or min_n < 1:
        raise ValueError(f"min_n={min_n!r}: must be an integer >= 1 (prompt_lookup_min)")
    if not isinstance(max_n, (int, np.integer)) or max_n < min_n:
        raise ValueError(f"max_n={max_n!r}: must be an integer >= min_n={min_n} "
                         "(prompt_lookup_max)")
    # BEGIN EXERCISE ngram_proposal: the longest suffix n matched, its MOST RECENT match, next k
    # ... return at most k token ids (a list; [] when nothing matches)
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    if length < 2:
        return []
    # Candidate occurrences are identified by their last position e, with e <= length - 2
    # (an earlier occurrence leaves at least one token after it). match[e] stays True while
    # tokens[e-n+1 .. e] == the last n tokens; each longer n adds one compare per candidate.
    ends = np.arange(length - 1)
    match = np.ones(length - 1, dtype=bool)
    best_end = None
    for n in range(1, min(max_n, length - 1) + 1):
        start = ends - (n - 1)
        valid = start >= 0
        match &= valid & (tokens[np.maximum(start, 0)] == tokens[length - n])
        if not match.any():
            break  # no occurrence of the length-n suffix, so none of any longer one
        if n >= min_n:
            best_end = int(np.flatnonzero(match)[-1])  # the most recent occurrence
    if best_end is None:
        return []
    return tokens[best_end + 1 : best_end + 1 + k].tolist()
    # END EXERCISE


class NgramProposer(Proposer):
    """Prompt lookup (`propose` above): copies what followed the latest earlier occurrence
    of the context's suffix. Runs no model, so draft_cost_per_token = 0."""

    method = "ngram"
    options = {"prompt_lookup_min": None, "prompt_lookup_max": None}

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    @classmethod
    def check_options(cls, options: dict, config=None) -> dict:
        """prompt_lookup_min / _max, vLLM's defaults (2, 4) when both are unset; one unset
        follows the other."""
        lo, hi = options["prompt_lookup_min"], options["prompt_lookup_max"]
        if lo is None and hi is None:
            lo, hi = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        elif lo is None:
            lo = min(DEFAULT_PROMPT_LOOKUP_MIN, hi) if _is_int(hi) else hi
        elif hi is None:
            hi = max(DEFAULT_PROMPT_LOOKUP_MAX, lo) if _is_int(lo) else lo
        if not _is_int(lo) or lo < 1:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo!r}: must be an "
                             "integer >= 1")
        if not _is_int(hi) or hi < lo:
            raise ValueError(f"speculative_config.prompt_lookup_max={hi!r}: must be an "
                             f"integer >= prompt_lookup_min={lo}")
        return {"prompt_lookup_min": lo, "prompt_lookup_max": hi}

    @classmethod
    def create(cls, spec, loaded, backend, num_blocks: int, block_size: int
               ) -> NgramProposer:
        return cls(spec.options["prompt_lookup_min"], spec.options["prompt_lookup_max"])

    def propose(self, seqs, num_drafts) -> list[Proposal]:
        return [Proposal(propose(seq.token_ids, n, self.min_n, self.max_n) if n > 0 else [])
                for seq, n in zip(seqs, num_drafts)]


DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


if __name__ == "__main__":
    context = [7, 1, 2, 3, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3]
    print("context       ", context)
    for min_n, max_n in [(1, 3), (1, 1), (4, 5)]:
        print(f"n in [{min_n}, {max_n}]  ", propose(context, k=3, min_n=min_n, max_n=max_n))
