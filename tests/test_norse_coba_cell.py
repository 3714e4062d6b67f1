"""Norse's ``CobaLIFCell`` (conductances, input and recurrent weights inside; not an
``SNNCell``, it builds its start from ``None``) against Norse's own loop: layer-wise (its
block's neuron, one call per step: `spikeckpt.adapters.norse_coba` makes its start) and the
stack; outputs bitwise, gradients at round-off. Before, layer-wise refused it.

Norse 1.1.0's ``coba_lif_step`` adds the input's conductance jumps to ``g_e`` / ``g_i`` and
then overwrites both with the recurrent jumps, so the cell ignores its input (the gradients
of ``x``, the first ``Linear`` and ``input_weights`` are None in its own loop): the wrapped
model reproduces that too. The cell still fires: it starts at ``v = 0``, above
``v_thresh``, and its recurrent jumps drive it from there."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from norse_cells import close, norse_loop
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.errors import UnsupportedLayerError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse
    from norse.torch.functional.coba_lif import CobaLIFParameters


def _weighted(y: Tensor) -> Tensor:
    return (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()


def _model(seed: int) -> nn.Module:
    """``SequentialState(Linear, CobaLIFCell, Linear, LICell)``, fast enough to spike."""
    torch.manual_seed(seed)
    cell = norse.CobaLIFCell(8, 6, p=CobaLIFParameters(c_m_inv=torch.tensor(60.0)))
    model = norse.SequentialState(nn.Linear(4, 8), cell, nn.Linear(6, 3), norse.LICell())
    with torch.no_grad():
        model[0].weight.mul_(6.0)
        cell.input_weights.mul_(8.0)
    return model


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.integers(1, 12),
    chunk=st.integers(1, 5),
    granularity=st.sampled_from(["layer", "stack"]),
    seed=st.integers(0, 2**16),
)
def test_the_cell_runs_as_norses_loop(steps: int, chunk: int, granularity: str, seed: int) -> None:
    model = _model(seed)
    x = ((torch.rand(steps, 2, 4) < 0.6).float() * 2).requires_grad_()
    wrt = [x, *model.parameters()]
    want = norse_loop(model, x)
    want_grads = torch.autograd.grad(_weighted(want), wrt, allow_unused=True)
    assert want_grads[0] is None and want_grads[-1] is not None  # x unused; the last bias used
    options = {"chunk": chunk} if granularity == "layer" else {"plan": sc.plans.Uniform(chunk)}
    seq = sc.wrap(model, granularity=granularity, **options)
    got, state = seq(x)
    if granularity == "layer":
        assert [b.neuron for b in seq.last_stats.blocks] == ["per-step", "fused"]
    assert torch.equal(got, want)
    assert state[1].v.shape == (2, 6)
    got_grads = torch.autograd.grad(_weighted(got), wrt, allow_unused=True)
    for a, b in zip(want_grads, got_grads, strict=True):
        if a is None:  # unused in Norse's loop: none, or zeros, in the wrapped run
            assert b is None or not b.any()
        else:
            close(a, b)


def test_the_cell_fires_in_these_tests() -> None:
    """The model above spikes (the checks compare more than resting membranes), and its
    recurrent weights get a gradient."""
    model = _model(0)
    x = (torch.rand(12, 2, 4) < 0.6).float() * 2
    spikes = norse_loop(lambda x_t, s: model[1](model[0](x_t), s), x)
    assert 0 < spikes.sum() < spikes.numel()
    (grad,) = torch.autograd.grad(_weighted(norse_loop(model, x)), [model[1].recurrent_weights])
    assert grad.abs().sum() > 0


def test_beside_a_sequence_module_the_cell_is_refused() -> None:
    """Norse's call hands a cell beside sequence modules the whole sequence as one step."""
    model = norse.SequentialState(norse.LIF(), norse.CobaLIFCell(4, 3))
    with pytest.raises(UnsupportedLayerError, match="CobaLIFCell.*sits beside sequence"):
        sc.wrap(model)(torch.rand(5, 2, 4))
