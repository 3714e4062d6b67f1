"""The plain layers of a Norse ``SequentialState`` of sequence modules (``LIF``, ``LI``,
``Lift``), torch's and yours (`spikeckpt.adapters.time_lifted`): Norse's call hands them the
whole ``(T, B, ...)`` sequence; spikeckpt runs them on each step, on the stack and layer-wise,
as Norse computes them, and refuses, naming the layer, one that mixes time steps (before:
a max-over-time decoder returned the max over the batch, a layer of yours crashed in torch,
``Flatten(2)`` crashed layer-wise)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.errors import UnsupportedLayerError

norse = pytest.importorskip("norse.torch")

GRANULARITIES = ["stack", "layer", "auto"]


class Flattened(nn.Module):
    """``nn.Flatten(2)`` written as a layer of yours."""

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(2)


class MaxOverTime(nn.Module):
    """Norse's MNIST decoding written as a layer: the max over time of the readout voltage."""

    def forward(self, v: Tensor) -> Tensor:
        return v.max(0).values


class Difference(nn.Module):
    """Each step minus the one before (the first kept): keeps the shape, mixes time."""

    def forward(self, z: Tensor) -> Tensor:
        return torch.cat([z[:1], z[1:] - z[:-1]])


def _lif() -> nn.Module:
    return norse.LIF(norse.LIFParameters(v_th=torch.tensor(0.2)))


def _docstring_model() -> nn.Module:
    """The model of Norse's own ``SequentialState`` docstring."""
    return norse.SequentialState(
        norse.Lift(nn.Conv2d(16, 8, 3)),
        nn.Flatten(3),
        norse.LIFRecurrent(12, 6),
        norse.LIFRecurrent(6, 1),
    )


def _conv_model(flatten: nn.Module) -> nn.Module:
    return norse.SequentialState(
        norse.Lift(nn.Conv2d(1, 2, 5)), _lif(), flatten, nn.Linear(2 * 8 * 8, 4), norse.LI()
    )


def _compare(build: object, x: Tensor, granularity: str) -> None:
    """Output and every gradient of the wrapped model against Norse's own call."""
    torch.manual_seed(0)
    model = build()  # type: ignore[operator]
    torch.manual_seed(0)
    twin = build()  # type: ignore[operator]
    want, _ = model(x)
    want.square().sum().backward()
    got, _ = sc.wrap(twin, granularity=granularity)(x)
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_norse_docstring_model_runs_as_norse_computes_it(granularity: str) -> None:
    torch.manual_seed(1)
    _compare(_docstring_model, torch.rand(5, 2, 16, 8, 4) * 4, granularity)


