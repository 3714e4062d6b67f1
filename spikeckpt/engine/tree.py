"""State pytrees: flatten a state (tensor, tuple, NamedTuple, dict, nested) to a list of tensors.

The executor works on flat lists of tensors ("leaves"); `TreeDef` remembers how to
rebuild the user's structure. A bare tensor, a flat tuple/list/NamedTuple of tensors and nested
tuples/lists/NamedTuples of tensors (a stack's per-layer states) take a fast path (no
``torch.utils._pytree`` call per step: its flatten and unflatten cost about 30 us per step for
a two-layer state, a tenth of a LIF step on a CPU); anything else (dicts, other containers)
goes through ``torch.utils._pytree``.

This module is the package's one pytree: every other module flattens, rebuilds and maps
structures through it (`tree_flatten`, `tree_unflatten`, `tree_map`, `tree_leaves`,
`tree_structure`), never through ``torch.utils._pytree`` directly.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.utils import _pytree as pytree

from spikeckpt.errors import ConfigTypeError
from spikeckpt.storage.base import tensor_nbytes

__all__ = [
    "refuse_non_tensor_leaves",
    "TreeDef",
    "fresh_containers",
    "is_float",
    "leaf_bytes",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_structure",
    "tree_unflatten",
]


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


# A nested structure of tuples, lists and NamedTuples: ``None`` for a tensor leaf, else
# ``(cls, is_namedtuple, children)``.
_Nested = Any


def _nested_spec(obj: Any) -> _Nested | bool:
    """The nested spec of ``obj``, or False when it holds anything but tensors in tuples,
    lists and NamedTuples."""
    if isinstance(obj, Tensor):
        return None
    if type(obj) in (tuple, list) or _is_namedtuple(obj):
        children = []
        for child in obj:
            spec = _nested_spec(child)
            if spec is False:
                return False
            children.append(spec)
        return (type(obj), _is_namedtuple(obj), tuple(children))
    return False


def _compile_nested(spec: _Nested) -> tuple[Any, Any]:
    """Straight-line ``flatten(obj) -> leaves | None`` and ``unflatten(leaves) -> obj`` for a
    nested spec (generated once per structure: a few attribute loads per step instead of a
    recursive walk)."""
    env: dict[str, Any] = {"Tensor": Tensor}
    checks: list[str] = []
    leaves: list[str] = []

    def visit(node: _Nested, name: str) -> str:
        if node is None:
            leaves.append(name)
            return f"l[{len(leaves) - 1}]"
        cls, named, children = node
        cls_name = f"C{len(env)}"
        env[cls_name] = cls
        checks.append(f"    if type({name}) is not {cls_name} or len({name}) != {len(children)}:")
        checks.append("        return None")
        parts = []
        for i, child in enumerate(children):
            child_name = f"{name}_{i}"
            checks.append(f"    {child_name} = {name}[{i}]")
            parts.append(visit(child, child_name))
        inner = ", ".join(parts)
        if named:
            return f"{cls_name}({inner})"
        if cls is tuple:
            return f"({inner},)" if len(parts) == 1 else f"({inner})"
        return f"[{inner}]" if cls is list else f"{cls_name}([{inner}])"

    built = visit(spec, "o")
    tensors = " and ".join(f"isinstance({n}, Tensor)" for n in leaves) or "True"
    source = "\n".join(
        [
            "def flatten(o):",
            *checks,
            f"    if not ({tensors}):",
            "        return None",
            f"    return [{', '.join(leaves)}]",
            "def unflatten(l):",
            f"    return {built}",
        ]
    )
    exec(compile(source, "<spikeckpt.engine.tree>", "exec"), env)  # noqa: S102 - our own code
    return env["flatten"], env["unflatten"]


class TreeDef:
    """How to rebuild a structure from its leaves.

    Build one with `tree_flatten`. ``unflatten(leaves)`` rebuilds; ``flatten(obj)``
    flattens an object of the same structure (it returns ``None`` when the structure differs,
    so callers can raise a precise error).
    """

    __slots__ = ("kind", "spec", "cls", "count", "names", "_flatten", "_unflatten")

    def __init__(self, kind: str, spec: Any, cls: type[Any] | None, count: int, names: list[str]):
        self.kind = kind  # "tensor" | "tuple" | "list" | "namedtuple" | "nested" | "pytree"
        self.spec = spec
        self.cls = cls
        self.count = count
        self.names = names
        if kind == "nested":
            self._flatten, self._unflatten = _compile_nested(spec)

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        """Rebuild the structure from ``leaves`` (a list of ``count`` tensors)."""
        kind = self.kind
        if kind == "tensor":
            return leaves[0]
        if kind == "tuple":
            return tuple(leaves)
        if kind == "list":
            return list(leaves)
        if kind == "namedtuple":
            return self.cls(*leaves)  # type: ignore[misc]
        if kind == "nested":
            return self._unflatten(leaves)
        return pytree.tree_unflatten(list(leaves), self.spec)

    def flatten(self, obj: Any) -> list[Any] | None:
        """Leaves of ``obj`` if it has this structure, else ``None``."""
        kind = self.kind
        if kind == "tensor":
            return [obj] if isinstance(obj, Tensor) else None
        if kind in ("tuple", "list", "namedtuple"):
            if type(obj) is not self.cls or len(obj) != self.count:
                return None
            if not all(isinstance(leaf, Tensor) for leaf in obj):
                return None
            return list(obj)
        if kind == "nested":
            return self._flatten(obj)  # type: ignore[no-any-return]
        leaves, spec = pytree.tree_flatten(obj)
        return leaves if spec == self.spec else None

    def describe(self) -> str:
        """A short human-readable description (for error messages)."""
        if self.kind == "tensor":
            return "a tensor"
        if self.kind in ("pytree", "nested"):
            return f"a pytree {self._pytree_spec()}"
        name = self.cls.__name__ if self.cls is not None else self.kind
        return f"a {name} of {self.count} tensors"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TreeDef) or other.kind != self.kind:
            return False
        if self.kind in ("pytree", "nested"):
            return bool(self.spec == other.spec)
        return self.cls is other.cls and self.count == other.count

    def _pytree_spec(self) -> Any:
        if self.kind != "nested":
            return self.spec
        return pytree.tree_structure(self.unflatten([0] * self.count))

    def __hash__(self) -> int:  # pragma: no cover - not used as a key
        return hash((self.kind, self.count))


def tree_flatten(obj: Any) -> tuple[list[Any], TreeDef]:
    """Flatten ``obj`` into its leaves and a `TreeDef` (leaves may be non-tensors)."""
    if isinstance(obj, Tensor):
        return [obj], TreeDef("tensor", None, None, 1, [""])
    if (type(obj) in (tuple, list) or _is_namedtuple(obj)) and all(
        isinstance(leaf, Tensor) for leaf in obj
    ):
        if _is_namedtuple(obj):
            names = [f".{f}" for f in type(obj)._fields]  # type: ignore[attr-defined]
            kind = "namedtuple"
        else:
            names = [f"[{i}]" for i in range(len(obj))]
            kind = "tuple" if type(obj) is tuple else "list"
        return list(obj), TreeDef(kind, None, type(obj), len(obj), names)
    with_paths, spec = pytree.tree_flatten_with_path(obj)
    leaves = [leaf for _, leaf in with_paths]
    names = [pytree.keystr(path) for path, _ in with_paths]
    nested = _nested_spec(obj)
    if nested is not False and nested is not None:
        return leaves, TreeDef("nested", nested, type(obj), len(leaves), names)
    return leaves, TreeDef("pytree", spec, None, len(leaves), names)


def leaf_bytes(leaves: Sequence[Any]) -> int:
    """Bytes of the tensors' elements (``numel * element_size`` summed; views count fully);
    leaves that are not tensors (a step's ``None`` output, a ``None`` state kept as it is)
    hold none."""
    return sum(tensor_nbytes(t) for t in leaves if isinstance(t, Tensor))


def is_float(t: Tensor) -> bool:
    """Whether ``t`` can carry a gradient (floating or complex dtype)."""
    return t.is_floating_point() or t.is_complex()


def tree_unflatten(leaves: Sequence[Any], treedef: TreeDef) -> Any:
    """Rebuild the structure ``treedef`` describes from ``leaves`` (``treedef.unflatten``)."""
    return treedef.unflatten(list(leaves))


def tree_structure(obj: Any) -> TreeDef:
    """The structure of ``obj`` (the `TreeDef` of `tree_flatten`)."""
    return tree_flatten(obj)[1]


def tree_leaves(obj: Any) -> list[Any]:
    """The leaves of ``obj``, in `tree_flatten`'s order."""
    return tree_flatten(obj)[0]


def fresh_containers(tree: Any) -> Any:
    """``tree`` with a new list and dict for each of its lists and dicts (the dict's own type
    kept), the tuples holding them rebuilt, every leaf and every other tuple the same object:
    what a step that assigns into the state it is given may change (about 1 us for a tensor
    or a tuple of tensors, where `tree_map` takes 5 us for a pair and 128 us for a nested
    tuple, through torch's pytree)."""
    if isinstance(tree, list):
        return [fresh_containers(x) for x in tree]
    if isinstance(tree, dict):
        out = copy.copy(tree)
        for key, value in out.items():
            out[key] = fresh_containers(value)
        return out
    if isinstance(tree, tuple):
        items = [fresh_containers(x) for x in tree]
        if all(a is b for a, b in zip(items, tree, strict=True)):
            return tree
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


def tree_map(fn: Any, tree: Any, *rest: Any) -> Any:
    """``fn`` applied leaf by leaf to ``tree`` (and the same leaves of ``rest``), rebuilt."""
    leaves, treedef = tree_flatten(tree)
    others = [treedef.flatten(r) for r in rest]
    if any(o is None for o in others):
        return pytree.tree_map(fn, tree, *rest)  # structures that differ in their leaves' types
    return treedef.unflatten([fn(*args) for args in zip(leaves, *others, strict=True)])


def refuse_non_tensor_leaves(leaves: Sequence[Any], names: Sequence[str], where: str = "") -> None:
    """Raise `ConfigTypeError` for the first of a state's ``leaves`` that is not a tensor,
    naming it (``names``, one per leaf), ``where`` it is (a layer, or nothing) and the fix (a
    counter kept as a Python number: start it as ``torch.tensor(n)``)."""
    for name, leaf in zip(names, leaves, strict=False):
        if isinstance(leaf, Tensor):
            continue
        fix = "start it as a tensor"
        if isinstance(leaf, (bool, int, float)):  # a counter kept in the state
            fix = f"start it as torch.tensor({leaf!r}) and return a tensor from the step"
        raise ConfigTypeError(
            f"{where}every state leaf must be a tensor; {name} is {type(leaf).__name__}: {fix}"
        )
