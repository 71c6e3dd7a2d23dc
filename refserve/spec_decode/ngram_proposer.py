"""The n-gram proposer (prompt lookup): draft tokens copied from earlier in the context.

Text that quotes, edits or repeats its prompt continues the way an earlier passage did.
So take the last n tokens of the context (the suffix), find where they occurred before, and
propose the tokens that followed there:

    for n = max_n, max_n - 1, ..., min_n        (longest suffix first: a longer match is
                                                 stronger evidence the passage repeats)
        occurrences = every earlier position where the last n tokens also appear
                      (an occurrence must end before the last token; it may overlap the
                      suffix, as in a repeating pattern)
        if any: take the MOST RECENT one (the latest copy is the likeliest to be repeated,
                e.g. the passage being edited right now) and propose up to k tokens that
                followed it (fewer when it is near the end of the context); stop
    nothing matched: propose nothing (the request decodes normally this step)

Its q is one-hot at each proposed token, so `rejection_sample(..., draft_probs=None)`.

Cost: one vectorized pass per n over the context, O(len · max_n) element compares.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(token_ids: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for a context `token_ids` (see the module docstring)."""
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k={k!r}: must be an integer >= 1 (num_speculative_tokens)")
    if not isinstance(min_n, (int, np.integer)) or min_n < 1:
        raise ValueError(f"min_n={min_n!r}: must be an integer >= 1 (prompt_lookup_min)")
    if not isinstance(max_n, (int, np.integer)) or max_n < min_n:
        raise ValueError(f"max_n={max_n!r}: must be an integer >= min_n={min_n} "
                         "(prompt_lookup_max)")
    # BEGIN EXERCISE ngram_proposal: longest suffix n first, its MOST RECENT earlier match, next k
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


if __name__ == "__main__":
    context = [7, 1, 2, 3, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3]
    print("context       ", context)
    for min_n, max_n in [(1, 3), (1, 1), (4, 5)]:
        print(f"n in [{min_n}, {max_n}]  ", propose(context, k=3, min_n=min_n, max_n=max_n))
