"""The n-gram proposer (prompt lookup): unit cases and properties against a brute-force
reading of its rule."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refserve.spec_decode.ngram import propose


def brute_force(tokens, k, min_n, max_n):
    """The rule read literally: longest n first; among the earlier occurrences of the last n
    tokens (ending before the last token), the most recent; the up-to-k tokens after it."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for end in range(length - 2, n - 2, -1):  # end = last index of an occurrence
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def proposed(context, k, min_n, max_n):
    """propose(...), and how to say what was asked in an assertion's message."""
    return propose(context, k=k, min_n=min_n, max_n=max_n), \
        f"propose({context}, k={k}, min_n={min_n}, max_n={max_n})"


#          0  1  2  3  4  5  6  7  8  9
CONTEXT = [1, 2, 3, 7, 8, 9, 3, 5, 2, 3]


def test_the_longest_matching_suffix_wins_over_a_more_recent_shorter_one():
    # "2 3" occurred at 1..2 (then 7 8 9); "3" alone occurred later, at 6 (then 5).
    got, asked = proposed(CONTEXT, 3, 1, 2)
    assert got == [7, 8, 9], f"{asked} = {got}: the 2-token suffix '2 3' matches at 1..2"


def test_the_most_recent_occurrence_of_a_suffix_wins():
    # "3" occurred at 2 (then 7 8 9) and at 6 (then 5 2 3): the later one is used.
    got, asked = proposed(CONTEXT, 3, 1, 1)
    assert got == [5, 2, 3], f"{asked} = {got}: '3' last occurred at 6, followed by 5 2 3"
    got, asked = proposed([4, 1, 5, 4, 1, 6, 0, 4, 1], 2, 2, 2)
    assert got == [6, 0], f"{asked} = {got}: '4 1' last occurred at 3..4, followed by 6 0"


@pytest.mark.parametrize("context, min_n, max_n, why", [
    ([1, 2, 3, 4], 1, 3, "'4' never occurred before"),
    ([1, 2, 1, 2, 9, 3], 2, 3, "'9 3' never occurred before"),
    ([], 1, 3, "an empty context"),
    ([5], 1, 3, "one token: nothing before it"),
])
def test_no_match_proposes_nothing(context, min_n, max_n, why):
    got, asked = proposed(context, 3, min_n, max_n)
    assert got == [], f"{asked} = {got}: {why}"


def test_proposal_stops_at_the_end_of_the_context():
    # The most recent earlier "7" is at index 1: one token follows it (the suffix itself:
    # an overlap with the suffix is allowed).
    got, asked = proposed([7, 7, 7], 4, 1, 1)
    assert got == [7], f"{asked} = {got}: only one token follows the match at 1"
    got, asked = proposed([1, 2, 1, 2, 1, 2], 4, 2, 4)
    assert got == [1, 2], f"{asked} = {got}: '1 2 1 2' matches at 0..3, then 1 2 ends it"


def test_min_n_excludes_short_matches():
    got, asked = proposed([1, 2, 3, 9, 3], 2, 1, 3)
    assert got == [9, 3], f"{asked} = {got}: '3' matched at 2"
    got, asked = proposed([1, 2, 3, 9, 3], 2, 2, 3)
    assert got == [], f"{asked} = {got}: only a 1-token suffix matches, and min_n is 2"


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(k=0, min_n=1, max_n=2), "k=0"), (dict(k=2, min_n=0, max_n=2), "min_n=0"),
     (dict(k=2, min_n=3, max_n=2), "max_n=2")],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        propose([1, 2, 1], **kwargs)


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(1, 5),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_matches_the_rule_read_literally(tokens, k, min_n, extra):
    max_n = min_n + extra
    got, asked = proposed(tokens, k, min_n, max_n)
    want = brute_force(tokens, k, min_n, max_n)
    assert got == want, f"{asked} = {got}; the rule read literally gives {want}"


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), min_size=2, max_size=30), k=st.integers(1, 4))
def test_a_proposal_continues_an_earlier_occurrence_of_the_longest_matching_suffix(tokens, k):
    """Stated as properties rather than by a second implementation: a proposal is what
    followed an earlier occurrence of some matched suffix, no longer suffix (<= max_n)
    occurred earlier, and nothing is proposed only when no suffix of length >= min_n did."""
    min_n, max_n = 1, 4
    proposal = propose(tokens, k, min_n, max_n)
    length = len(tokens)

    def occurrences(n):  # last index of each earlier occurrence of the length-n suffix
        suffix = tokens[length - n:]
        return [e for e in range(n - 1, length - 1) if tokens[e - n + 1 : e + 1] == suffix]

    matched = [n for n in range(min_n, min(max_n, length - 1) + 1) if occurrences(n)]
    asked = f"propose({tokens}, k={k}, min_n={min_n}, max_n={max_n}) = {proposal}"
    if not matched:
        assert proposal == [], f"{asked}: no suffix of {min_n}..{max_n} tokens occurred before"
        return
    n = max(matched)
    assert 1 <= len(proposal) <= k, f"{asked}: 1 to k tokens after a match"
    assert any(tokens[e + 1 : e + 1 + len(proposal)] == proposal for e in occurrences(n)), \
        f"{asked}: not what followed an occurrence of the longest matching suffix ({n})"
    # The proposal is exactly the continuation of the most recent occurrence.
    e = max(occurrences(n))
    assert proposal == tokens[e + 1 : e + 1 + k], \
        f"{asked}: the most recent occurrence ends at {e}"


def test_fast_enough_for_long_contexts():
    """A 4000-token context (a quote-heavy prompt) must cost well under a millisecond per
    call, or the proposer would eat the time speculation saves. Generous bound for CI."""
    rng = np.random.default_rng(0)
    passage = rng.integers(0, 1000, size=500).tolist()
    context = (rng.integers(0, 1000, size=3000).tolist() + passage
               + rng.integers(0, 1000, size=400).tolist() + passage[:100])
    assert propose(context, k=4, min_n=1, max_n=5) == passage[100:104], \
        "the repeated passage's continuation"
    start = time.perf_counter()
    for _ in range(50):
        propose(context, k=4, min_n=1, max_n=5)
    per_call = (time.perf_counter() - start) / 50
    assert per_call < 5e-3, f"propose took {per_call * 1e3:.2f} ms on 4000 tokens"
