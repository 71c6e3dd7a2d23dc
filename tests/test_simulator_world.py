"""The simulator against published GPU measurements (refserve/simulator/world.py): the data
is complete and cited, the fit's linear form is the simulation's, and the quick form of
`bench sim-world` meets the held-out target with the shipped constants."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from refserve.bench import main
from refserve.simulator.engine_overheads import load_engine
from refserve.simulator.hardware import load_gpu, load_model
from refserve.simulator.world import (
    HELD_OUT,
    METRIC_UNITS,
    Constants,
    load_measurements,
    replay,
)
from refserve.simulator.world_fit import _linear_rows, solve

ROWS = load_measurements()


def test_every_measurement_is_cited_and_complete():
    assert len(ROWS) >= 15
    for m in ROWS:
        assert m.source.startswith("https://github.com/") and m.where, m.id
        assert m.engine and m.version and m.metric in METRIC_UNITS and m.value > 0, m.id
        load_model(m.model), load_gpu(m.gpu), load_engine(m.engine_profile)
        assert m.tp >= 1 and m.dtype in ("float16", "bfloat16")
        if m.replay == "static":
            assert m.batch_size and m.input_len and m.output_len
        else:
            assert m.replay == "serving" and m.workload and m.num_requests, m.id
    assert len({m.source for m in ROWS}) >= 2  # more than one publisher


def test_held_out_rows_are_representative():
    held = [m for m in ROWS if m.role == "held-out"]
    fit = [m for m in ROWS if m.role == "fit"]
    assert len(held) == len(HELD_OUT) >= 8 and len(fit) > len(held)
    for attribute in ("gpu", "engine_profile", "metric", "replay"):
        # every GPU, engine, metric and kind of run the fit saw is judged too
        assert {getattr(m, attribute) for m in held} == {getattr(m, attribute) for m in fit}
    assert any(m.quantization == "fp8" for m in held)
    assert any(not m.enable_chunked_prefill for m in held)


def test_the_fit_form_is_the_simulated_time():
    """c + X theta (the fit's linear form) equals the simulated metric's time."""
    constants = Constants()
    for row_id in ("trt-a100-7b-2048-128", "trt-h100-70b-ttft-2048"):
        m = next(r for r in ROWS if r.id == row_id)
        r = replay(m, constants)
        constants.gpu(m.gpu), constants.engine(m.engine_profile)
        values = constants.values()
        names = sorted(values)
        x, c = _linear_rows([r], names)
        linear = c[0] + x[0] @ np.array([values[n] for n in names])
        if m.metric == "output_tokens_per_s":
            tokens = m.batch_size * m.output_len
            assert linear == pytest.approx(tokens / r.predicted, rel=1e-9)
        else:
            assert linear == pytest.approx(r.predicted / 1e3, rel=1e-9)


def test_solve_recovers_known_values_and_keeps_unexercised_ones():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.1, 1.0, (12, 4))
    x[:, 3] = 0.0  # nobody exercises the last value
    truth = np.array([0.5, 2.0, 0.01, 7.0])
    c = rng.uniform(0, 0.1, 12)
    target = c + x @ truth
    got = solve(x, c, target, prior=np.array([1.0, 1.0, 1.0, 3.0]), ridge=1e-9)
    assert got[:3] == pytest.approx(truth[:3], rel=1e-4)
    assert got[3] == pytest.approx(3.0)  # its prior


def test_sim_world_quick_meets_the_held_out_target(tmp_path):
    out = tmp_path / "world.json"
    assert main(["sim-world", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert rows and all(r["role"] == "held-out" for r in rows)
    for r in rows:
        assert r["error"] == pytest.approx((r["predicted"] - r["published"]) / r["published"])
        assert math.isfinite(r["predicted"]) and abs(r["error"]) <= 0.25, r
    assert np.median([abs(r["error"]) for r in rows]) <= 0.10
    assert data["target_met"] is True
