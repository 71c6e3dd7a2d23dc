"""One owner per lifecycle, checked on the source (issue 15): a sequence finishes in one
place (`SchedulerBase.update` retires it, `abort` is the user's way out), output processing
only reports, and draft tokens never live on a Sequence."""

from __future__ import annotations

import ast
from pathlib import Path

import refserve

ROOT = Path(refserve.__file__).parent
FINISHED = ("FINISHED_STOPPED", "FINISHED_LENGTH", "FINISHED_ABORTED")


def finishing_sites(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of every `x.status = <a finished status>` and every call
    of `_retire(...)` in a module."""
    sites = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef,
                                                   ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "status" for t in child.targets):
                value = ast.unparse(child.value)
                if any(f in value for f in FINISHED) or value == "status":
                    sites.append((name, child.lineno))
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr == "_retire"):
                sites.append((name, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return sites


def all_finishing_sites() -> dict[str, list[str]]:
    found = {}
    for path in ROOT.rglob("*.py"):
        sites = finishing_sites(ast.parse(path.read_text()))
        if sites:
            found[str(path.relative_to(ROOT))] = sorted({func for func, _ in sites})
    return found


def test_a_sequence_finishes_only_in_update_retire_or_abort():
    assert all_finishing_sites() == {
        "scheduler/base.py": ["_retire", "abort", "update"]}


def test_the_checker_sees_a_second_retirement_path():
    """Negative control: output processing that finishes a sequence itself is found."""
    src = ("def advance_text(seq):\n"
           "    seq.status = SequenceStatus.FINISHED_STOPPED\n"
           "def make(s):\n    s.scheduler._retire(s, 1)\n")
    assert [f for f, _ in finishing_sites(ast.parse(src))] == ["advance_text", "make"]


def test_output_processing_only_reads_what_update_decided():
    tree = ast.parse((ROOT / "output_processor.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not {"engine", "scheduler"} & (names | attrs), "output_processor reaches back"
    assert not {"finish", "abort", "_retire", "status"} & {
        ast.unparse(t).split(".")[-1] for n in ast.walk(tree) if isinstance(n, ast.Assign)
        for t in n.targets}


def test_no_draft_tokens_on_a_sequence():
    """Drafts are values of one step (scheduler/drafts.py); nothing stores them on a
    Sequence."""
    for path in ROOT.rglob("*.py"):
        assert "spec_token_ids" not in path.read_text(), path
