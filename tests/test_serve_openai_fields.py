"""The OpenAI fields beyond the basics: logprobs (completions and chat,
streamed too) equal `LLM.generate`'s, echo, stop_reason, the prefix-cache hit in
usage.prompt_tokens_details.cached_tokens, and stream_options as vLLM defaults them. Also
the command line's `serve MODEL` and the backend-dependent token budget."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_utils import MODEL, PROMPT, make_engine

from refserve import SamplingParams
from refserve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from refserve.engine import LLMEngine
from refserve.sampling_params import MAX_LOGPROBS
from refserve.serve import build_parser, main

pytestmark = pytest.mark.serving

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _offline(offline, prompt, **kw):
    return offline.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def _post(served, path, **body):
    r = httpx.post(served.url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _sse(served, path, **body) -> list[dict]:
    with httpx.stream("POST", served.url + path, json={"model": MODEL, "stream": True, **body},
                      timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _want_top(position, n):
    """The n most likely (decoded token, logprob) of one offline position."""
    entries = sorted(position.items(), key=lambda e: (-e[1].logprob, e[0]))
    if len(position) > n:  # the sampled token, first, is not among the top n
        entries = sorted(list(position.items())[1:], key=lambda e: (-e[1].logprob, e[0]))
    return [(lp.decoded_token, pytest.approx(lp.logprob, abs=1e-5)) for _, lp in entries[:n]]


def test_completion_logprobs_equal_llm_generate(served, offline):
    want = _offline(offline, PROMPT, max_tokens=6, logprobs=3, **GREEDY).outputs[0]
    got = _post(served, "/v1/completions", prompt=PROMPT, max_tokens=6, logprobs=3,
                **GREEDY)["choices"][0]["logprobs"]
    assert got["tokens"] == [want.logprobs[i][t].decoded_token
                             for i, t in enumerate(want.token_ids)]
    assert got["token_logprobs"] == pytest.approx(
        [want.logprobs[i][t].logprob for i, t in enumerate(want.token_ids)], abs=1e-5)
    for top, position in zip(got["top_logprobs"], want.logprobs):
        assert top == pytest.approx({lp.decoded_token: lp.logprob
                                     for lp in position.values()}, abs=1e-5)
    assert got["text_offset"] == [sum(len(t) for t in got["tokens"][:i])
                                  for i in range(len(got["tokens"]))]
    # streamed: the chunks' logprobs concatenate to the whole response's
    chunks = _sse(served, "/v1/completions", prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    streamed = {k: [] for k in got}
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        for k in streamed:
            streamed[k] += lp[k] if lp else []
    # (the repeat reads its prompt's KV from the prefix cache: the same numbers to float
    # rounding, not bit for bit)
    assert streamed["tokens"] == got["tokens"]
    assert streamed["text_offset"] == got["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(got["token_logprobs"], abs=1e-5)
    for a, b in zip(streamed["top_logprobs"], got["top_logprobs"]):
        assert a == pytest.approx(b, abs=1e-5)


def test_chat_logprobs_equal_llm_generate_through_the_openai_client(served, offline):
    messages = [{"role": "user", "content": "What is a block?"}]
    prompt = offline.get_tokenizer().apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=True)
    want = _offline(offline, prompt, max_tokens=5, logprobs=2, **GREEDY).outputs[0]
    r = served.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    for entry, token_id, position in zip(content, want.token_ids, want.logprobs):
        assert entry.token == position[token_id].decoded_token
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == _want_top(position, 2)
    streamed = [e for chunk in served.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content]
    assert [(e.token, pytest.approx(e.logprob, abs=1e-5)) for e in streamed] == [
        (e.token, e.logprob) for e in content]
    # logprobs without top_logprobs: the chosen tokens only
    r = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_echo_sends_the_prompt_back_with_its_logprobs(served, offline):
    want = _offline(offline, PROMPT, max_tokens=4, logprobs=1, prompt_logprobs=1, **GREEDY)
    choice = _post(served, "/v1/completions", prompt=PROMPT, max_tokens=4, echo=True,
                   logprobs=1, **GREEDY)["choices"][0]
    assert choice["text"] == PROMPT + want.outputs[0].text
    lp = choice["logprobs"]
    n = len(want.prompt_token_ids)
    assert len(lp["tokens"]) == n + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx(
        [want.prompt_logprobs[i][t].logprob for i, t in enumerate(want.prompt_token_ids)
         if i > 0], abs=1e-5)
    assert lp["text_offset"][n] == len(PROMPT)
    # streamed: the prompt comes first, then the generated text
    chunks = _sse(served, "/v1/completions", prompt=PROMPT, max_tokens=4, echo=True, **GREEDY)
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    # token ids are echoed as their text
    ids = offline.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    assert _post(served, "/v1/completions", prompt=ids, max_tokens=1, echo=True)[
        "choices"][0]["text"].startswith(PROMPT)


def test_stop_reason_names_the_stop_string_or_token(served, offline):
    full = _offline(offline, PROMPT, max_tokens=20, **GREEDY).outputs[0]
    stop_id = full.token_ids[3]
    choice = _post(served, "/v1/completions", prompt=PROMPT, max_tokens=20,
                   stop_token_ids=[stop_id], **GREEDY)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    choice = _post(served, "/v1/completions", prompt=PROMPT, max_tokens=3, **GREEDY)[
        "choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    last = _sse(served, "/v1/completions", prompt=PROMPT, max_tokens=20,
                stop_token_ids=[stop_id], **GREEDY)[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop_id)


def test_cached_tokens_report_the_prefix_cache_hit(served):
    prompt = "Prefix caching reuses full blocks of a shared prompt " * 4
    first = _post(served, "/v1/completions", prompt=prompt, max_tokens=2)["usage"]
    second = _post(served, "/v1/completions", prompt=prompt, max_tokens=2)["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    block = served.engine.block_size
    # every full block but the one holding the last prompt token (it must be computed)
    assert cached == (second["prompt_tokens"] - 1) // block * block > 0
    usage = _sse(served, "/v1/completions", prompt=prompt, max_tokens=2,
                 stream_options={"include_usage": True})[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached


def test_stream_options_default_as_vllm_and_continuous_usage(served):
    plain = _sse(served, "/v1/completions", prompt=PROMPT, max_tokens=3)
    assert "usage" not in plain[-1]                         # no stream_options: no usage
    given = _sse(served, "/v1/completions", prompt=PROMPT, max_tokens=3, stream_options={},
                 ignore_eos=True)
    assert given[-1]["choices"] == [] and given[-1]["usage"]["completion_tokens"] == 3
    every = _sse(served, "/v1/completions", prompt=PROMPT, max_tokens=4, ignore_eos=True,
                 stream_options={"include_usage": False, "continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in every]
    assert counts == sorted(counts) and counts[-1] == 4 and every[-1]["choices"]


def test_logprobs_are_capped():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=10**6)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1)
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == 20


def test_serve_takes_the_model_as_a_positional_argument(capsys):
    args = build_parser().parse_args(["/models/x"])
    assert args.model_tag == "/models/x"
    with pytest.raises(SystemExit) as e:
        main(["/models/x", "--model", "/models/y"])
    assert e.value.code == 2 and "disagree" in capsys.readouterr().err


def test_the_token_budget_defaults_to_the_backends(tiny_chat_llama, capsys):
    assert EngineConfig().max_num_batched_tokens is None
    assert build_parser().parse_args([]).max_num_batched_tokens is None
    assert "numpy 256, cpu 256" in " ".join(build_parser().format_help().split())
    assert DEFAULT_MAX_NUM_BATCHED_TOKENS["numpy"] == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    engine = LLMEngine(model=str(tiny_chat_llama), num_gpu_blocks_override=64, block_size=4)
    assert engine.config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    assert engine.scheduler.max_num_batched_tokens == 256
    assert "token budget 256 per step (the cpu default)" in capsys.readouterr().err
    engine = LLMEngine(model=str(tiny_chat_llama), backend="numpy", num_gpu_blocks_override=64,
                       block_size=4)
    assert engine.scheduler.max_num_batched_tokens == 256
    assert "token budget 256 per step (the numpy default)" in capsys.readouterr().err
    engine = make_engine(tiny_chat_llama, max_num_batched_tokens=64)
    assert engine.scheduler.max_num_batched_tokens == 64


# ---- vLLM's SamplingParams fields over HTTP: each equals LLM.generate with the field -------

def _text_and_ids(served, offline, body, **params):
    got = _post(served, "/v1/completions", prompt=PROMPT, max_tokens=8, **GREEDY, **body)
    want = _offline(offline, PROMPT, max_tokens=8, **GREEDY, **params)
    return got, want


def test_logit_bias_allowed_token_ids_and_bad_words_equal_llm_generate(served, offline):
    plain = _offline(offline, PROMPT, max_tokens=8, **GREEDY).outputs[0]
    first = plain.token_ids[0]
    cases = [({"logit_bias": {str(first): -100}}, {"logit_bias": {first: -100.0}}),
             ({"logit_bias": {"7": 250}}, {"logit_bias": {7: 100.0}}),     # clamped to 100
             ({"allowed_token_ids": [40, 41, 42]}, {"allowed_token_ids": [40, 41, 42]}),
             ({"bad_words": ["pool", "ks"]}, {"bad_words": ["pool", "ks"]})]
    for body, params in cases:
        got, want = _text_and_ids(served, offline, body, **params)
        assert got["choices"][0]["text"] == want.outputs[0].text, body
        assert want.outputs[0].token_ids != plain.token_ids or "bad_words" in body, body
    chat = _post(served, "/v1/chat/completions", max_tokens=4, **GREEDY,
                 messages=[{"role": "user", "content": "hi"}], logit_bias={"7": 100})
    assert chat["choices"][0]["message"]["content"] == offline.llm_engine.tokenizer.decode(
        [7] * 4)


def test_special_token_options_and_truncation_equal_llm_generate(served, offline):
    body = {"allowed_token_ids": [1, 2], "skip_special_tokens": False,
            "spaces_between_special_tokens": False}
    got, want = _text_and_ids(served, offline, body, **body)
    assert got["choices"][0]["text"] == want.outputs[0].text
    assert got["choices"][0]["text"].startswith("<|im_")
    got, want = _text_and_ids(served, offline, {"truncate_prompt_tokens": 2},
                              truncate_prompt_tokens=2)
    assert got["choices"][0]["text"] == want.outputs[0].text
    assert got["usage"]["prompt_tokens"] == 2
    # A prompt longer than the context is cut before the length check, as in vLLM.
    long = PROMPT * 200
    r = httpx.post(served.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 8


@pytest.mark.parametrize("body,param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": "big"}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),           # outside the vocabulary
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids"),
    ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
    ({"bad_words": "pool"}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
])
def test_bad_vllm_fields_are_400_naming_the_field(served, body, param):
    r = httpx.post(served.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_priority_reaches_the_engine_and_is_refused_without_the_priority_policy(tiny_chat_llama,
                                                                              served):
    # vLLM's extra field: lower runs first, only under scheduling_policy="priority".
    from serve_utils import ServerThread

    engine = make_engine(tiny_chat_llama, scheduling_policy="priority")
    seen = []
    add = engine.add_request

    def recording_add(*args, priority=0, **kw):
        seen.append(priority)
        return add(*args, priority=priority, **kw)

    engine.add_request = recording_add
    s = ServerThread(engine)
    try:
        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": PROMPT}]})):
            r = httpx.post(s.url + path, timeout=60, json={
                "model": MODEL, "max_tokens": 2, "priority": -3, **body})
            assert r.status_code == 200, r.text
        assert seen == [-3, -3]
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and seen[-1] == 0          # the default
    finally:
        s.close()
    # The fcfs server names the field: the policy must be asked for, and it is an integer.
    for value, words in ((1, "scheduling_policy"), ("high", "integer")):
        r = httpx.post(served.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "priority": value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "priority" and words in err["message"], err
