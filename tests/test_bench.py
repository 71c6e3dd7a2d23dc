"""`python -m refserve.bench ... --quick` runs end to end and its numbers hang together.
(Speed itself is measured by running the bench, never asserted in a test.)"""

import json

import pytest

from refserve.bench import main, make_workload

pytestmark = pytest.mark.slow


def test_workload_is_long_tailed_and_reproducible():
    a = make_workload(64, seed=0, vocab_size=49152)
    b = make_workload(64, seed=0, vocab_size=49152)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert all(16 <= n <= 512 for n in a.output_lens)
    assert all(16 <= len(p) <= 128 for p in a.prompts)
    assert max(a.output_lens) > 2.5 * (sum(a.output_lens) / 64)   # a long tail


def test_batching_quick(tmp_path, smollm2_dir, capsys):
    out = tmp_path / "bench.json"
    assert main(["batching", "--quick", "--json", str(out), "--plot",
                 str(tmp_path / "bench.png")]) == 0
    data = json.loads(out.read_text())
    cont, static, hf = data["rows"]
    assert cont["useful_tokens"] == static["useful_tokens"] == hf["useful_tokens"]
    assert cont["slot_steps_wasted"] == 0 < static["slot_steps_wasted"]
    assert static["slot_steps_wasted"] == hf["slot_steps_wasted"]
    assert cont["steps"] < static["steps"]
    # Same greedy tokens as transformers' generate (left padding may flip a near-tie
    # argmax in float32, so allow one or two): the comparison is like for like.
    assert hf["same_outputs_as_refserve"] >= 6
    assert (tmp_path / "bench.png").stat().st_size > 0
    overhead = data["overhead"]
    assert 0 < overhead["dense_matmul_floor_ms"] < overhead["forward_ms"]
    assert overhead["step_over_floor"] > 1
    assert 0 < overhead["sampling_top_p_ms"] and 0 < overhead["sampling_fraction"] < 1
    assert "continuous / refserve static" in capsys.readouterr().out
