"""refserve against a recording of the real vLLM (tests/data/vllm_parity.json, made by
scripts/record_vllm_parity.py with vLLM's CPU build, float32; its version is in the file).
CI has no vLLM: the recording is the reference.

What must hold, for the embedded SmolLM2 in float32:
- tokenization: every prompt's token ids equal vLLM's, chat prompts through the model's
  chat template included (refserve's `LLM.chat` renders them itself);
- greedy decoding: the output token ids, text and finish reason equal vLLM's, prompt by
  prompt (32 prompts: raw, chat, long, multilingual, code);
- logprobs: each position's top-5 (and prompt_logprobs' top-5 plus the prompt token) agree
  within LOGPROB_TOL;
- the deterministic SamplingParams fields (stop strings and token ids, the three penalties,
  logit_bias, bad_words, allowed_token_ids, min_tokens, ignore_eos, skip_special_tokens):
  the same tokens, text, finish reason and stop reason.

Why LOGPROB_TOL = 1e-3 (nats): both engines compute in float32 but not in the same order.
vLLM runs torch's kernels (oneDNN/MKL GEMMs with their own blocking, its CPU paged-attention
kernel over 128-token blocks); refserve runs OpenBLAS GEMMs and a NumPy attention. A float32
sum of n terms carries a relative rounding error of order sqrt(n) * 6e-8; through 30 layers
of hidden size 576 and a 49152-way softmax the logprobs move by about 1e-5 typically and
1e-4 at worst (measured on this recording: median 9e-6, largest 1.05e-4, on the longest
prompt, whose attention sums the most terms). 1e-3 leaves a tenfold margin for another
BLAS kernel; a real mistake (a wrong RoPE base, a missing norm epsilon, a bias applied
twice, a penalty on the prompt) moves logprobs by 1e-2 or more and flips greedy tokens,
which the token checks catch first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from refserve import LLM, SamplingParams

RECORDING = Path(os.environ.get("REFSERVE_VLLM_PARITY",
                                Path(__file__).parent / "data" / "vllm_parity.json"))
LOGPROB_TOL = 1e-3
pytestmark = pytest.mark.slow
DATA = json.loads(RECORDING.read_text())
SETTINGS = DATA["settings"]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(seed=SETTINGS["seed"], max_model_len=SETTINGS["max_model_len"], progress=False)


def _greedy(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", SETTINGS["max_tokens"])
    return SamplingParams(temperature=0.0, **kw)


def _as_rows(logprobs) -> list[dict[int, float] | None]:
    """refserve's per-position {token_id: Logprob} as {token_id: logprob}."""
    return [None if d is None else {int(t): float(lp.logprob) for t, lp in d.items()}
            for d in logprobs]


def _recorded_rows(rows) -> list[dict[int, float] | None]:
    return [None if d is None else {int(t): v for t, v in d.items()} for d in rows]


def logprob_differences(mine, theirs, top: int) -> list[float]:
    """|refserve - vLLM| for every token both report at every position. The top-`top` sets
    must agree, except for a token at the edge whose logprob is within LOGPROB_TOL of the
    other engine's last kept one (a near tie for the last place). AssertionError otherwise."""
    diffs = []
    assert len(mine) == len(theirs)
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a is None or b is None:
            assert a is None and b is None, f"position {i}: one engine has no logprobs"
            continue
        for t in a.keys() & b.keys():
            diffs.append(abs(a[t] - b[t]))
        a_top = sorted(a.values(), reverse=True)[:top]
        b_top = sorted(b.values(), reverse=True)[:top]
        for t in a.keys() ^ b.keys():
            v = a.get(t, b.get(t))
            edge = min(b_top) if t in a else min(a_top)
            assert abs(v - edge) <= LOGPROB_TOL, (
                f"position {i}: token {t} ({v:.5f}) is in one engine's top {top} only, "
                f"not a near tie with the other's last ({edge:.5f})")
    return diffs


@pytest.fixture(scope="module")
def greedy_outputs(llm):
    """The recorded greedy cases, in order: raw-text ones in one generate call, chat ones in
    one LLM.chat call (refserve renders the template itself)."""
    cases = DATA["greedy"]
    top = SETTINGS["logprobs"]
    texts = [(i, c["prompt"]) for i, c in enumerate(cases) if c["kind"] != "chat"]
    chats = [(i, c["messages"]) for i, c in enumerate(cases) if c["kind"] == "chat"]
    out = [None] * len(cases)
    for (i, _), o in zip(texts, llm.generate([t for _, t in texts], _greedy(logprobs=top),
                                             use_tqdm=False)):
        out[i] = o
    for (i, _), o in zip(chats, llm.chat([m for _, m in chats], _greedy(logprobs=top),
                                         use_tqdm=False)):
        out[i] = o
    return out


