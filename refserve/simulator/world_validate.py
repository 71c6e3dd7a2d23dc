"""Validation that means prediction: refit without a whole source (or engine), predict it.

A held-out row beside its fit rows (the same table, GPU, model and engine, one setting
apart) tests interpolation, not prediction. The headline test here leaves a whole group
out and refits from the pre-fit defaults (the priors of bounds.toml) on everything else:

    leave-one-source-out   every row of one public source is predicted by constants
                           fitted on the other sources only
    leave-one-engine-out   every row of one engine profile likewise (its host terms stay
                           at their priors: nothing else measured that engine)

`held_out_within_source` judges the shipped constants (fitted on the rows not in
world.HELD_OUT) on the held-out rows: the second, weaker table.
"""

from __future__ import annotations

import numpy as np

from refserve.simulator.world import Constants, Measurement
from refserve.simulator.world_fit import fit
from refserve.simulator.world_replay import replay

GROUPINGS = {"source": lambda m: m.source_key, "engine": lambda m: m.engine_profile}
# Rounds of each refit (simulate the online runs, solve): their schedules settle in two or
# three (the shipped fit's median |error| moves by <= 0.5 points after its third round).
REFIT_ROUNDS = 3


def leave_one_out(measurements: list[Measurement], by: str, scale: float = 1.0,
                  on_group=None, rounds: int = REFIT_ROUNDS) -> list[dict]:
    """One row per measurement: its error predicted by a fit on every other group
    (`by`: "source" or "engine"). `on_group(group, fit_report)` after each refit."""
    group_of = GROUPINGS[by]
    out = []
    for group in sorted({group_of(m) for m in measurements}):
        train = [m for m in measurements if group_of(m) != group]
        report = fit(train, scale=scale, max_rounds=rounds)
        if on_group is not None:
            on_group(group, report)
        for m in measurements:
            if group_of(m) == group:
                r = replay(m, report.constants, scale)
                out.append(_row(m, r.predicted, group))
    return out


def held_out_within_source(measurements: list[Measurement], constants: Constants | None = None,
                           scale: float = 1.0) -> list[dict]:
    """The held-out rows (world.HELD_OUT) predicted by `constants` (default: shipped)."""
    constants = constants or Constants()
    return [_row(m, replay(m, constants, scale).predicted, m.source_key)
            for m in measurements if m.role == "held-out"]


def _row(m: Measurement, predicted: float, group: str) -> dict:
    return {"group": group, "id": m.id, "source": m.source_key, "engine": m.engine_profile,
            "metric": m.metric, "published": m.value, "predicted": predicted,
            "error": (predicted - m.value) / m.value}


def summarize(rows: list[dict], by: str = "group") -> dict:
    """{group: {rows, median_abs_error, max_abs_error}} and "all" over every row."""
    out = {}
    for group in [*sorted({r[by] for r in rows}), "all"]:
        errs = np.abs([r["error"] for r in rows if group == "all" or r[by] == group])
        out[group] = {"rows": len(errs),
                      "median_abs_error": float(np.median(errs)) if len(errs) else None,
                      "max_abs_error": float(np.max(errs)) if len(errs) else None}
    return out


__all__ = ["GROUPINGS", "held_out_within_source", "leave_one_out", "summarize"]
