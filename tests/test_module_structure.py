"""The package's import structure (issue 7, part 3): no import circles, and no core module
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
               "refserve.serve", "refserve.course", "refserve.simulate", "refserve.plan"}


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
