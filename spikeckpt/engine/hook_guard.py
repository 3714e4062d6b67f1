"""The tensors a layer's forward hooks see in a wrapped run: theirs to watch, refused in a loss.

A wrapped run calls a hooked layer more often than the user's loop does (a shape probe,
recomputation in the backward pass, a chunk at a time layer-wise) and runs most of its steps
untaped, so a loss built from what the hooks kept would get gradients unlike the loop's: none
at all for untaped steps (silently), or a second backward through a graph the engine already
backpropagated. During the forward pass, `hook_guard` hands each forward hook (and pre-hook) of
the model's layers an alias of the layer's untaped output (inputs) whose gradient raises
`UsageError` naming the layer; the layer's caller still gets the layer's own output. Watching
the values (``.detach()``, ``.sum().item()``, plotting) and changing them in place work as
before.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from spikeckpt.engine.tree import tree_flatten, tree_unflatten
from spikeckpt.errors import UsageError

__all__ = ["hook_guard"]


def _refuse(where: str, _grad: Tensor) -> None:
    raise UsageError(
        f"the loss backpropagates through a tensor a forward hook of layer {where} saw in a "
        "wrapped run. spikeckpt calls a layer more often than your loop (a shape probe, "
        "recomputation in the backward pass, a chunk of steps at a time layer-wise) and runs "
        "most steps untaped, so a loss built from hooked tensors cannot get the loop's "
        "gradients. Use hooks to watch values (detach them); return what the loss needs from "
        "the model instead: output='both' for the last neuron's membrane, Norse's "
        "return_hidden=True, or a module (or a spikeckpt.scan step) whose output includes the "
        "hidden spikes"
    )


class _Aliases:
    """What the hooks of one call see (``aliased``, the structure of ``own``). In a step run
    untaped (grad off), each floating-point tensor of ``own`` as a leaf that shares its
    memory (an in-place change in a hook changes the layer's tensor, as in the loop) and
    requires grad, as the loop's tensors do; a gradient reaching it raises `UsageError`. In a
    step taped in the forward pass, ``own`` as it is: a loss through its tensors fails in the
    backward with torch's own error (their graph is the engine's, backpropagated by then)."""

    def __init__(self, where: str, own: Any) -> None:
        self.own = own
        if torch.is_grad_enabled():  # a taped step: the loop's tensors, as the loop has them
            self.aliased = own
            return
        leaves, spec = tree_flatten(own)
        at = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.is_floating_point()]
        for i in at:
            alias = leaves[i].detach().requires_grad_()
            alias.register_hook(functools.partial(_refuse, where))
            leaves[i] = alias
        self.aliased = tree_unflatten(leaves, spec) if at else own

    def restore(self, result: Any) -> Any:
        """The layer's own tensors if the hooks left the aliases as they were; else the hooks'
        replacement (computed untaped: no graph reaches the aliases)."""
        return self.own if result is self.aliased else result


def _guard(module: nn.Module, where: str) -> list[RemovableHandle]:
    """Hooks around ``module``'s own: the first swaps in aliases, the last puts the layer's
    own tensors back unless a hook of the user's replaced them."""
    handles: list[RemovableHandle] = []
    if module._forward_hooks:
        outputs: list[_Aliases] = []

        def alias_output(_m: nn.Module, _args: Any, output: Any) -> Any:
            outputs.append(_Aliases(where, output))
            return outputs[-1].aliased

        def restore_output(_m: nn.Module, _args: Any, output: Any) -> Any:
            return outputs.pop().restore(output)

        handles.append(module.register_forward_hook(alias_output, prepend=True))
        handles.append(module.register_forward_hook(restore_output))
    if module._forward_pre_hooks:
        inputs: list[_Aliases] = []

        def alias_args(_m: nn.Module, args: Any) -> Any:
            inputs.append(_Aliases(where, args))
            return inputs[-1].aliased

        def restore_args(_m: nn.Module, args: Any) -> Any:
            return inputs.pop().restore(args)

        handles.append(module.register_forward_pre_hook(alias_args, prepend=True))
        handles.append(module.register_forward_pre_hook(restore_args))
    return handles


@contextlib.contextmanager
def hook_guard(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside, the forward hooks and pre-hooks of ``model``'s modules see aliases whose
    backward raises `UsageError` naming the layer (see the module docstring). Nothing is
    installed when not ``enabled`` (a step compiled with ``torch.compile``: hooks installed
    anew at each call would recompile it at each call), grad is off, no module has hooks or no
    parameter requires grad (the loop's tensors would carry no gradient either)."""
    hooked = [
        (name, m) for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks
    ]
    if (
        not enabled
        or not hooked
        or not torch.is_grad_enabled()
        or not any(p.requires_grad for p in model.parameters())
    ):
        yield
        return
    handles = [
        h
        for name, m in hooked
        for h in _guard(m, f"{name or '<root>'!r} ({type(m).__module__}.{type(m).__qualname__})")
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
