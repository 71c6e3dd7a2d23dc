"""Scheduling policies (refserve/scheduler/scheduling_policy.py): the orders alone (fcfs /
lpm / priority admission order, lpm's fallback and starvation guard, the preemption victim),
then wired into the scheduler and the engine (the waiting queue's order, the priority victim,
vLLM's priority= argument). Every policy also runs the random workloads of
test_scheduler.py."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import expected_output, make, make_seq, run_all, step

from refserve import LLM, SamplingParams
from refserve.scheduler import Scheduler
from refserve.scheduler.scheduling_policy import (
    LPM_MAX_QUEUE,
    LongestPrefixMatch,
    PriorityPolicy,
    SchedulingPolicy,
    make_policy,
)
from refserve.sequence import Sequence, SequenceStatus

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


def running_in_arrival_order(policy, arrivals):
    """The running batch after admitting `arrivals` one by one, as the scheduler does."""
    running = []
    for seq in arrivals:
        running.insert(policy.running_index(running, seq), seq)
    return running


def test_the_running_batch_keeps_the_victim_last():
    arrivals = seqs(4, [0, 2, 2, 1])
    assert running_in_arrival_order(SchedulingPolicy(), arrivals) == arrivals
    assert running_in_arrival_order(LongestPrefixMatch(), arrivals) == arrivals
    # Most urgent first, ties oldest first: the victim (last) is the newest of priority 2.
    running = running_in_arrival_order(PriorityPolicy(), arrivals)
    assert ids(running) == [0, 3, 1, 2]


@given(st.lists(st.integers(-3, 3), min_size=1, max_size=20))
def test_priority_victim_is_the_newest_of_the_lowest_priority(priorities):
    running = running_in_arrival_order(PriorityPolicy(), seqs(len(priorities), priorities))
    victim = running[-1]
    assert victim.priority == max(priorities)
    assert victim.seq_id == max(i for i, p in enumerate(priorities) if p == max(priorities))
    keys = [(seq.priority, seq.seq_id) for seq in running]
    assert keys == sorted(keys)  # the budget goes to the most urgent first


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


# ---- wired into the scheduler and the engine --------------------------------------------


def admission_order(sched, runner):
    order = []
    while sched.has_unfinished():
        out, _ = step(sched, runner)
        order += out.admitted
    return order


def with_priority(seq, priority):
    seq.priority = priority
    return seq


# ---- priority ------------------------------------------------------------------------------


def test_priority_admits_the_lowest_value_first_ties_in_arrival_order():
    sched, kv, runner = make(max_num_seqs=1, policy="priority")
    seqs = [with_priority(make_seq(name, 5, 2), p)
            for name, p in (("a", 2), ("b", 0), ("c", 1), ("d", 0))]
    for seq in seqs:
        sched.add_sequence(seq)
    a, b, c, d = (seq.seq_id for seq in seqs)
    assert admission_order(sched, runner) == [b, d, c, a]
    fcfs, _, fcfs_runner = make(max_num_seqs=1)
    for seq in [make_seq(name, 5, 2) for name in "abcd"]:
        fcfs.add_sequence(seq)
    assert admission_order(fcfs, fcfs_runner) == [0, 1, 2, 3]  # priorities ignored


def test_priority_preempts_the_lowest_priority_not_the_newest():
    """a (priority 5) runs first; b (priority 0) joins later. When the pool runs short,
    fcfs would preempt b (the newest); priority preempts a, and serves b first meanwhile."""
    def run(policy):
        sched, kv, runner = make(num_blocks=6, block_size=4, max_num_seqs=2, prefix=False,
                                 policy=policy)
        a, b = with_priority(make_seq("a", 4, 12), 5), make_seq("b", 4, 12)
        sched.add_sequence(a)
        step(sched, runner)
        sched.add_sequence(b)
        for _ in range(100):
            out, _ = step(sched, runner)
            if out.preempted:
                break
        assert out.preempted, "the pool never ran short"
        preempted = out.preempted
        done = run_all(sched, runner)
        for seq in (a, b):  # preemption loses no output
            tokens, _ = expected_output(seq.request_id, 4, seq.sampling_params, 512, None)
            assert done[seq.request_id].output_token_ids == tokens
        assert kv.num_held_blocks == 0
        return preempted, a, b

    preempted, a, b = run("priority")
    assert preempted == [a.seq_id] and a.num_preemptions == 1 and b.num_preemptions == 0
    preempted, a, b = run("fcfs")
    assert preempted == [b.seq_id]


@pytest.mark.parametrize("policy, served", [("priority", "urgent"), ("fcfs", "old")])
def test_priority_serves_the_most_urgent_running_sequence_first(policy, served):
    """When the budget covers one row, the running sequence of lowest priority value gets
    it under "priority", whatever its age (fcfs: the oldest)."""
    sched, kv, runner = make(budget=2, max_num_seqs=2, policy=policy)
    old, urgent = make_seq("old", 1, 6), make_seq("urgent", 1, 6)
    old.priority, urgent.priority = (3, 1) if policy == "priority" else (0, 0)
    sched.add_sequence(old)
    step(sched, runner)  # old admitted alone
    sched.add_sequence(urgent)
    out, _ = step(sched, runner)  # old decodes, urgent is admitted with the budget left
    assert [row.seq for row in out.scheduled] == [old, urgent]
    sched.max_num_batched_tokens = 1  # from now on one row per step
    out, _ = step(sched, runner)
    assert [row.seq.request_id for row in out.scheduled] == [served]
    run_all(sched, runner)


# ---- lpm -----------------------------------------------------------------------------------

STEM = list(range(100, 116))  # 4 blocks of 4


def lpm_scheduler(prefix_policy, policy):
    sched, kv, runner = make(max_num_seqs=1, budget=64, prefix_policy=prefix_policy,
                             policy=policy)
    warm = make_seq("warm", 1, 1)
    warm.token_ids = warm.prompt_token_ids = STEM + [1]
    sched.add_sequence(warm)
    run_all(sched, runner)  # the stem is now cached
    return sched, kv, runner


def stem_seq(name, tail):
    seq = make_seq(name, 1, 1)
    seq.prompt_token_ids = STEM + list(tail)
    seq.token_ids = list(seq.prompt_token_ids)
    return seq


@pytest.mark.parametrize("prefix_policy", ["hash", "radix"])
def test_lpm_admits_the_longest_cached_prefix_first(prefix_policy):
    orders = {}
    for policy in ("fcfs", "lpm"):
        sched, kv, runner = lpm_scheduler(prefix_policy, policy)
        cold = make_seq("cold", 18, 1)  # shares nothing
        half = stem_seq("half", [])
        half.token_ids = half.prompt_token_ids = STEM[:8] + [7] * 9  # 2 blocks cached
        full = stem_seq("full", [9, 9])  # 4 blocks cached
        for seq in (cold, half, full):
            sched.add_sequence(seq)
        ids = {seq.seq_id: seq.request_id for seq in (cold, half, full)}
        orders[policy] = [ids[i] for i in admission_order(sched, runner)]
    assert orders == {"fcfs": ["cold", "half", "full"], "lpm": ["full", "half", "cold"]}


@pytest.mark.parametrize("max_passes, bound", [(2, 3), (None, None)])
def test_lpm_starvation_guard(max_passes, bound):
    """A sequence with no cached prefix waits behind a stream of sequences that hit the
    stem: with the guard it is admitted after at most max_passes rounds that passed it
    over; without it, only when the stream dries up."""
    kv_sched, kv, runner = make(max_num_seqs=1, budget=64, prefix_policy="radix")
    sched = Scheduler(1, 64, kv, 512,
                      scheduling_policy=LongestPrefixMatch(max_passes=max_passes))
    warm = stem_seq("warm", [1])
    sched.add_sequence(warm)
    run_all(sched, runner)
    cold = make_seq("cold", 18, 1)
    sched.add_sequence(cold)
    admitted_before_cold = 0
    for i in range(8):  # a new stem sequence arrives every step
        sched.add_sequence(stem_seq(f"s{i}", [i + 1, 2]))
        out, _ = step(sched, runner)
        if cold.seq_id in out.admitted:
            break
        admitted_before_cold += len(out.admitted)
    if bound is None:
        assert cold.status is SequenceStatus.WAITING and admitted_before_cold >= 7
    else:
        assert cold.status is not SequenceStatus.WAITING
        assert admitted_before_cold <= bound
    run_all(sched, runner)


# ---- the engine ----------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_greedy_output_is_the_same_under_every_scheduling_policy(tiny_llama):
    rng = np.random.default_rng(1)
    stem = rng.integers(3, 97, size=12).tolist()
    prompts = [stem + rng.integers(3, 97, size=int(n)).tolist() for n in (3, 9, 1, 6, 4, 2)]
    priorities = [2, 0, 1, 0, 3, 1]
    outputs = {}
    for policy in ("fcfs", "lpm", "priority"):
        llm = LLM(model=str(tiny_llama), progress=False, block_size=4, max_model_len=40,
                  num_gpu_blocks_override=14, max_num_seqs=3, scheduling_policy=policy)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                            priority=priorities if policy == "priority" else None)
        outputs[policy] = [o.outputs[0].token_ids for o in outs]
        llm.llm_engine.kv_cache_manager.check_invariants()
    assert outputs["fcfs"] == outputs["lpm"] == outputs["priority"]


def test_priority_argument_rules(tiny_llama):
    llm = LLM(model=str(tiny_llama), progress=False, block_size=4, max_model_len=40,
              num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="prompt 1: priority=3 given, but scheduling_policy"):
        llm.generate([[5, 6], [7, 8]], GREEDY, priority=[0, 3])
    llm.generate([[5, 6]], GREEDY, priority=[0])  # 0 is everyone's priority: fine
    prio = LLM(model=str(tiny_llama), progress=False, block_size=4, max_model_len=40,
               num_gpu_blocks_override=32, scheduling_policy="priority")
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        prio.generate([[5, 6]], GREEDY, priority=[0, 1])
    with pytest.raises(ValueError, match="priority='high'"):
        prio.llm_engine.add_request(None, [5, 6], GREEDY, priority="high")
    assert not prio.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="batching='continuous'"):
        LLM(model=str(tiny_llama), progress=False, batching="static",
            scheduling_policy="lpm")


def test_the_flag():
    from refserve.entrypoints.cli_common import ArgumentParser
    from refserve.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).scheduling_policy == "fcfs"
    args = parser.parse_args(["--scheduling-policy", "lpm"])
    assert engine_config_from_args(args).scheduling_policy == "lpm"
