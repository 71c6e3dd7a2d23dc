"""The course machinery: exercise regions, student copies (`python -m refserve.course
make-student DIR`), grading a copy exercise by exercise (`python -m refserve.course grade
DIR`, `pytest --impl DIR --grade`), and the notebooks' sources.

The central promise: each exercise is graded alone inside the reference, so its row depends
on that exercise only. A blank one reads "not done yet" on its own row, a correct one
passes its row whatever else is blank, and a plausible wrong one (tests/course_mutants.py)
fails its own row with one plain line and no other row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import grading
import pytest
from course_mutants import MUTANTS, mutate

from refserve import course, course_grade
from refserve.course_exercises import find_regions, replace_body

ROOT = Path(__file__).resolve().parents[1]
MIN_EXERCISES = 8
# What a stale mutant fails with (it names something the region no longer has): not a
# caught mistake.
STALE = ("SyntaxError", "NameError", "UnboundLocalError", "AttributeError", "ImportError",
         "ModuleNotFoundError")


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("REFSERVE_IMPL", "PYTHONPATH")}


def put_body(copy: Path, name: str, body: str) -> None:
    """Write `body` (indented from column 0) into exercise `name`'s region of `copy`."""
    region = {r.name: r for r in find_regions(copy / "refserve")}[name]
    path = copy / region.path
    path.write_text(replace_body(path.read_text(), region, body.splitlines(keepends=True), ""))


def put_mistake(copy: Path, name: str, old: str, new: str) -> None:
    """Edit exercise `name`'s region of `copy` (a copy of the reference's) into a mistake
    (tests/course_mutants.py)."""
    region = {r.name: r for r in find_regions(copy / "refserve")}[name]
    lines = (copy / region.path).read_text().splitlines(keepends=True)
    body = "".join(line.removeprefix(region.indent) for line in region.body(lines))
    put_body(copy, name, mutate(body, old, new))


def rows_by_name(rows) -> dict[str, course_grade.Row]:
    return {row.exercise: row for row in rows}


# ---- regions and the generator -----------------------------------------------------------


def test_regions_are_well_formed_and_each_has_a_grader():
    regions = course.find_regions()
    names = [r.name for r in regions]
    assert len(names) >= MIN_EXERCISES, f"only {len(names)} exercise regions: {names}"
    assert sorted(names) == sorted(course.EXERCISES), (
        "every region needs an EXERCISES entry (its mechanism and test files) and vice versa")
    assert sorted(MUTANTS) == sorted(course.EXERCISES), "every exercise needs wrong bodies"
    for r in regions:
        assert r.hint, f"exercise {r.name} ({r.path}) has no hint on its BEGIN line"
        assert r.end - r.begin >= 2, f"exercise {r.name} has an empty region"
        g = course.EXERCISES[r.name]
        assert g.mechanism in grading.MECHANISMS, f"exercise {r.name}: unknown {g.mechanism}"
        for f in g.test_files:
            assert (ROOT / f).is_file(), f"exercise {r.name}: no test file {f}"


def test_blank_regions_keeps_markers_and_indentation():
    text = ("def f(x):\n    y = 1\n    # BEGIN EXERCISE demo: add one\n    y = x + 1\n"
            "    return y\n    # END EXERCISE\n")
    region = course.Region("demo", "add one", Path("m.py"), 2, 5, "    ")
    out = course.blank_regions(text, [region])
    assert out == ("def f(x):\n    y = 1\n    # BEGIN EXERCISE demo: add one\n"
                   "    raise NotImplementedError('exercise demo: add one')\n"
                   "    # END EXERCISE\n")


