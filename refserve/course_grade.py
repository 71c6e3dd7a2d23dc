"""Grading a student copy: each exercise alone, inside the reference.

For each exercise the grader builds a *hybrid* package in a temporary folder: this
checkout's refserve/ with only that exercise's region taken from the copy (regions are
matched by name, wherever their files are), and runs the exercise's tests (`EXERCISES`: its
test files, `-m "<mechanism> and not slow"`) against the hybrid in a pytest subprocess
(`--impl=HYBRID`). Every other region is the reference's, so a row depends on one exercise
and nothing else: a blank exercise reads "not done yet" on its row only, one correct
exercise passes its row whatever else is blank, one wrong exercise fails its row only.
Only the lines between the markers are graded; code outside them is the reference's.

One row per exercise, labelled with the mechanism it teaches (two exercises may teach the
same one: a row per mechanism would mix them). A row's status:

    pass                  every selected test passed (GPU checks without a GPU: blocked);
                          its tests column reads passed/selected
    FAIL at test F of N   the F-th of the N selected tests (collection order) is the first
                          to fail, with how many passed before it; the line below quotes it
                          in one plain line: the assertion, and for a Hypothesis test its
                          falsifying example
    not done yet          the region still holds its stub, or a test reached the stub
    timed out after N s   the run was stopped (an endless loop, most likely)

The tests run stopped at the first failure (`-x`) with a deterministic Hypothesis profile
that reports one bug (tests/grading.py, `--grade-record`), so a grade repeats exactly.
Exercises run `jobs` at a time (one per core, at most 4); with fewer exercises than jobs,
each one's selection is split into shards run at once (`--grade-shard`). Every shard stops
at its own first failure, after running all of its tests that come before the first
failure overall, so the failure reported (the earliest in collection order) and the counts
before it are the same however the tests were split: graded alone or in the whole grade.

grade.json (`--grade-json`): `created`, `duration_s`, `copy` (the graded folder; null for
this checkout), `reference` (this checkout), `jobs`, `timeout_s`, `exit_status` (0 when
every graded exercise passes, else 1), `summary` (rows per status), and `exercises`: per
exercise `mechanism`, `status` (pass / fail / not done yet / timed out), `line` (the plain
line, "" on pass), `failed_test` (node id or null), `failed_at` (its place among the
selected tests, from 1; null without a failure, 0 for a collection error), `selected`, and
`passed`, `failed`, `skipped`, `blocked`: the tests that ran before the first failure and
that failure (all of them when none failed), the same alone and in the whole grade;
`duration_s`, `test_files`, `marker_expression` and `command` (the one command that grades
it alone).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from refserve.course_exercises import (
    EXERCISES,
    PACKAGE_DIR,
    SOURCE_ROOT,
    Region,
    find_regions,
    replace_body,
)

DEFAULT_TIMEOUT_S = 60.0
STATUSES = ("pass", "fail", "not done yet", "timed out")


@dataclass
class Row:
    """One exercise's grade (the fields of grade.json's `exercises` entries)."""

    exercise: str
    mechanism: str
    status: str = "pass"
    line: str = ""
    failed_test: str | None = None
    failed_at: int | None = None  # 1-based place of the first failure; 0: collection
    selected: int = 0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    blocked: int = 0
    duration_s: float = 0.0
    test_files: tuple[str, ...] = ()
    marker_expression: str = ""
    command: str = ""
    output: str = field(default="", repr=False)  # pytest's own report, for --verbose

    def shown_status(self, timeout_s: float) -> str:
        if self.status == "timed out":
            return f"timed out after {timeout_s:g} s"
        if self.status == "pass" and self.blocked:
            return "pass (some blocked: no GPU)" if self.passed else "blocked: no GPU"
        if self.status == "fail":
            return f"FAIL {self.failed_where()}"
        return self.status

    def failed_where(self) -> str:
        """Where the first failure is and what passed before it: "at test 5 of 28
        (4 passed before it)". The same alone and in the whole grade."""
        if self.failed_at is None:  # no test failed: the run itself did (a syntax error)
            return "before any test ran"
        if self.failed_at == 0:
            return "while collecting the tests"
        before = [f"{self.passed} passed"] + [f"{n} {what}" for n, what in
                                              ((self.skipped, "skipped"),
                                               (self.blocked, "blocked")) if n]
        return (f"at test {self.failed_at} of {self.selected} "
                f"({', '.join(before)} before it)")


