"""The package's layering, read from the source with ``ast`` (imports inside functions too).

Layers, bottom-up (docs/concepts.md, "Architecture"): errors, units and numba_jit < plans (no torch) <
storage < engine < adapters and models < planning < wrapping < lightning, data, bench < cli.
A module imports only its own layer and those below; sibling packages of one layer do not
import each other; there is no import cycle; the package root holds the public API only.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "spikeckpt"

#: (module prefix, layer) — the longest matching prefix wins.
LAYERS: tuple[tuple[str, int], ...] = (
    ("spikeckpt.errors", 0),
    ("spikeckpt.units", 0),
    ("spikeckpt.numba_jit", 0),
    ("spikeckpt.plans", 1),
    ("spikeckpt.storage", 2),
    ("spikeckpt.engine", 3),
    ("spikeckpt.adapters", 4),
    ("spikeckpt.models", 4),
    ("spikeckpt.planning", 5),
    ("spikeckpt.wrapping", 6),
    ("spikeckpt", 6),  # the root package: the public API, which loads wrap & co. lazily
    ("spikeckpt.lightning", 7),
    ("spikeckpt.data", 7),
    ("spikeckpt.bench", 7),
    ("spikeckpt.cli", 8),
    ("spikeckpt.__main__", 8),
)

#: the package root may hold at most this many modules (files)
MAX_ROOT_MODULES = 8


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(name: str) -> tuple[str, int]:
    best = max((p for p, _ in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return best, dict(LAYERS)[best]


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The spikeckpt modules ``name`` imports, anywhere in the file (resolved to modules)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import submodule` imports the submodule; `from mod import name`, mod
            subs = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t for t in subs if t in known] or [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("spikeckpt") and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_every_module_has_a_layer() -> None:
    for name in _modules():
        assert _layer(name)[1] >= 0, name


def test_imports_point_down() -> None:
    wrong = []
    for name, targets in _graph().items():
        if name == "spikeckpt":  # the root re-exports the public API (lazily, by name)
            continue
        group, layer = _layer(name)
        for target in targets:
            target_group, target_layer = _layer(target)
            if target_layer > layer:
                wrong.append(f"{name} (layer {layer}) imports {target} (layer {target_layer})")
            elif target_layer == layer and target_group != group and layer in (4, 7):
                wrong.append(f"{name} imports its sibling {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = _graph()
    graph["spikeckpt"] = {t for t in graph["spikeckpt"] if _layer(t)[1] <= 1}  # eager ones
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_engine_knows_no_adapters_or_frameworks() -> None:
    for name, path in _modules().items():
        if not name.startswith(("spikeckpt.engine", "spikeckpt.storage", "spikeckpt.plans")):
            continue
        text = path.read_text()
        for word in ("snntorch", "norse", "lightning", "tonic", "spikeckpt.adapters"):
            assert f"import {word}" not in text and f"from {word}" not in text, (name, word)


def test_the_package_root_is_the_public_api() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
