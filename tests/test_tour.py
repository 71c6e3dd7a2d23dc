"""`python -m refserve.tour`: one decode step traced, the student's table of contents.

The reference path's size is a promise (docs/architecture.md, "Reading one step"): one plain
decode step of 4 requests on the reference backend executes code in at most 12 files. The
line ceilings below are today's totals, so that the path cannot grow unnoticed; the goal
docs/architecture.md states is 450 distinct lines in files of 3,000 lines at most. The
reading list in docs/architecture.md is generated from the same trace
(`python -m refserve.tour --markdown`) and must match it."""

import re
from pathlib import Path

import pytest

from refserve import tour

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def reference_trace():
    return tour.trace_step(tour.decode_engine("numpy", 4))


@pytest.mark.slow
def test_one_decode_step_reads_in_few_files(reference_trace):
    t = reference_trace
    assert t.num_files <= 12, sorted(t.lines)
    assert t.num_lines <= 450
    assert t.num_file_lines <= 3000
    # Every stage of LLMEngine.step ran, in order, and the step reached the model.
    stages = list(dict.fromkeys(call.stage for call in t.calls))
    assert stages == ["step", *tour.STAGES]
    assert any(c.path == "refserve/models/llama.py" and c.name == "LlamaModel.forward"
               for c in t.calls)


@pytest.mark.slow
def test_the_reading_list_in_the_docs_is_the_trace(reference_trace):
    text = ARCHITECTURE.read_text()
    block = re.search(r"<!-- tour:begin -->\n(.*?)\n<!-- tour:end -->", text, re.S)
    assert block, "docs/architecture.md lost its tour block"
    assert block.group(1).strip() == tour.reading_list(reference_trace), (
        "the reference path changed: regenerate the reading list with "
        "`python -m refserve.tour --markdown` into docs/architecture.md")


def test_the_tracer_attributes_calls_to_the_stage_that_made_them(tiny_llama):
    """On the tiny model (fast): the stages appear in step() order, each call is listed
    once, and only refserve's own functions are listed."""
    from refserve import LLM, SamplingParams

    engine = LLM(model=str(tiny_llama), backend="numpy", progress=False).llm_engine
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4))
    engine.step()
    t = tour.trace_step(engine)
    assert list(dict.fromkeys(c.stage for c in t.calls)) == ["step", *tour.STAGES]
    keys = [(c.path, c.line) for c in t.calls]
    assert len(keys) == len(set(keys))
    assert all(c.path.startswith("refserve/") and "<" not in c.name for c in t.calls)
    assert t.num_lines == sum(len(v) for v in t.lines.values()) > 0
    step = next(c for c in t.calls if c.name == "Scheduler.schedule")
    assert step.stage == "schedule" and step.doc.startswith("One step's decision")
