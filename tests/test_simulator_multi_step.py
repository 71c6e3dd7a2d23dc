"""vLLM V0's multi-step scheduling in the simulator (refserve/simulator/multi_step.py): one
scheduler call per round of n decode steps, no admission mid-round, prefills alone, and a
round's tokens delivered together when it ends."""

import pytest

from refserve.config import EngineConfig
from refserve.simulator import SimRequest, SimulatedEngine, load_gpu, load_model
from refserve.simulator.multi_step import MultiStepRounds

MODEL = load_model("llama-3-8b")


class UnitSteps:
    """Every step takes one second; records which steps called the scheduler."""

    def __init__(self):
        self.calls = []

    def step_time(self, out, scheduled=True):
        self.calls.append((scheduled, [row.num_scheduled_tokens for row in out.scheduled]))
        return 1.0


def engine(n, cost):
    return SimulatedEngine(MODEL, load_gpu("h100-80gb"), EngineConfig(
        max_model_len=256, num_gpu_blocks_override=64, enable_chunked_prefill=False,
        enable_prefix_caching=False),
        cost_model=cost, num_scheduler_steps=n)


def request(rid, t, prompt, output):
    return SimRequest(rid, t, list(range(1000, 1000 + prompt)), list(range(output)))


def test_a_round_is_one_scheduler_call_and_one_delivery():
    cost = UnitSteps()
    result = engine(4, cost).run([request("a", 0.0, 30, 21)])
    m = result.metrics["a"]
    # step 1 the prefill (alone, one step: the first token at t = 1), then rounds of 4
    # decode steps delivering at t = 5, 9, 13, 17, 21
    assert cost.calls[0] == (True, [30])
    assert [s for s, _ in cost.calls[1:]] == [True, False, False, False] * 5
    assert m.ttft == pytest.approx(1.0) and m.finish_time == pytest.approx(21.0)
    assert list(result.itl) == pytest.approx([4.0] * 5)  # one gap per round
    assert m.tpot == pytest.approx(1.0)  # 20 tokens in 20 steps
    assert result.delivery.first["a"] == (0, 0) and result.delivery.last["a"] == (20, 20)


def test_an_arrival_waits_for_the_round_to_end():
    cost = UnitSteps()
    result = engine(4, cost).run([request("a", 0.0, 30, 21), request("b", 2.5, 40, 3)])
    # b arrives in a's first round (steps 1..5) and is prefilled alone after it, 5 -> 6
    assert result.metrics["b"].ttft == pytest.approx(6.0 - 2.5)
    assert cost.calls[5] == (True, [40])
    one_step = UnitSteps()
    plain = engine(1, one_step).run([request("a", 0.0, 30, 21), request("b", 2.5, 40, 3)])
    assert plain.metrics["b"].ttft == pytest.approx(4.0 - 2.5)  # the next step, 3 -> 4


def test_rounds_refuse_bad_settings():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        MultiStepRounds(0)
    with pytest.raises(ValueError, match="speculative"):
        SimulatedEngine(MODEL, load_gpu("h100-80gb"), EngineConfig(
            max_model_len=256, speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 2}),
            num_scheduler_steps=4)
