"""n-gram speculation against the recording of the real vLLM (tests/data/vllm_parity.json,
"speculation"): with the same speculative_config, refserve's greedy output equals what vLLM
generated, which is also what both generate without speculation. A second module because
it needs its own engine (the speculative one); test_vllm_parity.py has the plain one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refserve import LLM, SamplingParams

DATA = json.loads((Path(__file__).parent / "data" / "vllm_parity.json").read_text())
SPEC = DATA["speculation"]
SETTINGS = DATA["settings"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outputs(smollm2_dir):
    if "error" in SPEC:
        pytest.fail(f"the recording has no speculative outputs: {SPEC['error']}")
    llm = LLM(seed=SETTINGS["seed"], max_model_len=SETTINGS["max_model_len"], progress=False,
              speculative_config=SPEC["speculative_config"])
    params = SamplingParams(temperature=0.0, max_tokens=SETTINGS["max_tokens"])
    return llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in SPEC["cases"]],
                        params, use_tqdm=False)


def test_ngram_speculation_output_equals_vllms(outputs):
    for case, out in zip(SPEC["cases"], outputs):
        c = out.outputs[0]
        assert list(c.token_ids) == case["token_ids"], case["prompt_text"][:40]
        assert c.finish_reason == case["finish_reason"]


def test_speculation_ran_and_kept_drafts(outputs):
    """Drafts were proposed and some accepted: the equality above is speculation's, not
    plain decoding's (the repeating prompt gives n-gram lookup something to find)."""
    assert sum(o.metrics.num_spec_proposed for o in outputs) > 0
    assert sum(o.metrics.num_spec_accepted for o in outputs) > 0


def test_vllms_speculative_output_is_its_plain_greedy_output():
    """What makes the check above a parity check of speculation: in the recording, vLLM with
    speculation generated what vLLM without it did, for the prompts recorded both ways."""
    plain = {tuple(c["prompt_token_ids"]): c["token_ids"] for c in DATA["greedy"]}
    both = [c for c in SPEC["cases"] if tuple(c["prompt_token_ids"]) in plain]
    assert len(both) >= 2
    for case in both:
        assert case["token_ids"] == plain[tuple(case["prompt_token_ids"])]
