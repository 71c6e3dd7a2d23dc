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


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    #            0  1  2  3  4  5  6  7  8  9
    context = [1, 2, 3, 7, 8, 9, 3, 5, 2, 3]
    # "2 3" occurred at 1..2 (followed by 7 8 9); "3" alone occurred later at 6 (then 5).
    assert propose(context, k=3, min_n=1, max_n=2) == [7, 8, 9]
    assert propose(context, k=3, min_n=1, max_n=1) == [5, 2, 3]


def test_most_recent_occurrence_is_used():
    context = [4, 1, 5, 4, 1, 6, 0, 4, 1]
    assert propose(context, k=2, min_n=2, max_n=2) == [6, 0]


def test_no_match_proposes_nothing():
    assert propose([1, 2, 3, 4], k=3, min_n=1, max_n=3) == []
    assert propose([1, 2, 1, 2, 9, 3], k=3, min_n=2, max_n=3) == []  # "9 3" never before
    assert propose([], k=3, min_n=1, max_n=3) == []
    assert propose([5], k=3, min_n=1, max_n=3) == []


def test_proposal_stops_at_the_end_of_the_context():
    # The most recent earlier "7" is at index 2: only one token follows it... then the
    # suffix itself. Overlap with the suffix is allowed.
    assert propose([7, 7, 7], k=4, min_n=1, max_n=1) == [7]
    assert propose([1, 2, 1, 2, 1, 2], k=4, min_n=2, max_n=4) == [1, 2]


def test_min_n_excludes_short_matches():
    context = [1, 2, 3, 9, 3]
    assert propose(context, k=2, min_n=1, max_n=3) == [9, 3]
    assert propose(context, k=2, min_n=2, max_n=3) == []


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
    proposal = propose(tokens, k, min_n, max_n)
    assert proposal == brute_force(tokens, k, min_n, max_n)


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
    if not matched:
        assert proposal == []
        return
    n = max(matched)
    assert 1 <= len(proposal) <= k
    assert any(tokens[e + 1 : e + 1 + len(proposal)] == proposal for e in occurrences(n))
    # The proposal is exactly the continuation of the most recent occurrence.
    e = max(occurrences(n))
    assert proposal == tokens[e + 1 : e + 1 + k]


def test_fast_enough_for_long_contexts():
    """A 4000-token context (a quote-heavy prompt) must cost well under a millisecond per
    call, or the proposer would eat the time speculation saves. Generous bound for CI."""
    rng = np.random.default_rng(0)
    passage = rng.integers(0, 1000, size=500).tolist()
    context = (rng.integers(0, 1000, size=3000).tolist() + passage
               + rng.integers(0, 1000, size=400).tolist() + passage[:100])
    assert propose(context, k=4, min_n=1, max_n=5) == passage[100:104]
    start = time.perf_counter()
    for _ in range(50):
        propose(context, k=4, min_n=1, max_n=5)
    per_call = (time.perf_counter() - start) / 50
    assert per_call < 5e-3, f"propose took {per_call * 1e3:.2f} ms on 4000 tokens"
