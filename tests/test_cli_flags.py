"""The command lines' shared conventions (one engine-args builder, --tensor-parallel-size
as vLLM spells it): each checked as a user meets it, in a subprocess.

- no abbreviations in any parser of the project (`--max-token 5` is not `--max-tokens`);
- outputs (--json, --plot) checked before the long work, in every entry point;
- capacity's --memory needs a unit; `generate --help` shows each default once;
- prompts (empty ones, --file mixing JSON and text) refused before the model loads;
- generate and serve take their engine flags from one builder.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_errors import assert_user_error

ROOT = Path(__file__).resolve().parents[1]


def run(module, *args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


# ---- abbreviations --------------------------------------------------------------------------


@pytest.mark.parametrize("module, args, abbreviation", [
    ("refserve.generate", ["--max-token", "5", "hi"], "--max-token"),
    ("refserve.serve", ["--max-num-seq", "4"], "--max-num-seq"),
    ("refserve.capacity", ["--model", "llama-3-8b", "--memory", "80GiB", "--context", "8",
                           "--block", "16"], "--block"),
    ("refserve.bench", ["batching", "--qui"], "--qui"),
    ("refserve.course", ["make-student", "/tmp/never-written", "--solution"], "--solution"),
    ("refserve.selfcheck", ["--skip"], "--skip"),
])
def test_no_parser_takes_an_abbreviation(module, args, abbreviation):
    r = run(module, *args)
    assert_user_error(r, "unrecognized arguments", abbreviation)


def argument_parser_calls(path: Path):
    """(line, keywords) of every `ArgumentParser(...)` call in a file."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name == "ArgumentParser":
                yield node.lineno, {k.arg: k.value for k in node.keywords}, node.func


def parsers_allowing_abbreviations(paths) -> list[str]:
    """Calls of argparse's ArgumentParser without allow_abbrev=False; refserve's own
    ArgumentParser (refserve/entrypoints/cli_common.py) sets it for every parser."""
    bad = []
    for path in paths:
        for line, keywords, func in argument_parser_calls(path):
            is_argparse = isinstance(func, ast.Attribute) and getattr(
                func.value, "id", None) == "argparse"
            flag = keywords.get("allow_abbrev")
            if is_argparse and not (isinstance(flag, ast.Constant) and flag.value is False):
                bad.append(f"{path.relative_to(ROOT)}:{line}")
    return bad


def test_every_parser_of_the_project_refuses_abbreviations():
    paths = [p for folder in ("refserve", "notebooks", "scripts", "tests")
             for p in sorted((ROOT / folder).rglob("*.py"))]
    assert parsers_allowing_abbreviations(paths) == []
    from refserve.entrypoints.cli_common import ArgumentParser

    assert ArgumentParser().allow_abbrev is False


def test_the_abbreviation_scan_finds_a_plain_parser(tmp_path):
    """Negative control for the scan."""
    bad = ROOT / "tests" / "_tmp_parser_control.py"
    try:
        bad.write_text("import argparse\np = argparse.ArgumentParser(prog='x')\n")
        assert parsers_allowing_abbreviations([bad]) == ["tests/_tmp_parser_control.py:2"]
        bad.write_text("import argparse\np = argparse.ArgumentParser(allow_abbrev=False)\n")
        assert parsers_allowing_abbreviations([bad]) == []
    finally:
        bad.unlink()


# ---- one engine-args builder, --tensor-parallel-size --------------------------------------


def engine_options(parser) -> dict[str, tuple]:
    """option string -> (group title, default) for the engine groups of a parser."""
    return {opt: (group.title, action.default)
            for group in parser._action_groups if group.title.startswith("engine")
            for action in group._group_actions for opt in action.option_strings}


def test_generate_and_serve_share_the_engine_flags():
    from refserve.entrypoints.engine_args import engine_config_from_args
    from refserve.generate import build_parser as generate_parser
    from refserve.serve import build_parser as serve_parser

    gen, srv = engine_options(generate_parser()), engine_options(serve_parser())
    assert gen == srv
    assert {"--model", "--max-num-seqs", "--tensor-parallel-size", "--backend",
            "--num-gpu-blocks", "--kv-cache-memory"} <= set(gen)
    flags = ["--max-num-seqs", "7", "--block-size", "8", "--num-gpu-blocks", "64",
             "--kv-cache-memory-bytes", "1GiB", "--no-enable-prefix-caching"]
    a = engine_config_from_args(generate_parser().parse_args([*flags, "hi"]))
    b = engine_config_from_args(serve_parser().parse_args(flags))
    assert a == b
    assert (a.max_num_seqs, a.block_size, a.num_gpu_blocks_override,
            a.kv_cache_memory_bytes, a.enable_prefix_caching) == (7, 8, 64, 2**30, False)


@pytest.mark.parametrize("module, rest", [("refserve.generate", ["hi"]),
                                          ("refserve.serve", ["--port", "0"])])
def test_tensor_parallel_size_one_runs_and_more_names_vllm(module, rest):
    assert_user_error(run(module, "--tensor-parallel-size", "2", *rest),
                      "--tensor-parallel-size", "one device", "use vLLM")
    from refserve.generate import build_parser as generate_parser
    from refserve.serve import build_parser as serve_parser

    parser = generate_parser() if module.endswith("generate") else serve_parser()
    assert parser.parse_args(["--tensor-parallel-size", "1"]).tensor_parallel_size == 1


