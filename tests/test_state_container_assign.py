"""A per-step module of yours that assigns into the state container it is given
(``state[0] = cell(x, state[0])``, then ``return y, state``, as Norse's ``SequentialState``
does with its list): the plain loop runs it, each state used once. Before 2026-11-29 a
wrapped run that measured the model first (``plan="auto"`` with a budget,
``granularity="auto"``) handed the initial state's own list to the measuring step, which
left a later step's states in it, and the run then started from those: outputs 0.15-0.44
off the loop's, silently. Now the module gets fresh containers at each step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc


class ListStateGRU(nn.Module):
    """Two GRU cells whose states are kept in one list, assigned into in place."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.GRUCell(6, 8)
        self.c2 = nn.GRUCell(8, 8)

    def initial_state(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Zeros for both cells."""
        return [torch.zeros(x.shape[0], 8), torch.zeros(x.shape[0], 8)]

    def forward(
        self, x: torch.Tensor, state: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One step; the list given is assigned into and returned."""
        state[0] = self.c1(x, state[0])
        state[1] = self.c2(state[0], state[1])
        return state[1], state


class DictStateGRU(nn.Module):
    """The same with a dict state updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.GRUCell(6, 8)

    def initial_state(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """A zero hidden state."""
        return {"h": torch.zeros(x.shape[0], 8)}

    def forward(
        self, x: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One step; the dict given is updated and returned."""
        state["h"] = self.c1(x, state["h"])
        return torch.tanh(state["h"]), state


def _loop(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The user's loop: its outputs and parameter gradients of a weighted sum."""
    state, ys = module.initial_state(x[0]), []
    for x_t in x:
        y, state = module(x_t, state)
        ys.append(y)
    out = torch.stack(ys)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), list(module.parameters()))
    return out, list(grads)


@pytest.mark.parametrize("cls", [ListStateGRU, DictStateGRU])
@pytest.mark.parametrize(
    "options",
    [
        {"plan": "auto", "budget": "64MiB"},
        {"plan": "auto", "budget": "64MiB", "granularity": "auto"},
        {"plan": sc.plans.BPTT(), "granularity": "auto"},
        {"plan": sc.plans.Uniform(3)},
    ],
    ids=["auto-budget", "auto-both", "bptt-granularity-auto", "uniform"],
)
def test_state_assigned_in_place_gives_the_loops_results(
    cls: type[nn.Module], options: dict[str, object]
) -> None:
    torch.manual_seed(0)
    module = cls()
    x = torch.randn(12, 4, 6)
    expected, expected_grads = _loop(module, x)
    out, _ = sc.wrap(module, **options)(x)
    assert torch.equal(out, expected)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), list(module.parameters()))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_in_a_stack_too() -> None:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(5, 6), ListStateGRU(), nn.Linear(8, 3))
    x = torch.randn(10, 3, 5)
    state, ys = net[1].initial_state(x[0]), []
    for x_t in x:
        y, state = net[1](net[0](x_t), state)
        ys.append(net[2](y))
    expected = torch.stack(ys)
    out = sc.wrap(net, plan="auto", budget="64MiB", granularity="auto")(x)
    assert torch.equal(out, expected)


def test_fresh_containers_copies_lists_and_dicts_and_keeps_leaves_and_other_tuples() -> None:
    """What the module is handed: new lists and dicts (their types kept), the tuples around
    them rebuilt (a NamedTuple as itself), every leaf and every tuple of leaves the same."""
    from collections import OrderedDict, namedtuple

    from spikeckpt.engine.tree import fresh_containers

    pair = namedtuple("pair", "v i")
    a, b = torch.zeros(2), torch.ones(2)
    flat = (a, b)
    assert fresh_containers(flat) is flat and fresh_containers(a) is a
    tree = ([a, {"v": b}], pair(a, [b]), OrderedDict(v=flat), None)
    fresh = fresh_containers(tree)
    assert fresh is not tree and type(fresh) is tuple
    assert fresh[0] is not tree[0] and fresh[0][0] is a
    assert fresh[0][1] is not tree[0][1] and fresh[0][1]["v"] is b
    assert type(fresh[1]) is pair and fresh[1].i is not tree[1].i and fresh[1].v is a
    assert type(fresh[2]) is OrderedDict and fresh[2] is not tree[2] and fresh[2]["v"] is flat
    assert fresh[3] is None
    fresh[0][0] = b  # assigning into the copy leaves the original as it was
    assert tree[0][0] is a
