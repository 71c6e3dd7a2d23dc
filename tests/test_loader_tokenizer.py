"""A model folder's tokenizer is loaded once per process and again when its files change."""

import os

from tiny_text_model import save_tiny_text_model

from refserve.models.loader import load_tokenizer


def test_a_folders_tokenizer_is_shared_until_its_files_change(tmp_path):
    folder = save_tiny_text_model(tmp_path / "model")
    first = load_tokenizer(folder)
    assert first is not None and load_tokenizer(folder) is first
    assert first.decode(first.encode("hello")) == "hello"
    path = folder / "tokenizer.json"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert load_tokenizer(folder) is not first


def test_a_folder_without_tokenizer_files_has_none(tmp_path):
    assert load_tokenizer(tmp_path) is None
