"""torch's ``nn.GRUCell`` / ``nn.RNNCell`` / ``nn.LSTMCell`` inside a Norse ``SequentialState``:
Norse calls a module whose ``forward`` has no ``state`` argument without a state, so the
cell starts from zeros at every step of Norse's loop (``z, state = model(x_t, state)``).
Before 2026-11-29 the wrapped model carried the cell's state from step to step, its outputs
0.25-0.42 off Norse's loop, silently; now it steps the cell as Norse calls it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spikeckpt as sc

norse = pytest.importorskip("norse.torch")


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "gru": norse.SequentialState(nn.Linear(6, 6), nn.GRUCell(6, 5)),
        "lif-rnn": norse.SequentialState(
            nn.Linear(6, 6), norse.LIFCell(), nn.Linear(6, 6), nn.RNNCell(6, 5)
        ),
        "lstm-last": norse.SequentialState(nn.Linear(6, 6), nn.LSTMCell(6, 5)),
    }


def _norse_loop(model: nn.Module, x: torch.Tensor) -> tuple[object, list[object]]:
    """Norse's tutorial loop: the outputs over time (a tuple stacked entry-wise where the
    last layer returns one) and the final state list."""
    state, out = None, []
    for x_t in x:
        z, state = model(x_t, state)
        out.append(z)
    if isinstance(out[0], tuple):
        return tuple(torch.stack(v) for v in zip(*out, strict=True)), state
    return torch.stack(out), state


def _total(out: object) -> torch.Tensor:
    """A loss of every output."""
    if isinstance(out, tuple):
        return sum((v * v).sum() for v in out)  # type: ignore[return-value]
    assert isinstance(out, torch.Tensor)
    return (out * out).sum()


@pytest.mark.parametrize("name", ["gru", "lif-rnn", "lstm-last"])
@pytest.mark.parametrize(
    "options",
    [{"plan": sc.plans.BPTT()}, {"plan": sc.plans.Uniform(3), "storage": "host"}],
    ids=["bptt", "uniform-host"],
)
def test_a_torch_cell_runs_as_norses_loop_runs_it(name: str, options: dict[str, object]) -> None:
    x = (torch.rand(12, 4, 6, generator=torch.Generator().manual_seed(1)) < 0.4).float() * 2
    model = _models()[name]
    expected, expected_state = _norse_loop(model, x)
    _total(expected).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out, state = sc.wrap(model, **options)(x)
    if isinstance(expected, tuple):
        assert isinstance(out, tuple)
        for got, want in zip(out, expected, strict=True):
            assert torch.equal(got, want)
    else:
        assert torch.equal(out, expected)
    assert state[-1] is None and expected_state[-1] is None  # Norse keeps no state there
    _total(out).backward()
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g)
