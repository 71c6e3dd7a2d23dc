"""preemption_mode="swap" end to end: a state machine over the scheduler keeps the device
pool and the host pool consistent; on the tiny model a swapped-in sequence's K/V arrays
equal what they were, and greedy output is the same as with recompute (forced preemption,
speculation on, a host pool too small). The host pool's own bookkeeping and the backend
ops are test_swap.py's."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_scheduler import expected_output, make, make_seq, step

from refserve import LLM, SamplingParams
from refserve.sequence import SequenceStatus

pytestmark = pytest.mark.scheduler

STEMS = [[(g * 131 + i * 17) % 991 + 1 for i in range(24)] for g in range(2)]


class SwapSchedulerMachine(RuleBasedStateMachine):
    """Requests arrive (some sharing a stem, so prefix hits share blocks), steps run
    against the fake runner (which checks every position's K/V each step), some requests
    are aborted; a small pool forces preemption, a small host pool forces fallbacks."""

    def __init__(self):
        super().__init__()
        self.ids = itertools.count()
        self.live = {}  # request id -> sequence, until it finishes or is aborted
        self.finished = {}

    @initialize(num_blocks=st.integers(8, 14), host_blocks=st.sampled_from([0, 3, 8, 64]),
                prefix_policy=st.sampled_from(["hash", "radix"]),
                policy=st.sampled_from(["fcfs", "priority"]))
    def setup(self, num_blocks, host_blocks, prefix_policy, policy):
        self.sched, self.kv, self.runner = make(
            num_blocks=num_blocks, block_size=4, max_num_seqs=4, budget=16,
            max_model_len=32, prefix_policy=prefix_policy, policy=policy,
            host_blocks=host_blocks)
        self.host = self.sched.swapper.host_pool
        self.host_blocks = host_blocks

    @rule(stem=st.sampled_from([None, 0, 1]), shared=st.integers(0, 24),
          own=st.integers(1, 6), max_tokens=st.integers(1, 12), priority=st.integers(0, 2))
    def add(self, stem, shared, own, max_tokens, priority):
        rid = f"r{next(self.ids)}"
        seq = make_seq(rid, own, max_tokens)
        if stem is not None:
            seq.prompt_token_ids = STEMS[stem][:shared] + seq.prompt_token_ids
            seq.token_ids = list(seq.prompt_token_ids)
        seq.priority = priority if self.sched.policy.name == "priority" else 0
        self.sched.add_sequence(seq)
        self.live[rid] = seq

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def run_step(self):
        _, retired = step(self.sched, self.runner)
        for seq in retired:
            self.finished[seq.request_id] = self.live.pop(seq.request_id)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def abort(self, index):
        rid = sorted(self.live)[index % len(self.live)]
        seq = self.live.pop(rid)
        assert self.sched.abort(seq.seq_id) is seq

    @invariant()
    def pools_are_consistent(self):
        self.kv.check_invariants()
        self.host.check_invariants()
        waiting = {seq.seq_id: seq for seq in self.sched.waiting}
        swapped = set(self.host.swapped_out())
        assert swapped <= set(waiting), "a host table outlived its sequence's wait"
        for seq_id in swapped:
            assert not self.kv.has_sequence(seq_id), "swapped out, yet holding device blocks"
            assert waiting[seq_id].num_computed_tokens > 0
        for seq in self.sched.running:
            assert self.kv.has_sequence(seq.seq_id) and seq.seq_id not in swapped
        for seq_id, seq in waiting.items():  # a recompute victim holds nothing anywhere
            if seq_id not in swapped:
                assert seq.num_computed_tokens == 0 and not self.kv.has_sequence(seq_id)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.run_step()
        assert not self.sched.has_unfinished()
        for rid, seq in self.finished.items():
            tokens, _ = expected_output(rid, seq.num_prompt_tokens, seq.sampling_params, 32,
                                        None)
            assert seq.output_token_ids == tokens
        assert self.kv.num_held_blocks == 0
        assert self.host.num_available_blocks == self.host_blocks  # nothing left on host


SwapSchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestSwapScheduler = SwapSchedulerMachine.TestCase


def two_on_a_small_pool():
    """Two 4-token prompts that want 12 tokens each on a 6-block pool of 4-token blocks:
    the second is preempted (swapped out) within a few steps."""
    sched, kv, runner = make(num_blocks=6, block_size=4, max_num_seqs=2, prefix=False,
                             host_blocks=16)
    a, b = make_seq("a", 4, 12), make_seq("b", 4, 12)
    sched.add_sequence(a)
    sched.add_sequence(b)
    return sched, kv, runner, a, b


def test_a_swapped_out_sequence_keeps_its_computed_tokens():
    sched, kv, runner, a, b = two_on_a_small_pool()
    for _ in range(100):
        out, _ = step(sched, runner)
        if out.preempted:
            break
    assert out.preempted == [b.seq_id] and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens > 0 and sched.swapper.is_swapped_out(b)
    assert len(out.swap_out) == len(sched.swapper.host_pool.host_table(b.seq_id))
    assert "swap out" in str(out)
    assert sched.num_recomputed_tokens == 0
    while b.status is SequenceStatus.WAITING:
        out, _ = step(sched, runner)
    assert out.swap_in and not sched.swapper.is_swapped_out(b)
    # it resumed where it stopped: the row starts at its computed tokens, not at 0
    row = next(r for r in out.scheduled if r.seq is b)
    assert row.start > 0


# ---- the tiny model -----------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts():
    rng = np.random.default_rng(3)
    stem = rng.integers(3, 97, size=8).tolist()
    return [stem + rng.integers(3, 97, size=int(n)).tolist() for n in (2, 5, 9, 3, 7)]


def generate(tiny_folder, spy=None, **kw):
    llm = LLM(model=str(tiny_folder), progress=False, block_size=4, max_model_len=48,
              num_gpu_blocks_override=16, max_num_seqs=4, **kw)
    if spy is not None:
        spy(llm.engine)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    llm.engine.kv_cache_manager.check_invariants()
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats()


def test_swapped_in_kv_equals_what_was_swapped_out(tiny_folder):
    """Every swap-out records the device blocks' K and V (all layers) by host block; every
    swap-in must put exactly those arrays into the new device blocks."""
    saved, checked = {}, []

    def spy(engine):
        runner, original = engine.runner, engine.runner.copy_blocks

        def copy_blocks(block_copies, swap_out=(), swap_in=()):
            for device, host in swap_out:
                saved[host] = [(k[device].copy(), v[device].copy()) for k, v in runner.kv_caches]
            original(block_copies, swap_out, swap_in)
            for host, device in swap_in:
                for (k, v), (k0, v0) in zip(runner.kv_caches, saved[host]):
                    np.testing.assert_array_equal(k[device], k0)
                    np.testing.assert_array_equal(v[device], v0)
                checked.append(host)

        runner.copy_blocks = copy_blocks

    _, stats = generate(tiny_folder, spy, preemption_mode="swap", swap_space=0.01)
    assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"]
    assert checked, "no block was swapped back in"


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1}])
def test_greedy_output_is_the_same_recompute_or_swap(tiny_folder, spec):
    recompute, r_stats = generate(tiny_folder, speculative_config=spec)
    swap, s_stats = generate(tiny_folder, speculative_config=spec, preemption_mode="swap",
                             swap_space=0.01)
    assert recompute == swap
    assert r_stats["num_preemptions"] > 0 and r_stats["recomputed_tokens"] > 0
    assert r_stats["swap_outs"] == 0
    assert s_stats["swap_outs"] > 0 and s_stats["swap_fallbacks_to_recompute"] == 0
    assert s_stats["recomputed_tokens"] == 0 and s_stats["swap_bytes"] > 0


def test_a_full_host_pool_falls_back_to_recompute(tiny_folder):
    recompute, _ = generate(tiny_folder)
    swap, stats = generate(tiny_folder, preemption_mode="swap", swap_space=0)
    assert recompute == swap
    assert stats["swap_outs"] == 0 and stats["swap_fallbacks_to_recompute"] > 0
    assert stats["recomputed_tokens"] > 0


def test_swap_knobs_are_checked(tiny_folder):
    with pytest.raises(ValueError, match="preemption_mode='evict'"):
        LLM(model=str(tiny_folder), progress=False, preemption_mode="evict")
    with pytest.raises(ValueError, match="swap_space=-1"):
        LLM(model=str(tiny_folder), progress=False, swap_space=-1)
    with pytest.raises(ValueError, match="draft model"):
        LLM(model=str(tiny_folder), progress=False, preemption_mode="swap",
            speculative_config={"method": "draft_model", "model": "self",
                                "num_speculative_tokens": 2, "num_draft_layers": 1})
    # static batching has no swap: refused, not silently run by recompute
    with pytest.raises(ValueError, match="preemption_mode='swap' needs batching='continuous'"):
        LLM(model=str(tiny_folder), progress=False, preemption_mode="swap", batching="static")


def test_a_step_never_applied_carries_its_swap_copies():
    """The forward of the step that planned a swap-out fails: the next schedule() carries
    the copies over (the host pool already names those blocks), so the KV still arrives."""
    sched, kv, runner, a, b = two_on_a_small_pool()
    for _ in range(100):
        out = sched.schedule()
        if out.swap_out:
            break
        sched.update(out, runner.execute(out))
    assert out.swap_out
    again = sched.schedule()  # `out` was never run nor applied
    assert set(out.swap_out) <= set(again.swap_out)
    sched.update(again, runner.execute(again))
    done = {}
    while sched.has_unfinished():
        _, retired = step(sched, runner)
        done.update({seq.request_id: seq for seq in retired})
    for seq in (a, b):
        tokens, _ = expected_output(seq.request_id, 4, seq.sampling_params, 512, None)
        assert done[seq.request_id].output_token_ids == tokens


def test_victims_of_one_step_share_their_host_blocks():
    """Two forked siblings preempted in the same step: their 3 shared blocks are copied
    once, onto host blocks of ref count 2; device ref counts drop as on recompute."""
    from refserve.kv_cache import KVCacheManager
    from refserve.kv_cache.host_pool import HostBlockPool
    from refserve.scheduler import SchedulerOutput
    from refserve.scheduler.swapping import Swapper
    from refserve.sequence import Sequence

    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    a = Sequence("a", list(range(10)), SamplingParams(), seq_id=0)
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    b = a.fork(seq_id=1)
    kv.fork(a, b)
    swapper = Swapper(HostBlockPool(8), kv)
    assert swapper.defer(a) and swapper.defer(b)
    assert kv.num_held_blocks == 0  # released at once: the pool can use them this step
    out = SchedulerOutput(step=0)
    swapper.flush(out)
    host = swapper.host_pool
    assert len(out.swap_out) == 3 and host.host_table(0) == host.host_table(1)
    assert [host.ref_count(h) for h in host.host_table(0)] == [2, 2, 2]
    back = SchedulerOutput(step=1)
    # Alone: its own device copies; b keeps the host blocks.
    assert swapper.swap_in(a, 0, back) == []
    assert len(back.swap_in) == 3 and kv.get_block_ids(0) == [d for _, d in back.swap_in]
    assert [host.ref_count(h) for h in host.host_table(1)] == [1, 1, 1]
    kv.check_invariants()
    host.check_invariants()


def test_a_victim_the_host_pool_cannot_hold_is_left_to_recompute():
    from refserve.kv_cache import KVCacheManager
    from refserve.kv_cache.host_pool import HostBlockPool
    from refserve.scheduler.swapping import Swapper
    from refserve.sequence import Sequence

    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    a = Sequence("a", list(range(10)), SamplingParams(), seq_id=0)
    kv.allocate_slots(a, 10)
    swapper = Swapper(HostBlockPool(2), kv)  # 3 blocks do not fit
    assert not swapper.defer(a) and swapper.num_fallbacks == 1
    assert kv.has_sequence(0) and not swapper.is_swapped_out(a)  # nothing changed
