"""Every error spikeckpt raises on purpose is a ``SpikeckptError`` (errors.py promises it).

The test reads every ``raise`` statement of the package with ``ast`` and resolves what it
raises: a class (``raise ConfigError(...)``), or a helper that builds the exception (its
return annotation: ``def unsupported(...) -> UnsupportedLayerError``). A re-raise of an
exception object (``raise error``, ``raise errors[0]``) passes. Besides ``SpikeckptError``
subclasses, only the exceptions of Python's own protocols are allowed (:data:`PROTOCOL`), and
a few internal seams that never reach the user (:data:`INTERNAL`).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import typing
from pathlib import Path

import pytest

import spikeckpt
from spikeckpt.errors import SpikeckptError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "spikeckpt"

#: Python's protocols: abstract methods, unreachable code, attribute and sequence/mapping
#: access (``hasattr``, ``for`` loops, ``in``), Ctrl-C, and argparse's ``type=`` functions
#: (argparse turns an ``ArgumentTypeError`` into a usage message).
PROTOCOL: tuple[type[BaseException], ...] = (
    NotImplementedError,
    AssertionError,
    AttributeError,
    IndexError,
    KeyError,
    StopIteration,
    KeyboardInterrupt,  # Ctrl-C, raised again after the command line's own cleanup
    argparse.ArgumentTypeError,
)

#: ``(module, exception name)``: raised and caught inside the package, never seen by a user.
INTERNAL = {
    ("spikeckpt.storage.disk", "OSError"),  # the write/read seams; callers raise StorageError
    ("spikeckpt.plans.simulate", "_NotLocal"),  # control flow of the simulator
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _local_imports(tree: ast.AST) -> dict[str, typing.Any]:
    """Names imported inside functions (``from spikeckpt.data.errors import X`` in a body)."""
    names: dict[str, typing.Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                module = importlib.import_module(node.module)
                if hasattr(module, alias.name):
                    names[alias.asname or alias.name] = getattr(module, alias.name)
    return names


def _resolve(expr: ast.expr, scope: dict[str, typing.Any]) -> typing.Any:
    """The object a name or dotted name means in ``scope`` (None when it is not there)."""
    if isinstance(expr, ast.Name):
        return scope.get(expr.id)
    if isinstance(expr, ast.Attribute):
        owner = _resolve(expr.value, scope)
        return getattr(owner, expr.attr, None) if owner is not None else None
    return None


Defs = dict[str, tuple[ast.FunctionDef, dict[str, typing.Any]]]


def _raised(node: ast.Raise, scope: dict[str, typing.Any], defs: Defs) -> tuple[str, type | None]:
    """``(what the statement raises, as written; the exception class it resolves to)``;
    the class is None for a re-raise of an exception object."""
    exc = node.exc
    assert exc is not None
    func = exc.func if isinstance(exc, ast.Call) else exc
    text = ast.unparse(func)
    target = _resolve(func, scope)
    if isinstance(target, type):
        return text, target
    if not isinstance(exc, ast.Call):
        return text, None  # ``raise error``: an exception object raised again
    if callable(target):  # a helper imported or defined at the module's top
        return text, typing.get_type_hints(target).get("return")
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    definition, where = defs.get(name, (None, scope)) if name else (None, scope)
    assert definition is not None and definition.returns is not None, (
        f"cannot tell what `raise {ast.unparse(exc)}` raises: give {text} a return annotation"
    )
    annotation = ast.unparse(definition.returns)
    return text, eval(annotation, dict(where))  # noqa: S307 - a name in the package's source


def _raises() -> list[tuple[str, int, str, type | None]]:
    modules: list[tuple[str, ast.AST, dict[str, typing.Any]]] = []
    defs: Defs = {}  # every function and method of the package, by name (methods of a base)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":  # runs the command line when imported; raises nothing
            continue
        name = _module_name(path)
        tree = ast.parse(path.read_text())
        module = vars(importlib.import_module(name))
        scope = {**vars(builtins), **_local_imports(tree), **module}
        modules.append((name, tree, scope))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.returns is not None:
                defs.setdefault(node.name, (node, scope))
    found = []
    for name, tree, scope in modules:
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text, cls = _raised(node, scope, defs)
                found.append((name, node.lineno, text, cls))
    return found


def test_every_deliberate_error_is_a_spikeckpt_error() -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("tonic")
    raises = _raises()
    assert len(raises) > 150  # the reading found the package's raise statements
    wrong = [
        f"{module}:{line} raise {text}"
        for module, line, text, cls in raises
        if cls is not None
        and not issubclass(cls, SpikeckptError)
        and not issubclass(cls, PROTOCOL)
        and (module, text) not in INTERNAL
    ]
    assert not wrong, "raise a SpikeckptError subclass (spikeckpt.errors) instead:\n" + "\n".join(
        wrong
    )


def test_the_error_classes_are_the_builtins_they_stand_for() -> None:
    assert issubclass(spikeckpt.ConfigError, ValueError)
    assert issubclass(spikeckpt.ConfigTypeError, TypeError)
    assert issubclass(spikeckpt.UsageError, RuntimeError)
    for cls in (spikeckpt.ConfigError, spikeckpt.ConfigTypeError, spikeckpt.UsageError):
        assert issubclass(cls, SpikeckptError)
    with pytest.raises(spikeckpt.ConfigError, match="granularity"):
        spikeckpt.wrap(__import__("torch").nn.Linear(2, 2), granularity="layers")
    with pytest.raises(spikeckpt.ConfigError, match="cannot parse"):
        spikeckpt.parse_bytes("12 parsecs")


@pytest.mark.parametrize("share", ["25%", 0.25])
def test_a_share_given_as_a_budget_names_where_shares_are_read(share: object) -> None:
    """``wrap(budget="25%")`` after ``spikeckpt plan --budget 25%``: the error says that a
    share is not a byte count here and which entry points read one, and what each means."""
    nn = pytest.importorskip("torch").nn
    budget_callback = pytest.importorskip("spikeckpt.lightning").MemoryBudget
    for call in (
        lambda: spikeckpt.wrap(nn.Linear(2, 2), budget=share),
        lambda: budget_callback(share),
    ):
        with pytest.raises(spikeckpt.ConfigError, match=r"MemoryBudget\(fraction=0\.25\)"):
            call()
