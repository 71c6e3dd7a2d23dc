"""The embedded SmolLM2-135M-Instruct: conversion checked against transformers' own GGUF loader
(an independent path), the rebuilt tokenizer and chat template, and greedy parity."""

import gguf
import numpy as np
import pytest

from refserve.models.default_model import default_gguf_path, unpermute_rows
from refserve.models.loader import read_safetensors

pytestmark = pytest.mark.slow

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 12345",
    "Prices rose 3.14% in 2024; 1,000,000 units shipped.",
    "Emoji: 🚀🔥 café naïve — “quotes”",
    "日本語のテキストと中文句子, and Кириллица, العربية, हिन्दी",
    "  leading spaces\ttabs\nnewlines<|im_start|>special<|im_end|>",
]


def test_converted_tensors_equal_transformers_gguf_loader(smollm2_dir):
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    hf.hf_quantizer.remove_quantization_config(hf)  # plain float32 tensors from here on
    theirs = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    ours = read_safetensors(smollm2_dir / "model.safetensors")
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: HF lists it, we don't store it
    for name, array in ours.items():
        np.testing.assert_array_equal(array, theirs[name], err_msg=name)
    cfg = hf.config
    assert cfg.tie_word_embeddings
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    assert theta == 100000.0


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    heads, head_dim, d = 3, 8, 5
    w = rng.standard_normal((heads * head_dim, d)).astype(np.float32)
    # llama.cpp's permutation, as its converter writes it: per head, interleave the halves.
    permuted = (w.reshape(heads, 2, head_dim // 2, d).swapaxes(1, 2).reshape(w.shape))
    np.testing.assert_array_equal(permuted[1], w[head_dim // 2])  # GGUF row 1 = HF row d/2
    np.testing.assert_array_equal(unpermute_rows(permuted, heads), w)


def test_gguf_q_rows_really_were_permuted(smollm2_dir):
    """Without the un-permutation the Q projection differs: the fix is not a no-op."""
    reader = gguf.GGUFReader(str(default_gguf_path()))
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    raw = gguf.dequantize(t.data, t.tensor_type)
    ours = read_safetensors(smollm2_dir / "model.safetensors")
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(raw, q)
    np.testing.assert_array_equal(unpermute_rows(raw, 9), q)


def test_tokenizer_matches_transformers_gguf_tokenizer(hf_tokenizer):
    from transformers import AutoTokenizer

    path = default_gguf_path()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ours = hf_tokenizer.encode(text, add_special_tokens=False)
        assert ours == reference.encode(text, add_special_tokens=False), text
        assert hf_tokenizer.decode(ours) == text
    # Digits are split one by one (SmolLM's pre-tokenizer).
    assert len(hf_tokenizer.encode("12345", add_special_tokens=False)) == 5


def test_chat_template_renders_conversation(hf_tokenizer):
    text = hf_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == hf_tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert hf_tokenizer.eos_token == "<|im_end|>"


PARITY_PROMPTS = ["The capital of France is", "def quicksort(arr):",
                  "Once upon a time, in a small village,", "1, 1, 2, 3, 5, 8,"]


@pytest.fixture(scope="module")
def transformers_greedy(hf_smollm2, hf_tokenizer, hf_greedy_fn):
    """transformers' 32 greedy tokens after each parity prompt, computed once for both
    backends: {prompt: (prompt ids, tokens)}."""
    out = {}
    for prompt in PARITY_PROMPTS:
        ids = hf_tokenizer.encode(prompt, add_special_tokens=False)
        out[prompt] = ids, hf_greedy_fn(hf_smollm2, ids, 32)
    return out


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_greedy_matches_transformers_generate(smollm2_dir, transformers_greedy, backend):
    """Four prompts, 32 greedy tokens each, token-identical to transformers' generate, on the
    reference backend and on the tuned CPU backend (so the two are identical too)."""
    from model_utils import prefill_logits, row, run_step

    from refserve.backends import get_backend
    from refserve.models.loader import load_model

    model = load_model(smollm2_dir, get_backend(backend))
    for prompt, (ids, expected) in transformers_greedy.items():
        blocks = list(range(8))
        logits, runner = prefill_logits(model, ids, block_size=16, block_ids=blocks)
        tokens = list(ids)
        out = []
        nxt = int(np.argmax(logits[-1]))
        for _ in range(32):
            out.append(nxt)
            tokens.append(nxt)
            logits = run_step(runner, [row(tokens, len(tokens) - 1, 1, blocks)])
            nxt = int(np.argmax(logits[-1]))
        assert out == expected, prompt
