"""Helpers shared by the model tests: tiny random HF checkpoints and direct forward calls."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from refserve.backends.numpy_backend import NumpyBackend
from refserve.model_runner import ModelRunner


def save_numpy_llama(folder, vocab_size: int = 97, hidden_size: int = 48,
                     intermediate_size: int = 96, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, max_position_embeddings: int = 256,
                     init_std: float = 0.02, seed: int = 0, eos_token_id: int | None = None):
    """A tiny random Llama (GQA, tied embeddings, no tokenizer) written with NumPy alone:
    config.json and model.safetensors in `folder`, which is returned. For the tests that
    need some model but not transformers' weights: importing torch and transformers costs
    seconds, which a course exercise graded alone should not pay. Norm weights are
    1 + N(0, 0.1) so they are really read; a large `init_std` (0.3) makes greedy text
    varied rather than one token repeated."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(model_type="llama", vocab_size=vocab_size, hidden_size=hidden_size,
                  intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=eos_token_id)
    (folder / "config.json").write_text(json.dumps(config))
    from refserve.models.config import LlamaConfig

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in LlamaConfig.from_hf_dict(config).expected_tensor_shapes().items():
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (init_std * rng.standard_normal(shape)).astype(np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def save_tiny_hf_model(tmp_path, model_type="llama", tie=True, num_kv_heads=2, bias=None,
                       seed=0):
    """Create a tiny random transformers model, save it as safetensors, return (folder, hf)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=tie)
    if model_type == "llama":
        cfg = transformers.LlamaConfig(**common, attention_bias=bool(bias))
        model = transformers.LlamaForCausalLM(cfg)
    elif model_type == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif model_type == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(model_type)
    # Random init leaves norms at 1 and biases at 0; perturb them so they are really tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    folder = tmp_path / f"tiny-{model_type}"
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def hf_logits(hf_model, token_ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float().numpy()


def row(token_ids, start, num_scheduled_tokens, block_ids, num_logits=1, draft_token_ids=()):
    """A scheduled row as the runner reads it: a `ScheduledSequence` whose sequence holds
    `token_ids` (as its prompt, `start` of them computed) and computes [start, start +
    num_scheduled_tokens) of token_ids + drafts."""
    from refserve.sampling_params import SamplingParams
    from refserve.scheduler.output import ScheduledSequence
    from refserve.sequence import Sequence

    seq = Sequence("r", list(token_ids), SamplingParams())
    seq.num_computed_tokens = start
    return ScheduledSequence(seq=seq, start=start, num_scheduled_tokens=num_scheduled_tokens,
                             num_logits=num_logits, block_ids=list(block_ids),
                             draft_token_ids=tuple(draft_token_ids))


def run_step(runner, rows, block_copies=()):
    """prepare -> copy_blocks -> forward for the given rows; returns host logits."""
    out = SimpleNamespace(scheduled=list(rows), block_copies=list(block_copies))
    inputs = runner.prepare(out)
    runner.copy_blocks(out.block_copies)
    return runner.forward(inputs)


def prefill_logits(model, token_ids, block_size=16, chunk=None, block_ids=None):
    """All-position logits of one sequence computed through the paged cache, optionally in
    prefill chunks of `chunk` tokens (each chunk attends to the cached earlier ones)."""
    n = len(token_ids)
    nblocks = -(-n // block_size)
    block_ids = list(block_ids) if block_ids is not None else list(range(nblocks))
    runner = ModelRunner(model, model.backend, num_blocks=max(block_ids) + 1,
                         block_size=block_size)
    chunk = chunk or n
    rows = []
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        rows.append(run_step(runner, [row(token_ids, start, size, block_ids,
                                          num_logits=size)]))
    return np.concatenate(rows), runner


def numpy_backend():
    return NumpyBackend()


def max_rel_err(a, b) -> float:
    """max over positions of max|a-b| / max|b| (relative to the row's scale)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b).max(-1) / np.abs(b).max(-1)))


class LetterTokenizer:
    """Token t is the one letter chr(ord('A') + t % 26): every token adds exactly one
    character, so a test can say which token completes a stop string. EOS (if given)
    decodes to nothing, like a special token."""

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join("" if t == self.eos_token_id and skip_special_tokens
                       else chr(ord("A") + t % 26) for t in token_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) - ord("A") for c in text]
