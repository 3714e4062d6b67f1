"""A neuron of yours whose state argument has no default but which builds its state from None.

Norse's memory task writes ``forward(input_spikes, state: Optional[Tuple[...]])`` and its loop
passes None at step 0. spikeckpt starts such a state from zeros, learning their shape from one
probed step. Before, the guess ``zeros_like(x_t)`` given as the state was unpacked by
``v, i = state`` along the batch when the batch was 2, so it "fitted": the run started from zeros
where the loop's started from the module's own state (other outputs, silently); at other batch
sizes the refusal did not name the one-word fix (``state=None``).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc


class RestingLIF(nn.Module):
    """Starts at ``v_rest`` from None; the state argument has no default."""

    def __init__(self, v_rest: float = -0.5) -> None:
        super().__init__()
        self.v_rest = v_rest

    def forward(
        self,
        x: Tensor,
        state: Optional[tuple[Tensor, Tensor]],  # noqa: UP045 (as users write it)
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        if state is None:
            v, i = torch.full_like(x, self.v_rest), torch.zeros_like(x)
        else:
            v, i = state
        i = 0.8 * i + x
        v = 0.9 * v + 0.1 * i
        z = (v > 0.3).to(v.dtype)
        v = v - 0.3 * z
        return z * v, (v, i)


class RestingLIFWithDefault(RestingLIF):
    def forward(self, x: Tensor, state: tuple[Tensor, Tensor] | None = None) -> Any:  # type: ignore[override]
        return super().forward(x, state)


class TupleLIF(RestingLIF):
    """No None branch: the loop passes zeros; one step's state is a 2-tuple."""

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor]) -> Any:  # type: ignore[override]
        v, i = state
        return super().forward(x, (v, i))


def _loop(net: nn.Sequential, x: Tensor, state: object) -> Tensor:
    ys = []
    for t in range(x.shape[0]):
        y, state = net[1](net[0](x[t]), state)
        ys.append(y)
    return torch.stack(ys)


@pytest.mark.parametrize("batch", [2, 3])
def test_a_state_built_from_none_otherwise_than_zeros_is_refused_naming_the_default(
    batch: int,
) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), RestingLIF())
    x = torch.randn(6, batch, 5)
    with pytest.raises(sc.UnsupportedLayerError, match=r"forward\(x, state=None\)"):
        sc.wrap(net, plan=sc.plans.Uniform(2))(x)


@pytest.mark.parametrize("batch", [2, 3])
def test_the_advised_default_runs_as_the_loop_passing_none(batch: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), RestingLIFWithDefault())
    x = torch.randn(6, batch, 5)
    out = sc.wrap(net, plan=sc.plans.Uniform(2))(x)
    assert torch.equal(out, _loop(net, x, None))


def test_a_tuple_state_without_a_none_branch_still_starts_from_zeros() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), TupleLIF())
    x = torch.randn(6, 2, 5)
    zeros = (torch.zeros(2, 4), torch.zeros(2, 4))
    out = sc.wrap(net, plan=sc.plans.Uniform(2))(x)
    assert torch.equal(out, _loop(net, x, zeros))


class SynLIF(nn.Module):
    """Two required states, each built from None (its loop passes None, None)."""

    def forward(self, x: Tensor, syn: Tensor | None, mem: Tensor | None) -> Any:
        syn = torch.zeros_like(x) if syn is None else syn
        mem = torch.full_like(x, -0.5) if mem is None else mem
        syn = 0.8 * syn + x
        mem = 0.9 * mem + 0.1 * syn
        z = (mem > 0.3).to(mem.dtype)
        mem = mem - 0.3 * z
        return z * mem, syn, mem


class SynLIFWithInitialState(SynLIF):
    def initial_state(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return torch.zeros_like(x), torch.full_like(x, -0.5)


def _loop2(net: nn.Sequential, x: Tensor) -> Tensor:
    syn = mem = None
    ys = []
    for t in range(x.shape[0]):
        y, syn, mem = net[1](net[0](x[t]), syn, mem)
        ys.append(y)
    return torch.stack(ys)


def test_several_states_built_from_none_are_refused_naming_initial_state() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), SynLIF())
    with pytest.raises(
        sc.UnsupportedLayerError, match=r"initial_state\(x\) method returning the 2"
    ):
        sc.wrap(net, plan=sc.plans.Uniform(2))(torch.randn(6, 3, 5))


def test_the_advised_initial_state_runs_as_the_loop_passing_nones() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), SynLIFWithInitialState())
    x = torch.randn(6, 3, 5)
    assert torch.equal(sc.wrap(net, plan=sc.plans.Uniform(2))(x), _loop2(net, x))
