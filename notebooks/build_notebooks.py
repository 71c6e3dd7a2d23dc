"""Write the course notebooks (*.ipynb) from the cell sources below.

    python notebooks/build_notebooks.py           # rewrite every notebook
    python notebooks/build_notebooks.py --check   # exit 1 if a committed notebook differs

The notebooks are committed WITHOUT outputs (this script writes none), so git diffs stay
readable and nothing stale is ever shown; CI executes them top to bottom:

    pytest --nbmake notebooks/

Edit the cells here, not in Jupyter, then rerun this script. One file per notebook part:
`nb01.py` ... `nb04.py` each define CELLS, a list of ("md" | "code", source) pairs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
NOTEBOOKS = {
    "01_paged_kv_cache": "nb01",
    "02_one_scheduler_iteration": "nb02",
    "03_speculative_decoding": "nb03",
    "04_capacity_and_the_contract": "nb04",
}


def build(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate(cells):
        source = source.strip("\n")
        cell = (nbformat.v4.new_markdown_cell(source) if kind == "md"
                else nbformat.v4.new_code_cell(source))
        cell.id = f"c{i:02d}"  # stable ids: rebuilding an unchanged notebook changes nothing
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    sys.path.insert(0, str(HERE))
    try:
        module = importlib.import_module(NOTEBOOKS[name])
    finally:
        sys.path.remove(str(HERE))
    return nbformat.writes(build(module.CELLS)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if a notebook is missing or differs")
    parser.add_argument("names", nargs="*", choices=[[], *NOTEBOOKS], metavar="NAME",
                        help="only these notebooks (default: all)")
    args = parser.parse_args(argv)
    stale = []
    for name in args.names or NOTEBOOKS:
        path = HERE / f"{name}.ipynb"
        text = render(name)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"error: out of date (run python notebooks/build_notebooks.py): {stale}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
