"""`python -m refserve.bench busy`: the busy-loop neighbour never outlives its measurement,
and the scenario runs end to end (numbers are never asserted: the machines are noisy)."""

from __future__ import annotations

import json
import os

import pytest

from refserve.bench import main
from refserve.bench.busy import busy_neighbour
from refserve.bench.common import non_finite


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_neighbour_spins_and_is_killed_even_when_the_block_fails():
    with pytest.raises(RuntimeError), busy_neighbour(60) as hog:
        pid = hog.pid
        assert alive(pid) and hog.poll() is None
        assert os.getsid(pid) == pid != os.getsid(0)   # a program of its own session
        raise RuntimeError("the measurement failed")
    assert hog.returncode is not None and not alive(pid)


def test_the_neighbour_stops_at_its_own_deadline():
    with busy_neighbour(0.1) as hog:
        hog.wait(timeout=30)    # it ends by itself, long before the block does
        assert hog.returncode == 0


def test_a_bad_thread_setting_is_refused_before_the_engine_loads(capsys):
    assert main(["busy", "--quick", "--threads", "auto", "zero"]) == 2
    assert "--threads zero" in capsys.readouterr().err


@pytest.mark.slow
def test_busy_quick(tmp_path, smollm2_dir):
    out, png = tmp_path / "busy.json", tmp_path / "busy.png"
    assert main(["busy", "--quick", "--threads", "auto", "1", "--json", str(out), "--plot",
                 str(png)]) == 0
    data = json.loads(out.read_text())
    assert non_finite(data) == [] and png.stat().st_size > 1000
    assert [r["threads"] for r in data["rows"]] == ["auto", "1"]
    assert len(data["runs"]) == 2 * 2          # each setting quiet and beside the hog
    for row in data["rows"]:
        assert row["quiet_tok_s"] > 0 and row["busy_tok_s"] > 0 and row["kept_decode"] > 0
    assert [r["threads_after"] for r in data["runs"] if r["threads"] == "1"] == [1, 1]
