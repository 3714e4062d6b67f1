"""The adapter protocol, the registry, plain torch layers and the generic adapter."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters import (
    LayerAdapter,
    StatefulAdapter,
    StatelessAdapter,
    adapter_for,
    register_adapter,
    unregister_adapter,
)
from spikeckpt.plans import BPTT, Revolve, Uniform


def test_import_needs_no_framework() -> None:
    code = (
        "import sys, spikeckpt, spikeckpt.adapters, spikeckpt.wrapping\n"
        "from torch import nn\n"
        "spikeckpt.wrap(nn.Sequential(nn.Linear(2, 2), nn.GRUCell(2, 3)))\n"
        "assert not any(m.split('.')[0] in ('snntorch', 'norse') for m in sys.modules), "
        "[m for m in sys.modules if m.startswith(('snntorch', 'norse'))]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class Decay(nn.Module):
    """A user module with ``forward(x, state) -> (y, state)`` and no initial-state method."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.full((n,), 0.7))

    def forward(self, x: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        state = torch.zeros_like(x) if state is None else state
        state = self.a * state + x
        return torch.tanh(state), state


def _loop(model: nn.Module, x: Tensor) -> tuple[Tensor, Any]:
    lin, cell = model[0], model[1]
    s = None
    out = []
    for t in range(x.shape[0]):
        if isinstance(cell, nn.LSTMCell):
            s = cell(lin(x[t]), s)
            out.append(s[0])
        elif isinstance(cell, (nn.GRUCell, nn.RNNCell)):
            s = cell(lin(x[t]), s)
            out.append(s)
        else:
            y, s = cell(lin(x[t]), s)
            out.append(y)
    return torch.stack(out), s


CELLS = {
    "generic": lambda: Decay(4),
    "GRUCell": lambda: nn.GRUCell(4, 3),
    "LSTMCell": lambda: nn.LSTMCell(4, 3),
    "RNNCell": lambda: nn.RNNCell(4, 3),
}


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("plan", [BPTT(), Uniform(3), Revolve(2)], ids=repr)
def test_generic_and_rnn_cells_equal_loop(cell: str, plan: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), CELLS[cell]())
    x = torch.randn(9, 2, 3)
    ref, ref_s = _loop(model, x)
    ref.pow(2).sum().backward()
    ref_g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y, s = sc.wrap(model, plan=plan)(x, return_state=True)
    y.pow(2).sum().backward()
    torch.testing.assert_close(y, ref)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(s[1]), torch.utils._pytree.tree_leaves(ref_s), strict=True
    ):
        torch.testing.assert_close(a, b)
    for a, p in zip(ref_g, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a)


def test_generic_uses_initial_state_method() -> None:
    class WithInit(Decay):
        def initial_state(self, x: Tensor) -> Tensor:
            return torch.ones_like(x)

    adapter = adapter_for(WithInit(3))
    assert isinstance(adapter, StatefulAdapter)
    torch.testing.assert_close(adapter.init_state(torch.zeros(2, 3)), torch.ones(2, 3))


def test_several_states_defaulting_to_none_are_refused_with_the_way_to_write_them() -> None:
    """``forward(x, mem1=None, mem2=None) -> (spk, mem1, mem2)`` (arguments defaulting to None
    count as one state): the refusal said it takes 1 state, and nothing more; it names the
    required form, which wraps."""

    class TwoStates(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, x: Tensor, mem1: Any = None, mem2: Any = None) -> Any:
            mem1 = torch.zeros(x.shape[0], 4) if mem1 is None else mem1
            mem2 = torch.zeros(x.shape[0], 4) if mem2 is None else mem2
            mem1 = 0.9 * mem1 + self.fc(x)
            mem2 = 0.8 * mem2 + mem1
            return torch.tanh(mem2), mem1, mem2

    x = torch.randn(5, 2, 3)
    with pytest.raises(
        sc.UnsupportedLayerError, match=r"make them required: forward\(x, mem1, mem2\)"
    ):
        sc.wrap(TwoStates())(x)

    class Required(TwoStates):
        def forward(self, x: Tensor, mem1: Tensor, mem2: Tensor) -> Any:  # type: ignore[override]
            return super().forward(x, mem1, mem2)

    model = Required()
    mem1 = mem2 = torch.zeros(2, 4)
    ys = []
    for x_t in x:
        y, mem1, mem2 = model(x_t, mem1, mem2)
        ys.append(y)
    torch.testing.assert_close(sc.wrap(model)(x)[0], torch.stack(ys))


