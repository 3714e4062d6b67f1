"""Norse's ``LILinearCell`` (a leaky integrator with its input's weights inside, Norse's usual
readout) against Norse's own loop: the stack steps its call; layer-wise splits it into the
product with its ``input_weights`` and the fused ``"li"`` integrator
(`spikeckpt.adapters.norse_li_linear`). Outputs bitwise with ``exact=True`` (the product per
step, as the cell's call runs it) and at round-off otherwise (one product over the chunk);
gradients at round-off, the weights' landing in the cell's own parameter."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from norse_cells import close, norse_loop
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.errors import UnsupportedLayerError
from spikeckpt.plans import Uniform

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse


def _weighted(y: Tensor) -> Tensor:
    return (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()


def _model(learnable: bool, dropout: float, seed: int) -> tuple[nn.Module, list[Tensor]]:
    """``SequentialState(Linear, LIFCell, [Dropout], LILinearCell)`` and the learnable
    tensors of the cell's ``p`` (none unless ``learnable``)."""
    torch.manual_seed(seed)
    fields: list[Tensor] = []
    p = norse.LIParameters()
    if learnable:
        fields = [nn.Parameter(torch.tensor(90.0)), nn.Parameter(torch.linspace(0.0, 0.2, 3))]
        p = norse.LIParameters(tau_mem_inv=fields[0], v_leak=fields[1])
    layers: list[nn.Module] = [nn.Linear(5, 8), norse.LIFCell()]
    layers += [nn.Dropout(dropout)] if dropout else []
    model = norse.SequentialState(*layers, norse.LILinearCell(8, 3, p=p))
    with torch.no_grad():
        model[0].weight.mul_(4.0)
    return model, fields


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.integers(1, 13),
    chunk=st.integers(1, 6),
    batch=st.integers(1, 3),
    learnable=st.booleans(),
    dropout=st.sampled_from([0.0, 0.3]),
    exact=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_layerwise_fuses_the_cell_as_norses_loop(
    steps: int, chunk: int, batch: int, learnable: bool, dropout: float, exact: bool, seed: int
) -> None:
    """T below, at and past the chunk (the last chunk short); a learnable ``p``; Dropout
    before the cell (its masks replayed in the recomputation). Both blocks fused."""
    model, fields = _model(learnable, dropout, seed)
    x = (torch.rand(steps, batch, 5) < 0.5).float()
    wrt = [*model.parameters(), *fields]
    torch.manual_seed(seed + 1)
    want = norse_loop(model, x)
    want_grads = torch.autograd.grad(_weighted(want), wrt)
    seq = sc.wrap(model, granularity="layer", chunk=chunk, exact=exact)
    torch.manual_seed(seed + 1)
    got, state = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    if exact:
        assert torch.equal(got, want)
    else:
        close(want, got)
    assert isinstance(state[-1], norse.LIState)
    for a, b in zip(want_grads, torch.autograd.grad(_weighted(got), wrt), strict=True):
        close(a, b)


@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_backward_fills_the_cells_own_weight_gradient(granularity: str) -> None:
    """``loss.backward()`` as a training loop calls it: ``input_weights.grad`` of the cell,
    the one an optimizer steps, is the loop's (a single cell wrapped: one block)."""
    torch.manual_seed(3)
    cell = norse.LILinearCell(6, 2)
    x = (torch.rand(9, 4, 6) < 0.4).float()
    _weighted(norse_loop(cell, x)).backward()
    want = cell.input_weights.grad.clone()
    cell.input_weights.grad = None
    options: dict[str, Any] = {"chunk": 4} if granularity == "layer" else {"plan": Uniform(3)}
    seq = sc.wrap(cell, granularity=granularity, **options)
    got, _ = seq(x)
    _weighted(got).backward()
    if granularity == "layer":
        assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    close(want, cell.input_weights.grad)


def test_a_hooked_cell_runs_its_call_per_step_and_a_later_hook_is_refused() -> None:
    """A forward hook on the cell: layer-wise then calls the cell per step (the hook sees
    every step, outputs bitwise the loop's). A hook registered after the blocks were split
    would never run: refused, naming the cell and the way forward."""
    model, _ = _model(False, 0.0, 7)
    x = (torch.rand(6, 2, 5) < 0.5).float()
    want = norse_loop(model, x)
    seen: list[Any] = []
    handle = model[2].register_forward_hook(lambda m, args, out: seen.append(out[0].shape))
    hooked = sc.wrap(model, granularity="layer", chunk=4)
    got, _ = hooked(x)
    assert [b.neuron for b in hooked.last_stats.blocks] == ["fused", "per-step"]
    assert torch.equal(got, want) and len(seen) >= 6
    handle.remove()
    seq = sc.wrap(model, granularity="layer", chunk=4)
    seq(x)
    model[2].register_forward_hook(lambda m, args, out: None)
    with pytest.raises(UnsupportedLayerError, match=r"'2'.*wrap the model again"):
        seq(x)
