"""`python -m refserve.tour`: one engine step, traced, as a student's table of contents.

It starts an engine on the embedded model (the reference backend unless --backend says
otherwise), runs a small batch until every request decodes, then runs ONE more
`LLMEngine.step()` under `sys.settrace` and prints what executed, in order, stage by stage:
every refserve function the step called, with file:line and the first line of its docstring,
then the totals:

    files        refserve source files with at least one executed line
    statements   distinct statements executed at least once (a statement spread over
                 several lines counts once, so a long line split for clarity costs nothing;
                 a function's `def` counts when it is called)
    file lines   the lines those files hold: what a student following the step reads

`python -m refserve.tour --markdown` prints the reading list docs/architecture.md holds
(tests/test_tour.py keeps the two in step).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import refserve
from refserve.config import BACKENDS
from refserve.entrypoints.cli_common import ArgumentParser

PACKAGE = Path(refserve.__file__).parent
STAGES = ("propose", "schedule", "prepare", "copy_blocks", "forward", "sample", "update",
          "finish_step")
PROMPTS = ("The capital of France is", "Write a haiku about paged memory:",
           "def fibonacci(n):", "Three things every cook knows:")


@dataclass
class Call:
    """A refserve function the step called (its first call), and the stage that called it."""

    stage: str
    path: str           # relative to the repository root, e.g. refserve/engine.py
    line: int           # where the function is defined
    name: str           # qualified name
    doc: str            # the first line of its docstring ("" without one)


@dataclass
class Trace:
    calls: list[Call] = field(default_factory=list)
    lines: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))

    @property
    def num_files(self) -> int:
        return len(self.lines)

    @property
    def num_lines(self) -> int:
        """Distinct (file, line) pairs executed: physical lines, for comparison only."""
        return sum(len(v) for v in self.lines.values())

    def statements(self, path: str) -> set[int]:
        """The statements of `path` that executed, each named by its first line."""
        owner = statement_of_line(path)
        return {owner[line] for line in self.lines[path] if line in owner}

    @property
    def num_statements(self) -> int:
        return sum(len(self.statements(p)) for p in self.lines)

    def file_lines(self, path: str) -> int:
        return len((PACKAGE.parent / path).read_text().splitlines())

    @property
    def num_file_lines(self) -> int:
        return sum(self.file_lines(p) for p in self.lines)


@functools.cache
def statement_of_line(path: str) -> dict[int, int]:
    """Line -> the first line of the innermost statement that holds it, for a file relative
    to the repository root. A decorated function or class starts at its first decorator
    (where a call event reports it)."""
    tree = ast.parse((PACKAGE.parent / path).read_text())
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            start = min([node.lineno] + [d.lineno for d in
                                         getattr(node, "decorator_list", [])])
            spans.append((start, node.end_lineno))
    owner: dict[int, int] = {}
    # Outer statements first, so an inner one (starting later, or ending sooner) wins.
    for start, end in sorted(spans, key=lambda span: (span[0], -span[1])):
        for line in range(start, end + 1):
            owner[line] = start
    return owner


def _relative(filename: str) -> str | None:
    path = Path(filename)
    if not path.is_relative_to(PACKAGE):
        return None
    return str(path.relative_to(PACKAGE.parent))


def _doc_line(frame) -> str:
    """The first docstring line of the function running in `frame` ("" if none)."""
    code = frame.f_code
    func = frame.f_globals.get(code.co_name)
    owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
    if owner is not None:
        func = getattr(owner if inspect.isclass(owner) else type(owner), code.co_name, func)
        func = getattr(func, "fget", func)  # a property's getter
    doc = inspect.getdoc(func) if getattr(func, "__code__", None) is code else None
    return doc.strip().splitlines()[0] if doc else ""


def trace_step(engine) -> Trace:
    """Run `engine.step()` once under sys.settrace and return what it executed."""
    trace = Trace()
    seen: set = set()
    step_code = type(engine).step.__code__
    stage = ["step"]

    def tracer(frame, event, arg):
        path = _relative(frame.f_code.co_filename)
        if path is None:
            return None
        if event == "call":
            caller = frame.f_back
            if caller is not None and caller.f_code is step_code and \
                    frame.f_code.co_name in STAGES:
                stage[0] = frame.f_code.co_name
            key = (path, frame.f_code.co_firstlineno)
            # Comprehensions and lambdas run as functions of their own: not listed.
            if key not in seen and "<" not in frame.f_code.co_name:
                seen.add(key)
                trace.calls.append(Call(
                    stage=stage[0], path=path, line=frame.f_code.co_firstlineno,
                    name=frame.f_code.co_qualname, doc=_doc_line(frame)))
        trace.lines[path].add(frame.f_lineno)
        return tracer

    sys.settrace(tracer)
    try:
        engine.step()
    finally:
        sys.settrace(None)
    return trace


def decode_engine(backend: str = "numpy", batch: int = 4):
    """An engine on the embedded model with `batch` requests, stepped until every one of
    them decodes (its next step computes one token)."""
    from refserve import LLM, SamplingParams

    llm = LLM(backend=backend, seed=0, progress=False)
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)),
                           SamplingParams(max_tokens=64, ignore_eos=True, seed=i))
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                   for s in scheduler.running):
        engine.step()
    return engine


def print_trace(trace: Trace, out=sys.stdout) -> None:
    """The calls stage by stage, then the totals."""
    current = None
    for call in trace.calls:
        if call.stage != current:
            current = call.stage
            print(f"\n== {current}", file=out)
        where = f"{call.path}:{call.line}"
        print(f"  {where:<44} {call.name}" + (f"  — {call.doc}" if call.doc else ""), file=out)
    print(f"\n{trace.num_files} files, {trace.num_statements} statements executed; those "
          f"files hold {trace.num_file_lines} lines", file=out)


def reading_list(trace: Trace) -> str:
    """The reading list of docs/architecture.md: every file the step executed, in the order
    the step first reaches it, with its statements executed, its lines and its docstring's
    first line."""
    order = list(dict.fromkeys(call.path for call in trace.calls))
    rows = ["| # | file | statements run / lines held | what it is |",
            "| --- | --- | --- | --- |"]
    for i, path in enumerate(order, start=1):
        source = (PACKAGE.parent / path).read_text()
        doc = source.split('"""')[1].strip().splitlines()[0] if source.startswith('"""') else ""
        rows.append(f"| {i} | `{path}` | {len(trace.statements(path))} / "
                    f"{trace.file_lines(path)} | {doc.replace('|', '/')} |")
    rows.append(f"| | **{trace.num_files} files** | **{trace.num_statements} / "
                f"{trace.num_file_lines}** | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="python -m refserve.tour",
        description="Trace one decode step of a small batch and print what it executed.")
    parser.add_argument("--backend", default="numpy", choices=BACKENDS,
                        help="numpy (the reference, default), cpu (the tuned CPU backend) "
                             "or auto")
    parser.add_argument("--batch", type=int, default=4, help="requests decoding (default 4)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the reading list of docs/architecture.md instead")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch {args.batch}: must be at least 1")
    try:
        engine = decode_engine(args.backend, args.batch)
    except (ValueError, RuntimeError) as e:
        print(f"refserve.tour: {e}", file=sys.stderr)
        return 2
    trace = trace_step(engine)
    if args.markdown:
        print(reading_list(trace))
    else:
        print(f"One decode step of {args.batch} requests on the {engine.backend.name} backend, "
              "stage by stage (each function at its first call):")
        print_trace(trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
