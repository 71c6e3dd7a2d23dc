"""The simulator against published GPU measurements (refserve/simulator/world.py): the data
is complete and cited, every shipped constant lies in its physical range, the fit's linear
form is the simulation's, the shipped constants are the fit's fixed point (checked on the
record of its last step), and the quick form of `bench sim-world` meets the held-out
target at the published request counts."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from refserve.bench import main
from refserve.simulator.bounds import Bounds
from refserve.simulator.engine_overheads import engine_names, load_engine
from refserve.simulator.hardware import load_gpu, load_model
from refserve.simulator.world import HELD_OUT, METRIC_UNITS, Constants, load_measurements
from refserve.simulator.world_fit import FIT_RECORD, linear_form, load_record, solve
from refserve.simulator.world_replay import replay
from refserve.simulator.world_write import shipped_value

ROWS = load_measurements()
BY_ID = {m.id: m for m in ROWS}


def test_every_measurement_is_cited_and_complete():
    assert len(ROWS) >= 60
    sources = {m.source_key for m in ROWS}
    assert len(sources) >= 5
    for m in ROWS:
        # a public page at a fixed commit, the table the number is in
        assert re.match(r"https://github\.com/.+/blob/[0-9a-f]{40}/", m.source), m.id
        assert m.where and m.publisher and m.engine and m.version, m.id
        assert m.metric in METRIC_UNITS and m.value > 0, m.id
        load_model(m.model), load_gpu(m.gpu), load_engine(m.engine_profile)
        assert m.tp >= 1 and m.dtype in ("float16", "bfloat16")
        if m.replay == "static":
            assert m.batch_size and m.input_len and m.output_len
        else:
            assert m.replay == "serving" and m.workload and m.num_requests, m.id
    # every source has rows of its own held out, and the fit keeps most rows
    for key in sources:
        mine = [m for m in ROWS if m.source_key == key]
        assert any(m.role == "held-out" for m in mine), key
        assert sum(m.role == "fit" for m in mine) > len(mine) / 2, key
    assert set(HELD_OUT) <= set(BY_ID)


def test_every_shipped_constant_lies_in_its_physical_range():
    constants = Constants()
    for m in ROWS:
        constants.gpu(m.gpu), constants.engine(m.engine_profile)
    for key in engine_names():
        constants.engine(key)
    bounds = Bounds()
    assert bounds.check(constants.values()) == []
    for name in constants.values():  # and every range says where it comes from
        r = bounds.range_of(name)
        assert r.low <= r.prior <= r.high and len(r.source) > 20, name
    for name in ("flops_efficiency", "bandwidth_efficiency", "attention_efficiency",
                 "kv_bandwidth_efficiency"):
        assert bounds.gpu("h100-80gb", name).high <= 1.0  # a fraction of a peak


def test_the_linear_form_is_the_simulated_time():
    """c + X theta (the fit's form) equals the simulated metric's time: static batches,
    a batch-1 latency and an online run's median TPOT and TTFT with multi-step rounds."""
    constants = Constants()
    rows = [BY_ID[i] for i in ("trt-a100-7b-2048-128", "trt-h100-70b-ttft-2048",
                               "gptfast-a100-70b-tp4", "lmdeploy-a100-7b-ttft-128")]
    for m in rows:
        r = replay(m, constants)
        values = constants.values()
        names = sorted(values)
        x, c = linear_form([r], constants, names)
        theta = np.array([1 / values[n] if n[2].endswith("efficiency") else values[n]
                          for n in names])
        assert c[0] + x[0] @ theta == pytest.approx(r.seconds(r.cost_model), rel=1e-9)


def test_solve_recovers_known_values_and_respects_the_ranges():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.1, 1.0, (12, 4))
    x[:, 3] = 0.0  # nobody exercises the last value
    truth = np.array([0.5, 2.0, 0.01, 7.0])
    c = rng.uniform(0, 0.1, 12)
    target = c + x @ truth
    low, high = np.full(4, 1e-3), np.full(4, 10.0)
    got = solve(x, c, target, np.array([1.0, 1.0, 1.0, 3.0]), low, high, ridge=1e-9)
    assert got[:3] == pytest.approx(truth[:3], rel=1e-4)
    assert got[3] == pytest.approx(3.0)  # its prior
    # a range that excludes the truth: the solution sits on its edge, not beyond it
    high[1] = 1.5
    bounded = solve(x, c, target, np.array([1.0, 1.0, 1.0, 3.0]), low, high, ridge=1e-9)
    assert bounded[1] == pytest.approx(1.5) and np.all(bounded <= high * (1 + 1e-12))


def test_the_shipped_constants_are_the_fits_fixed_point():
    """One fit step, from the record `bench sim-world --fit --write` leaves: solving the
    recorded linear forms of every fit row gives the shipped constants back, and the
    rows cheap enough to replay here still have the recorded forms (the record is the
    simulation's, not stale)."""
    record = load_record()
    names = [tuple(n) for n in record["names"]]
    x, c, target = (np.array(record[k]) for k in ("x", "c", "target"))
    theta = solve(x, c, target, np.array(record["prior"]), np.array(record["low"]),
                  np.array(record["high"]), record["ridge"], start=np.array(record["theta"]))
    shipped = Constants()
    for m in ROWS:
        shipped.gpu(m.gpu), shipped.engine(m.engine_profile)
    values = shipped.values()
    for name, t in zip(names, theta):
        fitted = 1 / t if name[2].endswith("efficiency") else t
        assert values[name] == pytest.approx(shipped_value(fitted), rel=2e-3, abs=1e-12), name
    cheap = [i for i, row_id in enumerate(record["ids"]) if BY_ID[row_id].replay == "static"
             and BY_ID[row_id].batch_size * BY_ID[row_id].output_len <= 20_000]
    assert len(cheap) >= 10
    for i in cheap:
        r = replay(BY_ID[record["ids"][i]], shipped)
        xi, ci = linear_form([r], shipped, names)
        assert ci[0] == pytest.approx(c[i], rel=1e-6, abs=1e-12), record["ids"][i]
        assert xi[0] == pytest.approx(x[i], rel=1e-6, abs=1e-12), record["ids"][i]
    assert FIT_RECORD.is_file()


# The worst held-out row the quick form replays, as docs/benchmarks.md reports it:
# LMDeploy 0.1's 128-token first-token latency of Llama-2-70B on 4 x A100 (-35.4%).
KNOWN_WORST = 0.40


def test_sim_world_quick_on_the_held_out_rows(tmp_path):
    """The held-out rows that replay in seconds, at their published request counts: the
    median meets the held-out target (10%); the worst row is the documented miss, no
    worse (the full target is not met, docs/benchmarks.md says why)."""
    out = tmp_path / "world.json"
    assert main(["sim-world", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert len(rows) >= 8 and all(r["role"] == "held-out" for r in rows)
    for r in rows:
        assert r["error"] == pytest.approx((r["predicted"] - r["published"]) / r["published"])
        assert math.isfinite(r["predicted"]) and abs(r["error"]) <= KNOWN_WORST, r
    assert np.median([abs(r["error"]) for r in rows]) <= 0.10
    worst = max(abs(r["error"]) for r in rows)
    assert data["targets"]["held_out"] is (worst <= 0.25)  # reported as it is
    assert data["outside_ranges"] == []
