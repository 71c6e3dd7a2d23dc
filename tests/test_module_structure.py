"""The package's import structure: no import circles, and no core module
imports a command-line module. Checked on the source with `ast`, so a circle shows up here
even where Python tolerates it at run time (e.g. one side importing lazily in a function)."""

import ast
import subprocess
import sys
from pathlib import Path

import refserve

ROOT = Path(refserve.__file__).parent
# Entry points: they may import anything; nothing else may import them.
CLI_MODULES = {"refserve.capacity_cli", "refserve.generate", "refserve.bench",
               "refserve.serve", "refserve.course", "refserve.simulate", "refserve.plan",
               "refserve.tour"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, lazy: bool) -> set[str]:
    """refserve modules `path` imports: at module level, plus (lazy=True) inside functions.
    Blocks under `if TYPE_CHECKING:` and `if __name__ == "__main__":` do not count."""
    tree = ast.parse(path.read_text())
    found = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("refserve"))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("refserve"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test and "__main__" not in test:
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, (ast.Try, ast.With)):
                visit(node.body)
            elif lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                            ast.ClassDef)):
                visit(node.body)

    visit(tree.body)
    return found


def import_graph(lazy: bool = True) -> dict[str, set[str]]:
    """module -> refserve modules it imports. Importing the root package or one's own parent
    package is left out: Python has always loaded those first."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in imports_of(path, lazy) if m in modules and m != name
                   and m != "refserve" and not name.startswith(m + ".")}
            for name, path in modules.items()}


def find_cycle(graph):
    state, stack = {}, []

    def dfs(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_no_import_circle():
    graph = import_graph()
    assert "refserve.models.config" in graph["refserve.models.llama"]
    assert "refserve.models.llama" in graph["refserve.models.loader"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
    """Negative control for the checker itself."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_modules_import_no_cli_module():
    graph = import_graph(lazy=False)
    for name, imports in graph.items():
        if name in CLI_MODULES or name.endswith("__main__") or ".entrypoints" in name:
            continue
        assert not imports & CLI_MODULES, f"{name} imports {imports & CLI_MODULES}"
    # And at run time: importing the engine loads neither argparse CLI.
    code = ("import sys, refserve.engine; "
            "print([m for m in ('refserve.capacity_cli', 'refserve.generate') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_one_list_of_backend_names():
    from refserve import backends, config

    assert not hasattr(backends, "VALID_BACKENDS")
    assert backends.BACKENDS is config.BACKENDS


# ---- the floors of the house ------------------------------------------------------------

# Bottom up (docs/architecture.md, "Floors"): a module may import its own floor and the
# floors below, never one above, lazy imports inside functions included. Every module has
# a floor: a new module that fits none of these fails `test_every_module_has_a_floor`.
# A prefix names a module and everything under it, except the root package, "refserve",
# which names itself only (else it would give every module the top floor).
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("config, params, sequence", (
        "refserve.config", "refserve.speculative_config",
        "refserve.sampling_params", "refserve.logits_processors",
        "refserve.logprobs", "refserve.inputs", "refserve.metrics",
        "refserve.outputs", "refserve.sequence", "refserve.benchmark_datasets")),
    ("kv cache and capacity", ("refserve.kv_cache", "refserve.capacity")),
    ("scheduler", ("refserve.scheduler",)),
    ("the sample stage", ("refserve.sampling",)),
    ("backends and models", ("refserve.backends", "refserve.models")),
    ("model runner", ("refserve.model_runner", "refserve.static_runner")),
    ("the propose stage", ("refserve.spec_decode",)),
    ("engine", ("refserve.engine", "refserve.engine_setup", "refserve.request_intake",
                "refserve.output_processor", "refserve.prompt_logprobs")),
    ("llm, entrypoints, CLIs, bench, simulator", (
        "refserve", "refserve.__main__", "refserve.llm", "refserve.entrypoints",
        "refserve.generate", "refserve.serve", "refserve.bench", "refserve.capacity_cli",
        "refserve.selfcheck", "refserve.course", "refserve.course_exercises",
        "refserve.course_grade", "refserve.tour", "refserve.war_stories",
        "refserve.war_story_spec", "refserve.prompt_files", "refserve.simulator",
        "refserve.simulate", "refserve.plan")),
]


