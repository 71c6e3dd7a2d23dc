"""`--model org/name` (a hub id) resolved as vLLM does (refserve/models/hub.py): from the
local Hugging Face cache when the snapshot is there, downloaded when online, otherwise one
error saying how to get the folder. Every cache here is a layout built in tmp_path; no test
touches the network (HF_HUB_OFFLINE=1, or huggingface_hub.snapshot_download replaced)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from model_utils import save_tiny_hf_model
from test_cli_errors import assert_user_error

from refserve.models import hub
from refserve.models.loader import resolve_model_path

HUB_ID = "TinyOrg/tiny-llama"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _ = save_tiny_hf_model(tmp_path_factory.mktemp("hub-src"))
    return folder


def fill_cache(cache, tiny, revisions, main=None):
    """models--TinyOrg--tiny-llama/snapshots/<rev>/ for each revision (oldest first), and
    refs/main naming `main` when given: huggingface_hub's layout."""
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    for rev in revisions:
        shutil.copytree(tiny, repo / "snapshots" / rev)
        stamp = time.time() - 1000 + 10 * revisions.index(rev)
        os.utime(repo / "snapshots" / rev, (stamp, stamp))
    if main is not None:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(main)
    return repo


@pytest.fixture
def hf_env(monkeypatch, tmp_path):
    """A private, empty HF cache and offline mode; returns the cache folder."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_cached_snapshot_is_found_under_refs_main(hf_env, tiny):
    repo = fill_cache(hf_env, tiny, ["0ld", "aaa111", "zzz999"], main="aaa111")
    # refs/main wins over the newest snapshot.
    assert resolve_model_path(HUB_ID) == repo / "snapshots" / "aaa111"


def test_without_refs_the_newest_snapshot_with_a_config(hf_env, tiny):
    repo = fill_cache(hf_env, tiny, ["r1", "r2"])
    (repo / "snapshots" / "r3-broken").mkdir()  # newest, but holds no config.json
    assert resolve_model_path(HUB_ID) == repo / "snapshots" / "r2"


def test_hf_home_means_its_hub_subfolder(hf_env, tiny, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    repo = fill_cache(tmp_path / "home" / "hub", tiny, ["abc"], main="abc")
    assert hub.hub_cache_dir() == tmp_path / "home" / "hub"
    assert resolve_model_path(HUB_ID) == repo / "snapshots" / "abc"
    assert hub.hub_id_of(repo / "snapshots" / "abc") == HUB_ID


def test_not_cached_and_offline_says_how_to_get_it(hf_env):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path(HUB_ID)
    message = str(e.value)
    assert str(hf_env) in message and f"hf download {HUB_ID}" in message
    assert "--model /path/to/folder" in message and "HF_HUB_OFFLINE" in message


def test_online_it_downloads_into_the_cache(hf_env, tiny, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_snapshot_download(repo_id, cache_dir, allow_patterns):
        calls.append((repo_id, cache_dir, allow_patterns))
        return str(fill_cache(hf_env, tiny, ["new"], main="new") / "snapshots" / "new")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_path(HUB_ID) == hf_env / ("models--TinyOrg--tiny-llama") / \
        "snapshots" / "new"
    assert calls == [(HUB_ID, str(hf_env), hub.DOWNLOAD_PATTERNS)]
    assert "*.safetensors" in hub.DOWNLOAD_PATTERNS and "*.json" in hub.DOWNLOAD_PATTERNS
    # Cached now: no second download.
    resolve_model_path(HUB_ID)
    assert len(calls) == 1


def test_a_failed_download_is_one_clear_error(hf_env, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(FileNotFoundError, match=r"downloading it failed \(ConnectionError: "
                       r"Failed to resolve 'huggingface.co'\)"):
        resolve_model_path(HUB_ID)


@pytest.mark.parametrize("model, is_hub_id", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("meta-llama/Llama-3.1-8B", True),
    ("/abs/path", False), ("./rel/path", False), ("../up/x", False), ("~/models/x", False),
    ("a/b/c", False), ("plainname", False), ("org/..", False),
])
def test_what_looks_like_a_hub_id(model, is_hub_id):
    assert hub.looks_like_hub_id(model) is is_hub_id


def test_an_existing_folder_is_never_looked_up(hf_env, tiny, monkeypatch, tmp_path):
    # A relative path that looks like a hub id but exists: it is the folder.
    (tmp_path / "TinyOrg").mkdir()
    shutil.copytree(tiny, tmp_path / HUB_ID)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(HUB_ID) == Path(HUB_ID)


def test_generate_with_a_hub_id_runs_from_the_cache_and_errors_in_one_line(tiny, tmp_path):
    cache = tmp_path / "hub"
    fill_cache(cache, tiny, ["c0ffee"], main="c0ffee")
    requests = tmp_path / "r.jsonl"
    requests.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "refserve.generate", "--model", HUB_ID, "--file",
           str(requests), "--max-tokens", "3", "--ignore-eos", "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    missing = [*cmd[:4], "NoSuchOrg/nothing", *cmd[5:]]
    r = subprocess.run(missing, capture_output=True, text=True, timeout=120, env=env)
    assert_user_error(r, "'NoSuchOrg/nothing' is not a local folder", str(cache),
                      "hf download NoSuchOrg/nothing")
