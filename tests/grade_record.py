"""Recording one exercise's run for the course grader (tests/grading.py, job 3): what
refserve/course_grade.py reads back from `pytest --grade-record PATH`.

Three pieces: a deterministic Hypothesis profile that reports one bug per test
(`load_grading_profile`), one plain line per failure (`plain_line`: the assertion, a
Hypothesis falsifying example folded in, never an exception group), and the `Recorder`
plugin that writes each event as a JSON line the moment it happens.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

# Skip reasons that mean "this machine cannot run a GPU check" (lower-cased): the convention
# ("no GPU ..."), a failed pytest.importorskip("cupy") (cupy exists only for GPUs), and a
# missing CUDA toolkit ("nvcc (CUDA toolkit) is not installed").
_BLOCKED_REASONS = re.compile(
    r"^no gpu|could not import 'cupy|\b(nvcc|cuda)\b.*\bnot (installed|available|found)")
# An exercise stub's NotImplementedError in a failure report (the raise line or its message,
# or a command line's `error: exercise NAME: ...`), and the terminal's colour codes around it.
_EXERCISE_STUB = re.compile(r"(?:NotImplementedError\W{1,4}|error: )exercise ([a-z][a-z0-9_]*)")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def exercises_not_done(report_text: str) -> set[str]:
    """The exercises whose stub (NotImplementedError "exercise NAME: ...") a failure shows."""
    return set(_EXERCISE_STUB.findall(_ANSI.sub("", report_text)))


def is_blocked(reason: str) -> bool:
    """A skip reason that means "this machine has no GPU" (tests/grading.py, job 4)."""
    text = reason.strip().removeprefix("Skipped:").strip().lower()
    return bool(_BLOCKED_REASONS.search(text))


# Deterministic (the same examples on every run, no example database carried between runs)
# and one bug per test (no exception group); a slow machine is no reason to fail a student.
GRADING_PROFILE = dict(derandomize=True, database=None, report_multiple_bugs=False,
                       deadline=None, print_blob=False)
_EXAMPLE_NOTE = re.compile(r"^(?:Falsifying (?:explicit )?example|Failing test case)s?:\s*")
_NOTE_SECTION = re.compile(r"^(?:[A-Z][A-Za-z ]*:\s*(?:\n|$)|You can )")  # "Explanation:"
# The message's first lines (an assert and pytest's "where" line, numpy's mismatch counts),
# and the folded example, each cut to a length a terminal line can show.
MAX_LINES, MAX_MESSAGE_CHARS, MAX_EXAMPLE_CHARS = 4, 240, 300
GRADE_INDEX = pytest.StashKey[int]()  # a test's place in the selection, before sharding


def load_grading_profile() -> None:
    """Load GRADING_PROFILE before any test module is imported: a test's own @settings take
    what they do not set from the profile loaded when the module runs."""
    from hypothesis import HealthCheck, Phase, settings

    # No explain phase: its report is a list of source lines, and it costs a rerun.
    phases = [Phase.explicit, Phase.generate, Phase.target, Phase.shrink]
    settings.register_profile("refserve-grading", suppress_health_check=[HealthCheck.too_slow],
                              phases=phases, **GRADING_PROFILE)
    settings.load_profile("refserve-grading")


def fold_example(text: str) -> str:
    """A Hypothesis example (a call over several lines, or a state machine's steps) on one
    line: `test_x(a=0, b=-50)`, `state = M(); state.add(k=2); ...`."""
    out, depth = "", 0
    for line in (re.sub(r"\s+# .*$", "", line).strip() for line in text.splitlines()):
        if not line or line == "<state machine>":
            continue
        out += ("" if not out or out.endswith("(") else " " if depth else "; ") + line
        depth += line.count("(") + line.count("[") - line.count(")") - line.count("]")
    out = re.sub(r",\s*([)\]])", r"\1", out)
    return out if len(out) <= MAX_EXAMPLE_CHARS else out[:MAX_EXAMPLE_CHARS - 4] + " ..."


def plain_line(exc: BaseException) -> str:
    """One line for a failure: the exception's type and its message's first lines joined
    with "; ", then a Hypothesis falsifying example folded in. An exception group (several
    bugs, or Hypothesis' flaky failure) is read through its first exception."""
    flaky = ""
    while isinstance(getattr(exc, "exceptions", None), tuple) and exc.exceptions:
        if "Flaky" in type(exc).__name__:
            flaky = " (it did not fail again when Hypothesis replayed it)"
        exc = exc.exceptions[0]
    lines = []
    for text in (" ".join(line.split()) for line in str(exc).splitlines()):
        if text.startswith(("Full diff", "Use -v", "Omitting ")) or len(lines) == MAX_LINES:
            break
        if text:
            lines.append(text)
    message = ""
    for text in lines:  # a line that ends in ":" introduces the next one
        message += ("" if not message else " " if message.endswith(":") else "; ") + text
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS - 4] + " ..."
    line = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    notes = list(getattr(exc, "__notes__", ()))
    for i, note in enumerate(notes):
        match = _EXAMPLE_NOTE.match(note)
        if match:  # the example: this note and (a state machine's steps) the next ones
            steps = [note[match.end():]]
            for more in notes[i + 1:]:
                if _NOTE_SECTION.match(more):
                    break
                steps.append(more)
            line += f" (falsifying example: {fold_example(chr(10).join(steps))})"
            break
    return line + flaky


def last_error_line(text: str) -> str:
    """The last `E   ...` line of a pytest report (a collection error), else its last line."""
    lines = [line.strip() for line in _ANSI.sub("", text).splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors or lines or ["(no report)"])[-1]


class Recorder:
    """--grade-record PATH: what refserve/course_grade.py reads back from one exercise's
    run, one JSON object a line, written as it happens (a run stopped by the grader's
    timeout still says which test was running):

        {"selected": N}                                        after collection
        {"start": NODEID}                                      a test begins
        {"test": NODEID, "index": I, "outcome": O, "line": L, "not_done": [EXERCISE, ...]}
        {"collect_error": NODEID, "line": L, "not_done": [...]}

    I: the test's place in the selection (`--grade-shard I/N` runs every Nth from I);
    O: passed, failed, skipped or blocked (a "no GPU" skip); L: the first failure of the
    test in one plain line ("" unless failed); not_done: the exercise stubs it reached."""

    def __init__(self, path: Path, shard: int = 0, shards: int = 1) -> None:
        self.file = path.open("a", buffering=1)
        self.shard, self.shards = shard, shards
        self.tests: dict[str, dict] = {}

    def write(self, **event) -> None:
        self.file.write(json.dumps(event) + "\n")

    def pytest_collectreport(self, report):
        if report.failed:
            text = report.longreprtext
            self.write(collect_error=report.nodeid or "(the command line)",
                       line=last_error_line(text), not_done=sorted(exercises_not_done(text)))

    @pytest.hookimpl(trylast=True)  # after -m has deselected: shards split what is left
    def pytest_collection_modifyitems(self, config, items):
        for index, item in enumerate(items):
            item.stash[GRADE_INDEX] = index
        if self.shards > 1:
            config.hook.pytest_deselected(items=[item for i, item in enumerate(items)
                                                 if i % self.shards != self.shard])
            items[:] = items[self.shard::self.shards]

    def pytest_collection_finish(self, session):
        self.write(selected=len(session.items))

    def pytest_runtest_logstart(self, nodeid, location):
        self.write(start=nodeid)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        report.grade_index = item.stash.get(GRADE_INDEX, -1)
        if report.failed and call.excinfo is not None:
            report.plain_line = plain_line(call.excinfo.value)
        return report

    def pytest_runtest_logreport(self, report):
        test = self.tests.setdefault(report.nodeid, {"outcome": None, "line": "",
                                                     "not_done": set()})
        if report.failed and test["outcome"] != "failed":
            test["outcome"] = "failed"
            test["line"] = getattr(report, "plain_line", None) or last_error_line(
                report.longreprtext)
        if report.failed:
            test["not_done"] |= exercises_not_done(report.longreprtext)
        elif report.skipped and test["outcome"] is None:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            test["outcome"] = ("blocked" if is_blocked(reason) and not hasattr(report, "wasxfail")
                               else "skipped")
        elif report.passed and report.when == "call" and test["outcome"] is None:
            test["outcome"] = "passed"
        if report.when == "teardown":
            self.write(test=report.nodeid, index=getattr(report, "grade_index", -1),
                       outcome=test["outcome"] or "passed", line=test["line"],
                       not_done=sorted(test["not_done"]))

    def pytest_unconfigure(self, config):
        self.file.close()