def floor_of(module: str) -> int | None:
    """The floor (0 = bottom) of `module`: the floor of the longest prefix naming it."""
    best, best_len = None, -1
    for floor, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            names = module == prefix or (prefix != "refserve"
                                         and module.startswith(prefix + "."))
            if names and len(prefix) > best_len:
                best, best_len = floor, len(prefix)
    return best


def uphill_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (floor {floor_of(a)}: {FLOORS[floor_of(a)][0]}) imports {b} "
                  f"(floor {floor_of(b)}: {FLOORS[floor_of(b)][0]})"
                  for a, imports in graph.items() for b in imports
                  if floor_of(b) > floor_of(a))


def modules_without_a_floor(modules) -> list[str]:
    return sorted(m for m in modules if floor_of(m) is None)


def test_every_module_has_a_floor():
    missing = modules_without_a_floor(import_graph())
    assert not missing, f"give these modules a floor in FLOORS: {missing}"


def test_a_module_without_a_floor_is_reported():
    """Negative control: a new top-level module, or one under the root package's name but
    no listed prefix, has no floor until FLOORS gives it one."""
    assert modules_without_a_floor(["refserve.new_idea", "refserve.samplingx",
                                    "refserve.sampling.new_op", "refserve"]) == [
        "refserve.new_idea", "refserve.samplingx"]


def test_no_module_imports_one_above_it():
    graph = import_graph(lazy=True)
    # the root package is the top floor (it re-exports LLM), so it is a source, never a target
    graph = {name: {m for m in imports if m != "refserve"} for name, imports in graph.items()}
    assert not uphill_imports(graph), "\n".join(uphill_imports(graph))


def test_uphill_checker_catches_an_uphill_import():
    """Negative control: the scheduler importing the engine, or a backend importing the
    propose stage (lazily or not), is reported; the backend's own op contract in the sample
    stage is not."""
    assert floor_of("refserve.scheduler.scheduler") < floor_of("refserve.engine")
    assert floor_of("refserve.kv_cache") == 1 and floor_of("refserve") == len(FLOORS) - 1
    bad = uphill_imports({"refserve.scheduler.scheduler": {"refserve.engine"},
                          "refserve.backends.base": {"refserve.spec_decode.speculator",
                                                     "refserve.sampling.rejection_sampler"},
                          "refserve.engine": {"refserve.scheduler"}})
    assert len(bad) == 2 and "refserve.backends.base" in bad[0], bad
    assert "refserve.scheduler.scheduler" in bad[1]


def test_no_backend_imports_speculation_or_the_engine():
    """The backends implement the sample stage's ops (sampling_weights, sample,
    rejection_sample) and import nothing of the propose stage, the runner or the engine:
    every refserve import of refserve/backends/ is on a floor at or below its own."""
    graph = import_graph(lazy=True)
    backends = {name: imports for name, imports in graph.items()
                if name.startswith("refserve.backends")}
    assert len(backends) >= 8
    above = {name: sorted(m for m in imports if floor_of(m) > floor_of("refserve.backends"))
             for name, imports in backends.items()}
    assert not any(above.values()), above
    assert "refserve.sampling.rejection_sampler" in graph["refserve.backends.base"]


# ---- notebooks use only public names ----------------------------------------------------

NOTEBOOKS = ROOT.parent / "notebooks"


def private_accesses(source: str) -> list[str]:
    """`obj._name` accesses in Python source (dunders like __name__ are fine)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_notebooks_use_only_public_names():
    import json

    sources = {p.name: p.read_text() for p in [NOTEBOOKS / "kvpictures.py"]}
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                sources[f"{path.name} cell {i}"] = "".join(cell["source"])
    assert len(sources) >= 5
    bad = {where: found for where, src in sources.items() if (found := private_accesses(src))}
    assert not bad, f"notebooks must use only public names: {bad}"


def test_private_access_checker_catches_one():
    assert private_accesses("engine._postprocess(out)\nx = a.__class__") == [
        "line 1: engine._postprocess"]
