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
    # A plain-text file whose line starts with "{" is still plain text (not every line is
    # a JSON object).
    prompts.write_text("hello there\nabc\n\n{not json, a prompt\n")
    out = tmp_path / "out.json"
    rc = main(["--model", str(tiny_with_tokenizer), "--file", str(prompts), "--max-tokens", "5",
               "--ignore-eos", "--json", str(out), "--block-size", "4"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [o["prompt"] for o in data["outputs"]] == ["hello there", "abc", "{not json, a prompt"]
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


def test_jsonl_requests_with_their_own_sampling_params(tiny_with_tokenizer, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "hello", "max_tokens": 3},
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 6, "n": 2, "seed": 1,
         "temperature": 1.0},
        {"prompt": "abc"}]) + "\n")
    out = tmp_path / "out.json"
    rc = main(["--model", str(tiny_with_tokenizer), "--file", str(requests), "--max-tokens",
               "4", "--ignore-eos", "--json", str(out), "--block-size", "4", "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())["outputs"]
    assert [o["prompt"] for o in data] == ["hello", None, "abc"]
    assert data[1]["prompt_token_ids"] == [5, 6, 7]
    assert [[len(c["token_ids"]) for c in o["outputs"]] for o in data] == [[3], [6, 6], [4]]


def test_jsonl_lines_take_vllm_fields_and_logit_bias_keys_as_strings(tiny_with_tokenizer,
                                                                      tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(r) for r in [
        {"prompt_token_ids": [5, 6, 7], "logit_bias": {"9": 100}},
        {"prompt_token_ids": [5, 6, 7], "allowed_token_ids": [11, 12]},
        {"prompt_token_ids": [5, 6, 7, 8, 9], "truncate_prompt_tokens": 2}]) + "\n")
    out = tmp_path / "out.json"
    common = ["--model", str(tiny_with_tokenizer), "--max-tokens", "4", "--ignore-eos",
              "--temperature", "0", "--block-size", "4", "--quiet"]
    assert main([*common, "--file", str(requests), "--json", str(out)]) == 0
    data = json.loads(out.read_text())["outputs"]
    assert data[0]["outputs"][0]["token_ids"] == [9] * 4
    assert set(data[1]["outputs"][0]["token_ids"]) <= {11, 12}
    assert data[2]["prompt_token_ids"] == [8, 9]
    requests.write_text(json.dumps({"prompt": "x", "logit_bias": {"a": 1}}) + "\n")
    assert main([*common, "--file", str(requests)]) == 2
    err = capsys.readouterr().err
    assert "line 1: 'logit_bias' keys must be token ids" in err and "Traceback" not in err


def run_cli(args, stdin):
    return subprocess.run([sys.executable, "-m", "refserve.generate", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_stdin_is_one_prompt_and_file_dash_one_per_line(tiny_with_tokenizer, tmp_path):
    common = ["--model", str(tiny_with_tokenizer), "--max-tokens", "3", "--ignore-eos"]
    out = tmp_path / "one.json"
    r = run_cli(common + ["--quiet", "--json", str(out)], "one\ntwo\n")
    assert r.returncode == 0, r.stderr
    assert [o["prompt"] for o in json.loads(out.read_text())["outputs"]] == ["one\ntwo"]
    r = run_cli(common + ["--quiet", "--file", "-", "--json", str(out)], "one\ntwo\n")
    assert r.returncode == 0, r.stderr
    assert [o["prompt"] for o in json.loads(out.read_text())["outputs"]] == ["one", "two"]


@pytest.mark.parametrize("argv,message", [
    (["--max-tokens", "0", "x"], "max_tokens"),
    (["--temperature", "-1", "x"], "temperature"),
    (["--top-p", "0", "x"], "top_p"),
    (["--block-size", "0", "x"], "block_size"),
    (["--kv-cache-memory-bytes", "lots", "x"], "kv-cache-memory-bytes"),
    (["--file", "/nonexistent/prompts.txt"], "no such file"),
])
def test_bad_flags_exit_with_a_clear_message(tiny_with_tokenizer, argv, message, capsys):
    try:
        rc = main(["--model", str(tiny_with_tokenizer)] + argv)
    except SystemExit as exit_:   # argparse's own checks exit from inside parse_args
        rc = exit_.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and len(err.splitlines()) == 1


def test_bad_model_path_is_reported(capsys):
    assert main(["--model", "/nonexistent/model", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err
