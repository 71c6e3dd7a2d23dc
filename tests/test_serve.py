"""The OpenAI-compatible server, over real loopback sockets: the official `openai` client for
the happy paths, raw HTTP (httpx) for the errors, and the engine's own state for what a
disconnect frees. Most tests use a tiny random Llama with a tiny real tokenizer
(tests/tiny_text_model.py); the SmolLM2 test is marked slow."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from serve_utils import (
    MODEL,
    PROMPT,
    ServerProcess,
    ServerThread,
    assert_blocks_freed,
    make_engine,
    wait_for,
)

from refserve import LLM, SamplingParams
from refserve.engine import EngineStepError
from refserve.entrypoints.detokenize import DeltaTracker
from refserve.entrypoints.prometheus import Histogram, parse_metrics
from refserve.entrypoints.protocol import APIError, parse_chat_request, parse_completion_request

pytestmark = pytest.mark.serving


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# ---- the openai client: completions, chat, streaming, n > 1 ------------------------------

def test_completion_equals_offline_greedy(served, offline):
    want = offline.generate([PROMPT], greedy(12), use_tqdm=False)[0].outputs[0]
    r = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(offline.get_tokenizer().encode(
        PROMPT, add_special_tokens=False))
    # token ids are a prompt too, and give the same continuation
    ids = offline.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    r2 = served.client().completions.create(model=MODEL, prompt=ids, max_tokens=12,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert r2.choices[0].text == want.text


def test_streamed_completion_concatenates_to_the_text(served, offline):
    want = offline.generate([PROMPT], greedy(16), use_tqdm=False)[0].outputs[0].text
    chunks = list(served.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2                      # it really streamed
    assert "".join(c.choices[0].text for c in text_chunks) == want
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 16


def test_chat_applies_the_template_server_side(served, offline):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a block?"}]
    prompt = offline.get_tokenizer().apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=True)
    want = offline.generate([prompt], greedy(10), use_tqdm=False)[0].outputs[0].text
    client = served.client()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(offline.get_tokenizer().encode(
        prompt, add_special_tokens=False))
    stream = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    assert stream[-1].usage.completion_tokens == 10


def test_parallel_sampling_n_choices_streamed_and_not(served, offline):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=1.0, seed=5, n=3,
              extra_body={"ignore_eos": True})
    client = served.client()
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 21
    want = offline.generate([PROMPT], SamplingParams(n=3, max_tokens=7, temperature=1.0,
                                                     seed=5, ignore_eos=True),
                            use_tqdm=False)[0].outputs
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [w.text for w in want]
    texts, finishes = {0: "", 1: "", 2: ""}, []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes.append(c.index)
    assert sorted(finishes) == [0, 1, 2]             # each choice finishes exactly once
    assert [texts[i] for i in range(3)] == [w.text for w in want]


def test_stop_string_is_never_streamed(served, offline):
    full = offline.generate([PROMPT], greedy(24), use_tqdm=False)[0].outputs[0].text
    at = next(i for i in range(3, len(full) - 3) if "\ufffd" not in full[i:i + 3]
              and full[i:i + 3].strip() == full[i:i + 3])
    stop = full[at:at + 3]
    want = full[:full.find(stop)]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    client = served.client()
    assert client.completions.create(**kw).choices[0].text == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == want and stop not in streamed


def test_delta_tracker_holds_back_a_possible_stop_prefix():
    # Cumulative texts as the engine reports them; the last step completes the stop string
    # "END" and the engine cuts the final text where it begins.
    texts = ["ab", "abE", "abEN", "abENx", "abENxE", "abENxEND"]
    final = "abENx"
    sent = ""
    tracker = DeltaTracker(["END"])
    for i, t in enumerate(texts):
        last = i == len(texts) - 1
        sent += tracker.delta(final if last else t, last)
        assert final.startswith(sent) or not last
        assert (final if last else t).startswith(sent)
    assert sent == final
    # Negative control: without holding back, "abENxE" is sent, which the final text drops.
    naive, naive_sent = DeltaTracker([]), ""
    for t in texts[:-1]:
        naive_sent += naive.delta(t, False)
    assert not final.startswith(naive_sent)
    # a half-decoded multi-byte character is held back until complete
    t2 = DeltaTracker()
    assert t2.delta("caf\ufffd", False) == "caf"
    assert t2.delta("café", False) == "é"


# ---- errors: raw HTTP -------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -3}, "top_k"),
    ({"prompt": "x", "presence_penalty": 9}, "presence_penalty"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),  # above --max-logprobs (20)
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),                 # an unknown token id
    ({"prompt": "x " * 400}, "prompt"),              # longer than max_model_len (256)
    ({"prompt": "x", "max_tokens": 300}, "max_tokens"),
])
def test_bad_completion_field_is_a_400_naming_it(served, body, param):
    r = httpx.post(served.url + "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"]


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -2},
     "max_completion_tokens"),
])
def test_bad_chat_field_is_a_400_naming_it(served, body, param):
    r = httpx.post(served.url + "/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_other_errors_are_openai_shaped(served):
    r = httpx.post(served.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.get(served.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError) as e:
        served.client().completions.create(model=MODEL, prompt="x", top_p=7)
    assert e.value.body["param"] == "top_p"


def test_models_health_and_metrics(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(served.url + "/health").status_code == 200
    text = httpx.get(served.url + "/metrics").text
    for family, kind in (("num_requests_running", "gauge"), ("num_requests_waiting", "gauge"),
                         ("kv_cache_blocks_used", "gauge"), ("prefix_cache_hit_rate", "gauge"),
                         ("num_preemptions_total", "counter"),
                         ("time_to_first_token_seconds", "histogram"),
                         ("time_per_output_token_seconds", "histogram")):
        assert f"# TYPE refserve:{family} {kind}" in text
    m = parse_metrics(text)
    assert m["refserve:kv_cache_blocks_total"] == 512
    assert m['refserve:time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        m["refserve:time_to_first_token_seconds_count"]


def test_histogram_buckets_are_cumulative_and_le_is_inclusive():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    lines = h.lines("x")
    assert lines[:3] == ['x_bucket{le="0.1"} 2', 'x_bucket{le="1.0"} 4', 'x_bucket{le="+Inf"} 5']
    assert lines[-1] == "x_count 5"


def test_protocol_maps_fields_onto_sampling_params():
    req = parse_completion_request({"prompt": ["a", "b"], "n": 2, "temperature": 0.5,
                                    "top_p": 0.9, "top_k": 7, "seed": 3, "stop": "##",
                                    "ignore_eos": True, "max_tokens": 9})
    sp = req.sampling_params(req.max_tokens)
    assert (sp.n, sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop,
            sp.ignore_eos) == (2, 9, 0.5, 0.9, 7, 3, ["##"], True)
    assert req.prompts == ["a", "b"]
    chat = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "max_completion_tokens": 4})
    assert chat.messages == [{"role": "user", "content": "hi"}] and chat.max_tokens == 4
    with pytest.raises(APIError) as e:
        parse_completion_request({"prompt": "x", "temperature": True})
    assert e.value.param == "temperature"


# ---- the serving contract: overload, disconnects, failures, concurrency -----------------

async def _post_all(url, bodies):
    async with httpx.AsyncClient(timeout=60) as c:
        return await asyncio.gather(*(c.post(url + "/v1/completions", json=b) for b in bodies))


def test_full_waiting_queue_is_a_503_with_retry_after(tiny_chat_llama):
    s = ServerThread(make_engine(tiny_chat_llama, max_num_seqs=1), max_waiting=1)
    try:
        bodies = [{"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                   "ignore_eos": True} for _ in range(6)]
        responses = asyncio.run(_post_all(s.url, bodies))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 1
        for r in responses:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 40
        m = s.metrics()
        outcomes = {k: m[f'refserve:requests_total{{outcome="{k}"}}']
                    for k in ("finished", "aborted", "rejected", "failed")}
        assert outcomes["finished"] == codes.count(200)
        assert outcomes["rejected"] == codes.count(503)
        assert sum(outcomes.values()) == 6           # every request has exactly one outcome
    finally:
        s.close()


def test_disconnect_mid_stream_aborts_and_frees_the_blocks(served, monkeypatch):
    # The tiny model can finish 240 tokens before a loaded client has read three: pace the
    # engine (at least 20 ms a step) so the request is surely running when the client leaves.
    step = served.engine.step

    def paced_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(served.engine, "step", paced_step)
    before = served.metrics()
    aborted = 'refserve:requests_total{outcome="aborted"}'
    finished = 'refserve:requests_total{outcome="finished"}'
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", served.url + "/v1/completions",
                                                 json=body) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
        m = served.metrics()
        assert m["refserve:kv_cache_blocks_used"] > 0       # it holds blocks while running
    # Leaving the block closes the connection mid-stream. Wait on the abort itself (its
    # counter), however long a loaded machine takes, not on a time window.
    wait_for(lambda: served.metrics()[aborted] == before[aborted] + 1, "the abort")
    m = assert_blocks_freed(served)
    # Aborted while running (an abort of a finished request counts nothing), never finished.
    assert m[aborted] == before[aborted] + 1 and m[finished] == before[finished]


@pytest.mark.parametrize("named", [True, False])
def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(tiny_chat_llama, named):
    """An EngineStepError fails the requests it names; any other step error fails all in
    flight. Either way they get a 500, their blocks are freed and the next request works."""
    s = ServerThread(make_engine(tiny_chat_llama))
    try:
        original = s.engine.step
        calls = {"n": 0}

        def fail_once():
            calls["n"] += 1
            if calls["n"] == 2:                      # mid-generation, not at admission
                if named:
                    raise EngineStepError("injected", s.server.request_ids)
                raise FloatingPointError("injected")
            return original()

        s.engine.step = fail_once
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"          # the stream after the failure is whole
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        m = assert_blocks_freed(s)
        assert m['refserve:requests_total{outcome="failed"}'] == 1
        assert m['refserve:requests_total{outcome="finished"}'] == 2
    finally:
        s.close()


def test_200_concurrent_streams_all_finish_with_their_token_counts(served):
    async def one(client, i):
        want = 3 + i % 11
        stream = await client.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=want, temperature=0.8, seed=i,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                usage = chunk.usage
        return want, finish, usage.completion_tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused",
                                    max_retries=0, timeout=60,
                                    http_client=httpx.AsyncClient(
                                        limits=httpx.Limits(max_connections=256)))
        async with client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(200))), 60)

    results = asyncio.run(main())
    assert len(results) == 200
    assert all(finish == "length" and got == want for want, finish, got in results)
    assert_blocks_freed(served)


# ---- the command line ---------------------------------------------------------------------

def test_cli_serves_and_rejects_bad_flags(tiny_chat_llama, tmp_path):
    bad = ServerProcess(["--port", "70000"], tmp_path)
    assert bad.wait() == 2
    assert "error:" in bad.output() and "Traceback" not in bad.output()
    proc = ServerProcess(["--model", str(tiny_chat_llama), "--num-gpu-blocks-override", "64",
                          "--served-model-name", "t"], tmp_path)
    try:
        proc.wait_healthy()
        r = httpx.post(proc.url + "/v1/completions", json={"model": "t", "prompt": PROMPT,
                                                           "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.stop()


@pytest.mark.slow
def test_smollm2_greedy_chat_over_http_equals_llm_generate(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), progress=False)
    question = "What is the capital of France? Answer in one word."
    want = llm.generate([llm.llm_engine.apply_chat_template(question)],
                        SamplingParams(max_tokens=12, temperature=0.0),
                        use_tqdm=False)[0].outputs[0]
    s = ServerThread(llm.llm_engine)
    try:
        r = s.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12,
            temperature=0)
        assert r.choices[0].message.content == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           s.client().chat.completions.create(
                               model=MODEL, messages=[{"role": "user", "content": question}],
                               max_tokens=12, temperature=0, stream=True) if c.choices)
        assert streamed == want.text
        assert json.loads(httpx.get(s.url + "/v1/models").text)["data"][0]["id"] == MODEL
    finally:
        s.close()
