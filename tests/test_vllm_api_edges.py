"""Where refserve's offline API meets vLLM's at its edges, each settled against what vLLM
0.32 was recorded doing (tests/data/vllm_parity.json, "edges" and "get_metrics"):

- `LLM.get_metrics()` exists with vLLM's shape: Counter / Gauge / Histogram objects with
  vLLM's names, types and label keys, for the metrics refserve has, and the right values;
- truncation: vLLM 0.32 takes `tokenization_kwargs={"truncate_prompt_tokens": k}` (keeping
  the last k prompt tokens) and refuses the field on SamplingParams; refserve takes both;
- logprobs=-1 (the whole vocabulary): vLLM refuses it unless LLM(max_logprobs=-1); refserve
  takes max_logprobs with vLLM's rule, but its default sets no cap;
- n > 1 with greedy sampling: vLLM refuses it; refserve returns n identical samples.
The differences are refserve's, documented in README.md ("Where refserve and vLLM differ").
The tiny model keeps these fast; the recorded truncation on the real model is checked in
test_vllm_parity.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refserve import LLM, SamplingParams
from refserve.entrypoints.metrics_reader import Counter, Gauge, Histogram, Metric

RECORDED = json.loads((Path(__file__).parent / "data" / "vllm_parity.json").read_text())
EDGES = RECORDED["edges"]
KINDS = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}


@pytest.fixture(scope="module")
def llm(tiny_chat_llama):
    return LLM(model=str(tiny_chat_llama), block_size=4, num_gpu_blocks_override=256,
               progress=False, disable_log_stats=False)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def _by_name(metrics: list[Metric]) -> dict[str, list[Metric]]:
    out: dict[str, list[Metric]] = {}
    for m in metrics:
        out.setdefault(m.name, []).append(m)
    return out


# ---- get_metrics ----------------------------------------------------------------------------

def test_get_metrics_has_vllms_names_types_and_label_keys(llm):
    vllm = {}
    for m in RECORDED["get_metrics"]:
        vllm[m["name"]] = (m["type"], m["labels"])
    mine = llm.get_metrics()
    assert mine and all(type(m) in KINDS for m in mine)
    for m in mine:
        assert m.name in vllm, f"{m.name}: not a metric vLLM has"
        kind, labels = vllm[m.name]
        assert KINDS[type(m)] == kind and sorted(m.labels) == labels, m.name
    for name in ("vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                 "vllm:kv_cache_usage_perc", "vllm:num_requests_running"):
        assert name in _by_name(mine), name
    # the finish reasons vLLM lists at zero before any request has one
    recorded = {m["finished_reason"] for m in RECORDED["get_metrics"]
                if m["name"] == "vllm:request_success"}
    reasons = {m.labels["finished_reason"] for m in _by_name(mine)["vllm:request_success"]}
    assert {"stop", "length", "abort"} <= reasons & recorded


def test_get_metrics_counts_what_generate_did(llm):
    def value(metrics, name, **labels):
        return sum(m.value for m in _by_name(metrics)[name]
                   if all(m.labels.get(k) == v for k, v in labels.items()))

    before = llm.get_metrics()
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    outs = [o for _ in range(2)    # the second round finds the first one's blocks cached
            for o in llm.generate(prompts, _greedy(max_tokens=3), use_tqdm=False)]
    after = llm.get_metrics()

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("vllm:prompt_tokens") == 4 * 9
    assert grew("vllm:generation_tokens") == sum(len(o.outputs[0].token_ids) for o in outs) == 12
    assert grew("vllm:request_success", finished_reason="length") == 4
    assert grew("vllm:request_success", finished_reason="stop") == 0
    # each prompt's second time finds its first two full blocks (4 tokens each) cached
    assert grew("vllm:prefix_cache_hits") == sum(o.num_cached_tokens for o in outs) == 16
    assert grew("vllm:prefix_cache_queries") >= 4 * 8
    assert value(after, "vllm:num_requests_running") == 0
    assert 0.0 <= value(after, "vllm:kv_cache_usage_perc") <= 1.0
    hist = {m.name: m for m in after if isinstance(m, Histogram)}
    old = {m.name: m for m in before if isinstance(m, Histogram)}
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_time_per_output_token_seconds"):
        h = hist[name]
        assert h.count - old[name].count == 4 and h.sum > old[name].sum
        counts = list(h.buckets.values())
        assert counts == sorted(counts) and h.buckets["+Inf"] == h.count  # cumulative
        assert list(h.buckets)[-1] == "+Inf"


def test_get_metrics_is_there_without_disable_log_stats(tiny_chat_llama):
    """vLLM asserts stat logging is on; refserve's counters are always kept."""
    llm = LLM(model=str(tiny_chat_llama), block_size=4, num_gpu_blocks_override=64, progress=False)
    llm.generate([[5, 6, 7]], _greedy(max_tokens=2), use_tqdm=False)
    tokens = [m for m in llm.get_metrics() if m.name == "vllm:generation_tokens"]
    assert [m.value for m in tokens] == [2]


