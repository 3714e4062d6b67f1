"""The tensors a wrapped model's call runs with, kept for its backward.

``torch.func.functional_call(seq, params, (x,))`` (and ``torch.nn.utils.stateless``) puts
``params`` into the model's modules for the forward call only. The stack granularity's
backward recomputes steps after the call has returned: `ForwardTensors` puts the forward's
tensors back for each recomputed step. The layer-wise blocks hold the parameters they were
built with: `refuse_swapped` refuses a call whose model holds others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from spikeckpt.engine.grad import leaves_behind
from spikeckpt.engine.layerwise import LayerBlock
from spikeckpt.engine.phase import recomputing
from spikeckpt.errors import ConfigError

__all__ = [
    "ForwardTensors",
    "Slot",
    "param_ids",
    "refuse_swapped",
    "swapped_params",
    "tensor_slots",
]


#: one tensor slot of a module: its ``_parameters`` or ``_buffers`` dict, the name, the tensor
Slot = tuple[dict[str, Any], str, Tensor]


def tensor_slots(module: nn.Module) -> list[Slot]:
    """Every parameter and buffer of ``module`` and its submodules, where it sits now."""
    return [
        (d, name, t)
        for m in module.modules()
        for d in (m._parameters, m._buffers)
        for name, t in d.items()
        if t is not None
    ]


class ForwardTensors:
    """The stack step, run in the backward phase with the tensors the forward ran with.

    ``torch.func.functional_call(seq, params, (x,))`` (and ``torch.nn.utils.stateless``) puts
    ``params`` into the model's modules for the forward call only; the backward phase, which
    recomputes steps after the call has returned, would otherwise recompute them with the
    module's own parameters: other values, and gradients for tensors the forward never used.
    While recomputing, the slots that no longer hold the forward's tensors get them back for
    the step's call (one identity check per parameter and buffer per recomputed step).
    """

    def __init__(self, step: Callable[[Any, Any], Any], slots: list[Slot]) -> None:
        self.step = step
        self.__wrapped__ = step  # plan caches key on the step's code (`plan_key`)
        self.slots = slots

    def __call__(self, state: Any, x_t: Any) -> Any:
        if not recomputing():
            return self.step(state, x_t)
        moved = [(d, k, t, d.get(k)) for d, k, t in self.slots if d.get(k) is not t]
        if not moved:
            return self.step(state, x_t)
        for d, k, t, _ in moved:
            d[k] = t
        try:
            return self.step(state, x_t)
        finally:
            for d, k, _, now in moved:
                d[k] = now


def param_ids(module: nn.Module) -> frozenset[int]:
    """The identities of ``module``'s parameters (what a swap for one call replaces)."""
    return frozenset(id(p) for p in module.parameters())


def swapped_params(module: nn.Module, known: frozenset[int] | set[int]) -> list[str]:
    """The names of ``module``'s parameters requiring grad that are not among ``known`` (by
    identity): swapped in for one call (``torch.func.functional_call``) or replaced since."""
    return [
        name
        for name, t in module.named_parameters(remove_duplicate=False)
        if t.requires_grad and id(t) not in known
    ]


def refuse_swapped(module: nn.Module, blocks: list[LayerBlock]) -> None:
    """Layer-wise blocks hold the parameters they were built with; refuse a forward whose
    model holds other tensors that require grad (``torch.func.functional_call``, or a
    parameter replaced since the blocks were built: ``load_state_dict(..., assign=True)``
    after wrapping) instead of failing on them later."""
    held = [p for b in blocks for p in b.params]
    # a parameter behind a computed one (raw of a Norse p field 0.2 + sigmoid(raw)) is held
    moved = swapped_params(module, {id(p) for p in (*held, *leaves_behind(held))})
    if moved:
        raise ConfigError(
            f"granularity='layer': the model's parameters {', '.join(moved[:4])} are not the "
            "tensors its layer-wise blocks were built with (torch.func.functional_call or "
            "torch.nn.utils.stateless swap them in for one call; or a parameter was replaced "
            "since the blocks were built, when wrapping or at the first forward: "
            "load_state_dict(..., assign=True), module.weight = nn.Parameter(...)). Use "
            "granularity='stack' (exact under functional_call), load_state_dict without "
            "assign=True (it copies into the parameters the blocks hold), or wrap the model "
            "again after replacing parameters."
        )
