"""Scheduling policies (refserve/scheduler/policy.py): admission order for fcfs / lpm /
priority, lpm's fallback and starvation guard, and the preemption victim."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refserve.sampling import SamplingParams
from refserve.scheduler.policy import (
    LPM_MAX_QUEUE,
    LongestPrefixMatch,
    PriorityPolicy,
    SchedulingPolicy,
    make_policy,
)
from refserve.sequence import Sequence

pytestmark = pytest.mark.scheduler


def seqs(n, priorities=None):
    out = []
    for i in range(n):
        seq = Sequence(f"r{i}", [1, 2, 3], SamplingParams(), seq_id=i)
        seq.priority = 0 if priorities is None else priorities[i]
        out.append(seq)
    return out


def ids(order):
    return [seq.seq_id for seq in order]


# ---- fcfs and priority ----------------------------------------------------------------------


@given(st.integers(0, 20))
def test_fcfs_is_the_queue_as_it_stands(n):
    waiting = seqs(n)
    assert ids(SchedulingPolicy().order(waiting)) == list(range(n))


@given(st.lists(st.integers(-3, 3), max_size=20))
def test_priority_lower_first_ties_in_queue_order(priorities):
    waiting = seqs(len(priorities), priorities)
    order = PriorityPolicy().order(waiting)
    assert sorted(ids(order)) == list(range(len(waiting)))
    keys = [(seq.priority, seq.seq_id) for seq in order]
    assert keys == sorted(keys)


def test_preemption_victim():
    running = seqs(4, [0, 2, 2, 1])
    assert SchedulingPolicy().preemption_victim(running) is running[-1]
    assert LongestPrefixMatch().preemption_victim(running) is running[-1]
    # Lowest priority is the largest value (2); the newest of the two.
    assert PriorityPolicy().preemption_victim(running) is running[2]
    with pytest.raises(ValueError, match="no running sequence"):
        PriorityPolicy().preemption_victim([])


@given(st.lists(st.integers(-3, 3), min_size=1, max_size=20))
def test_priority_victim_is_the_newest_of_the_lowest_priority(priorities):
    running = seqs(len(priorities), priorities)
    victim = PriorityPolicy().preemption_victim(running)
    assert victim.priority == max(priorities)
    assert victim.seq_id == max(i for i, p in enumerate(priorities) if p == max(priorities))


# ---- lpm ------------------------------------------------------------------------------------


def test_lpm_orders_by_match_length_ties_in_queue_order():
    waiting = seqs(5)
    match = {0: 0, 1: 32, 2: 16, 3: 32, 4: 0}
    order = LongestPrefixMatch().order(waiting, lambda seq: match[seq.seq_id])
    assert ids(order) == [1, 3, 2, 0, 4]


@given(st.lists(st.integers(0, 64), max_size=30))
def test_lpm_is_a_permutation(lengths):
    waiting = seqs(len(lengths))
    order = LongestPrefixMatch().order(waiting, lambda seq: lengths[seq.seq_id])
    assert sorted(ids(order)) == list(range(len(lengths)))


def test_lpm_falls_back_to_fcfs_on_a_long_queue():
    waiting = seqs(LPM_MAX_QUEUE + 1)
    order = LongestPrefixMatch().order(waiting, lambda seq: seq.seq_id)  # longest is last
    assert ids(order) == list(range(LPM_MAX_QUEUE + 1))
    short = LongestPrefixMatch().order(waiting[:LPM_MAX_QUEUE], lambda seq: seq.seq_id)
    assert ids(short)[0] == LPM_MAX_QUEUE - 1


def test_lpm_needs_a_match_length_and_checks_its_arguments():
    with pytest.raises(ValueError, match="prefix_match_length"):
        LongestPrefixMatch().order(seqs(2))
    with pytest.raises(ValueError, match="max_passes"):
        LongestPrefixMatch(max_passes=0)
    with pytest.raises(ValueError, match="max_queue"):
        LongestPrefixMatch(max_queue=0)
    with pytest.raises(ValueError, match="choose one of fcfs, lpm, priority"):
        make_policy("sjf")
    assert make_policy("lpm", max_passes=2).max_passes == 2


def test_a_passed_over_sequence_goes_first_after_max_passes():
    policy = LongestPrefixMatch(max_passes=2)
    waiting = seqs(2)  # 0 has no cached prefix, the newcomers all do
    for round_ in range(3):
        order = policy.order(waiting, lambda seq: 0 if seq.seq_id == 0 else 16)
        if round_ < 2:
            assert ids(order)[0] != 0
        else:
            assert ids(order)[0] == 0  # starved: ahead of every newcomer
        admitted = [order[0]]
        policy.on_admitted(waiting, admitted)
        waiting = [s for s in waiting if s not in admitted] + seqs(100)[10 + round_:11 + round_]
    assert 0 not in policy.passes  # admitted: forgotten


def simulate(policy, rounds):
    """Admission rounds as the scheduler runs them: new arrivals join the tail, the policy
    orders the queue, sequences are admitted in that order while the room lasts, and the
    first one that does not fit stops the round. Returns each sequence's passes (rounds in
    which a sequence that arrived after it was admitted while it waited)."""
    waiting, passes, next_id = [], {}, 0
    for arrivals, room in rounds:
        for match, size in arrivals:
            seq = Sequence(f"r{next_id}", [0], SamplingParams(), seq_id=next_id)
            seq.match, seq.size = match, size
            waiting.append(seq)
            next_id += 1
        order = policy.order(waiting, lambda seq: seq.match)
        admitted = []
        for seq in order:
            if seq.size > room:
                break
            room -= seq.size
            admitted.append(seq)
        last = max((waiting.index(seq) for seq in admitted), default=-1)
        for i, seq in enumerate(waiting):
            if seq not in admitted and i < last:
                passes[seq.seq_id] = passes.get(seq.seq_id, 0) + 1
        policy.on_admitted(waiting, admitted)
        waiting = [seq for seq in waiting if seq not in admitted]
    return passes


rounds = st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 3)),
                                     max_size=4),
                            st.integers(0, 6)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(rounds, st.integers(1, 5))
def test_the_guard_bounds_how_often_a_sequence_is_passed_over(rounds, max_passes):
    passes = simulate(LongestPrefixMatch(max_passes=max_passes), rounds)
    assert all(count <= max_passes for count in passes.values()), passes


def test_without_the_guard_lpm_starves_a_sequence():
    """The negative control of the property above: a sequence with no cached prefix, and a
    stream of newcomers that all have one, one admitted per round."""
    rounds = [([(0, 1)], 0)] + [([(4, 1)], 1)] * 10  # no room in the first round
    assert simulate(LongestPrefixMatch(max_passes=None), rounds)[0] == 10
    assert simulate(LongestPrefixMatch(max_passes=3), rounds)[0] == 3
