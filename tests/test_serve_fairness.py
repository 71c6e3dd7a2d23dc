"""One long prompt must not stall the others. On the NumPy backend the default token budget
is small (config.py: one step stays well under a second on 2 cores), so a long prompt is
prefilled in chunks and each step stays one budget long, and a prefill takes at most
`long_prefill_token_threshold` (half the budget) of it, so the budget always has room for the
requests behind it. Over HTTP, with a stream already decoding and a long prompt prefilling, a
short request that arrives mid-prefill gets its first token within 3 engine steps (not after
the long prompt's remaining chunks), each bounded by the step period measured in the same
run. The decoding stream gets a token every step throughout."""

from __future__ import annotations

import math
import threading
import time

import httpx
import pytest
from serve_utils import DEADLINE_S, MODEL, ServerThread, make_engine, wait_for

from refserve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

pytestmark = pytest.mark.serving

LONG, SHORT, DECODE = [10 + i % 300 for i in range(2000)], [5, 6, 7], [8, 9]


def test_a_short_request_behind_a_long_prompt_waits_only_for_its_chunks(long_tiny_chat_llama):
    engine = make_engine(long_tiny_chat_llama, block_size=16, num_gpu_blocks_override=1024)
    budget = engine.config.max_num_batched_tokens           # the backend's default
    assert budget == DEFAULT_MAX_NUM_BATCHED_TOKENS["numpy"] <= 512
    steps = []       # (start, end, tokens scheduled, request ids with an output)
    added = {}       # prompt length -> (request id, time, long prompt tokens left)
    schedule, step, add = engine.scheduler.schedule, engine.step, engine.add_request
    planned = []

    def recording_schedule(*args):
        out = schedule(*args)
        planned.append(out.num_batched_tokens)
        return out

    short_posted = threading.Event()

    def recording_step():
        # Hold the engine once the long prompt's first chunk is computed until the short
        # request is on its way: on a loaded machine the HTTP round trip can otherwise take
        # the whole prefill, and the test would see nothing (wait on the event, not a clock).
        long = [s for s in engine.scheduler.running if s.num_prompt_tokens == len(LONG)]
        if long and long[0].num_computed_tokens and not short_posted.is_set():
            short_posted.wait(DEADLINE_S)
        start = time.perf_counter()
        outs = step()
        steps.append((start, time.perf_counter(), planned[-1] if planned else 0,
                      {o.request_id for o in outs}))
        return outs

    def recording_add(request_id, prompt, params=None, arrival_time=None, priority=0):
        long = [s for s in engine.scheduler.running if s.num_prompt_tokens == len(LONG)]
        left = long[0].num_prompt_tokens - long[0].num_computed_tokens if long else None
        added[len(prompt)] = (request_id, time.perf_counter(), left)
        return add(request_id, prompt, params, arrival_time, priority)

    engine.scheduler.schedule, engine.step = recording_schedule, recording_step
    engine.add_request = recording_add
    s = ServerThread(engine)
    add_many = s.server.add_many

    async def marking_add_many(requests, sink, arrival_time=None, priority=0):
        if any(len(prompt) == len(SHORT) for _, prompt, _ in requests):
            short_posted.set()  # the engine may step once more before it takes the request
        await add_many(requests, sink, arrival_time, priority)

    s.server.add_many = marking_add_many
    try:
        def stream(prompt, max_tokens):
            with httpx.stream("POST", s.url + "/v1/completions", timeout=DEADLINE_S, json={
                    "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass

        decoding = threading.Thread(target=stream, args=(DECODE, 3000), daemon=True)
        decoding.start()
        wait_for(lambda: len(DECODE) in added and len(steps) > 3, "the decoding stream")
        long = threading.Thread(target=stream, args=(LONG, 64), daemon=True)
        long.start()
        # the short one arrives once the long prompt's first chunk is computed
        wait_for(lambda: any(tokens > budget // 2 for _, _, tokens, _ in steps),
                 "the long prompt's first chunk")
        r = httpx.post(s.url + "/v1/completions", timeout=DEADLINE_S, json={
            "model": MODEL, "prompt": SHORT, "max_tokens": 1})
        assert r.status_code == 200, r.text
    finally:
        short_posted.set()  # never leave the engine held
        s.close()

    short_id, t_add, left = added[len(SHORT)]
    assert left is not None and left > budget, "the short request did not arrive mid-prefill"
    first = next(i for i, (*_, ids) in enumerate(steps) if short_id in ids)
    window = [i for i, (start, *_) in enumerate(steps) if start >= t_add and i <= first]
    chunk = engine.config.long_prefill_token_threshold
    assert 0 < chunk < budget and math.ceil(left / chunk) > 3  # the prefill was far from done
    assert len(window) <= 3, (len(window), left, chunk)
    # each of those steps computed at most one budget: none was the whole prompt at once
    assert all(steps[i][2] <= budget for i in window)
    periods = [steps[i + 1][0] - steps[i][0] for i in window[:-1]] + [
        steps[first][1] - steps[first][0]]
    ttft = steps[first][1] - t_add
    assert ttft <= (len(window) + 1) * max(periods), (ttft, periods)
    # the decoding stream was served in every step of the long prefill
    decode_id = added[len(DECODE)][0]
    assert all(decode_id in steps[i][3] for i in window)
