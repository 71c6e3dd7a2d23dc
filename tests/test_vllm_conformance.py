"""vLLM's own offline examples, run against refserve with only the import changed.

Each test body is written the way vLLM's examples/offline_inference scripts are (basic
generate, greedy, chat, prompt dicts and token ids, logprobs, min_tokens, stop strings with
and without include_stop_str_in_output, n > 1 with a seed, the LLMEngine loop), then checks
what vLLM documents about the result. `MODEL` is the embedded SmolLM2 folder (vLLM would take
a hub name there). Plus: logprobs against transformers' log-softmax, TPOT with n = 4 against
measured inter-token times, streamed text against the final text with straddling stop strings.
"""

import time

import numpy as np
import pytest

from refserve import LLM, SamplingParams  # vLLM: from vllm import ...
from refserve.inputs import TokensPrompt  # vLLM: from vllm.inputs import ...

pytestmark = pytest.mark.slow

PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]


@pytest.fixture(scope="module")
def MODEL(smollm2_dir):  # noqa: N802 - the examples' constant
    return str(smollm2_dir)


@pytest.fixture(scope="module")
def llm(MODEL):  # noqa: N803
    return LLM(model=MODEL, seed=0, max_model_len=1024, progress=False)


# ----------------------------------------------------------------- examples/offline_inference


def test_basic(llm):
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(PROMPTS, sampling_params)
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs):
        generated_text = output.outputs[0].text
        assert output.prompt == prompt and output.finished
        assert isinstance(generated_text, str)
        assert 1 <= len(output.outputs[0].token_ids) <= 16           # max_tokens default 16
        assert output.outputs[0].finish_reason in ("stop", "length")
        assert output.outputs[0].logprobs is None and output.prompt_logprobs is None
        assert output.outputs[0].cumulative_logprob is None


def test_greedy_is_deterministic_and_batch_independent(llm):
    sampling_params = SamplingParams(temperature=0, max_tokens=12)
    batch = llm.generate(PROMPTS, sampling_params)
    alone = llm.generate(PROMPTS[2], sampling_params)
    assert alone[0].outputs[0].token_ids == batch[2].outputs[0].token_ids
    assert "Paris" in batch[2].outputs[0].text


def test_chat(llm):
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    sampling_params = SamplingParams(temperature=0, max_tokens=16)
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    assert "Paris" in outputs[0].outputs[0].text
    # A batch of conversations, and the same through the tokenizer's template + generate.
    both = llm.chat([conversation, conversation[:2]], sampling_params)
    assert both[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    text = llm.get_tokenizer().apply_chat_template(conversation, tokenize=False,
                                                   add_generation_prompt=True)
    assert llm.generate(text, sampling_params)[0].outputs[0].text == outputs[0].outputs[0].text


def test_prompt_dicts_and_token_ids(llm):
    sampling_params = SamplingParams(temperature=0, max_tokens=8)
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    outputs = llm.generate([{"prompt": PROMPTS[2]}, TokensPrompt(prompt_token_ids=ids),
                            np.array(ids)], sampling_params)
    assert outputs[0].prompt == PROMPTS[2] and outputs[1].prompt is None
    assert outputs[0].prompt_token_ids == outputs[1].prompt_token_ids == ids
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    with pytest.raises(TypeError, match="accepted forms"):
        llm.generate([3.5], sampling_params)


def test_logprobs(llm):
    sampling_params = SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                                     prompt_logprobs=3)
    output = llm.generate(PROMPTS[0], sampling_params)[0]
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert token in position and len(position) in (5, 6)
        assert position[token].rank == 1                           # greedy: the top token
        assert position[token].decoded_token == llm.get_tokenizer().decode([token])
        assert all(lp.logprob <= 0 for lp in position.values())
    assert completion.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids)))
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
    for token, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert token in position and len(position) in (3, 4)