def test_a_hint_continues_on_its_marker_lines_and_stays_in_the_copy(tmp_path):
    """`# ...` lines right after BEGIN continue the hint (what the region leaves defined):
    they are part of the marker, so the stub replaces only the body below them."""
    package = tmp_path / "pkg"
    package.mkdir()
    text = ("def f(x):\n    # BEGIN EXERCISE demo: add one\n    # ... leave y defined\n"
            "    # ... (an int)\n    y = x + 1\n    # END EXERCISE\n    return y\n")
    (package / "m.py").write_text(text)
    (region,) = course.find_regions(package)
    assert region.hint == "add one; leave y defined (an int)"
    assert (region.begin, region.body_start, region.end) == (1, 4, 5)
    assert course.blank_regions(text, [region]).splitlines()[1:6] == [
        "    # BEGIN EXERCISE demo: add one", "    # ... leave y defined", "    # ... (an int)",
        f"    raise NotImplementedError({'exercise demo: ' + region.hint!r})",
        "    # END EXERCISE"]


@pytest.mark.parametrize("text, message", [
    ("# BEGIN EXERCISE a: x\npass\n", "without END"),
    ("pass\n# END EXERCISE\n", "without BEGIN"),
    ("# BEGIN EXERCISE a: x\n# BEGIN EXERCISE b: y\n# END EXERCISE\n", "inside the region"),
    ("# BEGIN EXERCISE Bad-Name\n# END EXERCISE\n", "malformed"),
])
def test_malformed_regions_are_refused(tmp_path, text, message):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(text)
    with pytest.raises(ValueError, match=message):
        course.find_regions(package)


