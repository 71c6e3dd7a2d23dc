"""Who may talk to the server: the API key (through the official `openai` client), the Host
header of a loopback-bound server (DNS rebinding), and the docs switch."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_utils import MODEL, PROMPT, ServerThread, make_engine

from refserve.entrypoints.options import ServerOptions, is_loopback
from refserve.serve import build_parser, server_options

pytestmark = pytest.mark.serving

KEY = "sk-refserve-test-0123456789"


@pytest.fixture(scope="module")
def keyed(tiny_chat_llama):
    s = ServerThread(make_engine(tiny_chat_llama), api_key=KEY, docs=False)
    yield s
    s.close()


def test_the_api_key_is_required_on_v1_and_works_through_the_openai_client(keyed):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                    {"authorization": f"Basic {KEY}"}):
        r = httpx.post(keyed.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="wrong").completions.create(model=MODEL, prompt=PROMPT,
                                                         max_tokens=2)
    r = keyed.client(api_key=KEY).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                     extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2
    assert [m.id for m in keyed.client(api_key=KEY).models.list().data] == [MODEL]
    # as in vLLM, the probes stay open
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 200


def test_the_docs_can_be_switched_off(keyed, served):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(keyed.url + path).status_code == 404
    assert httpx.get(served.url + "/openapi.json").status_code == 200


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    parser = build_parser()
    monkeypatch.delenv("REFSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert server_options(parser.parse_args([])).api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")        # what vLLM users have set
    assert server_options(parser.parse_args([])).api_key == "from-vllm"
    monkeypatch.setenv("REFSERVE_API_KEY", "from-refserve")
    assert server_options(parser.parse_args([])).api_key == "from-refserve"
    assert server_options(parser.parse_args(["--api-key", "flag"])).api_key == "flag"


def test_a_loopback_server_answers_only_loopback_host_names(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for host in ("evil.example", "evil.example:8000", "192.168.1.5", "localhost.evil.example"):
        r = httpx.post(served.url + "/v1/completions", json=body, headers={"host": host})
        assert r.status_code == 403, (host, r.text)
        assert "--allowed-hosts" in r.json()["error"]["message"]
        assert httpx.get(served.url + "/health", headers={"host": host}).status_code == 403
    for host in ("localhost", f"127.0.0.1:{served.port}", "[::1]:80", "app.localhost"):
        r = httpx.post(served.url + "/v1/completions", json=body, headers={"host": host})
        assert r.status_code == 200, (host, r.text)


def test_allowed_hosts_widen_the_loopback_rule():
    opts = ServerOptions(allowed_hosts=("Box.Lan",))
    assert opts.host_allowed("box.lan:8000") and opts.host_allowed("localhost")
    assert not opts.host_allowed("evil.example")
    assert ServerOptions(allowed_hosts=("*",)).host_allowed("anything.example")
    # bound to every interface and told nothing: any name (a warning says to set a key)
    assert ServerOptions(host="0.0.0.0").host_allowed("evil.example")
    assert [is_loopback(h) for h in ("127.0.0.7", "::1", "[::1]", "LOCALHOST.", "10.0.0.1",
                                     "0.0.0.0", "localhost.example")] == [
        True, True, True, True, False, False, False]


def test_listening_beyond_loopback_without_a_key_warns():
    assert ServerOptions().exposure_warning() is None
    assert ServerOptions(host="0.0.0.0", api_key=KEY).exposure_warning() is None
    assert "without an API key" in ServerOptions(host="0.0.0.0").exposure_warning()
