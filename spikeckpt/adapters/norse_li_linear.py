"""Norse's ``LILinearCell``: a leaky integrator with its input's weights inside.

Norse's readout of choice (``SequentialState(..., LIFCell(), LILinearCell(n, classes))``)
computes ``li_step``: ``i' = i + F.linear(x_t, input_weights)``, then the leaky integrator's
update, the very ops of ``li_feed_forward_step`` on that product. The stack granularity steps
the cell through its own call (`LILinearAdapter`). For the layer-wise granularity the cell is
the same step as two layers (`LILinearAdapter.split_synapse`): a bias-free ``nn.Linear``
holding the cell's own ``input_weights`` parameter (so the product runs over a whole chunk,
gathers over spike inputs and is backpropagated without a tape, as a ``Linear`` block is), and
the leaky integrator after it (`LINeuronAdapter`, fused by Norse's ``"li"`` kernel). With
``exact=True`` the product runs step by step, as the cell's call runs it: outputs bitwise.

This module imports Norse; import it only when a Norse layer was found.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from norse.torch.functional.leaky_integrator import LIState, li_feed_forward_step
from norse.torch.module.leaky_integrator import LILinearCell
from torch import Tensor, nn

from spikeckpt.adapters.generic import StatefulAdapter, StatelessAdapter
from spikeckpt.adapters.kernels import NorseKernel
from spikeckpt.adapters.norse_params import move_params
from spikeckpt.adapters.protocol import LayerAdapter, State, no_hooks, unsupported

__all__ = ["LILinearAdapter", "LINeuronAdapter"]


class LILinearAdapter(StatefulAdapter):
    """Norse's ``LILinearCell`` (not an ``SNNCell``): ``z, state = cell(x_t, state)``. Its state
    at t=0 is the one it builds from ``None`` (``v = v_leak``, ``i = 0``), made explicit with
    full shapes: ``v_leak`` broadcast to ``(B, hidden)`` (the update is elementwise, so the
    values are those of the 0-d start) and detached, as Norse detaches it."""

    def __init__(self, module: nn.Module, path: str) -> None:
        super().__init__(module, path, 1)
        self._init = self._li_init

    def _li_init(self, x_t: Tensor) -> State:
        m: Any = self.module  # Norse's cell: its attributes are not typed
        return _li_start(m, x_t, (x_t.shape[0], m.hidden_size))

    def membrane(self, state: State) -> Tensor | None:
        return state.v

    def split_synapse(self) -> tuple[LayerAdapter, LayerAdapter] | None:
        """``(the product with input_weights, the leaky integrator)`` for a cell that Norse's
        own ``forward`` runs and no hook watches (see the module docstring); None otherwise
        (the cell is then stepped through its call, per step)."""
        m: Any = self.module
        weight = getattr(m, "input_weights", None)
        if not _own_call(m) or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            return None
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = weight  # the cell's own parameter: its gradient lands there
        return StatelessAdapter(linear, self.path), LINeuronAdapter(m, self.path)


def _li_start(m: Any, like: Tensor, shape: Sequence[int]) -> State:
    """The start Norse's ``LILinearCell`` builds from ``None``, ``shape`` ``(B, hidden)``:
    ``v = v_leak`` broadcast and detached, ``i = 0``, in ``like``'s device and dtype."""
    v = torch.as_tensor(m.p.v_leak).detach().to(like.device, like.dtype).expand(*shape)
    return LIState(v=v.clone(), i=like.new_zeros(tuple(shape)))


def _own_call(m: Any) -> bool:
    """Whether ``m`` is a ``LILinearCell`` run by Norse's own ``forward`` (``li_step``),
    ``dt`` a number, and no hook on it."""
    own = type(m) is LILinearCell and "forward" not in vars(m)
    return own and isinstance(m.dt, float) and no_hooks(m)


class LINeuronAdapter(LayerAdapter):
    """The leaky integrator of an ``LILinearCell`` ``m``, on the product ``z_t (B, hidden)``:
    ``li_feed_forward_step(z_t, state, m.p, m.dt)``, the ops ``li_step`` runs after its
    product. ``m.p`` and ``m.dt`` are read at each step. A hook registered on the cell after
    its blocks were made is refused: the blocks never call the cell."""

    def init_state(self, x_t: Tensor) -> State:
        """The cell's state at t=0 (`LILinearAdapter`'s) for a product ``x_t (B, hidden)``."""
        return _li_start(self.module, x_t, x_t.shape)

    def step(self, state: State, x_t: Tensor) -> tuple[State, Tensor]:
        m: Any = self.module
        if not _own_call(m):
            raise unsupported(
                m,
                self.path,
                "the cell changed after its layer-wise blocks were made (a hook registered, "
                "its forward or dt replaced), and those blocks compute its product and its "
                "integrator apart, never through its call; wrap the model again",
            )
        v, s = li_feed_forward_step(x_t, state, p=move_params(m.p, x_t.device), dt=m.dt)
        return s, v

    def membrane(self, state: State) -> Tensor | None:
        return state.v

    def chunk_kernel(self) -> NorseKernel:
        """Norse's ``"li"`` kernel with the cell's ``p`` and ``dt``, declining chunks once the
        cell no longer has the step it was made for."""
        return _LILinearKernel(self.module)


class _LILinearKernel(NorseKernel):
    """`NorseKernel`'s ``"li"`` for an ``LILinearCell``'s integrator."""

    def __init__(self, m: Any) -> None:
        super().__init__(lambda: m.p, m.dt, None, "li")
        self.module = m

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        m: Any = self.module
        return _own_call(m) and bool(m.dt == self.dt) and super().accepts(leaves, z)