def test_sampled_token_logprob_is_reported_outside_the_top_n(llm):
    sampling_params = SamplingParams(temperature=1.5, max_tokens=16, logprobs=1, seed=3)
    completion = llm.generate(PROMPTS[3], sampling_params)[0].outputs[0]
    ranks = [p[t].rank for p, t in zip(completion.logprobs, completion.token_ids)]
    assert max(ranks) > 1                  # some sampled tokens were not the likeliest
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert token in position and len(position) == (1 if position[token].rank == 1 else 2)


def test_min_tokens(llm):
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Say only: yes"}], tokenize=False,
        add_generation_prompt=True)
    natural = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert natural.finish_reason == "stop"          # EOS after a short answer
    n = len(natural.token_ids) + 4
    longer = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n + 20,
                                                 min_tokens=n))[0].outputs[0]
    eos = llm.get_tokenizer().eos_token_id
    assert len(longer.token_ids) >= n and eos not in longer.token_ids[:n]


def test_bad_words_logit_bias_and_special_tokens_on_the_real_tokenizer(llm):
    """SmolLM2's byte-level BPE spells a word differently at the start and after a space
    ("Paris" vs " Paris"): bad_words bans both, so the greedy answer changes."""
    greedy = dict(temperature=0, max_tokens=8)
    plain = llm.generate("The capital of France is", SamplingParams(**greedy))[0].outputs[0]
    assert "Paris" in plain.text
    tok = llm.get_tokenizer()
    variants = {tok.encode(w, add_special_tokens=False)[0] for w in ("Paris", " Paris")}
    assert len(variants) == 2
    banned = llm.generate("The capital of France is",
                          SamplingParams(bad_words=["Paris"], **greedy))[0].outputs[0]
    assert "Paris" not in banned.text and not variants & set(banned.token_ids)
    # logit_bias -100 on the first answer token: the same change of course as vLLM's.
    biased = llm.generate("The capital of France is", SamplingParams(
        logit_bias={plain.token_ids[0]: -100}, **greedy))[0].outputs[0]
    assert biased.token_ids[0] != plain.token_ids[0]
    # The chat answer ends with EOS, <|im_end|>. As in vLLM its text is dropped like a stop
    # token's unless include_stop_str_in_output, and then shows only with
    # skip_special_tokens=False.
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say only: yes"}],
                                     tokenize=False, add_generation_prompt=True)
    texts = {}
    for skip in (True, False):
        for include in (False, True):
            out = llm.generate(prompt, SamplingParams(
                temperature=0, max_tokens=32, skip_special_tokens=skip,
                include_stop_str_in_output=include))[0].outputs[0]
            assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
            texts[skip, include] = out.text
    answer = texts[True, False]
    assert answer and "<|im_end|>" not in answer
    assert texts[True, True] == texts[False, False] == answer
    assert texts[False, True] == answer + "<|im_end|>"


