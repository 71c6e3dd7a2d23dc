"""The course machinery: exercise regions in the reference, and student copies made from them.

The reference code marks the spots a student writes with comment lines:

    # BEGIN EXERCISE <name>: <one-line hint>
    ... the reference solution (the answer key) ...
    # END EXERCISE

`python -m refserve.course make-student DIR` writes a copy of the package (plus tests/,
notebooks/, pyproject.toml and the course texts when run from a source checkout) in which the
lines between the markers are replaced by

    raise NotImplementedError("exercise <name>: <hint>")

at the BEGIN line's indentation; the marker lines stay, so the student sees where to write.
`--only NAME` (repeatable) blanks only those exercises; `--solutions` keeps every region
(a copy with the reference regions put back). Grade a copy with the reference tests:

    pytest --impl DIR tests/test_block_allocator.py      # or: REFSERVE_IMPL=DIR pytest ...
    pytest --impl DIR -m "not slow" --grade               # the whole score table

`python -m refserve.course list` prints each exercise, where it is and how it is graded
(`EXERCISES`: its mechanism marker and the test file(s) that catch it).
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent  # a source checkout: tests/ and notebooks/ live here
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN EXERCISE (?P<name>[a-z][a-z0-9_]*)"
                   r"(?::\s*(?P<hint>.*\S))?\s*$")
END = re.compile(r"^[ \t]*# END EXERCISE\s*$")


@dataclass(frozen=True)
class Grading:
    """How one exercise is graded: its mechanism markers (tests/grading.py; the first is the
    one it teaches, the others are mechanisms built on it whose tests may fail too) and the
    test files that catch it. `pytest --impl DIR FILES -m MECHANISM` grades it alone."""

    mechanisms: tuple[str, ...]
    test_files: tuple[str, ...]


# Every exercise region in the reference, and how the course grades it.
EXERCISES: dict[str, Grading] = {
    "blocks_for_tokens": Grading(("capacity",), ("tests/test_capacity.py",)),
    "append_rule": Grading(("block_table",), ("tests/test_block_table.py",)),
    "allocator_decref": Grading(("allocator",), ("tests/test_block_allocator.py",)),
    "copy_on_write": Grading(("cow",), ("tests/test_prefix_cache.py",)),
    "prefix_cache_lookup": Grading(("prefix_cache", "cow"), ("tests/test_prefix_cache.py",)),
    "paged_attention_gather": Grading(("paged_attention",), ("tests/test_paged_attention.py",)),
    "runner_prepare": Grading(("prepare",), ("tests/test_model_runner.py",)),
    "scheduler_admit": Grading(("scheduler", "chunked_prefill", "preemption"),
                               ("tests/test_scheduler.py",)),
    "scheduler_preempt": Grading(("preemption", "scheduler"), ("tests/test_scheduler.py",)),
    "stop_rules": Grading(("scheduler",), ("tests/test_stop_rules.py",)),
    "accept_residual": Grading(("spec_accept",), ("tests/test_spec_rejection_sampler.py",)),
    "ngram_proposal": Grading(("spec_propose",), ("tests/test_spec_ngram.py",)),
}


@dataclass(frozen=True)
class Region:
    """Lines [begin, end] (0-based, both marker lines included) of `path`."""

    name: str
    hint: str
    path: Path  # relative to the package's parent (e.g. refserve/capacity.py)
    begin: int
    end: int
    indent: str

    def stub(self) -> str:
        message = f"exercise {self.name}: {self.hint}" if self.hint else f"exercise {self.name}"
        return f"{self.indent}raise NotImplementedError({message!r})\n"


def find_regions(package_dir: Path = PACKAGE_DIR) -> list[Region]:
    """Every exercise region under `package_dir`, in file then line order. Raises ValueError
    on a BEGIN without END (or the reverse), a nested BEGIN, or a name used twice."""
    regions: list[Region] = []
    for path in sorted(package_dir.rglob("*.py")):
        if path.name == "course.py":
            continue  # this file's docstring shows the markers; it has no regions
        rel = path.relative_to(package_dir.parent)
        lines = path.read_text().splitlines(keepends=True)
        open_at = None
        for i, line in enumerate(lines):
            match = BEGIN.match(line)
            if line.lstrip().startswith("# BEGIN EXERCISE") and match is None:
                raise ValueError(f"{rel}:{i + 1}: malformed marker; write "
                                 "'# BEGIN EXERCISE <name>: <hint>' (name: a-z, 0-9, _)")
            if match:
                if open_at is not None:
                    raise ValueError(f"{rel}:{i + 1}: BEGIN EXERCISE inside the region opened "
                                     f"at line {open_at[0] + 1}")
                open_at = (i, match)
            elif END.match(line):
                if open_at is None:
                    raise ValueError(f"{rel}:{i + 1}: END EXERCISE without BEGIN")
                start, m = open_at
                regions.append(Region(m["name"], m["hint"] or "", rel, start, i, m["indent"]))
                open_at = None
        if open_at is not None:
            raise ValueError(f"{rel}:{open_at[0] + 1}: BEGIN EXERCISE without END EXERCISE")
    names = [r.name for r in regions]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"exercise name(s) used twice: {twice}")
    return regions


def blank_regions(text: str, regions: list[Region]) -> str:
    """`text` (one file) with each region's inside replaced by its stub, markers kept."""
    lines = text.splitlines(keepends=True)
    for r in sorted(regions, key=lambda r: r.begin, reverse=True):  # bottom up: lines shift
        lines[r.begin + 1:r.end] = [r.stub()]
    return "".join(lines)


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
    lines = ["# Exercises", "",
             "Each exercise is a `raise NotImplementedError(\"exercise <name>: <hint>\")` between "
             "`# BEGIN EXERCISE` and `# END EXERCISE` lines. Replace the raise with your code, "
             "then grade it with the reference tests:", "",
             "| exercise | file | hint | grade it |", "| --- | --- | --- | --- |"]
    for r in chosen:
        g = EXERCISES.get(r.name)
        cmd = (f"`pytest {' '.join(g.test_files)} -m {g.mechanisms[0]}`"
               if g else "`pytest -m \"not slow\" --grade`")
        lines.append(f"| {r.name} | `{r.path}:{r.begin + 1}` | {r.hint} | {cmd} |")
    if not chosen:
        lines.append("| (none: every reference region is in place) | | | |")
    lines += ["", f"Run the commands inside `{dest}`, or from the reference checkout with "
              f"`--impl {dest}` added.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from refserve.entrypoints.cli_common import ArgumentParser

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
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            for r in find_regions():
                g = EXERCISES.get(r.name)
                graded = (f"-m {g.mechanisms[0]} {' '.join(g.test_files)}" if g
                          else "(no grading entry)")
                print(f"{r.name:<24} {str(r.path) + ':' + str(r.begin + 1):<44} {graded}")
                print(f"{'':<24} hint: {r.hint}")
            return 0
        if args.only and args.solutions:
            raise ValueError("--only and --solutions contradict each other; give one")
        names = make_student(args.dir, args.only, args.solutions)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a student copy to {args.dir}: {len(names)} exercise(s) blanked"
          + (f" ({', '.join(names)})" if names else "")
          + f"; see {args.dir / 'EXERCISES.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