def grade_command(copy: Path | None, name: str | None = None) -> str:
    """The command that grades `copy` (one exercise, or all of them)."""
    where = f" {copy}" if copy is not None else ""
    return f"python -m refserve.course grade{where}" + (f" --exercise {name}" if name else "")


def check_reference() -> dict[str, Region]:
    """This checkout's regions, by name, once it is sure to be a reference that can grade."""
    if not (SOURCE_ROOT / "tests" / "grading.py").is_file():
        raise ValueError(f"grading needs a source checkout of refserve (tests/ beside "
                         f"{PACKAGE_DIR}); run it from a clone of the repository")
    regions = {r.name: r for r in find_regions(PACKAGE_DIR)}
    for r in regions.values():
        if r.is_stub((SOURCE_ROOT / r.path).read_text().splitlines(keepends=True)):
            raise ValueError(f"{PACKAGE_DIR} is a student copy (exercise {r.name} is blank), "
                             "not the reference: run the command from the reference checkout "
                             "the copy was made from")
    return regions


def check_copy(copy: Path, names: list[str], reference: dict[str, Region]) -> dict[str, Region]:
    """The copy's regions, by name, with one for each of `names`. Raises ValueError saying
    what to do."""
    if not copy.is_dir():
        raise ValueError(f"{copy}: no such folder; make a copy with "
                         f"`python -m refserve.course make-student {copy}`")
    if not (copy / "refserve" / "__init__.py").is_file():
        if copy.name == "refserve" and (copy / "__init__.py").is_file():
            raise ValueError(f"{copy} is the package itself; give the folder that holds it "
                             f"({copy.parent})")
        raise ValueError(f"{copy} is not a student copy (it has no refserve/ package); make "
                         f"one with `python -m refserve.course make-student DIR`")
    try:
        regions = {r.name: r for r in find_regions(copy / "refserve")}
    except ValueError as e:
        raise ValueError(f"{copy}: {e}; put the marker lines back as make-student wrote "
                         "them") from None
    for name in names:
        if name not in regions:
            raise ValueError(
                f"{copy}: exercise {name} has no region (the reference has it in "
                f"{reference[name].path}); put back the lines '# BEGIN EXERCISE {name}: ...' "
                "and '# END EXERCISE' around your code (a copy older than the exercise: "
                "copy the region from the reference)")
    return regions


def build_hybrid(dest: Path, ref: Region, body: list[str], indent: str) -> Path:
    """dest/refserve: this checkout's package with `body` (written at `indent`) inside
    region `ref`. Returns dest. Raises SyntaxError (its lineno in the hybrid file)."""
    shutil.copytree(PACKAGE_DIR, dest / "refserve")  # __pycache__ too: the imports stay fast
    target = dest / ref.path
    text = replace_body(target.read_text(), ref, body, indent)
    compile(text, str(target), "exec")
    target.write_text(text)
    return dest


def plain_syntax_error(e: SyntaxError, ref: Region, student: Region, copy: Path) -> str:
    """The error at its line in the student's file (the hybrid's line moved back)."""
    offset = (e.lineno or 0) - 1 - ref.body_start  # lines into the region body
    where = copy / student.path
    if 0 <= offset < student.end - student.body_start:
        where = f"{where}:{student.body_start + 1 + offset}"
    return f"SyntaxError: {e.msg} ({where})"


def pytest_command(hybrid: Path, name: str, record: Path, basetemp: Path,
                   shard: tuple[int, int] = (0, 1)) -> list[str]:
    """The exercise's selection (shard i of n of it) against `hybrid`, in a pytest that
    loads only the grader and Hypothesis' plugin: pyproject's addopts (nbmake, for the
    notebooks) are replaced, and `run_shards` turns off the loading of every installed
    plugin (PYTEST_DISABLE_PLUGIN_AUTOLOAD): scanning the installed packages for them costs
    about a second of CPU per process, and none of them grades anything."""
    grading = EXERCISES[name]
    return [sys.executable, "-m", "pytest", *grading.test_files,
            "-m", grading.marker_expression, "-o", "addopts=", "-p", "grading",
            "-p", "_hypothesis_pytestplugin", "-p", "no:cacheprovider", "-x", "-q",
            "--tb=short",
            f"--impl={hybrid}", f"--grade-record={record}", f"--basetemp={basetemp}",
            f"--grade-shard={shard[0]}/{shard[1]}"]


