"""The course machinery: exercise regions, student copies (`python -m refserve.course
make-student DIR`), grading a copy with `pytest --impl DIR`, and the notebooks' sources.

The central promise: a student copy with one exercise blanked fails a test of that
exercise's mechanism (and nothing outside the mechanisms it declares), and passes again once
the reference region is put back. Each exercise costs one short pytest subprocess (stopped at
the first failure, `-x`), plus one subprocess at the end for the put-back copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refserve import course

ROOT = Path(__file__).resolve().parents[1]
MIN_EXERCISES = 8
# A cheap test file of a mechanism the exercise does not touch: it runs first in the same
# subprocess and must pass (the negative control: blanking one region breaks only its part).
CONTROL = {"blocks_for_tokens": ("tests/test_block_allocator.py", "allocator")}
DEFAULT_CONTROL = ("tests/test_capacity.py", "capacity")


def run_pytest(impl: Path, args: list[str], grade_json: Path, timeout: int = 240):
    env = {k: v for k, v in os.environ.items() if k not in ("REFSERVE_IMPL", "PYTHONPATH")}
    cmd = [sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider",
           "--impl", str(impl), "--grade", "--grade-json", str(grade_json)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    report = json.loads(grade_json.read_text()) if grade_json.is_file() else None
    return proc, report


def failed_tests(report: dict) -> dict[str, set[str]]:
    """node id -> the mechanisms under which it failed."""
    out: dict[str, set[str]] = {}
    for mechanism, row in report["mechanisms"].items():
        for nodeid in row["failed_tests"]:
            out.setdefault(nodeid, set()).add(mechanism)
    return out


# ---- regions and the generator -----------------------------------------------------------


def test_regions_are_well_formed_and_each_has_a_grader():
    regions = course.find_regions()
    names = [r.name for r in regions]
    assert len(names) >= MIN_EXERCISES, f"only {len(names)} exercise regions: {names}"
    assert sorted(names) == sorted(course.EXERCISES), (
        "every region needs an EXERCISES entry (its mechanism and test files) and vice versa")
    for r in regions:
        assert r.hint, f"exercise {r.name} ({r.path}) has no hint on its BEGIN line"
        assert r.end - r.begin >= 2, f"exercise {r.name} has an empty region"
        for f in course.EXERCISES[r.name].test_files:
            assert (ROOT / f).is_file(), f"exercise {r.name}: no test file {f}"


def test_blank_regions_keeps_markers_and_indentation():
    text = ("def f(x):\n    y = 1\n    # BEGIN EXERCISE demo: add one\n    y = x + 1\n"
            "    return y\n    # END EXERCISE\n")
    region = course.Region("demo", "add one", Path("m.py"), 2, 5, "    ")
    out = course.blank_regions(text, [region])
    assert out == ("def f(x):\n    y = 1\n    # BEGIN EXERCISE demo: add one\n"
                   "    raise NotImplementedError('exercise demo: add one')\n"
                   "    # END EXERCISE\n")


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
        assert lines[r.begin + 1:r.end] == [r.stub()], (
            f"exercise {r.name}: the copy's region must hold only the stub, got "
            f"{lines[r.begin + 1:r.end]}")
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


def test_grading_a_student_copy_as_the_readme_writes_it(tmp_path):
    """`pytest --impl DIR -m "not slow" --grade` with a space: the run grades
    DIR from this checkout's root, and an untouched copy's rows say "not done yet"."""
    dest = tmp_path / "student"
    course.make_student(dest)
    env = {k: v for k, v in os.environ.items() if k not in ("REFSERVE_IMPL", "PYTHONPATH")}
    # The README's command exactly (collection only: the whole suite is minutes).
    proc = subprocess.run([sys.executable, "-m", "pytest", "--impl", str(dest), "-m",
                           "not slow", "--co", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"rootdir: {ROOT}" in proc.stdout
    assert f"refserve under test: {(dest / 'refserve').resolve()} (--impl)" in proc.stdout
    assert "error" not in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]
    # Graded on two files and a notebook: each row fails only on the exercise stubs.
    proc, report = run_pytest(dest, ["tests/test_block_table.py",
                                     "notebooks/01_paged_kv_cache.ipynb", "-m", "not slow"],
                              tmp_path / "g.json")
    assert proc.returncode == 1 and report is not None, (proc.stdout + proc.stderr)[-3000:]
    assert report["refserve"] == str((dest / "refserve").resolve())
    rows = report["mechanisms"]
    assert rows["block_table"]["status"].startswith("FAIL: not done yet: ")
    assert "append_rule" in rows["block_table"]["exercises_not_done"]
    assert rows["course"]["status"].startswith("FAIL: not done yet: "), rows["course"]
    assert "FAIL: not done yet" in proc.stdout


# ---- each exercise is caught by its own mechanism, and only there -------------------------


def test_each_exercise_fails_its_mechanism_and_passes_with_the_reference(tmp_path):
    caught: dict[str, str] = {}  # exercise -> the failing node id
    problems: list[str] = []
    for name, grading in course.EXERCISES.items():
        dest = tmp_path / name
        course.make_student(dest, only=[name])
        control, control_mechanism = CONTROL.get(name, DEFAULT_CONTROL)
        assert control not in grading.test_files and control_mechanism not in grading.mechanisms
        proc, report = run_pytest(dest, [control, *grading.test_files, "-m", "not slow", "-x"],
                                  tmp_path / f"{name}.json")
        tail = (proc.stdout + proc.stderr)[-1500:]
        if report is None or proc.returncode != 1:
            problems.append(f"{name}: expected one failing test (exit 1), got exit "
                            f"{proc.returncode}\n{tail}")
            continue
        assert report["refserve"] == str((dest / "refserve").resolve()), report["refserve"]
        failed = failed_tests(report)
        control_row = report["mechanisms"][control_mechanism]
        if f"exercise {name}" not in proc.stdout:
            problems.append(f"{name}: the failure is not this exercise's NotImplementedError"
                            f"\n{tail}")
        if len(failed) != 1:
            problems.append(f"{name}: expected exactly one failed test with -x, got {failed}")
            continue
        (nodeid, mechanisms), = failed.items()
        if nodeid.startswith(control):
            problems.append(f"{name}: the control {control} failed: {nodeid}")
        elif not mechanisms & set(grading.mechanisms):
            problems.append(f"{name}: {nodeid} failed under {sorted(mechanisms)}, outside the "
                            f"declared mechanisms {grading.mechanisms}")
        elif control_row["passed"] == 0 or control_row["failed"]:
            problems.append(f"{name}: the control {control} ({control_mechanism}) did not "
                            f"pass: {control_row}")
        else:
            caught[name] = nodeid
    assert not problems, "\n\n".join(problems)

    # Put the reference regions back: the same tests, and the controls, pass on that copy.
    solved = tmp_path / "solutions"
    assert course.make_student(solved, solutions=True) == []
    controls = sorted({f for f, _ in [*CONTROL.values(), DEFAULT_CONTROL]})
    proc, report = run_pytest(solved, [*controls, *caught.values()],
                              tmp_path / "solutions.json")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert report["total"]["passed"] >= len(caught)


# ---- the notebooks ------------------------------------------------------------------------


def test_notebooks_are_built_from_their_sources_without_outputs():
    """The committed .ipynb files are exactly what notebooks/build_notebooks.py writes
    (no outputs, no stale cells). CI executes them: `pytest --nbmake notebooks/`."""
    proc = subprocess.run([sys.executable, "notebooks/build_notebooks.py", "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            assert not cell.get("outputs") and cell.get("execution_count") is None, (
                f"{path.name} has outputs committed; rebuild it with build_notebooks.py")