def test_cli_refuses_bad_input(tmp_path, capsys):
    assert course.main(["make-student", str(tmp_path / "a"), "--only", "no_such"]) == 2
    assert "error: unknown exercise(s) ['no_such']" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert course.main(["make-student", str(tmp_path / "full")]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_student_copy_imports_and_every_region_is_blanked(tmp_path):
    dest = tmp_path / "student"
    names = course.make_student(dest)
    assert sorted(names) == sorted(course.EXERCISES)
    blanked = {r.name: r for r in course.find_regions(dest / "refserve")}
    assert sorted(blanked) == sorted(names)
    for r in blanked.values():
        lines = (dest / r.path).read_text().splitlines(keepends=True)
        assert lines[r.body_start:r.end] == [r.stub()], (
            f"exercise {r.name}: the copy's region must hold only the stub, got "
            f"{lines[r.body_start:r.end]}")
    for extra in ("tests/grading.py", "notebooks/build_notebooks.py", "pyproject.toml",
                  "EXERCISES.md"):
        assert (dest / extra).is_file(), f"the student copy lacks {extra}"
    # The skeleton imports: every module of the package, from the copy, not the reference.
    code = ("import importlib, pkgutil, refserve\n"
            f"assert refserve.__file__.startswith({str(dest)!r}), refserve.__file__\n"
            "skip = ('refserve.serve', 'refserve.entrypoints', 'refserve.bench')\n"
            "for m in pkgutil.walk_packages(refserve.__path__, 'refserve.'):\n"
            "    if not m.name.startswith(skip) and not m.name.endswith('__main__'):\n"
            "        importlib.import_module(m.name)\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(dest)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_impl_option_refuses_a_folder_without_refserve(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest", "--impl", str(tmp_path),
                           "tests/test_block_table.py", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stdout[-1000:] + proc.stderr[-1000:]
    assert "is not a refserve package" in proc.stdout + proc.stderr


# ---- grading: each exercise alone inside the reference -------------------------------------


def test_the_readme_grade_of_a_fresh_copy_reads_not_done_yet_on_every_row(tmp_path):
    """`pytest --impl DIR -m "not slow" --grade` (with a space, as the README writes it) on
    an untouched copy: one row per exercise, each "not done yet", nothing else."""
    dest = tmp_path / "student"
    course.make_student(dest)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--impl", str(dest), "-m",
                           "not slow", "--grade", "--grade-json", str(tmp_path / "g.json")],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    table = proc.stdout.splitlines()
    for name, g in course.EXERCISES.items():
        assert [line.split() for line in table if line.split()[:1] == [name]] == \
            [[name, g.mechanism, "-", "not", "done", "yet"]]
    assert f"{len(course.EXERCISES)} not done yet" in proc.stdout
    report = json.loads((tmp_path / "g.json").read_text())
    assert report["copy"] == str(dest.resolve()) and report["reference"] == str(ROOT)
    assert report["exit_status"] == 1 and list(report["exercises"]) == list(course.EXERCISES)
    assert report["summary"] == {"pass": 0, "fail": 0, "not done yet": len(course.EXERCISES),
                                 "timed out": 0}
    row = report["exercises"]["append_rule"]
    assert row["mechanism"] == "block_table" and row["failed_test"] is None
    assert row["command"] == f"python -m refserve.course grade {dest.resolve()} " \
                             "--exercise append_rule"


def test_one_correct_one_wrong_one_blank_exercise_each_reads_on_its_own_row(tmp_path):
    """append_rule correct, allocator_decref wrong, the rest blank: append_rule passes
    though the allocator and blocks_for_tokens it sits beside are not right, the wrong one
    fails with its assertion in one line, the blank one is not done yet."""
    dest = tmp_path / "student"
    course.make_student(dest, only=[n for n in course.EXERCISES
                                    if n not in ("append_rule", "allocator_decref")])
    put_mistake(dest, "allocator_decref", *MUTANTS["allocator_decref"][0][1:])
    names = ["append_rule", "allocator_decref", "blocks_for_tokens"]
    proc = subprocess.run([sys.executable, "-m", "refserve.course", "grade", str(dest),
                           *(f"--exercise={n}" for n in names), "--grade-json",
                           str(tmp_path / "g.json"), "-v"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "g.json").read_text())["exercises"]
    assert list(rows) == names
    append = rows["append_rule"]
    assert append["status"] == "pass" and append["passed"] == append["selected"] > 0
    wrong = rows["allocator_decref"]
    assert wrong["status"] == "fail" and wrong["failed_test"].startswith(
        "tests/test_block_allocator.py::")
    assert wrong["line"] == "Failed: DID NOT RAISE ValueError", wrong["line"]
    assert f"    {wrong['failed_test']}: {wrong['line']}" in proc.stdout.splitlines()
    # -v: pytest's own report of the rows that do not pass, after the table.
    report = proc.stdout.split("---- allocator_decref: pytest's report ----\n")[1]
    assert wrong["failed_test"].split("::")[1] in report
    assert "---- append_rule:" not in proc.stdout
    assert rows["blocks_for_tokens"]["status"] == "not done yet"
    # The row says where the first failure is and what passed before it.
    assert wrong["failed_at"] == wrong["passed"] + 1 and wrong["failed"] == 1
    assert (f"{'allocator_decref':<24}{'allocator':<17}{'-':>7}  FAIL at test "
            f"{wrong['failed_at']} of {wrong['selected']} ({wrong['passed']} passed before it)"
            ) in proc.stdout.splitlines()
    # One exercise alone on 2 cores: its tests split in two processes, and the failure
    # reported is still the first in collection order, with the same counts.
    (sharded,) = course_grade.grade(dest, ["allocator_decref"], jobs=2)
    assert (sharded.failed_test, sharded.line, sharded.failed_at, sharded.passed,
            sharded.selected) == (wrong["failed_test"], wrong["line"], wrong["failed_at"],
                                  wrong["passed"], wrong["selected"])
    # This checkout graded the same way: its own regions pass.
    (row,) = course_grade.grade(None, ["append_rule"])
    assert row.status == "pass" and row.command == course_grade.grade_command(None,
                                                                              "append_rule")


def test_a_failing_row_counts_what_ran_before_its_first_failure_however_split(tmp_path):
    """Each shard stops at its own first failure; the row counts the tests before the first
    failure overall, which every shard ran, so one split or two read the same."""
    def record(path, events):
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        return path

    def test(index, outcome):
        return {"test": f"t.py::t{index}", "index": index, "outcome": outcome,
                "line": f"AssertionError: t{index}" if outcome == "failed" else "",
                "not_done": []}

    two = [record(tmp_path / "a.jsonl", [{"selected": 3}, test(0, "passed"),
                                         test(2, "skipped"), test(4, "failed")]),
           record(tmp_path / "b.jsonl", [{"selected": 3}, test(1, "passed"),
                                         test(3, "failed")])]
    one = [record(tmp_path / "c.jsonl", [{"selected": 6}, test(0, "passed"),
                                         test(1, "passed"), test(2, "skipped"),
                                         test(3, "failed")])]
    rows = []
    for records in (two, one):
        row = course_grade.Row("demo", "capacity")
        course_grade.read_records(records, row, "demo")
        rows.append(row)
        assert (row.failed_at, row.passed, row.skipped, row.failed, row.selected) == \
            (4, 2, 1, 1, 6)
        assert row.failed_test == "t.py::t3" and row.line == "AssertionError: t3"
        assert row.shown_status(60) == "FAIL at test 4 of 6 (2 passed, 1 skipped before it)"
    assert course_grade.format_table(rows[:1], 60)[1].split()[2] == "-"


def test_the_hybrid_is_the_reference_but_for_the_one_region(tmp_path):
    dest = tmp_path / "student"
    course.make_student(dest)
    reference = {r.name: r for r in find_regions()}["copy_on_write"]
    student = {r.name: r for r in find_regions(dest / "refserve")}["copy_on_write"]
    body = [student.indent + "new_block = self._take_block()  # the student's\n"]
    hybrid = course_grade.build_hybrid(tmp_path / "h", reference, body, student.indent)
    for path in sorted((ROOT / "refserve").rglob("*.py")):
        rel = path.relative_to(ROOT)
        text = (hybrid / rel).read_text()
        if rel != reference.path:
            assert text == path.read_text(), f"{rel} differs from the reference"
            continue
        ours, theirs = path.read_text().splitlines(), text.splitlines()
        assert theirs[:reference.body_start] == ours[:reference.body_start]
        assert theirs[reference.body_start] == body[0].rstrip("\n")
        assert theirs[reference.body_start + 1:] == ours[reference.end:]


def test_a_region_that_does_not_compile_fails_its_row_and_says_where(tmp_path):
    dest = tmp_path / "student"
    course.make_student(dest)
    put_body(dest, "blocks_for_tokens", "x = 1\nreturn (num_tokens +\n")
    (row,) = course_grade.grade(dest, ["blocks_for_tokens"])
    region = {r.name: r for r in find_regions(dest / "refserve")}["blocks_for_tokens"]
    assert row.status == "fail" and row.line.startswith("SyntaxError: ")
    assert row.line.endswith(f"({dest.resolve() / region.path}:{region.body_start + 2})"), \
        row.line


def test_an_exercise_that_hangs_fails_as_timed_out(tmp_path):
    dest = tmp_path / "student"
    course.make_student(dest)
    put_body(dest, "blocks_for_tokens", "while True:\n    pass\n")
    (row,) = course_grade.grade(dest, ["blocks_for_tokens"], timeout_s=8)
    assert row.status == "timed out" and row.shown_status(8) == "timed out after 8 s"
    assert row.line.startswith("timed out after 8 s"), row.line
    assert row.line == "timed out after 8 s" or row.line.startswith(
        "timed out after 8 s in tests/test_capacity.py::"), row.line
    assert row.duration_s < 30


def test_bad_copies_and_names_are_refused_before_any_test_runs(tmp_path):
    def refused(copy, names=None) -> str:
        with pytest.raises(ValueError) as e:
            course_grade.grade(copy, names)
        return str(e.value)

    assert "no such folder" in refused(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "is not a student copy" in refused(tmp_path / "empty")
    dest = tmp_path / "student"
    course.make_student(dest)
    assert f"give the folder that holds it ({dest})" in refused(dest / "refserve")
    assert "unknown exercise(s) ['no_such']" in refused(dest, ["no_such"])
    region = {r.name: r for r in find_regions(dest / "refserve")}["append_rule"]
    path = dest / region.path
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:region.begin] + lines[region.end + 1:]))  # markers gone
    message = refused(dest)
    assert "exercise append_rule has no region" in message and "put back" in message
    assert str(region.path) in message
    assert course_grade.grade(dest, ["blocks_for_tokens"])[0].status == "not done yet"
    lines[region.begin] = "# BEGIN EXERCISE Append-Rule\n"
    path.write_text("".join(lines))
    message = refused(dest, ["blocks_for_tokens"])
    assert f"{region.path}:{region.begin + 1}: malformed marker" in message
    assert "put the marker lines back" in message