def test_deprecated_alias_still_works_and_warns(capsys):
    from refserve.generate import build_parser

    args = build_parser().parse_args(["--num-gpu-blocks", "12", "hi"])
    assert args.num_gpu_blocks_override == 12
    assert "--num-gpu-blocks is deprecated; use --num-gpu-blocks-override" in \
        capsys.readouterr().err


# ---- outputs checked before the work --------------------------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_bench_checks_its_outputs_before_running(tmp_path, flag):
    for path, fragment in ((tmp_path / "missing" / "out", "does not exist"),
                           (tmp_path, "is a folder")):
        r = run("refserve.bench", "batching", "--quick", flag, str(path))
        assert_user_error(r, f"{flag} {path}", fragment)
        assert "machine:" not in r.stdout  # nothing was measured


def test_selfcheck_checks_its_json_before_the_gpu(tmp_path):
    r = run("refserve.selfcheck", "--json", str(tmp_path / "missing" / "s.json"))
    assert_user_error(r, "--json", "does not exist")


def test_capacity_memory_needs_a_unit():
    r = run("refserve.capacity", "--model", "llama-3-8b", "--memory", "80", "--context", "8")
    assert_user_error(r, "--memory", "no unit", "80GiB")
    ok = run("refserve.capacity", "--model", "llama-3-8b", "--memory", "80GiB",
             "--context", "2048")
    assert ok.returncode == 0 and "max concurrency" in ok.stdout, ok.stderr


# ---- --help ---------------------------------------------------------------------------------


def help_entries(text: str) -> dict[str, str]:
    """option -> its whole help text (argparse wraps it over several lines)."""
    entries, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (-\S+)", line)
        if m:
            current = m.group(1).rstrip(",")
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_generate_help_shows_each_default_once():
    r = run("refserve.generate", "--help")
    assert r.returncode == 0
    entries = help_entries(r.stdout)
    assert len(entries) > 30, entries.keys()
    for option, text in entries.items():
        assert len(re.findall(r"\(default", " ".join(text.split()))) <= 1, (option, text)
        assert "(default: None)" not in text, (option, text)
    max_tokens = " ".join(entries["--max-tokens"].split())
    assert "default: 128" in max_tokens and "16" in max_tokens and "vLLM" in max_tokens
    assert "(default: 16)" in " ".join(entries["--block-size"].split())


# ---- prompts before the model ---------------------------------------------------------------


def test_an_empty_prompt_is_refused_before_the_model_loads(tmp_path):
    # A model folder that does not exist: had the model been loaded first, the error would
    # be about the folder, and the start-up line would show.
    missing_model = str(tmp_path / "no-model")
    r = run("refserve.generate", "--model", missing_model, "")
    assert_user_error(r, "prompt argument 1 is empty")
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    r = run("refserve.generate", "--model", missing_model, "--file", str(jsonl))
    assert_user_error(r, "line 2", "'prompt' is empty")


def test_a_file_mixing_json_and_plain_text_is_refused_with_the_line_numbers(tmp_path):
    mixed = tmp_path / "prompts.txt"
    mixed.write_text("Once upon a time\n\n" + json.dumps({"prompt": "Hi", "max_tokens": 3})
                     + "\nThe capital of France is\n" + json.dumps({"prompt": "Yo"}) + "\n")
    r = run("refserve.generate", "--model", str(tmp_path / "no-model"), "--file", str(mixed))
    assert_user_error(r, "mixes JSON and plain text", "line(s) 3, 5 are JSON objects",
                      "line(s) 1, 4 are not")


def test_prompt_file_rules():
    from refserve.prompt_files import PromptFileError, is_jsonl

    assert is_jsonl("p.txt", [(1, '{"prompt": "a"}'), (2, '{"prompt": "b"}')])
    assert not is_jsonl("p.txt", [(1, "{not json"), (2, "plain")])
    with pytest.raises(PromptFileError, match="line.s. 2 are JSON"):
        is_jsonl("p.txt", [(1, "plain"), (2, '{"prompt": "b"}')])
    lines = [(i, "text") for i in range(1, 9)] + [(9, "{}")]
    with pytest.raises(PromptFileError, match="1, 2, 3, 4, 5 and 3 more are not"):
        is_jsonl("p.txt", lines)


def test_course_refuses_a_destination_it_cannot_create(tmp_path):
    (tmp_path / "file").write_text("x")
    r = run("refserve.course", "make-student", str(tmp_path / "file" / "copy"))
    assert_user_error(r, "cannot create it")


def test_bench_plot_without_matplotlib_fails_before_the_run(tmp_path):
    # A matplotlib that cannot be imported, first on the path: as on a machine without it.
    (tmp_path / "fake" / "matplotlib").mkdir(parents=True)
    (tmp_path / "fake" / "matplotlib" / "__init__.py").write_text(
        "raise ImportError('No module named matplotlib')\n")
    path = os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")])
    r = run("refserve.bench", "batching", "--quick", "--plot", str(tmp_path / "p.png"),
            env={"PYTHONPATH": path})
    assert_user_error(r, "--plot needs matplotlib")
    assert "machine:" not in r.stdout