def test_recording_names_its_vllm_version_and_settings():
    assert DATA["vllm_version"] and DATA["settings"]["dtype"] == "float32"
    kinds = [c["kind"] for c in DATA["greedy"]]
    assert len(kinds) >= 32
    assert {"raw", "chat", "long", "multilingual", "code"} <= set(kinds)
    assert max(len(c["prompt_token_ids"]) for c in DATA["greedy"]) > 1000


def test_prompt_token_ids_equal_vllms_chat_template_included(greedy_outputs):
    for case, out in zip(DATA["greedy"], greedy_outputs):
        assert list(out.prompt_token_ids) == case["prompt_token_ids"], case["kind"]


def test_greedy_tokens_text_and_finish_reason_equal_vllms(greedy_outputs):
    mismatched = []
    for i, (case, out) in enumerate(zip(DATA["greedy"], greedy_outputs)):
        c = out.outputs[0]
        if list(c.token_ids) != case["token_ids"]:
            mismatched.append((i, case["kind"], list(c.token_ids), case["token_ids"]))
            continue
        assert c.text == case["text"] and c.finish_reason == case["finish_reason"], i
        assert c.stop_reason == case["stop_reason"], i
    assert not mismatched, f"{len(mismatched)} of {len(greedy_outputs)} differ: {mismatched}"


def test_top5_logprobs_within_tolerance_of_vllms(greedy_outputs):
    diffs = []
    for case, out in zip(DATA["greedy"], greedy_outputs):
        diffs += logprob_differences(_as_rows(out.outputs[0].logprobs),
                                     _recorded_rows(case["logprobs"]), SETTINGS["logprobs"])
    assert diffs and max(diffs) <= LOGPROB_TOL, max(diffs)


def test_prompt_logprobs_within_tolerance_of_vllms(llm):
    cases = DATA["prompt_logprobs"]
    top = SETTINGS["logprobs"]
    outs = llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in cases],
                        _greedy(max_tokens=4, logprobs=top, prompt_logprobs=top),
                        use_tqdm=False)
    diffs = []
    for case, out in zip(cases, outs):
        assert list(out.outputs[0].token_ids) == case["token_ids"]
        mine = _as_rows(out.prompt_logprobs)
        diffs += logprob_differences(mine, _recorded_rows(case["prompt_logprobs"]), top)
        # every prompt position reports its own token too (vLLM's top-N plus the actual)
        for pos, row in enumerate(mine[1:], start=1):
            assert case["prompt_token_ids"][pos] in row
    assert diffs and max(diffs) <= LOGPROB_TOL, max(diffs)


def _field_params(case) -> SamplingParams:
    kw = dict(case["params"])
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(t): b for t, b in kw["logit_bias"].items()}
    return _greedy(**kw)


def test_deterministic_sampling_fields_behave_as_vllms(llm):
    cases = DATA["sampling_fields"]
    outs = llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in cases],
                        [_field_params(c) for c in cases], use_tqdm=False)
    for case, out in zip(cases, outs):
        c = out.outputs[0]
        assert list(out.prompt_token_ids) == case["prompt_token_ids"], case["name"]
        got = (list(c.token_ids), c.text, c.finish_reason, c.stop_reason)
        want = (case["token_ids"], case["text"], case["finish_reason"], case["stop_reason"])
        assert got == want, case["name"]


def test_each_sampling_field_changed_the_greedy_output():
    """The field cases test something: each one's output differs from plain greedy decoding
    of the same prompt (the recorded greedy case), for the fields that rewrite logits."""
    plain = {tuple(c["prompt_token_ids"]): c["token_ids"] for c in DATA["greedy"]}
    changed = [c["name"] for c in DATA["sampling_fields"]
               if c["token_ids"] != plain.get(tuple(c["prompt_token_ids"]))]
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty",
                 "logit_bias_ban", "logit_bias_force", "bad_words", "all_penalties"):
        assert name in changed, name


def test_truncation_keeps_the_last_tokens_as_vllm_did(llm):
    """vLLM 0.32 truncates through tokenization_kwargs, keeping the prompt's last k tokens
    (recorded on the first raw prompt with k = 3); refserve's LLM takes the same argument."""
    edge = DATA["edges"]["tokenization_kwargs_truncate_prompt_tokens_3"]
    out = llm.generate([DATA["greedy"][0]["prompt"]], _greedy(max_tokens=1), use_tqdm=False,
                       tokenization_kwargs={"truncate_prompt_tokens": 3})[0]
    assert list(out.prompt_token_ids) == edge["result"] == DATA["greedy"][0][
        "prompt_token_ids"][-3:]
