"""The house stays readable: module sizes and function complexity in the engine and planning.

The limits (issue 26): no module over :data:`MAX_LINES` lines and no function over cyclomatic
complexity :data:`MAX_COMPLEXITY` in ``spikeckpt/engine/``, ``spikeckpt/planning/`` and
``spikeckpt/wrapping.py``. Complexity is computed here from the ``ast``, McCabe's count as
radon counts it: 1, plus one per ``if``/``elif``, conditional expression, ``assert``, loop
(two with an ``else``), ``except`` clause (and a ``try``'s ``else``), comprehension ``for``
and its ``if`` clauses, ``match`` case, and one per boolean operand beyond the first. A nested
function or class is measured on its own, not in the function around it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "spikeckpt"
CHECKED = [PACKAGE / "engine", PACKAGE / "planning", PACKAGE / "wrapping.py"]
MAX_LINES = 700
MAX_COMPLEXITY = 20

_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _files() -> list[Path]:
    files: list[Path] = []
    for path in CHECKED:
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def complexity(function: ast.AST) -> int:
    """Cyclomatic complexity of one function (its nested functions left out)."""
    count = 1
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, _NESTED):
            continue
        if isinstance(node, (ast.If, ast.IfExp, ast.Assert, ast.match_case)):
            count += 1
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            count += 1 + bool(node.orelse)
        elif isinstance(node, ast.Try):
            count += len(node.handlers) + bool(node.orelse)
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            count += 1 + len(node.ifs)
        todo.extend(ast.iter_child_nodes(node))
    return count


def test_complexity_counts_decisions() -> None:
    source = """
def f(a, b):
    if a and b or a:
        return [x for x in a if x]
    for _ in b:
        pass
    else:
        pass
    try:
        pass
    except ValueError:
        pass
    def inner():
        if a:
            pass
    return 1 if a else 2
"""
    function = ast.parse(source).body[0]
    # 1 + if + (and, or) + comprehension for + its if + loop with else + except + ternary
    assert complexity(function) == 1 + 1 + 2 + 2 + 2 + 1 + 1


def test_modules_are_short() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _files()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_functions_are_simple() -> None:
    complex_ = {}
    for path in _files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                c = complexity(node)
                if c > MAX_COMPLEXITY:
                    complex_[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = c
    assert not complex_, f"functions over complexity {MAX_COMPLEXITY}: {complex_}"