def test_the_command_line_refuses_with_one_error_line(tmp_path):
    for args, message in [([str(tmp_path / "nowhere")], "no such folder"),
                          (["--timeout", "0"], "--timeout 0: must be > 0"),
                          (["--jobs", "0"], "--jobs 0: must be >= 1"),
                          (["--grade-json", str(tmp_path)], "is a folder")]:
        proc = subprocess.run([sys.executable, "-m", "refserve.course", "grade", *args],
                              cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
        assert message in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_grading_from_inside_a_student_copy_is_refused(tmp_path):
    """Inside the copy, `python -m refserve.course` is the copy's own (blank) refserve: it
    cannot be the reference, and says where to run instead."""
    dest = tmp_path / "student"
    course.make_student(dest)
    proc = subprocess.run([sys.executable, "-m", "refserve.course", "grade", "."], cwd=dest,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "is a student copy" in proc.stderr and "reference checkout" in proc.stderr


def test_the_sheet_and_list_give_the_one_command_per_exercise(tmp_path, capsys):
    dest = tmp_path / "student"
    course.make_student(dest)
    sheet = (dest / "EXERCISES.md").read_text()
    for name in course.EXERCISES:
        assert f"`python -m refserve.course grade {dest.resolve()} --exercise {name}`" in sheet
    assert f"    python -m refserve.course grade {dest.resolve()}\n" in sheet
    names = [line.split("|")[1].strip() for line in sheet.splitlines()
             if line.startswith("| ") and "`" in line]
    assert names == list(course.EXERCISES), "the sheet lists the exercises in course order"
    assert course.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "graded alone" in out and "no exercise depends on another" in out
    for g in course.EXERCISES.values():
        assert f'{" ".join(g.test_files)} -m "{g.mechanism} and not slow"' in out


@pytest.mark.slow
def test_every_wrong_body_fails_its_own_row_in_plain_words_and_no_other(tmp_path):
    """Each plausible mistake in tests/course_mutants.py, graded in whole copies: round k
    holds every exercise's k-th wrong body (the reference's where an exercise has fewer),
    and exactly the wrong rows fail, each with its first failing assertion in one plain
    line (never a stale edit: a NameError or AttributeError means the region changed)."""
    rounds = [{name: mutants[k] for name, mutants in MUTANTS.items() if k < len(mutants)}
              for k in range(max(map(len, MUTANTS.values())))]
    problems = []
    for k, wrong in enumerate(rounds):
        dest = tmp_path / f"round{k}"
        course.make_student(dest, solutions=True)
        for name, (_, old, new) in wrong.items():
            try:
                put_mistake(dest, name, old, new)
            except ValueError as e:
                problems.append(f"round {k}, {name}: {e}; update tests/course_mutants.py")
        for row in course_grade.grade(dest):
            what = f"round {k}, {row.exercise}"
            if row.exercise not in wrong:
                if row.status != "pass":
                    problems.append(f"{what} (the reference's body): {row.status}: {row.line}")
                continue
            mistake = wrong[row.exercise][0]
            if row.status != "fail":
                problems.append(f"{what}, '{mistake}' was not caught: {row.status}")
            elif "\n" in row.line or "ExceptionGroup" in row.line or not row.line:
                problems.append(f"{what}, '{mistake}': not one plain line: {row.line!r}")
            elif row.line.startswith(STALE):
                problems.append(f"{what}, '{mistake}' is stale (update course_mutants.py): "
                                f"{row.line}")
    assert not problems, "\n".join(problems)
