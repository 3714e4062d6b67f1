"""Norse's ``CobaLIFCell`` (conductance-based LIF, input and recurrent weights inside): its
state at t=0 made explicit.

Not an ``SNNCell``: ``forward(x_t, state=None)`` builds its start itself (``z``, ``v``, ``g_e``
and ``g_i`` all zeros, ``(B, hidden)``), which the layer-wise granularity needs as tensors.
The adapter makes the same zeros (Norse also marks its start ``v`` as requiring grad, a leaf
no parameter's gradient depends on), so the cell runs layer-wise as its block's neuron, one
call per step (``"per-step"``; its recurrent product keeps it out of the fused kernels).

This module imports Norse; import it only when a Norse layer was found.
"""

from __future__ import annotations

from norse.torch.functional.coba_lif import CobaLIFState
from torch import Tensor, nn

from spikeckpt.adapters.generic import StatefulAdapter
from spikeckpt.adapters.protocol import State

__all__ = ["CobaLIFAdapter"]


class CobaLIFAdapter(StatefulAdapter):
    """``z, state = cell(x_t, state)`` of a ``CobaLIFCell``, starting from Norse's zeros."""

    def __init__(self, module: nn.Module, path: str) -> None:
        super().__init__(module, path, 1)
        self._init = self._zeros

    def _zeros(self, x_t: Tensor) -> State:
        """Norse's start for an input ``x_t (B, input_size)``: zeros ``(B, hidden_size)``."""
        hidden: int = getattr(self.module, "hidden_size")  # noqa: B009 (Norse's, untyped)
        zeros = x_t.new_zeros(x_t.shape[0], hidden)
        return CobaLIFState(z=zeros, v=zeros.clone(), g_e=zeros.clone(), g_i=zeros.clone())

    def membrane(self, state: State) -> Tensor | None:
        return state.v
