"""WARMUP.md's quoted figures are what the named commands print today.

scripts/warmup_figures.py owns the list of figures and their commands; these tests run its
comparison: every marked output block and prose figure exactly (deterministic commands: the
simulator, the demos, the capacity arithmetic), the speculation war story's counted columns
exactly and its timed ones not at all, the benchmark tables against their recorded runs in
docs/bench/. A failure names the figure, the line that changed and the one command that
refreshes it: `python scripts/warmup_figures.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _load_script():
    """scripts/warmup_figures.py is a script, not a package module: load it by path."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "warmup_figures.py"
    spec = importlib.util.spec_from_file_location("warmup_figures", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


wf = _load_script()

pytestmark = pytest.mark.course


@pytest.fixture(scope="module")
def text() -> str:
    return wf.WARMUP.read_text()


def _report(stale) -> str:
    return ("WARMUP.md no longer matches its commands (after a code change, run "
            f"`{wf.REFRESH}` and review the diff):\n" + "\n".join(map(str, stale)))


def test_every_mark_names_a_figure_and_every_figure_is_quoted(text):
    assert wf.unknown_names(text) == []
    assert set(wf.BY_NAME) == wf.used_names(text)


def test_the_figures_that_need_no_model_reproduce(text):
    names = [f.name for f in wf.FIGURES if not f.loads_model]
    stale = wf.compare(text, wf.compute_all(names))
    assert not stale, _report(stale)


@pytest.mark.slow
def test_the_speculation_story_counts_reproduce(text):
    """Drafts proposed and accepted and tokens per target pass are compared; the seconds and
    speedups are wall-clock and masked."""
    names = [f.name for f in wf.FIGURES if f.loads_model]
    stale = wf.compare(text, wf.compute_all(names))
    assert not stale, _report(stale)


# ---- the comparison itself can fail, and says where ------------------------------------------

def test_a_changed_block_line_is_named_with_its_figure_and_command(text):
    results = wf.compute_all(["scheduler"])
    assert wf.compare(text, results) == []
    summary = results["scheduler"][0].split("\n")[-2]            # the static summary line
    broken = text.replace(summary, summary.replace(" steps,", "0 steps,"), 1)
    [stale] = wf.compare(broken, results)
    assert stale.figure.name == "scheduler" and "output block, line" in stale.where
    message = str(stale)
    assert "python -m refserve.scheduler" in message
    assert f"{wf.REFRESH} --only scheduler" in message


def test_a_changed_prose_figure_is_named(text):
    results = wf.compute_all(["scheduler"])
    value = results["scheduler"][1]["static_steps"]
    mark = f"<!-- scheduler.static_steps -->{value}<!-- / -->"
    assert mark in text
    [stale] = wf.compare(text.replace(mark, mark.replace(value, value + "1"), 1), results)
    assert stale.where == "prose scheduler.static_steps" and stale.printed == value


def test_rewrite_puts_back_what_the_commands_print(text):
    results = wf.compute_all(["scheduler", "block-table"])
    summary = results["scheduler"][0].split("\n")[-1]
    broken = text.replace(summary, "same outputs: False", 1)
    assert wf.compare(broken, results)
    assert wf.rewrite(broken, results) == text


def test_timed_columns_are_masked_and_counted_ones_are_not():
    fig = wf.BY_NAME["story-speculation"]
    row = "  quotes  n-gram      69        39   56.5%   2.56   4.78 s    2.55 s    1.87x"
    assert wf.masked(fig, row) == wf.masked(fig, row.replace("2.55 s", "3.01 s")
                                            .replace("1.87x", "1.59x"))
    # a wider timed value pads its column: the spacing is not a figure
    assert wf.masked(fig, row) == wf.masked(fig, row.replace(" 2.55 s", "12.55 s")
                                            .replace("  4.78 s", " 14.78 s"))
    assert wf.masked(fig, row) != wf.masked(fig, row.replace("  39 ", "  38 "))
    assert wf.masked(fig, row) != wf.masked(fig, row.replace("2.56", "2.51"))


def test_an_empty_block_does_not_swallow_the_next_one():
    text = ("<!-- figure scheduler -->\n```\n```\n\nprose\n\n<!-- figure radix -->\n```\n"
            "$ python -m refserve.kv_cache.radix_demo\n```\n")
    [m] = wf.BLOCK.finditer(text)      # the empty one is no block (so it reads as unquoted)
    assert m["name"] == "radix" and m["body"] == "$ python -m refserve.kv_cache.radix_demo"


def test_war_stories_rejects_an_unknown_story(capsys):
    from refserve.war_stories import main

    with pytest.raises(SystemExit) as e:
        main(["no-such-story"])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err