# ---- truncation ------------------------------------------------------------------------------

def test_vllm_takes_truncation_in_tokenization_kwargs_not_on_sampling_params():
    assert EDGES["sampling_params_truncate_prompt_tokens"]["error_type"] == "TypeError"
    assert EDGES["tokenization_kwargs_truncate_prompt_tokens_3"]["accepted"]


def test_tokenization_kwargs_truncation_keeps_the_last_k_tokens_as_the_field_does(llm):
    prompt = list(range(30, 50))
    via_kwargs = llm.generate([prompt], _greedy(max_tokens=2), use_tqdm=False,
                              tokenization_kwargs={"truncate_prompt_tokens": 5})[0]
    via_field = llm.generate([prompt], _greedy(max_tokens=2, truncate_prompt_tokens=5),
                             use_tqdm=False)[0]
    assert list(via_kwargs.prompt_token_ids) == prompt[-5:] == list(via_field.prompt_token_ids)
    assert via_kwargs.outputs[0].token_ids == via_field.outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": "hello there, how are you"}],
                    _greedy(max_tokens=1), use_tqdm=False,
                    tokenization_kwargs={"truncate_prompt_tokens": 3})[0]
    assert len(chat.prompt_token_ids) == 3


def test_tokenization_kwargs_other_than_truncation_are_refused_by_name(llm):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([[5, 6]], _greedy(max_tokens=1), use_tqdm=False,
                     tokenization_kwargs={"padding": "max_length"})


# ---- logprobs = -1 -------------------------------------------------------------------------

def test_vllm_refuses_whole_vocabulary_logprobs_at_its_default_cap():
    edge = EDGES["logprobs_minus_1"]
    assert not edge["accepted"] and "max allowed: 20" in edge["error"]


def test_max_logprobs_follows_vllms_rule(tiny_chat_llama):
    kw = dict(model=str(tiny_chat_llama), block_size=4, num_gpu_blocks_override=64, progress=False)
    capped = LLM(max_logprobs=5, **kw)
    for params in (_greedy(max_tokens=1, logprobs=-1), _greedy(max_tokens=1, logprobs=6),
                   _greedy(max_tokens=1, prompt_logprobs=-1)):
        with pytest.raises(ValueError, match="max_logprobs=5"):
            capped.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(capped.generate([[5, 6, 7]], _greedy(max_tokens=1, logprobs=5),
                               use_tqdm=False)[0].outputs[0].logprobs[0]) == 5
    vocab = capped.llm_engine.model.config.vocab_size
    whole = LLM(max_logprobs=-1, **kw).generate([[5, 6, 7]], _greedy(max_tokens=1, logprobs=-1),
                                                use_tqdm=False)
    assert len(whole[0].outputs[0].logprobs[0]) == vocab
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(max_logprobs=-2, **kw)


def test_refserves_default_sets_no_cap(llm):
    vocab = llm.llm_engine.model.config.vocab_size
    out = llm.generate([[5, 6, 7]], _greedy(max_tokens=1, logprobs=-1), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == vocab


# ---- n > 1 with greedy sampling --------------------------------------------------------------

def test_vllm_refuses_n_above_1_with_greedy_sampling():
    edge = EDGES["greedy_n_2"]
    assert not edge["accepted"] and "n must be 1 when using greedy sampling" in edge["error"]


def test_refserve_returns_n_identical_greedy_samples(llm):
    out = llm.generate([[5, 6, 7, 8]], _greedy(max_tokens=6, n=3), use_tqdm=False)[0]
    one = llm.generate([[5, 6, 7, 8]], _greedy(max_tokens=6), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [one.outputs[0].token_ids] * 3
