"""One owner per lifecycle, checked on the source: a sequence finishes in one
place (`Scheduler.update` retires it, `abort` is the user's way out), output processing
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
        "scheduler/scheduler.py": ["_retire", "abort", "update"]}


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


def computed_token_writers(tree: ast.AST) -> list[str]:
    """Functions that assign to some `x.num_computed_tokens` (in a module's source)."""
    sites = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else func
            targets = (child.targets if isinstance(child, ast.Assign) else
                       [child.target] if isinstance(child, (ast.AugAssign, ast.AnnAssign))
                       else [])
            if any(isinstance(t, ast.Attribute) and t.attr == "num_computed_tokens"
                   for t in targets):
                sites.append(name)
            visit(child, name)

    visit(tree, "<module>")
    return sorted(set(sites))


def test_num_computed_tokens_has_one_writer_in_the_scheduler():
    """update advances it, preemption by recompute resets it; a Sequence sets it when it is
    made (or forked), and the draft-model proposer keeps its own shadow sequences."""
    found = {}
    for path in ROOT.rglob("*.py"):
        if path.stem == "demo" or path.stem.endswith("_demo"):
            continue  # worked examples set a sequence's state by hand
        source = path.read_text().split('if __name__ == "__main__":')[0]  # demos aside
        writers = computed_token_writers(ast.parse(source))
        if writers:
            found[str(path.relative_to(ROOT))] = writers
    assert found == {"scheduler/scheduler.py": ["_preempt", "update"],
                     "sequence.py": ["__init__", "fork"],
                     "spec_decode/draft_model.py": ["_sync", "propose"]}
    # negative control: a second writer is seen
    assert computed_token_writers(ast.parse(
        "def _add_row(seq):\n    seq.num_computed_tokens += 4\n")) == ["_add_row"]


def test_output_processing_forgets_nothing():
    """Finished requests are forgotten by the engine; the output processor deletes nothing."""
    tree = ast.parse((ROOT / "output_processor.py").read_text())
    assert not any(isinstance(n, ast.Delete) for n in ast.walk(tree))


def test_no_draft_tokens_on_a_sequence():
    """Drafts are values of one step (scheduler/drafts.py); nothing stores them on a
    Sequence."""
    for path in ROOT.rglob("*.py"):
        assert "spec_token_ids" not in path.read_text(), path