@pytest.mark.parametrize("flatten", [nn.Flatten(2), Flattened()], ids=["torch", "yours"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_a_flatten_over_each_step_torchs_or_yours(flatten: nn.Module, granularity: str) -> None:
    torch.manual_seed(1)
    _compare(lambda: _conv_model(flatten), torch.rand(6, 3, 1, 12, 12) * 4, granularity)


@pytest.mark.parametrize(
    ("mixer", "layer"),
    [
        (lambda: [nn.Flatten(2), nn.Linear(128, 4), norse.LI(), MaxOverTime()], "'5'"),
        (lambda: [Difference(), nn.Flatten(2), nn.Linear(128, 4), norse.LI()], "'2'"),
        (lambda: [nn.Flatten(2), nn.BatchNorm1d(3), nn.Linear(128, 4), norse.LI()], "'3'"),
    ],
    ids=["max over time", "difference", "batchnorm over (T, B, C)"],
)
@pytest.mark.parametrize("granularity", ["stack", "auto"])
def test_a_layer_that_mixes_time_steps_is_refused_by_name(
    mixer: object, layer: str, granularity: str
) -> None:
    torch.manual_seed(0)
    model = norse.SequentialState(norse.Lift(nn.Conv2d(1, 2, 5)), _lif(), *mixer())  # type: ignore[operator]
    x = torch.rand(6, 3, 1, 12, 12) * 4
    model(x)  # Norse runs it (each layer sees the whole sequence)
    with pytest.raises(UnsupportedLayerError, match=f"layer {layer} .*does not treat each time"):
        sc.wrap(model, granularity=granularity)(x)


def test_time_merged_into_the_batch_is_refused_naming_lift() -> None:
    """``Flatten(0, 1)`` -> ``Conv2d`` -> ``Unflatten(0, (T, B))``: the message names Lift."""
    model = norse.SequentialState(
        nn.Flatten(0, 1), nn.Conv2d(1, 2, 5), nn.Unflatten(0, (6, 2)), _lif()
    )
    with pytest.raises(UnsupportedLayerError, match="layer '0' .*norse.torch.Lift"):
        sc.wrap(model)(torch.rand(6, 2, 1, 12, 12))


def test_the_check_leaves_the_generator_and_running_statistics_alone() -> None:
    """The probe of a BatchNorm over ``(T, B, C)`` moves no running mean and draws nothing."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(3)
    model = norse.SequentialState(nn.Linear(4, 4), norse.LIF(), norm)
    x = torch.rand(5, 3, 4)
    before = torch.random.get_rng_state()
    with pytest.raises(UnsupportedLayerError):
        sc.wrap(model)(x)
    assert torch.equal(norm.running_mean, torch.zeros(3))
    assert torch.equal(before, torch.random.get_rng_state())


def _lifted_cell_model(last: str) -> nn.Module:
    torch.manual_seed(0)
    cell = norse.LICell() if last == "LICell" else norse.LIFCell()
    return norse.SequentialState(
        norse.Lift(nn.Linear(10, 16)), _lif(), norse.Lift(nn.Linear(16, 4)), norse.Lift(cell)
    )


def _leaves(tree: object) -> list[Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, Tensor)]


@pytest.mark.parametrize("last", ["LICell", "LIFCell"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_a_lifted_cell_last_returns_and_continues_as_norses_call(
    last: str, granularity: str
) -> None:
    """Norse's ``Lift(cell)`` restarts the cell at each call, returns ``(outputs, final
    state)`` and leaves None at its place in the state list; a second call given the first's
    states starts it afresh again (before: the wrapped model returned the outputs alone and
    carried the cell's state into the second call: gradients 160 apart)."""
    torch.manual_seed(1)
    x, x2 = torch.rand(8, 3, 10) * 4, torch.rand(8, 3, 10) * 4
    model, twin = _lifted_cell_model(last), _lifted_cell_model(last)
    seq = sc.wrap(twin, granularity=granularity)
    want, got = model(x), seq(x)
    assert torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(want)
    want2, got2 = model(x2, list(want[1])), seq(x2, state=list(got[1]))
    for a, b in zip(_leaves((want, want2)), _leaves((got, got2)), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    _leaves(want2[0])[0].pow(2).sum().backward()
    _leaves(got2[0])[0].pow(2).sum().backward()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_an_iaf_cell_whose_initial_state_is_its_v_reset_runs_on_every_route(
    granularity: str,
) -> None:
    """Norse's ``IAFCell.initial_state`` hands out ``p.v_reset`` itself, marked requiring grad:
    the layer-wise probe and blocks made before that read their tensors again (before:
    ``UnlistedParamsError`` under ``"auto"`` and with a layer-wise budget); ``v_reset`` gets
    the loop's gradient."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        p = norse.IAFParameters(v_th=torch.tensor(0.3), v_reset=torch.zeros(4, 1, 1))
        return norse.SequentialState(
            nn.Conv2d(1, 4, 3), norse.IAFCell(p), nn.Flatten(), nn.Linear(400, 3), norse.LICell()
        )

    torch.manual_seed(1)
    x = torch.rand(6, 2, 1, 12, 12) * 3
    loop, wrapped = build(), build()
    state, outs = None, []
    for x_t in x:
        z, state = loop(x_t, state)
        outs.append(z)
    want = torch.stack(outs)
    want.square().sum().backward()
    budget = {"budget": "64MiB"} if granularity == "layer" else {}
    got, _ = sc.wrap(wrapped, granularity=granularity, **budget)(x)
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(loop.parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(wrapped[1].p.v_reset.grad, loop[1].p.v_reset.grad)


@pytest.mark.parametrize(
    "recurrent",
    ["LIFRecurrent", "LSNNRecurrent", "LIFExRecurrent", "LIFAdExRecurrent", "LIFRefracRecurrent"],
)
def test_recurrent_sequence_modules_fuse_as_their_cells_do(recurrent: str) -> None:
    # they ran per step layer-wise (1.45x Norse's own call for LIFRecurrent 100-128-10, T 300)
    def build() -> nn.Module:
        layer = getattr(norse, recurrent)(10, 12)
        return norse.SequentialState(layer, nn.Linear(12, 4), norse.LI())

    torch.manual_seed(1)
    x = torch.rand(9, 3, 10) * 4
    _compare(build, x, "layer")
    seq = sc.wrap(build(), granularity="layer")
    seq(x)
    assert [block.neuron for block in seq.last_stats.blocks] == ["fused", "fused"]
