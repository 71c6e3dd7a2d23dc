"""The full engine on the real SmolLM2 against transformers, under pressure."""

import pytest

from refserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def quicksort(arr):\n    ",
    "List three primary colors:",
    "In 1969, Neil Armstrong " + "walked on the moon and " * 6,
    "Water boils at",
    "Once upon a time, " + "there was a little robot who loved to read books. " * 18,
    "The quick brown fox " * 30,
]


def test_engine_greedy_equals_transformers_with_chunking_and_preemption(
        smollm2_dir, hf_smollm2, hf_tokenizer, hf_greedy_fn):
    ids = [hf_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    lens = sorted(len(i) for i in ids)
    assert lens[0] <= 3 and lens[-1] >= 150   # very different lengths
    n_new = 24
    # 36 blocks x 16 = 576 slots for ~1000 tokens of demand; 48-token steps chunk every
    # prompt longer than that.
    llm = LLM(model=str(smollm2_dir), progress=False, num_gpu_blocks_override=36,
              max_num_batched_tokens=48, max_num_seqs=8, max_model_len=576)
    kinds = []
    schedule = llm.llm_engine.scheduler.schedule

    def recording_schedule(*args):
        out = schedule(*args)
        kinds.extend(row.kind for row in out.scheduled)
        return out

    llm.llm_engine.scheduler.schedule = recording_schedule
    outs = llm.generate(ids, SamplingParams(max_tokens=n_new, temperature=0.0,
                                            ignore_eos=True))
    summary = llm.last_summary
    assert summary.num_preemptions > 0, "the tiny pool should have forced a preemption"
    assert kinds.count("chunk") >= 3, "long prompts should have been prefilled in chunks"
    for prompt_ids, out in zip(ids, outs):
        assert out.outputs[0].token_ids == hf_greedy_fn(hf_smollm2, prompt_ids, n_new), \
            hf_tokenizer.decode(prompt_ids)[:40]
    kv = llm.llm_engine.kv_cache_manager
    kv.check_invariants()
    assert kv.num_held_blocks == 0


def test_chat_answer_mentions_paris(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), progress=False)
    prompt = llm.llm_engine.apply_chat_template(
        "What is the capital of France? Answer in one sentence.")
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"    # ended with <|im_end|>


def test_stop_string_truncates_text(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), progress=False)
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert " 6" in base.outputs[0].text
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=12, temperature=0.0,
                                                       stop=[" 6"]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == base.outputs[0].text[:base.outputs[0].text.index(" 6")]
