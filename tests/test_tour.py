"""`python -m refserve.tour`: one decode step traced, the student's table of contents.

The reference path's size is a promise (docs/architecture.md, "Reading one step"): one plain
decode step of 4 requests on the reference backend executes code in at most 13 files (the
scheduler's records, scheduler/output.py, among them: the step reads a row's own `end`), and
what a student reads is bounded twice: the statements the step executes, and the lines of
the files it touches. Statements, not physical lines: a long line split in two, or a
statement spread over lines for clarity, counts once. Every bound keeps headroom over
today's totals (docs/architecture.md gives them), so a clearer line is never a failure and
the path still cannot grow unnoticed. The reading list in docs/architecture.md is generated
from the same trace (`python -m refserve.tour --markdown`) and must match it."""

import re
from pathlib import Path

import pytest

from refserve import tour

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# Today: 13 files, 430 statements, 2,992 lines held (docs/architecture.md).
MAX_FILES = 14
MAX_STATEMENTS = 520
MAX_FILE_LINES = 3300


@pytest.fixture(scope="module")
def reference_trace():
    return tour.trace_step(tour.decode_engine("numpy", 4))


@pytest.mark.slow
def test_one_decode_step_reads_in_few_files(reference_trace):
    t = reference_trace
    assert t.num_files <= MAX_FILES, sorted(t.lines)
    assert t.num_statements <= MAX_STATEMENTS
    assert t.num_file_lines <= MAX_FILE_LINES
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
    assert 0 < t.num_statements <= t.num_lines
    step = next(c for c in t.calls if c.name == "Scheduler.schedule")
    assert step.stage == "schedule" and step.doc.startswith("One step's decision")


def test_a_statement_counts_once_however_many_lines_it_spans(tmp_path, monkeypatch):
    """The count is of statements: a call split over three lines, a decorated function and
    a one-line `if` body each map every line they hold to one statement."""
    source = ("import functools\n"          # 1
              "@functools.cache\n"          # 2
              "def f(a,\n"                  # 3
              "      b):\n"                 # 4
              "    x = max(a,\n"            # 5
              "            b)\n"            # 6
              "    if x: return x\n"        # 7
              "    return 0\n")             # 8
    (tmp_path / "refserve").mkdir()
    (tmp_path / "refserve" / "m.py").write_text(source)
    monkeypatch.setattr(tour, "PACKAGE", tmp_path / "refserve")
    tour.statement_of_line.cache_clear()
    try:
        owner = tour.statement_of_line("refserve/m.py")
    finally:
        tour.statement_of_line.cache_clear()
    assert owner[2] == owner[3] == owner[4] == 2     # the def, from its decorator
    assert owner[5] == owner[6] == 5                  # one assignment over two lines
    assert owner[7] == 7 and owner[8] == 8
    trace = tour.Trace()
    trace.lines["refserve/m.py"] = {2, 5, 6, 7}
    monkeypatch.setattr(tour, "statement_of_line", lambda path: owner)
    assert trace.statements("refserve/m.py") == {2, 5, 7} and trace.num_lines == 4
