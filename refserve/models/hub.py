"""Hub ids (`--model HuggingFaceTB/SmolLM2-135M-Instruct`), resolved the way vLLM does.

vLLM takes either a local folder or a Hugging Face hub id. For a hub id it uses the snapshot
in the local Hugging Face cache, downloading it into that cache first when the machine is
online. The cache is huggingface_hub's layout:

    $HF_HUB_CACHE            (default $HF_HOME/hub; HF_HOME defaults to ~/.cache/huggingface)
      models--<org>--<name>/
        refs/main            the commit hash that the branch "main" points at
        snapshots/<hash>/    that commit's files (config.json, *.safetensors, tokenizer...)
        blobs/               the file contents the snapshot entries link to

`resolve_hub_id(model)` for a string that is not an existing path:

1. It must look like a hub id, `org/name`; anything else is left to the loader's
   "does not exist" error (return None).
2. The snapshot refs/main names, if it holds config.json; else the newest snapshot that
   does (a cache copied by hand may have no refs). No network is touched.
3. Otherwise, when online (neither HF_HUB_OFFLINE nor TRANSFORMERS_OFFLINE is set) and
   huggingface_hub is installed: `snapshot_download` of the files the loader reads, into
   that same cache.
4. Otherwise FileNotFoundError, whose message says how to get the folder.

The environment is read at each call, not at import, so a test can point HF_HUB_CACHE at a
folder it built.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
# What the loader reads from a model folder; weights in other formats are not fetched.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]


def looks_like_hub_id(model: str) -> bool:
    """'org/name' with hub characters, and not a path spelled with ./, ../ or ~."""
    return bool(HUB_ID.fullmatch(model)) and ".." not in model


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder, from the environment as it is now."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def is_offline() -> bool:
    return any(os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
               for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def repo_folder(cache: Path, hub_id: str) -> Path:
    """The cache folder of a model repository: models--org--name."""
    return cache / ("models--" + hub_id.replace("/", "--"))


def cached_snapshot(cache: Path, hub_id: str) -> Path | None:
    """The cached snapshot of `hub_id` holding config.json: refs/main's, else the newest."""
    repo = repo_folder(cache, hub_id)
    snapshots = repo / "snapshots"
    main = repo / "refs" / "main"
    if main.is_file():
        candidate = snapshots / main.read_text().strip()
        if (candidate / "config.json").is_file():
            return candidate
    if not snapshots.is_dir():
        return None
    found = [s for s in snapshots.iterdir() if (s / "config.json").is_file()]
    return max(found, key=lambda s: s.stat().st_mtime) if found else None


def hub_id_of(path: Path) -> str | None:
    """'org/name' when `path` is a snapshot in a hub cache (.../models--org--name/
    snapshots/<hash>), else None: the name to show for a model resolved from a hub id."""
    parts = Path(path).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/", 1)
    return None


def resolve_hub_id(model: str) -> Path | None:
    """The local folder of hub id `model` (see the module docstring), or None when `model`
    does not look like a hub id. Raises FileNotFoundError saying how to get it."""
    if not looks_like_hub_id(model):
        return None
    cache = hub_cache_dir()
    snapshot = cached_snapshot(cache, model)
    if snapshot is not None:
        return snapshot
    how = (f"download it where there is network with `hf download {model}` (huggingface_hub's "
           f"command; it fills that cache), or pass a local folder: --model /path/to/folder")
    where = (f"model {model!r} is not a local folder, and the Hugging Face cache {cache} "
             "holds no snapshot of it")
    if is_offline():
        raise FileNotFoundError(f"{where} (HF_HUB_OFFLINE is set, so nothing is downloaded); "
                                f"{how}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(f"{where}, and huggingface_hub is not installed to download "
                                f"it; {how}") from None
    try:
        folder = snapshot_download(model, cache_dir=str(cache),
                                   allow_patterns=DOWNLOAD_PATTERNS)
    except Exception as e:  # noqa: BLE001  (offline, unknown repo, gated: all say the same)
        cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise FileNotFoundError(f"{where}, and downloading it failed ({cause[:200]}); "
                                f"{how}") from None
    return Path(folder)
