"""enable_chunked_prefill=False, vLLM V0's prefill-first schedule, on the real engine and on
the scheduler the simulator runs: a step with prefill work holds prefill rows only, every
running decode waits for it, and greedy outputs do not change."""

from __future__ import annotations

import pytest

from refserve.config import EngineConfig
from refserve.engine import LLMEngine
from refserve.sampling_params import SamplingParams
from refserve.scheduler.prefill_first import PrefillFirstScheduler
from refserve.simulator.engine import SimulatedEngine
from refserve.simulator.hardware import load_gpu, load_model
from refserve.simulator.workload import make_workload


class Steps:
    """An engine observer that keeps every SchedulerOutput's rows as (request, kind)."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, str]]] = []

    def arrive(self, request_id, t) -> None:
        pass

    def abort(self, request_id, t) -> None:
        pass

    def step(self, t_start, t_end, out, update, outputs) -> None:
        self.steps.append([(row.seq.request_id, row.kind) for row in out.scheduled])


def run(tiny_llama, chunked: bool, budget: int = 64):
    engine = LLMEngine(model=str(tiny_llama), block_size=4, max_num_batched_tokens=budget,
                       enable_chunked_prefill=chunked, progress=False)
    engine.observer = steps = Steps()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(3, 13))}, params)
    for _ in range(3):  # a is decoding when b and c arrive
        engine.step()
    engine.add_request("b", {"prompt_token_ids": list(range(20, 60))}, params)
    engine.add_request("c", {"prompt_token_ids": [3 + i % 90 for i in range(90)]}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return steps.steps, outputs


def test_prefill_first_runs_prefill_only_steps_and_stalls_decodes(tiny_llama):
    steps, outputs = run(tiny_llama, chunked=False)
    mixed_steps, mixed_outputs = run(tiny_llama, chunked=True)
    # Prefill-first: b's whole 40-token prompt and the first 24 tokens of c's fill the
    # 64-token budget; a, decoding, is in neither of the next two steps.
    assert steps[3] == [("b", "prefill"), ("c", "chunk")]
    assert steps[4] == [("c", "prefill")]  # c's other 66 tokens (a prompt over the budget)
    assert steps[5] == [("a", "decode"), ("b", "decode"), ("c", "decode")]
    for rows in steps:
        kinds = {kind for _, kind in rows}
        assert not ({"prefill", "chunk"} & kinds and "decode" in kinds), rows
    # Mixed (chunked prefill on): a decodes in every step, prefill chunks fill the rest.
    assert mixed_steps[3] == [("a", "decode"), ("b", "prefill"), ("c", "chunk")]
    assert all(("a", "decode") in rows for rows in mixed_steps[3:6])
    # The schedule changes when tokens come, never which tokens.
    assert outputs == mixed_outputs and len(outputs) == 3


def test_prefill_first_flag_and_static_batching_refusal():
    assert EngineConfig().enable_chunked_prefill is True
    with pytest.raises(ValueError, match="enable_chunked_prefill=False needs batching"):
        EngineConfig(batching="static", enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="must be True or False"):
        EngineConfig(enable_chunked_prefill="no")
    from refserve.entrypoints.cli_common import ArgumentParser
    from refserve.entrypoints.engine_args import add_engine_args, engine_config_from_args

    p = ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(
        ["--no-enable-chunked-prefill"])).enable_chunked_prefill is False
    assert engine_config_from_args(p.parse_args([])).enable_chunked_prefill is True


def test_simulator_runs_the_same_schedule():
    """The simulator's scheduler is the engine's: with prefill-first, a decode's TPOT
    absorbs every prefill step while it runs, so the median TPOT rises and the TTFT falls
    against the mixed schedule (the same requests, the same step prices)."""
    model, gpu = load_model("llama-3-8b"), load_gpu("a100-80gb")
    requests = make_workload("sharegpt", 150, 20.0, vocab_size=model.vocab_size,
                             max_model_len=4096)
    results = {}
    for flag in (True, False):
        engine = SimulatedEngine(model, gpu, EngineConfig(
            max_model_len=4096, max_num_batched_tokens=4096, enable_chunked_prefill=flag))
        assert isinstance(engine.scheduler, PrefillFirstScheduler) is not flag
        results[flag] = engine.run(requests).summary
    assert results[False].tpot_p50 > 1.1 * results[True].tpot_p50
    assert results[False].ttft_p50 < results[True].ttft_p50