def test_stop_strings_with_and_without_include_stop_str_in_output(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24))[0]
    text = base.outputs[0].text
    stop = text[len(text) // 3: len(text) // 3 + 5]             # several tokens long
    cut = text.index(stop)
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24,
                                                  stop=[stop]))[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                   include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == text[:cut + len(stop)]
    assert kept.outputs[0].stop_reason == stop


def test_n_with_seed(llm, MODEL):  # noqa: N803
    sampling_params = SamplingParams(n=3, temperature=0.8, seed=42, max_tokens=10)
    first = llm.generate(PROMPTS[0], sampling_params)[0]
    again = llm.generate(PROMPTS[0], sampling_params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    # The engine-level seed makes unseeded requests reproducible from a fresh LLM.
    unseeded = SamplingParams(temperature=0.8, max_tokens=4)
    a = LLM(model=MODEL, seed=7, max_model_len=256, progress=False).generate(PROMPTS, unseeded)
    b = LLM(model=MODEL, seed=7, max_model_len=256, progress=False).generate(PROMPTS, unseeded)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_llm_engine_loop(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6)
    for request_id, prompt in enumerate(PROMPTS):
        engine.add_request(str(request_id), prompt, params)
    engine.add_request("gone", "Abort me", params)
    assert engine.abort_request("gone")
    finished = {}
    while engine.has_unfinished_requests():
        for request_output in engine.step():
            if request_output.finished:
                finished[request_output.request_id] = request_output
    assert sorted(finished) == ["0", "1", "2", "3"]
    want = llm.generate(PROMPTS, params)
    assert [finished[str(i)].outputs[0].token_ids for i in range(4)] == \
        [o.outputs[0].token_ids for o in want]


def test_vllm_engine_keywords(MODEL):  # noqa: N803
    with pytest.raises(ValueError, match="use vLLM"):
        LLM(model=MODEL, tensor_parallel_size=2, progress=False)
    with pytest.warns(UserWarning, match="trust_remote_code"):
        llm = LLM(model=MODEL, trust_remote_code=True, dtype="float32", enforce_eager=True,
                  num_gpu_blocks_override=64, max_model_len=1024, progress=False)
    assert llm.llm_engine.num_blocks == 64
    with pytest.raises(TypeError, match="unknown keyword"):
        LLM(model=MODEL, no_such_knob=1, progress=False)


# ----------------------------------------------------------------- refserve's measurements


def test_logprobs_match_transformers(llm, hf_smollm2):
    import torch

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5)
    for output in llm.generate(PROMPTS, params):
        c = output.outputs[0]
        ids = output.prompt_token_ids + c.token_ids
        with torch.no_grad():
            logits = hf_smollm2(torch.tensor([ids])).logits[0].float()
        want = torch.log_softmax(logits, dim=-1).numpy()
        for i, position in enumerate(c.logprobs):
            row = want[len(output.prompt_token_ids) - 1 + i]
            for token, lp in position.items():
                assert abs(lp.logprob - row[token]) < 1e-4, (i, token, lp.logprob, row[token])
            top5 = set(np.argsort(-row)[:5].tolist())
            assert top5 <= set(position)


def test_tpot_with_n_4_is_per_sequence(llm):
    """TPOT of an n = 4 request equals the measured time between its steps, not a quarter."""
    stamps = []
    params = SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=24, ignore_eos=True)
    out = llm.generate(PROMPTS[1], params,
                       on_step=lambda o: stamps.append(time.perf_counter()))[0]
    assert all(len(c.token_ids) == 24 for c in out.outputs)
    measured = (stamps[-1] - stamps[0]) / (len(stamps) - 1)   # one step = one token each
    assert len(stamps) == 24
    assert out.metrics.tpot == pytest.approx(measured, rel=0.25)
    assert llm.last_summary.tpot_p50 == pytest.approx(out.metrics.tpot)


def test_per_call_kv_peak(llm):
    llm.generate(PROMPTS * 2, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    big = llm.last_summary.kv_blocks_peak
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))
    assert llm.last_summary.kv_blocks_peak < big
    assert llm.llm_engine.stats()["kv_blocks_peak"] >= big      # cumulative, kept apart


def test_streamed_text_equals_final_text_with_straddling_stops(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24))[0]
    text, tokens = base.outputs[0].text, base.outputs[0].token_ids
    tok = llm.get_tokenizer()
    # Stop strings that start inside one token and end in a later one.
    pieces = [tok.decode(tokens[:k]) for k in range(1, len(tokens))]
    stops = [text[len(pieces[k]) - 2: len(pieces[k]) + 3] for k in (3, 7)]
    for stop in stops + ["no such stop string"]:
        seen = []
        params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
        final = llm.generate(PROMPTS[2], params,
                             on_step=lambda o, seen=seen: seen.append(o.outputs[0].text))[0]
        for shown in seen:
            assert final.outputs[0].text.startswith(shown), (stop, shown, final.outputs[0].text)
        assert seen[-1] == final.outputs[0].text
