"""The course's exercises: where each one is (a region between marker lines) and how it is
graded (`EXERCISES`).

The reference code marks the spots a student writes with comment lines:

    # BEGIN EXERCISE <name>: <hint>
    # ... <the hint, continued: what the region must leave defined>
    ... the reference solution (the answer key) ...
    # END EXERCISE

A hint says what to compute and what the code after the region reads (the value returned,
or the names left defined); it may continue on comment lines that start with `# ...` right
after the BEGIN line, which are part of the marker (the first joins the hint after "; ",
further ones continue its sentence).

A region is found by its markers, by name, wherever it lives: nothing here or in the grader
names the file an exercise is in, so code can move between files without breaking either.
A student copy (`refserve/course.py`) keeps the marker lines and replaces what is between
them by the region's stub, `raise NotImplementedError("exercise <name>: <hint>")`.

`EXERCISES` is the one table of how each exercise is graded: the mechanism it teaches (a
marker of tests/grading.py, the label of its row in the grade) and the reference test files
that catch a mistake in it. Its selection is those files, `-m "<mechanism> and not slow"`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent  # a source checkout: tests/ and notebooks/ live here
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN EXERCISE (?P<name>[a-z][a-z0-9_]*)"
                   r"(?::\s*(?P<hint>.*\S))?\s*$")
HINT_MORE = re.compile(r"^[ \t]*# \.\.\.\s*(?P<more>.*\S)\s*$")
END = re.compile(r"^[ \t]*# END EXERCISE\s*$")
# Files whose text shows the markers as an example and holds no region.
NO_REGIONS = ("course.py", "course_exercises.py", "course_grade.py")


@dataclass(frozen=True)
class Grading:
    """How one exercise is graded: `mechanism` (its row's label, a tests/grading.py marker)
    and the test files that catch it, run with `-m "<mechanism> and not slow"`."""

    mechanism: str
    test_files: tuple[str, ...]

    @property
    def marker_expression(self) -> str:
        return f"{self.mechanism} and not slow"


# Every exercise region in the reference, and how the course grades it, in course order.
EXERCISES: dict[str, Grading] = {
    "blocks_for_tokens": Grading("capacity", ("tests/test_capacity.py",)),
    "append_rule": Grading("block_table", ("tests/test_block_table.py",)),
    "allocator_decref": Grading("allocator", ("tests/test_block_allocator.py",)),
    "copy_on_write": Grading("cow", ("tests/test_prefix_cache.py",)),
    "prefix_cache_lookup": Grading("prefix_cache", ("tests/test_prefix_cache.py",)),
    "paged_attention_gather": Grading("paged_attention", ("tests/test_paged_attention.py",)),
    "runner_prepare": Grading("prepare", ("tests/test_model_runner.py",)),
    "scheduler_admit": Grading("scheduler", ("tests/test_scheduler.py",)),
    "scheduler_preempt": Grading("preemption", ("tests/test_scheduler.py",)),
    "stop_rules": Grading("scheduler", ("tests/test_stop_rules.py",)),
    "accept_residual": Grading("spec_accept", ("tests/test_spec_rejection_sampler.py",)),
    "ngram_proposal": Grading("spec_propose", ("tests/test_spec_ngram.py",)),
}


@dataclass(frozen=True)
class Region:
    """Lines [begin, end] (0-based, both marker lines included) of `path`: the BEGIN line,
    its `hint_lines` continuation lines, the body, the END line."""

    name: str
    hint: str
    path: Path  # relative to the package's parent (e.g. refserve/capacity.py)
    begin: int
    end: int
    indent: str
    hint_lines: int = 0

    @property
    def body_start(self) -> int:
        """The body's first line (after the BEGIN line and the hint's continuation)."""
        return self.begin + 1 + self.hint_lines

    def stub(self) -> str:
        message = f"exercise {self.name}: {self.hint}" if self.hint else f"exercise {self.name}"
        return f"{self.indent}raise NotImplementedError({message!r})\n"

    def body(self, lines: list[str]) -> list[str]:
        """The lines between the markers, from the file's `lines` (with line ends)."""
        return lines[self.body_start:self.end]

    def is_stub(self, lines: list[str]) -> bool:
        """The region holds only its stub (what make-student wrote): not written yet."""
        body = [line.strip() for line in self.body(lines) if line.strip()]
        return body == [self.stub().strip()]


def find_regions(package_dir: Path = PACKAGE_DIR) -> list[Region]:
    """Every exercise region under `package_dir`, in file then line order. Raises ValueError
    on a BEGIN without END (or the reverse), a nested BEGIN, or a name used twice."""
    regions: list[Region] = []
    for path in sorted(package_dir.rglob("*.py")):
        if path.name in NO_REGIONS or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(package_dir.parent)
        lines = path.read_text().splitlines(keepends=True)
        open_at: Region | None = None  # BEGIN read, END not yet (its `end` unknown: -1)
        for i, line in enumerate(lines):
            if open_at is not None and open_at.body_start == i and (
                    more := HINT_MORE.match(line)):
                # The first continuation is a new clause, later ones continue its sentence.
                sep = "; " if open_at.hint_lines == 0 and open_at.hint else " "
                open_at = replace(open_at, hint=open_at.hint + sep + more["more"],
                                  hint_lines=open_at.hint_lines + 1)
                continue
            match = BEGIN.match(line)
            if line.lstrip().startswith("# BEGIN EXERCISE") and match is None:
                raise ValueError(f"{rel}:{i + 1}: malformed marker; write "
                                 "'# BEGIN EXERCISE <name>: <hint>' (name: a-z, 0-9, _)")
            if match:
                if open_at is not None:
                    raise ValueError(f"{rel}:{i + 1}: BEGIN EXERCISE inside the region opened "
                                     f"at line {open_at.begin + 1}")
                open_at = Region(match["name"], match["hint"] or "", rel, i, -1,
                                 match["indent"])
            elif END.match(line):
                if open_at is None:
                    raise ValueError(f"{rel}:{i + 1}: END EXERCISE without BEGIN")
                regions.append(replace(open_at, end=i))
                open_at = None
        if open_at is not None:
            raise ValueError(f"{rel}:{open_at.begin + 1}: BEGIN EXERCISE without END EXERCISE")
    names = [r.name for r in regions]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"exercise name(s) used twice: {twice}")
    return regions


def replace_body(text: str, region: Region, body: list[str], indent: str | None = None) -> str:
    """`text` (the file holding `region`) with the region's inside replaced by `body`, the
    markers kept. `indent`: the indentation `body` was written at (default: the region's);
    it is moved to the region's, so a body fits a region that moved to another depth."""
    if indent is not None and indent != region.indent:
        body = [region.indent + line[len(indent):] if line.startswith(indent) else line
                for line in body]
    if body and not body[-1].endswith("\n"):
        body = [*body[:-1], body[-1] + "\n"]
    lines = text.splitlines(keepends=True)
    lines[region.body_start:region.end] = body
    return "".join(lines)


def blank_regions(text: str, regions: list[Region]) -> str:
    """`text` (one file) with each region's inside replaced by its stub, markers kept."""
    for r in sorted(regions, key=lambda r: r.begin, reverse=True):  # bottom up: lines shift
        text = replace_body(text, r, [r.stub()])
    return text
