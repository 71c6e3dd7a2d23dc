"""The server under hostile input, over real HTTP: every malformed or abusive request is a 4xx
in OpenAI's error shape (never a 500, never plain text), the server serves a normal request
right after each one, and no request can stall the others (a 5 MB body, a 1000-prompt
list whose client leaves)."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from serve_utils import DEADLINE_S, MODEL, PROMPT, ServerThread, make_engine, wait_for

from refserve.entrypoints.options import MiB

pytestmark = pytest.mark.serving

C, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}


def raw(text: str) -> bytes:
    return text.encode()


def body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 2, **fields}).encode()


def chat(**fields) -> bytes:
    return body(messages=[{"role": "user", "content": "hi"}], **fields)


DEEP = 100_000
# (kind, method, path, body, headers, status, param): param None = no field to name.
HOSTILE = [
    # the five bare 500s of the issue
    ("lone surrogate in prompt", "POST", C,
     raw('{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'), JSON, 400, "prompt"),
    ("lone surrogate in chat content", "POST", CHAT,
     raw('{"messages": [{"role": "user", "content": "\\ud800"}]}'), JSON, 400, "messages"),
    ("arrays nested 100000 deep", "POST", C,
     raw('{"prompt": ' + "[" * DEEP + "]" * DEEP + "}"), JSON, 400, None),
    ("objects nested 100000 deep", "POST", C,
     raw('{"prompt": "x", "a": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}"), JSON, 400, None),
    ("an integer of 5000 digits", "POST", C,
     raw('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}"), JSON, 400, None),
    # what the body is
    ("Content-Type text/plain", "POST", C, body(prompt="x"), {"content-type": "text/plain"},
     415, None),
    ("no Content-Type", "POST", C, body(prompt="x"), {}, 415, None),
    ("a form post", "POST", C, b"prompt=x",
     {"content-type": "application/x-www-form-urlencoded"}, 415, None),
    ("not JSON", "POST", C, b"{not json", JSON, 400, None),
    ("an empty body", "POST", C, b"", JSON, 400, None),
    ("invalid UTF-8", "POST", C, b'{"prompt": "\xff\xfe"}', JSON, 400, None),
    ("a JSON array", "POST", C, b"[1, 2]", JSON, 400, None),
    ("a JSON string", "POST", C, b'"prompt"', JSON, 400, None),
    ("a body over --max-request-bytes", "POST", C,
     body(prompt="x" * (9 * MiB)), JSON, 413, None),
    # fields
    ("n above max_num_seqs", "POST", C, body(prompt="x", n=100_000), JSON, 400, "n"),
    ("n = 10**30", "POST", C, body(prompt="x", n=10**30), JSON, 400, "n"),
    ("NaN temperature", "POST", C, raw('{"prompt": "x", "temperature": NaN}'), JSON, 400,
     "temperature"),
    ("Infinity top_p", "POST", C, raw('{"prompt": "x", "top_p": Infinity}'), JSON, 400,
     "top_p"),
    ("temperature as a string", "POST", C, body(prompt="x", temperature="0.5"), JSON, 400,
     "temperature"),
    ("max_tokens 3.5", "POST", C, body(prompt="x", max_tokens=3.5), JSON, 400, "max_tokens"),
    ("max_tokens 10**30", "POST", C, body(prompt="x", max_tokens=10**30), JSON, 400,
     "max_tokens"),
    ("seed 2**70", "POST", C, body(prompt="x", seed=2**70), JSON, 400, "seed"),
    ("min_tokens above max_tokens", "POST", C, body(prompt="x", min_tokens=9), JSON, 400,
     "min_tokens"),
    ("frequency_penalty 9", "POST", C, body(prompt="x", frequency_penalty=9), JSON, 400,
     "frequency_penalty"),
    ("repetition_penalty 0", "POST", C, body(prompt="x", repetition_penalty=0), JSON, 400,
     "repetition_penalty"),
    ("top_p 0", "POST", C, body(prompt="x", top_p=0), JSON, 400, "top_p"),
    ("ignore_eos 'true'", "POST", C, body(prompt="x", ignore_eos="true"), JSON, 400,
     "ignore_eos"),
    ("stream 'yes'", "POST", C, body(prompt="x", stream="yes"), JSON, 400, "stream"),
    ("stream_options without stream", "POST", C,
     body(prompt="x", stream_options={"include_usage": True}), JSON, 400, "stream_options"),
    ("stream_options.include_usage 'x'", "POST", C,
     body(prompt="x", stream=True, stream_options={"include_usage": "x"}), JSON, 400,
     "include_usage"),
    ("stop as a list of ints", "POST", C, body(prompt="x", stop=[1, 2]), JSON, 400, "stop"),
    ("lone surrogate in stop", "POST", C,
     raw('{"prompt": "x", "stop": ["\\udfff"], "max_tokens": 2}'), JSON, 400, "stop"),
    ("negative stop_token_ids", "POST", C, body(prompt="x", stop_token_ids=[-1]), JSON, 400,
     "stop_token_ids"),
    ("logprobs above --max-logprobs", "POST", C, body(prompt="x", logprobs=21), JSON, 400,
     "logprobs"),
    ("logprobs true on completions", "POST", C, body(prompt="x", logprobs=True), JSON, 400,
     "logprobs"),
    ("echo 'yes'", "POST", C, body(prompt="x", echo="yes"), JSON, 400, "echo"),
    ("best_of 3", "POST", C, body(prompt="x", best_of=3), JSON, 400, "best_of"),
    ("logit_bias with a word for a key", "POST", C, body(prompt="x", logit_bias={"a": 5}),
     JSON, 400, "logit_bias"),
    ("logit_bias past the vocabulary", "POST", C, body(prompt="x", logit_bias={"1000000000": 5}),
     JSON, 400, "logit_bias"),
    ("model 5", "POST", C, body(prompt="x", model=5), JSON, 400, "model"),
    ("an unknown model", "POST", C, body(prompt="x", model="gpt-9"), JSON, 404, "model"),
    # prompts
    ("no prompt", "POST", C, body(), JSON, 400, "prompt"),
    ("prompt as an object", "POST", C, body(prompt={"text": "x"}), JSON, 400, "prompt"),
    ("a list of empty prompts", "POST", C, body(prompt=["", ""]), JSON, 400, "prompt"),
    ("prompt lists nested three deep", "POST", C, body(prompt=[[[1]]]), JSON, 400, "prompt"),
    ("a negative token id", "POST", C, body(prompt=[-5]), JSON, 400, "prompt"),
    ("a token id of 10**30", "POST", C, body(prompt=[10**30]), JSON, 400, "prompt"),
    ("1000 prompts in one request", "POST", C, body(prompt=["x"] * 1000), JSON, 400, "prompt"),
    ("a 5 MB prompt", "POST", C, body(prompt="ab " * (5 * MiB // 3)), JSON, 400, "prompt"),
    ("echo of an unknown token id", "POST", C, body(prompt=[10**6], echo=True), JSON, 400,
     "prompt"),
    # chat
    ("messages not a list", "POST", CHAT, body(messages="hi"), JSON, 400, "messages"),
    ("a role that is a list", "POST", CHAT,
     body(messages=[{"role": ["user"], "content": "x"}]), JSON, 400, "messages"),
    ("content as an object", "POST", CHAT,
     body(messages=[{"role": "user", "content": {"a": 1}}]), JSON, 400, "messages"),
    ("an image part", "POST", CHAT, body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), JSON, 400, "messages"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), JSON, 400,
     "top_logprobs"),
    ("top_logprobs above --max-logprobs", "POST", CHAT, chat(logprobs=True, top_logprobs=21),
     JSON, 400, "top_logprobs"),
    ("max_completion_tokens -1", "POST", CHAT, chat(max_completion_tokens=-1), JSON, 400,
     "max_completion_tokens"),
    ("a 5 MB chat message", "POST", CHAT,
     body(messages=[{"role": "user", "content": "ab " * (5 * MiB // 3)}]), JSON, 400,
     "messages"),
    # routes
    ("GET on a POST route", "GET", C, None, {}, 405, None),
    ("DELETE /v1/models", "DELETE", "/v1/models", None, {}, 405, None),
    ("an unknown route", "POST", "/v1/nothing-here", body(prompt="x"), JSON, 404, None),
]


def _openai_shaped(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_every_hostile_input_is_a_4xx_in_openai_shape_and_the_server_keeps_serving(served):
    """Each kind alone gets its 4xx (naming the field where there is one); a normal request
    right after each is served. Failures are collected so one run reports all of them."""
    normal = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
    problems = []
    with httpx.Client(base_url=served.url, timeout=DEADLINE_S) as client:
        for kind, method, path, content, headers, status, param in HOSTILE:
            try:
                r = client.request(method, path, content=content, headers=headers)
                assert r.status_code == status, f"HTTP {r.status_code}: {r.text[:200]}"
                err = _openai_shaped(r)
                assert param is None or err["param"] == param, f"param {err['param']!r}"
            except (AssertionError, ValueError, KeyError, httpx.TransportError) as e:
                problems.append(f"{kind}: expected {status} naming {param}: {e}")
            try:
                ok = client.post(C, json=normal).status_code
            except httpx.TransportError as e:
                ok = repr(e)
            if ok != 200:
                problems.append(f"after {kind}: a normal request got {ok}")
    assert len(HOSTILE) >= 40
    assert not problems, f"{len(problems)} of {len(HOSTILE)} kinds:\n" + "\n".join(problems)


def test_a_5mb_prompt_is_refused_before_it_is_tokenized(served):
    calls = []
    engine = served.engine
    original = engine.encode
    engine.encode = lambda text: calls.append(len(text)) or original(text)
    try:
        r = httpx.post(served.url + C, json={"model": MODEL, "prompt": "ab " * (5 * MiB // 3)},
                       timeout=DEADLINE_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "maximum context length" in r.json()["error"]["message"]
        assert calls == [], "the 5 MB prompt was tokenized before it was refused"
        r = httpx.post(served.url + C, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and calls == [len(PROMPT)]
    finally:
        engine.encode = original


def test_tokenizing_and_the_chat_template_run_off_the_event_loop(served):
    """The asyncio thread serves every connection; tokenizing a long prompt there would
    freeze /health and every stream. So both run in the tokenizer's worker thread."""
    engine = served.engine
    threads = []
    encode, template = engine.encode, engine.tokenizer.apply_chat_template
    engine.encode = lambda text: threads.append(threading.current_thread().name) or encode(text)
    engine.tokenizer.apply_chat_template = lambda *a, **k: (
        threads.append(threading.current_thread().name) or template(*a, **k))
    try:
        r = httpx.post(served.url + CHAT, json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        engine.encode = encode
        del engine.tokenizer.apply_chat_template
    assert len(threads) == 2 and all(t.startswith("refserve-tokenize") for t in threads), threads


def test_1000_prompts_are_added_at_once_and_all_aborted_when_the_client_leaves(tiny_chat_llama):
    """Engine steps are gated here, so the test counts in steps, not seconds: the 1000
    prompts must be in the engine before its first step (one add for all), and once the
    client has left, every one of them must be aborted within a few steps."""
    s = ServerThread(make_engine(tiny_chat_llama), max_prompts_per_request=1000)
    gate = threading.Semaphore(0)
    original = s.engine.step

    def gated():
        assert gate.acquire(timeout=DEADLINE_S), "the test released no step"
        return original()

    s.engine.step = gated
    try:
        request = json.dumps({"model": MODEL, "prompt": [f"{PROMPT} {i}" for i in range(1000)],
                              "max_tokens": 200, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
                         b"application/json\r\ncontent-length: %d\r\n\r\n" % len(request)
                         + request)
            wait_for(lambda: s.server.request_ids, "the engine to take the request")
            assert len(s.server.request_ids) == 1000     # all of them, before any step ran
        # The client has left. Let the engine step, a few steps at most.
        for _ in range(5):
            gate.release()
        wait_for(lambda: not s.server.request_ids and s.outcome("aborted") == 1000,
                 "all 1000 prompts to be aborted")
        m = s.metrics()
        assert m["refserve:kv_cache_blocks_used"] == 0
        assert s.outcome("finished") == 0
    finally:
        s.engine.step = original
        for _ in range(10_000):
            gate.release()
        s.close()
