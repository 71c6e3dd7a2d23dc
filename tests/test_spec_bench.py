"""`python -m refserve.bench spec --quick`: every cell is there, the counts hang together and
speculation never changes greedy output. (Speed is measured by running the bench.)"""

import json

import pytest

from refserve.bench import main

pytestmark = pytest.mark.slow


def test_spec_quick(tmp_path, smollm2_dir, capsys):
    out, png = tmp_path / "spec.json", tmp_path / "spec.png"
    assert main(["spec", "--quick", "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data["scenario"] == "spec" and data["quick"] is True
    rows = data["rows"]
    cells = {(r["workload"], r["batch"], r["system"]) for r in rows}
    assert cells == {(w, b, s) for w in ("quote-heavy", "creative") for b in (1, 2)
                     for s in ("none", "ngram", "self-draft")}
    for r in rows:
        assert r["identical_outputs"] == r["requests"]  # greedy output never changes
        assert r["seconds"] > 0 and r["speedup"] > 0
        assert 0 <= r["accepted"] <= r["proposed"]
        if r["system"] == "none":
            assert r["proposed"] == 0 and r["target_passes_per_token"] == 1.0
    quote_ngram = [r for r in rows if r["workload"] == "quote-heavy" and r["system"] == "ngram"]
    assert all(r["acceptance_rate"] > 0.3 and r["target_passes_per_token"] < 1.0
               for r in quote_ngram)
    assert png.stat().st_size > 1000
    verify = data["verify_pass"]
    assert all(verify[name] > 0 and verify[f"{name}_one_row_ms"] > 0
               for name in ("loaded", "plain", "reference"))
    printed = capsys.readouterr().out
    assert "quote-heavy, batch 1: ngram" in printed
    assert "on the numpy reference" in printed