def read_records(records: list[Path], row: Row, name: str) -> tuple[list[str], int | None]:
    """Fill `row` from the --grade-record files of an exercise's shards: the first failure
    in collection order (each shard stops at its own first, so the earliest of those is the
    earliest of all) and the outcomes of the tests before it, which every shard ran to the
    end: so the counts do not depend on the split. Returns the tests started and never
    finished, and the shard of the first failure (None: no failure)."""
    running: dict[str, None] = {}
    finished = []  # (index, outcome, event, shard); a collection error has index -1
    for shard, record in enumerate(records):
        lines = record.read_text().splitlines() if record.is_file() else []
        for event in map(json.loads, filter(str.strip, lines)):
            if "selected" in event:
                row.selected += event["selected"]
            elif "start" in event:
                running[event["start"]] = None
            elif "test" in event or "collect_error" in event:
                running.pop(event.get("test"), None)
                finished.append((event.get("index", -1), event.get("outcome", "failed"),
                                 event, shard))
    failures = [f for f in finished if f[1] == "failed"]
    first = min(failures, key=lambda f: f[0]) if failures else None
    for index, outcome, _, _ in finished:
        if first is None or index < first[0]:
            setattr(row, outcome, getattr(row, outcome) + 1)
    if first is None:
        return list(running), None
    index, _, event, shard = first
    row.failed = 1
    row.failed_at = index + 1  # 0: a collection error, before any test
    row.failed_test = event.get("test") or event["collect_error"]
    row.line = event["line"]
    row.status = "not done yet" if name in event["not_done"] else "fail"
    return list(running), shard


def run_shards(commands: list[list[str]], workdir: Path, timeout_s: float
               ) -> tuple[list[int], list[str]]:
    """Run the commands at once, from this checkout, each in its own process group; after
    `timeout_s` all are killed (with their own subprocesses). Returns the exit statuses
    (negative: killed) and the outputs."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("REFSERVE_IMPL", "PYTHONPATH", "PYTEST_ADDOPTS")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the plugins it needs are named (-p)
    logs = [workdir / f"output{i}.txt" for i in range(len(commands))]
    procs = []
    for command, log in zip(commands, logs):
        with log.open("w") as out:  # a file, not a pipe: a long report never blocks
            procs.append(subprocess.Popen(command, cwd=SOURCE_ROOT, env=env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.perf_counter() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            for other in procs:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            proc.wait()
    return [proc.wait() for proc in procs], [log.read_text() for log in logs]


def grade_exercise(name: str, copy_dir: Path, student: Region, ref: Region,
                   workdir: Path, timeout_s: float, shards: int = 1) -> Row:
    """One exercise's row: not done yet (its stub, found without running anything), or its
    tests run against the hybrid in `shards` pytest processes at once."""
    grading = EXERCISES[name]
    row = Row(name, grading.mechanism, test_files=grading.test_files,
              marker_expression=grading.marker_expression,
              command=grade_command(copy_dir, name))
    lines = (copy_dir / student.path).read_text().splitlines(keepends=True)
    if student.is_stub(lines):
        row.status, row.line = "not done yet", f"exercise {name} still raises its stub"
        return row
    started = time.perf_counter()
    try:
        hybrid = build_hybrid(workdir / "hybrid", ref, student.body(lines), student.indent)
    except SyntaxError as e:
        row.status, row.line = "fail", plain_syntax_error(e, ref, student, copy_dir)
        return row
    records = [workdir / f"record{i}.jsonl" for i in range(shards)]
    commands = [pytest_command(hybrid, name, records[i], workdir / f"tmp{i}", (i, shards))
                for i in range(shards)]
    codes, outputs = run_shards(commands, workdir, timeout_s)
    row.duration_s = round(time.perf_counter() - started, 2)
    running, failed_shard = read_records(records, row, name)
    row.output = outputs[failed_shard] if failed_shard is not None else "".join(outputs)
    # 0: passed, 1: a test failed, 5: this shard selected no test (there are more shards).
    odd = [code for code in codes if code not in (0, 1, 5)]
    if any(code < 0 for code in codes):  # killed: the timeout
        row.status = "timed out"
        row.line = f"timed out after {timeout_s:g} s" + (f" in {running[0]}" if running else "")
    elif odd and row.failed_test is None:
        tail = [line for line in row.output.splitlines() if line.strip()]
        row.status = "fail"
        row.line = f"pytest exited with status {odd[0]}: " + (tail[-1] if tail else "no output")
    elif row.failed_test is None and row.selected == 0:
        row.status, row.line = "fail", "no test selected (the EXERCISES entry is wrong)"
    return row


def default_jobs() -> int:
    """Exercises graded at once: one per core this process may use, at most 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return max(1, min(4, cores or os.cpu_count() or 1))


