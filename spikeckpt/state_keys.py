"""A wrapped model's ``state_dict`` under the original model's keys.

`CheckpointedSequence` holds the model as its ``module``; its state dict hooks drop that
prefix when saving and accept the original model's keys (and prefixed ones) when loading, so
checkpoints move freely between the plain and the wrapped model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["INNER", "add_prefix", "strip_missing", "strip_prefix"]

#: the attribute of `CheckpointedSequence` that holds the wrapped model
INNER = "module"


def strip_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """state_dict hook: ``prefix + "module." + key`` -> ``prefix + key`` (and metadata)."""
    inner = prefix + INNER + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        own = prefix + INNER
        for key in [k for k in meta if k == own or k.startswith(own + ".")]:
            new = prefix[:-1] if key == own else prefix + key[len(own) + 1 :]
            meta[new] = meta.pop(key)


def add_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    """load_state_dict pre-hook: accept the original model's keys (and already prefixed ones)."""
    inner = prefix + INNER + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def strip_missing(module: nn.Module, incompatible: Any) -> None:
    """Report missing/unexpected keys under the original model's names."""
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [k.replace(INNER + ".", "", 1) if k.startswith(INNER + ".") else k for k in keys]
