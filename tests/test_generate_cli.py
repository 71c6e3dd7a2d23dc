"""`python -m refserve.generate` on a tiny model folder with a tokenizer."""

import json
import subprocess
import sys

import pytest
from model_utils import save_tiny_hf_model

from refserve.generate import main


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory, request):
    """A tiny random Llama plus a byte-level tokenizer whose vocabulary fits it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder, _ = save_tiny_hf_model(tmp_path_factory.mktemp("cli"))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<eos>": 0}
    for ch in sorted(alphabet)[:96]:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>",
        "chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                         "{% endfor %}[assistant] "}))
    return folder


def test_file_prompts_json_and_summary(tiny_with_tokenizer, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\nabc\n\n" + json.dumps({"prompt": "json line"}) + "\n")
    out = tmp_path / "out.json"
    rc = main(["--model", str(tiny_with_tokenizer), "--file", str(prompts), "--max-tokens", "5",
               "--ignore-eos", "--json", str(out), "--block-size", "4"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [o["prompt"] for o in data["outputs"]] == ["hello there", "abc", "json line"]
    assert all(len(o["outputs"][0]["token_ids"]) == 5 for o in data["outputs"])
    assert data["summary"]["num_requests"] == 3
    assert data["outputs"][0]["metrics"]["ttft"] > 0
    err = capsys.readouterr().err
    assert "summary: 3 requests" in err and "TTFT p50" in err and "KV blocks peak" in err


def test_single_prompt_streams_and_chat(tiny_with_tokenizer, capsys):
    rc = main(["--model", str(tiny_with_tokenizer), "--chat", "--max-tokens", "6",
               "--ignore-eos", "--temperature", "0.8", "--seed", "3", "hi"])
    assert rc == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and len(captured.out.strip()) > 0
    assert "summary: 1 requests" in captured.err


def test_stdin_prompts(tiny_with_tokenizer):
    r = subprocess.run([sys.executable, "-m", "refserve.generate", "--model",
                        str(tiny_with_tokenizer), "--max-tokens", "3", "--ignore-eos",
                        "--quiet"], input="one\ntwo\n", capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) >= 2


@pytest.mark.parametrize("argv,message", [
    (["--max-tokens", "0", "x"], "max_tokens"),
    (["--temperature", "-1", "x"], "temperature"),
    (["--top-p", "0", "x"], "top_p"),
    (["--block-size", "0", "x"], "block_size"),
    (["--kv-cache-memory", "lots", "x"], "kv-cache-memory"),
    (["--file", "/nonexistent/prompts.txt"], "no such file"),
])
def test_bad_flags_exit_with_a_clear_message(tiny_with_tokenizer, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--model", str(tiny_with_tokenizer)] + argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_model_path_is_reported(capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["--model", "/nonexistent/model", "hi"])
