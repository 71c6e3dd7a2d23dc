"""Every third-party module the project imports is declared in pyproject.toml.

A package installed by hand on one machine must never hide a missing dependency: CI
installs exactly `pip install -e ".[dev]"` into a fresh virtual environment, so whatever
tests/, notebooks/ (the .py sources and the .ipynb cells) and refserve/ import must be in
`dependencies` or the `dev` extra. The one exception is the GPU stack, which lives in the
`gpu` extra and whose imports the code guards (tests skip with "no GPU").

Import names are mapped to distributions with importlib.metadata (scipy -> scipy,
yaml -> PyYAML); a module that is not installed at all is reported too.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("refserve", "tests", "notebooks")
GPU_ONLY = {"cupy", "cupyx"}  # the `gpu` extra (cupyx ships in cupy), imported behind a guard
# Imported only by refserve/bench/offline_worker.py when vLLM's own environment runs it (bench
# compare --in-process --peer-python): never refserve's dependency.
PEER_ONLY = {"vllm"}
# Needed without being imported: pytest's --nbmake in addopts, ruff in .ci/run.
TOOLS = {"nbmake", "ruff", "pytest"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    return {normalize(re.match(r"[A-Za-z0-9._-]+", r.strip()).group(0)) for r in requirements}


def declared(pyproject: dict) -> dict[str, set[str]]:
    project = pyproject["project"]
    return {"dependencies": requirement_names(project["dependencies"]),
            **{extra: requirement_names(reqs)
               for extra, reqs in project["optional-dependencies"].items()}}


def imported_modules(source: str) -> set[str]:
    """Top-level names of the absolute imports in Python source (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def project_sources(root: Path) -> dict[str, str]:
    """path -> Python source, for every .py file and every notebook code cell."""
    sources = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            sources[str(path.relative_to(root))] = path.read_text()
        for path in sorted((root / folder).rglob("*.ipynb")):
            cells = [c for c in json.loads(path.read_text())["cells"]
                     if c["cell_type"] == "code"]
            for i, cell in enumerate(cells):
                code = "".join(cell["source"])
                # IPython magics (%matplotlib, !pip) are not Python.
                code = "\n".join(ln for ln in code.splitlines()
                                 if not ln.lstrip().startswith(("%", "!")))
                sources[f"{path.relative_to(root)}[cell {i}]"] = code
    return sources


def local_modules(root: Path) -> set[str]:
    """Modules that are the project's own: the package and the helpers next to the tests
    and notebooks (model_utils, grading, cuda_sim, kvpictures, ...)."""
    names = {"refserve"}
    for folder in SOURCE_FOLDERS:
        for path in (root / folder).iterdir():
            if path.suffix == ".py" or (path / "__init__.py").is_file():
                names.add(path.stem)
    return names


def undeclared_imports(sources: dict[str, str], allowed: set[str], local: set[str],
                       distributions: dict[str, list[str]]) -> dict[str, list[str]]:
    """module -> files importing it, for each third-party module whose distribution is not
    in `allowed` (normalized names)."""
    missing: dict[str, list[str]] = {}
    for where, code in sources.items():
        for module in imported_modules(code):
            if module in sys.stdlib_module_names or module in local or module in GPU_ONLY \
                    or module in PEER_ONLY:
                continue
            dists = {normalize(d) for d in distributions.get(module, [module])}
            if not dists & allowed:
                missing.setdefault(module, []).append(where)
    return missing


@pytest.fixture(scope="module")
def pyproject():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_imported_module_is_declared(pyproject):
    groups = declared(pyproject)
    allowed = groups["dependencies"] | groups["dev"]
    missing = undeclared_imports(project_sources(ROOT), allowed, local_modules(ROOT),
                                 packages_distributions())
    assert not missing, "imported but not in dependencies or the dev extra: " + "; ".join(
        f"{m} (by {', '.join(w[:3])})" for m, w in sorted(missing.items()))
    assert TOOLS <= groups["dev"], f"tools CI runs, missing from dev: {TOOLS - groups['dev']}"
    assert any(d.startswith("cupy") for d in groups["gpu"]), "GPU_ONLY must be the gpu extra"


def test_the_check_finds_an_undeclared_import(pyproject):
    """Negative control: scipy imported by a test, but left out of the declared set; and a
    module no distribution provides at all."""
    groups = declared(pyproject)
    allowed = (groups["dependencies"] | groups["dev"]) - {"scipy"}
    sources = {"tests/test_x.py": "import numpy\ndef f():\n    from scipy import stats\n",
               "notebooks/n.ipynb[cell 0]": "import not_a_real_module_anywhere\n",
               "tests/test_y.py": "import json\nfrom model_utils import x\nimport cupy\n"}
    missing = undeclared_imports(sources, allowed, local_modules(ROOT),
                                 packages_distributions())
    assert missing == {"scipy": ["tests/test_x.py"],
                       "not_a_real_module_anywhere": ["notebooks/n.ipynb[cell 0]"]}
