"""Read a Llama-family checkpoint from an HF-format folder, checking everything on the way in.

A folder holds `config.json` and the weights as safetensors, either one `model.safetensors`
or shards listed in `model.safetensors.index.json`. Supported `model_type`s: llama, mistral,
qwen2 (Qwen2 adds biases to the q/k/v projections) and the SmolLM family (which is llama).

We parse safetensors ourselves instead of calling a framework: the format is an 8-byte
little-endian header length, a JSON header mapping tensor names to dtype, shape and byte
offsets, then the raw bytes. Doing it here lets us (a) read bfloat16 with plain NumPy (a
bfloat16 is the top half of a float32), (b) name the exact tensor and file when something is
wrong, and (c) notice a truncated file before reading garbage.

Every error is a `ModelLoadError` (a `ValueError`) whose message names the file or tensor and
what was expected; a missing folder is a `FileNotFoundError`.

`load_model(folder, backend)` is the entry point: config, weights, then the `LlamaModel`.
"""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

import numpy as np

from refserve.models.config import LlamaConfig
from refserve.models.llama import LlamaModel

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class ModelLoadError(ValueError):
    """The checkpoint folder cannot be loaded; the message says which file or tensor and why."""


class UnsupportedModelError(ModelLoadError):
    """config.json describes an architecture refserve does not implement."""


def load_model(folder: str | Path, backend, dtype=np.float32) -> LlamaModel:
    """Load config and weights from an HF-format folder onto the backend, in `dtype`."""
    config = load_config(folder)
    return LlamaModel(config, load_weights(folder, config), backend, dtype)


def load_config(folder: str | Path) -> LlamaConfig:
    folder = _check_folder(folder)
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not supported; refserve implements the "
            f"Llama family: {', '.join(SUPPORTED_MODEL_TYPES)}")
    try:
        return LlamaConfig.from_hf_dict(raw)
    except KeyError as e:
        raise ModelLoadError(f"{path}: missing required field {e.args[0]!r}") from e
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e


def load_weights(folder: str | Path, config: LlamaConfig) -> dict[str, np.ndarray]:
    """All tensors the model needs, as float32 arrays, each checked against its expected shape."""
    folder = _check_folder(folder)
    expected = config.expected_tensor_shapes()
    files = _weight_files(folder)
    weights: dict[str, np.ndarray] = {}
    for file in files:
        for name, array in read_safetensors(file).items():
            if name not in expected:
                continue  # e.g. rotary_emb.inv_freq buffers some exporters save
            if tuple(array.shape) != expected[name]:
                raise ModelLoadError(f"{file.name}: tensor {name!r} has shape {array.shape}, "
                                     f"expected {expected[name]} from config.json")
            weights[name] = array
    missing = [n for n in expected if n not in weights]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"{folder}: missing tensor(s) {missing[:5]}{more} in "
                             f"{', '.join(f.name for f in files)}")
    return weights


def _check_folder(folder: str | Path) -> Path:
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"model path {str(folder)!r} does not exist; pass a folder "
                                "holding config.json and *.safetensors, or model=None for "
                                "the embedded default model")
    if not folder.is_dir():
        raise ModelLoadError(f"model path {str(folder)!r} is a file; pass the folder that "
                             "holds config.json and the safetensors weights")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder}: no config.json; this does not look like a Hugging "
                             "Face model folder")
    return folder


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = [folder / f for f in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                             "(only safetensors weights are supported)")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: shard listed in the index is missing")
    return files


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read every tensor of one safetensors file as float32 (memory-mapped, then converted)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path}: file is {size} bytes, too short for a safetensors "
                                 "header (truncated?)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ModelLoadError(f"{path}: header claims {header_len} bytes but the file has "
                                 f"{size}; the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors header ({e})") from e
    data_start = 8 + header_len
    header.pop("__metadata__", None)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{path.name}: tensor {name!r} has dtype {info['dtype']}; "
                                 "supported: F32, F16, BF16")
        begin, end = info["data_offsets"]
        if data_start + end > size:
            raise ModelLoadError(f"{path}: tensor {name!r} ends at byte {data_start + end} "
                                 f"but the file has {size} bytes; the file is truncated")
        raw = mm[data_start + begin: data_start + end].view(dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":
            # bfloat16 is the upper 16 bits of a float32.
            out[name] = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            out[name] = np.ascontiguousarray(raw, dtype=np.float32)
    return out


def resolve_model_path(model: str | None, progress: bool = True) -> Path:
    """The folder to load: the embedded default model for None (fetched and converted on
    first use), an existing path as given, a hub id ('org/name') from the Hugging Face
    cache as vLLM does (refserve/models/hub.py; FileNotFoundError saying how to get it).
    Anything else is returned as a path, for the loader's "does not exist" error."""
    if model is None:
        from refserve.models.default_model import ensure_default_model
        return ensure_default_model(progress=progress)
    path = Path(model).expanduser()
    if path.exists():
        return path
    from refserve.models.hub import resolve_hub_id

    return resolve_hub_id(str(model)) or path


def load_tokenizer(path: Path):
    """The tokenizer of a model folder, or None when the folder has none (then only
    token-id prompts are accepted): a plain fast tokenizer read straight through
    `tokenizers` (models/tokenizer.py, 0.2 s), any other through transformers' AutoTokenizer
    (which works without torch).

    Loaded once per folder and process: engines built one after another, as the benches and
    tests do, share it. Nothing in refserve changes a tokenizer after loading; a folder
    whose tokenizer files change is loaded again."""
    stamps = _tokenizer_stamps(path)
    if stamps == (None, None):
        return None
    return _tokenizer_of(str(path.resolve()), stamps)


def load_hf_tokenizer(path: Path):
    """transformers' own tokenizer of a model folder (None without one), loaded once per
    folder and process: what `LLM.get_tokenizer()` returns, as vLLM's does."""
    stamps = _tokenizer_stamps(path)
    if stamps == (None, None):
        return None
    return _hf_tokenizer_of(str(path.resolve()), stamps)


def _tokenizer_stamps(path: Path) -> tuple:
    files = (path / "tokenizer.json", path / "tokenizer_config.json")
    return tuple(f.stat().st_mtime_ns if f.is_file() else None for f in files)


@functools.lru_cache(maxsize=4)
def _tokenizer_of(path: str, stamps: tuple) -> object:
    from refserve.models.tokenizer import FastTokenizer, fast_tokenizer_config

    config = fast_tokenizer_config(Path(path))
    if config is not None:
        return FastTokenizer(Path(path), config)
    return _hf_tokenizer_of(path, stamps)


@functools.lru_cache(maxsize=4)
def _hf_tokenizer_of(path: str, stamps: tuple) -> object:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
