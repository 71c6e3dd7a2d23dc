"""`python -m refserve.selfcheck`: without a usable GPU a clear error and exit status 2; the
table it prints reads its results dict (formatting checked on made-up numbers)."""

from __future__ import annotations

import subprocess
import sys

from refserve import backends, selfcheck


def test_without_a_gpu_it_names_the_cause_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(backends, "_gpu_unavailable_reason", lambda: "cupy sees 0 CUDA devices")
    assert selfcheck.main(["--backend", "cupy"]) == 2
    assert capsys.readouterr().err.strip() == "error: no usable CUDA GPU: cupy sees 0 CUDA devices"


def test_the_command_line_on_this_machine():
    reason = backends._gpu_unavailable_reason()
    proc = subprocess.run([sys.executable, "-m", "refserve.selfcheck", "--backend", "cupy",
                           "--skip-tests", "--json", "/dev/null"],
                          capture_output=True, text=True, timeout=600)
    if reason is None:  # a GPU machine: the command is the GPU check itself
        assert proc.returncode in (0, 1) and "copy bandwidth" in proc.stdout
    else:
        assert proc.returncode == 2
        assert proc.stderr.startswith("error: no usable CUDA GPU: ") and "Traceback" not in \
            proc.stderr


def test_table_shows_every_measurement_with_its_target():
    results = {
        "tests": {"status": "passed", "summary": "12 passed"},
        "ceilings": {"copy_GBps": 4000.0, "matmul_fp16_TFLOPs": 700.0},
        "attention": [
            {"batch": 64, "context": 4096, "v1_us": 70.0, "v2_us": 90.0, "chosen": "v1",
             "GBps": 3800.0, "pct_copy": 95.0, "sdpa_us": 80.0},
            {"batch": 256, "context": 32768, "skipped": "does not fit in memory"}],
        "end_to_end": {"refserve_tok_s": 9000.0, "transformers_tok_s": 3000.0, "speedup": 3.0,
                       "batch1_ms_per_token": 1.5, "floor_ms_per_token": 0.6, "x_floor": 2.5,
                       "greedy_vs_transformers_mean_common_prefix": 40.0},
        "greedy": {"identical": {"cpu": 4, "cupy": 3}, "prompts": 4},
    }
    text = selfcheck.table(results)
    assert "attention B=64 ctx=4096 (v1) us" in text and "95% copy" in text
    assert ">= 80% copy, <= sdpa" in text and "sdpa 80" in text
    assert "does not fit in memory" in text
    assert "3.00x (target >= 2x)" in text and "2.50x (target <= 3x)" in text
    assert "passed" in text
    assert "numpy == cpu (fp32)" in text and "4/4" in text
    assert "numpy == cupy (fp32)" in text and "3/4" in text