def grade(copy: Path | None, names: list[str] | None = None, jobs: int | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S, progress=None) -> list[Row]:
    """One row per exercise in `names` (default: all, in course order) of the student copy
    `copy` (None: this checkout, whose own regions all pass). Raises ValueError on a bad
    copy or name, before any test runs."""
    names = list(dict.fromkeys(names or EXERCISES))  # a name given twice is graded once
    unknown = [n for n in names if n not in EXERCISES]
    if unknown:
        raise ValueError(f"unknown exercise(s) {unknown}; known: {', '.join(EXERCISES)}")
    reference = check_reference()
    copy_dir = SOURCE_ROOT if copy is None else Path(copy).expanduser().resolve()
    student = check_copy(copy_dir, names, reference)
    jobs = jobs or default_jobs()
    # Cores left over when there are fewer exercises than jobs split each one's tests.
    shards = max(1, jobs // len(names))
    with tempfile.TemporaryDirectory(prefix="refserve-grade-") as tmp:
        def one(name: str) -> Row:
            (Path(tmp) / name).mkdir()
            row = grade_exercise(name, copy_dir, student[name], reference[name],
                                 Path(tmp) / name, timeout_s, shards)
            if copy is None:
                row.command = grade_command(None, name)
            if progress is not None:
                progress(row)
            return row

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(one, names))


def format_table(rows: list[Row], timeout_s: float) -> list[str]:
    out = [f"{'exercise':<24}{'mechanism':<17}{'tests':>7}  status"]
    for row in rows:
        tests = f"{row.passed}/{row.selected}" if row.selected and row.status == "pass" else "-"
        out.append(f"{row.exercise:<24}{row.mechanism:<17}{tests:>7}  "
                   f"{row.shown_status(timeout_s)}")
        if row.status in ("fail", "timed out"):
            where = f"{row.failed_test}: " if row.failed_test else ""
            out.append(f"    {where}{row.line}")
    return out


def summary(rows: list[Row]) -> dict[str, int]:
    return {status: sum(r.status == status for r in rows) for status in STATUSES}


def report(rows: list[Row], copy: Path | None, jobs: int, timeout_s: float,
           duration_s: float) -> dict:
    """grade.json's content (fields: the module docstring)."""
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": round(duration_s, 2),
        "copy": None if copy is None else str(Path(copy).expanduser().resolve()),
        "reference": str(SOURCE_ROOT),
        "jobs": jobs,
        "timeout_s": timeout_s,
        "exit_status": 0 if all(r.status == "pass" for r in rows) else 1,
        "summary": summary(rows),
        "exercises": {r.exercise: {k: v for k, v in asdict(r).items()
                                   if k not in ("exercise", "output")} for r in rows},
    }


def run(copy: Path | None, names: list[str] | None = None, jobs: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S, json_path: Path = Path("grade.json"),
        verbose: bool = False) -> int:
    """Grade, print the table, write grade.json. Returns the exit status: 0 when every
    graded exercise passes, 1 otherwise; a bad copy, name or path raises ValueError first."""
    from tqdm import tqdm

    from refserve.entrypoints.cli_common import check_output_path

    check_output_path(json_path, "--grade-json")
    if timeout_s <= 0:
        raise ValueError(f"--timeout {timeout_s:g}: must be > 0 seconds")
    jobs = jobs or default_jobs()
    names = list(dict.fromkeys(names or EXERCISES))
    started = time.perf_counter()
    with tqdm(total=len(names), desc="grading", unit="exercise", file=sys.stderr,
              leave=False, disable=None) as bar:
        rows = grade(copy, names, jobs, timeout_s,
                     progress=lambda row: bar.update(1))
    duration = time.perf_counter() - started
    what = "this checkout" if copy is None else str(copy)
    print(f"grade of {what}: each exercise alone, every other region the reference's")
    for line in format_table(rows, timeout_s):
        print(line)
    counts = summary(rows)
    print(", ".join(f"{n} {'FAIL' if status == 'fail' else status}"
                    for status, n in counts.items() if n)
          + f" ({duration:.1f} s)")
    if verbose:
        for row in rows:
            if row.status != "pass" and row.output:
                print(f"\n---- {row.exercise}: pytest's report ----\n{row.output.rstrip()}")
    data = report(rows, copy, jobs, timeout_s, duration)
    Path(json_path).write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {json_path}")
    return data["exit_status"]
