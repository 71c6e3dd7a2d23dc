"""The simulator and the command lines use the engine's rules; none restates one.

- blocks are counted by `blocks_for_tokens` only: no ceiling division by a block size is
  written anywhere else in refserve/ (an AST scan, with negative controls);
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import refserve
from refserve.config import EngineConfig

PACKAGE = Path(refserve.__file__).parent


# ---- blocks are counted by blocks_for_tokens -----------------------------------------------

# The one place the ceiling is written: the course's first exercise.
CEILING_OWNER = ("refserve/kv_cache/block_table.py", "blocks_for_tokens")


def _is_block_size(node: ast.expr) -> bool:
    """A divisor that is a block size: a name or attribute spelled block_size (or bs, the
    short name the KV-cache code uses), or the default block size written as a literal."""
    if isinstance(node, ast.Constant):
        return node.value == EngineConfig.block_size
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name == "bs" or "block_size" in name.lower()


def _ceiling_divisor(node: ast.AST) -> ast.expr | None:
    """The divisor when `node` is a ceiling division written out, else None. The forms:
    -(-a // b), (a + b - 1) // b, and ceil(a / b) (math.ceil, np.ceil or a bare ceil)."""
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.BinOp)
            and isinstance(node.operand.op, ast.FloorDiv)
            and isinstance(node.operand.left, ast.UnaryOp)
            and isinstance(node.operand.left.op, ast.USub)):
        return node.operand.right
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
        left = node.left
        # a + b - 1 parses as (a + b) - 1, a + (b - 1) as written
        if (isinstance(left, ast.BinOp) and isinstance(left.op, ast.Sub)
                and isinstance(left.right, ast.Constant) and left.right.value == 1
                and isinstance(left.left, ast.BinOp) and isinstance(left.left.op, ast.Add)):
            return node.right
        if (isinstance(left, ast.BinOp) and isinstance(left.op, ast.Add)
                and isinstance(left.right, ast.BinOp) and isinstance(left.right.op, ast.Sub)):
            return node.right
    if isinstance(node, ast.Call) and len(node.args) == 1:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        arg = node.args[0]
        if name == "ceil" and isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Div):
            return arg.right
    return None


def inlined_block_ceilings(source: str, path: str = "<string>") -> list[str]:
    """'path:line: text' of every ceiling division by a block size in `source`, outside
    blocks_for_tokens itself."""
    tree = ast.parse(source)
    owners: dict[int, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(fn):
                owners.setdefault(id(inner), fn.name)
    found = []
    for node in ast.walk(tree):
        divisor = _ceiling_divisor(node)
        if divisor is None or not _is_block_size(divisor):
            continue
        if (path, owners.get(id(node))) == CEILING_OWNER:
            continue
        found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_block_ceiling_is_written_outside_blocks_for_tokens():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        found += inlined_block_ceilings(path.read_text(), rel)
    assert not found, ("count blocks with blocks_for_tokens (refserve/kv_cache/"
                       "block_table.py), not a ceiling of your own:\n" + "\n".join(found))


@pytest.mark.parametrize("snippet", [
    "n = -(-tokens // block_size)",
    "n = -(-tokens // self.block_size)",
    "n = -(-end // bs)",
    "n = batch * -(-tokens // 16)",
    "n = (tokens + block_size - 1) // block_size",
    "n = (tokens + (bs - 1)) // bs",
    "n = math.ceil(tokens / config.block_size)",
    "n = int(np.ceil(tokens / block_size))",
    "n = ceil(tokens / bs)",
])
def test_the_scan_finds_each_written_out_ceiling(snippet):
    assert len(inlined_block_ceilings(snippet)) == 1


@pytest.mark.parametrize("snippet", [
    "n = blocks_for_tokens(tokens, block_size)",
    "logical = p // block_size",                   # a floor: the block a position lies in
    "full = (len(tokens) - 1) // bs",              # a floor: full blocks before the last
    "tiles = -(-q // tile)",                       # a ceiling, of attention tiles
    "parts = -(-context // partition_size)",
])
def test_the_scan_leaves_floors_and_other_ceilings_alone(snippet):
    assert inlined_block_ceilings(snippet) == []


def test_the_scan_sees_the_exercise_when_it_is_not_the_owner():
    path, _ = CEILING_OWNER
    source = (PACKAGE.parent / path).read_text()
    assert inlined_block_ceilings(source, path) == []
    assert len(inlined_block_ceilings(source, "elsewhere.py")) == 1
