"""Student copies of refserve for the course, and the course's command line.

`python -m refserve.course make-student DIR` writes a copy of the package (plus tests/,
notebooks/, pyproject.toml and the course texts when run from a source checkout) in which
the inside of every exercise region (refserve/course_exercises.py) is replaced by

    raise NotImplementedError("exercise <name>: <hint>")

at the BEGIN line's indentation; the marker lines stay, so the student sees where to write.
`--only NAME` (repeatable) blanks only those exercises; `--solutions` keeps every region
(a copy with the reference regions put back).

`python -m refserve.course grade DIR --exercise NAME` grades one exercise of the copy,
alone inside the reference; without `--exercise` it grades every exercise the same way
(refserve/course_grade.py). `python -m refserve.course list` prints each exercise, where it
is, how it is graded and the command that grades it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from refserve import course_grade
from refserve.course_exercises import (
    EXERCISES,
    PACKAGE_DIR,
    SOURCE_ROOT,
    Region,
    blank_regions,
    find_regions,
)
from refserve.course_grade import grade_command

__all__ = ["EXERCISES", "Region", "blank_regions", "find_regions", "make_student", "main"]


def make_student(dest: Path, only: list[str] | None = None, solutions: bool = False) -> list[str]:
    """Write a student copy into `dest` (must not exist, or be an empty folder). Returns the
    names of the exercises blanked. Raises ValueError naming what is wrong."""
    regions = find_regions()
    known = [r.name for r in regions]
    unknown = sorted(set(only or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown exercise(s) {unknown}; known: {', '.join(known)}")
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"{dest} already exists and is not an empty folder; give a new path")
    chosen = [] if solutions else [r for r in regions if only is None or r.name in only]
    chosen.sort(key=_course_order)

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    try:  # before any copying: a folder that cannot be made is one clear error
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{dest}: cannot create it ({e.strerror})") from None
    shutil.copytree(PACKAGE_DIR, dest / PACKAGE_DIR.name, ignore=ignore)
    for extra in ("tests", "notebooks"):
        if (SOURCE_ROOT / extra).is_dir():
            shutil.copytree(SOURCE_ROOT / extra, dest / extra, ignore=ignore)
    for extra in ("pyproject.toml", "README.md", "WARMUP.md"):
        if (SOURCE_ROOT / extra).is_file():
            shutil.copy2(SOURCE_ROOT / extra, dest / extra)

    by_file: dict[Path, list[Region]] = {}
    for r in chosen:
        by_file.setdefault(r.path, []).append(r)
    for rel, file_regions in by_file.items():
        target = dest / rel
        target.write_text(blank_regions(target.read_text(), file_regions))
    (dest / "EXERCISES.md").write_text(_exercise_sheet(chosen, dest))
    return [r.name for r in chosen]


def _exercise_sheet(chosen: list[Region], dest: Path) -> str:
    copy = dest.resolve()
    lines = ["# Exercises", "",
             "Each exercise is a `raise NotImplementedError(\"exercise <name>: <hint>\")` between "
             "`# BEGIN EXERCISE` and `# END EXERCISE` lines. Replace the raise with your code "
             "(only the lines between the markers are graded), then grade that exercise alone "
             f"from the reference checkout (`{SOURCE_ROOT}`), not from inside this copy:", "",
             "| exercise | file | hint | grade it |", "| --- | --- | --- | --- |"]
    for r in chosen:
        lines.append(f"| {r.name} | `{r.path}:{r.begin + 1}` | {r.hint} | "
                     f"`{grade_command(copy, r.name)}` |")
    if not chosen:
        lines.append("| (none: every reference region is in place) | | | |")
    lines += ["", "Each exercise is graded inside the reference: every other region is the "
              "reference's, so one exercise's row never depends on another. The whole grade, "
              "one row per exercise:", "", f"    {grade_command(copy)}", ""]
    return "\n".join(lines)


def _course_order(region: Region) -> int:
    """Course order (EXERCISES); a region without an entry comes last."""
    order = list(EXERCISES)
    return order.index(region.name) if region.name in EXERCISES else len(order)


def _list() -> None:
    for r in sorted(find_regions(), key=_course_order):
        g = EXERCISES.get(r.name)
        print(f"{r.name:<24} {g.mechanism if g else '(not graded)':<17} {r.path}:{r.begin + 1}")
        print(f"{'':<24} hint: {r.hint}")
        if g:
            print(f"{'':<24} tests: {' '.join(g.test_files)} -m \"{g.marker_expression}\"")
    print("\nEach exercise is graded alone: its tests run against the reference with only "
          "that region taken from the copy, so no exercise depends on another.\n"
          f"Grade one: {grade_command(Path('DIR'), 'NAME')}\n"
          f"Grade all: {grade_command(Path('DIR'))}")


def main(argv: list[str] | None = None) -> int:
    from refserve.entrypoints.cli_common import ArgumentParser, CLIError

    parser = ArgumentParser(prog="python -m refserve.course",
                            description="Student copies of refserve for the course.")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-student", help="write a copy with exercise regions blanked")
    make.add_argument("dir", type=Path, help="where to write the copy (new or empty folder)")
    make.add_argument("--only", action="append", metavar="NAME",
                      help="blank only this exercise (repeatable); default: all")
    make.add_argument("--solutions", action="store_true",
                      help="keep every reference region (a copy with the answers in place)")
    sub.add_parser("list", help="print the exercises, where they are and how they are graded")
    grade = sub.add_parser("grade", help="grade a student copy, each exercise alone inside "
                                         "the reference (run from the reference checkout)")
    grade.add_argument("dir", type=Path, nargs="?",
                       help="the student copy (default: this checkout, whose regions all pass)")
    grade.add_argument("--exercise", action="append", metavar="NAME",
                       help="grade only this exercise (repeatable); default: all")
    grade.add_argument("--jobs", type=int, default=None, metavar="N",
                       help="exercises graded at once (default: one per core, at most 4)")
    grade.add_argument("--timeout", type=float, default=course_grade.DEFAULT_TIMEOUT_S,
                       metavar="S", help="seconds one exercise may run before it fails")
    grade.add_argument("--grade-json", type=Path, default=Path("grade.json"), metavar="PATH",
                       help="where to write the JSON report")
    grade.add_argument("-v", "--verbose", action="store_true",
                       help="also print pytest's report of each row that does not pass")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            _list()
            return 0
        if args.command == "grade":
            if args.jobs is not None and args.jobs < 1:
                raise ValueError(f"--jobs {args.jobs}: must be >= 1")
            return course_grade.run(args.dir, args.exercise, args.jobs, args.timeout,
                                    args.grade_json, args.verbose)
        if args.only and args.solutions:
            raise ValueError("--only and --solutions contradict each other; give one")
        names = make_student(args.dir, args.only, args.solutions)
    except (ValueError, CLIError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a student copy to {args.dir}: {len(names)} exercise(s) blanked"
          + (f" ({', '.join(names)})" if names else "")
          + f"; see {args.dir / 'EXERCISES.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