def test_stateless_layers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.LayerNorm(8),
        nn.Identity(),
        nn.Linear(8, 3),
        nn.GRUCell(3, 3),
    )
    x = torch.randn(5, 2, 1, 4, 4)
    seq = sc.wrap(model, plan=Uniform(2))
    y, s = seq(x, return_state=True)
    assert y.shape == (5, 2, 3)
    assert s[:7] == ((),) * 7


def test_dropout_is_replayed_exactly() -> None:
    """Dropout masks are the same in the forward pass and on recomputation, for every plan."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Dropout(0.5), nn.GRUCell(6, 4))
    x = torch.randn(12, 2, 3)
    results = []
    for plan in [BPTT(), Uniform(4), Revolve(2)]:
        model.zero_grad()
        torch.manual_seed(5)
        y = sc.wrap(model, plan=plan)(x)
        y.sum().backward()
        results.append((y.detach(), [p.grad.clone() for p in model.parameters()]))
    for y, g in results[1:]:
        torch.testing.assert_close(y, results[0][0])
        for a, b in zip(g, results[0][1], strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("plan", [BPTT(), Uniform(2), Revolve(2)], ids=repr)
def test_batchnorm_in_training_mode_matches_the_loop(plan: Any) -> None:
    """Batch statistics per step, running statistics updated once per step (never in
    recomputation or shape probes), bitwise as in the loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None), nn.GRUCell(4, 2))
    loop_model = copy.deepcopy(model)
    x = torch.randn(6, 5, 3)
    ref, _ = _loop(nn.Sequential(nn.Sequential(*loop_model[:2]), loop_model[2]), x)
    ref.pow(2).sum().backward()
    y = sc.wrap(model, plan=plan)(x)
    y.pow(2).sum().backward()
    assert torch.equal(y, ref)
    for a, b in zip(model.parameters(), loop_model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)  # float32 round-off: summation order
    for name, buf in model[1].named_buffers():
        assert torch.equal(buf, dict(loop_model[1].named_buffers())[name]), name
    assert int(model[1].num_batches_tracked) == 6
    model.eval()  # eval mode: a pure function of each step, with the running statistics
    assert sc.wrap(model)(x).shape == (6, 5, 2)
    free = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False))
    assert sc.wrap(free, plan=Uniform(2))(x).shape == (6, 5, 4)


@pytest.mark.parametrize(
    ("model", "where"),
    [
        (nn.Sequential(nn.Linear(2, 2), nn.LSTM(2, 2)), "'1'"),
        (
            nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.MultiheadAttention(2, 1))),
            "'1.1'",
        ),
        (nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])), "'0'"),
        (nn.MultiheadAttention(4, 1), "<root>"),
    ],
    ids=["LSTM", "nested-attention", "ModuleList", "root"],
)
def test_unsupported_layers_name_their_path(model: nn.Module, where: str) -> None:
    with pytest.raises(sc.UnsupportedLayerError) as info:
        sc.wrap(model)
    msg = str(info.value)
    assert f"layer {where}" in msg
    assert "Supported layers" in msg and "snnTorch Leaky" in msg and "register_adapter" in msg


def test_register_adapter_for_a_new_framework() -> None:
    class Twice(nn.Module):  # a layer no built-in adapter knows
        def forward(self, x: Tensor) -> Tensor:
            return 2 * x

    class Counter(LayerAdapter):
        """Counts steps in its state; y_t = 2 x_t."""

        def init_state(self, x_t: Tensor) -> Tensor:
            return x_t.new_zeros(x_t.shape[0])

        def step(self, state: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
            return state + 1, self.module(x_t)

    model = nn.Sequential(nn.Linear(2, 2), Twice())
    # a module of yours without state is stepped as a stateless layer without registration
    assert sc.wrap(model, plan=Uniform(2))(torch.ones(5, 3, 2), return_state=True)[1][1] == ()
    entry = register_adapter(
        lambda m: isinstance(m, Twice), Counter, name="twice", description="Twice layers"
    )
    try:
        y, s = sc.wrap(model, plan=Uniform(2))(torch.ones(5, 3, 2), return_state=True)
        torch.testing.assert_close(s[1], torch.full((3,), 5.0))
        assert "twice: Twice layers" in sc.adapters.supported_summary()
        # user entries come first: they can override a built-in adapter
        entry2 = register_adapter(lambda m: isinstance(m, nn.Linear), StatelessAdapter)
        unregister_adapter(entry2)
    finally:
        unregister_adapter(entry)
    assert isinstance(adapter_for(Twice()), StatelessAdapter)
