"""The simulator's schedule is the real engine's: run the tiny model for real, record every
step (who ran which tokens, who was preempted) and its time, then simulate the same requests
arriving before the same steps with those step times replayed. Both use the same Scheduler
and KVCacheManager classes, so the two schedules must be identical, step by step."""

import time

import numpy as np
import pytest

from refserve.engine import LLMEngine
from refserve.sampling_params import SamplingParams
from refserve.simulator import SimRequest, SimulatedEngine, load_gpu, load_model
from refserve.simulator.step_fit import replay

VOCAB = 97


def rows_of(out):
    return (tuple((row.seq.request_id, row.start, row.num_scheduled_tokens, row.num_logits)
                  for row in out.scheduled),
            tuple(sorted(out.preempted)))


def record_schedule(scheduler) -> list:
    """Wrap this scheduler's schedule(): each step's rows land in the returned list."""
    schedule, steps = scheduler.schedule, []

    def recording_schedule(*args):
        out = schedule(*args)
        steps.append(rows_of(out))
        return out

    scheduler.schedule = recording_schedule
    return steps


def run_real(folder, requests, add_before_step, **config):
    """The real engine, requests added just before their step (or earlier, were the engine
    idle); returns the schedule of every step, its wall time, each request's output, and
    the step each request was really added before."""
    engine = LLMEngine(model=str(folder), progress=False, **config)
    steps = record_schedule(engine.scheduler)
    times, outputs, step, added = [], {}, 0, {}
    pending = sorted(zip(add_before_step, requests), key=lambda p: p[0])
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():  # never idle: the next one comes now
            pending[0] = (step, pending[0][1])
        while pending and pending[0][0] <= step:
            _, (rid, prompt, max_tokens) = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                           ignore_eos=True, temperature=0.0))
            added[rid] = step
        t0 = time.perf_counter()
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o
        times.append(max(time.perf_counter() - t0, 1e-6))
        step += 1
    return steps, times, outputs, [added[rid] for rid, _, _ in requests]


def run_sim(folder, requests, add_before_step, times, outputs, **config):
    """The simulator on the same requests: request i arrives halfway through the step
    before the one it was added before (so it joins at exactly that step), answers with the
    real engine's tokens, and each step lasts what the real one did."""
    starts = np.concatenate([[0.0], np.cumsum(times)])
    sim_requests = []
    for step, (rid, prompt, _) in zip(add_before_step, requests):
        arrival = 0.0 if step == 0 else starts[step - 1] + times[step - 1] / 2
        sim_requests.append(SimRequest(rid, float(arrival), prompt,
                                       list(outputs[rid].outputs[0].token_ids)))
    engine = SimulatedEngine(load_model(str(folder)), load_gpu("h100-80gb"),
                             cost_model=replay(times), dtype="float32", **config)
    steps = record_schedule(engine.scheduler)
    result = engine.run(sim_requests, check_invariants=True)
    return steps, result


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_simulated_schedule_equals_the_real_engines(tiny_llama, prefix_caching):
    rng = np.random.default_rng(7)
    shared = rng.integers(3, VOCAB, 12).tolist()  # a shared prefix: prefix-cache hits
    requests = []
    for i in range(10):
        head = shared if i % 2 else []
        prompt = head + rng.integers(3, VOCAB, int(rng.integers(5, 30))).tolist()
        requests.append((f"r{i}", prompt, int(rng.integers(3, 16))))
    add_before_step = [0, 0, 0, 1, 2, 4, 4, 7, 9, 12]
    # A pool of 16 blocks of 4 tokens for up to 4 sequences of up to ~60 tokens: the
    # scheduler must preempt; a budget of 16 tokens: prompts are chunked.
    config = dict(block_size=4, num_gpu_blocks_override=16, max_num_seqs=4,
                  max_num_batched_tokens=16, max_model_len=64,
                  enable_prefix_caching=prefix_caching)
    real_steps, times, outputs, added = run_real(tiny_llama, requests, add_before_step,
                                                 **config)
    sim_steps, result = run_sim(tiny_llama, requests, added, times, outputs, **config)

    assert sim_steps == real_steps
    # The schedule really exercised what it is meant to compare.
    assert any(preempted for _, preempted in real_steps), "no preemption happened"
    assert any(num_tokens > 1 and num_logits == 0 for rows, _ in real_steps
               for _, _, num_tokens, num_logits in rows), "no prefill was chunked"
    for rid, _, _ in requests:
        real, sim = outputs[rid].metrics, result.metrics[rid]
        assert sim.num_preemptions == real.num_preemptions
        assert sim.num_cached_tokens == real.num_cached_tokens
        assert sim.num_output_tokens == real.num_output_tokens
    if prefix_caching:
        assert result.summary.prefix_hit_rate and result.summary.prefix_hit_rate > 0


def test_a_different_schedule_is_noticed(tiny_llama):
    """Negative control: the comparison fails when one knob differs (the recording is not
    trivially equal)."""
    rng = np.random.default_rng(3)
    requests = [(f"r{i}", rng.integers(3, VOCAB, 20).tolist(), 6) for i in range(6)]
    add_before_step = [0] * 6
    config = dict(block_size=4, num_gpu_blocks_override=40, max_num_seqs=4,
                  max_num_batched_tokens=32, max_model_len=64)
    real_steps, times, outputs, added = run_real(tiny_llama, requests, add_before_step,
                                                 **config)
    sim_steps, _ = run_sim(tiny_llama, requests, added, times + [1e-3] * 20, outputs,
                           **{**config, "max_num_batched_tokens": 24})
    assert sim_steps != real_steps
