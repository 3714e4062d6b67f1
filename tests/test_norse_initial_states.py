"""Norse cells whose start state users make learnable or compute, and ``p`` fields computed
from a parameter: the wrapped run gives Norse's loop's gradients, or refuses naming the way."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc

norse = pytest.importorskip("norse.torch")
from norse.torch.functional.izhikevich import (  # noqa: E402
    IzhikevichParameters,
    IzhikevichSpikingBehavior,
    IzhikevichState,
)
from norse.torch.functional.lif import (  # noqa: E402
    LIFFeedForwardState,
    lif_feed_forward_step,
)

GRANULARITIES = ["stack", "layer", "auto"]


def _loop(net: nn.Module, x: Tensor) -> Tensor:
    state, outs = None, []
    for x_t in x:
        z, state = net(x_t, state)
        outs.append(z)
    return torch.stack(outs)


def _compare(make: Callable[[], nn.Module], x: Tensor, **options: object) -> None:
    """The wrapped run's outputs and every parameter's gradient against Norse's loop."""
    net = make()
    want = _loop(net, x)
    want.pow(2).sum().backward()
    wrapped = make()
    got, _ = sc.wrap(wrapped, **options)(x)
    got.pow(2).sum().backward()
    assert torch.equal(got, want)
    for (name, a), b in zip(net.named_parameters(), wrapped.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, msg=name)


class _LearnedStart(norse.LIFCell):
    """A LIFCell starting from a learnable membrane (its only override)."""

    def __init__(self, n: int) -> None:
        super().__init__(p=norse.LIFParameters(v_th=torch.as_tensor(0.5)))
        self.v0 = nn.Parameter(torch.linspace(-0.3, 0.4, n))

    def initial_state(self, input_tensor: Tensor) -> LIFFeedForwardState:
        return LIFFeedForwardState(
            v=self.v0.expand_as(input_tensor), i=torch.zeros_like(input_tensor)
        )


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_a_learnable_start_gets_the_loops_gradient(granularity: str) -> None:
    # the start was detached: v0.grad None, silently
    def make() -> nn.Module:
        torch.manual_seed(0)
        return norse.SequentialState(
            nn.Linear(10, 12), _LearnedStart(12), nn.Linear(12, 5), norse.LICell()
        )

    torch.manual_seed(1)
    _compare(make, torch.rand(9, 3, 10) * 6, granularity=granularity)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_izhikevich_with_a_learnable_start_gets_the_loops_gradient(granularity: str) -> None:
    # IzhikevichCell starts from its behaviour's ``s`` itself: Parameters there were detached
    def make() -> nn.Module:
        torch.manual_seed(0)
        v0, u0 = nn.Parameter(torch.full((12,), -70.0)), nn.Parameter(torch.full((12,), -14.0))
        behaviour = IzhikevichSpikingBehavior(
            p=IzhikevichParameters(a=0.02, b=0.2, c=-65.0, d=6.0), s=IzhikevichState(v=v0, u=u0)
        )
        net = norse.SequentialState(nn.Linear(10, 12), norse.IzhikevichCell(behaviour))
        net.v0, net.u0 = v0, u0  # registered, as the optimizer needs them
        return net

    torch.manual_seed(1)
    _compare(make, torch.rand(12, 3, 10) * 10, granularity=granularity)


class _StartFromInput(norse.LIFCell):
    def initial_state(self, input_tensor: Tensor) -> LIFFeedForwardState:
        return LIFFeedForwardState(v=0.5 * input_tensor, i=torch.zeros_like(input_tensor))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_a_start_read_from_the_input_is_refused_naming_the_way(granularity: str) -> None:
    # the run made the start before the run, without a graph to the Linear before it: that
    # Linear's gradient was silently wrong (4.61 off where the loop's largest is 13.8)
    torch.manual_seed(0)
    net = norse.SequentialState(nn.Linear(10, 12), _StartFromInput())
    with pytest.raises(sc.UnsupportedLayerError, match="reads its input.*seq\\(x, state\\)"):
        sc.wrap(net, granularity=granularity)(torch.rand(9, 3, 10))


class _NoisyStart(norse.LIFCell):
    """A LIFCell starting from a random membrane drawn from a generator of its own."""

    def __init__(self) -> None:
        super().__init__(p=norse.LIFParameters(v_th=torch.as_tensor(0.5)))
        self.gen = torch.Generator().manual_seed(3)

    def initial_state(self, input_tensor: Tensor) -> LIFFeedForwardState:
        v = 0.5 * torch.rand(input_tensor.shape, generator=self.gen)
        return LIFFeedForwardState(v=v, i=torch.zeros_like(input_tensor))


def _noisy_start() -> nn.Module:
    torch.manual_seed(0)
    return norse.SequentialState(nn.Linear(10, 12), _NoisyStart(), nn.Linear(12, 5), norse.LICell())


def test_a_start_drawn_from_its_own_generator_runs_as_the_loop() -> None:
    # the input-reading probe drew twice from the cell's generator: refused as "reads its input"
    torch.manual_seed(1)
    _compare(_noisy_start, torch.rand(9, 3, 10) * 6, granularity="stack", plan=sc.plans.BPTT())


def test_a_start_drawn_from_its_own_generator_is_refused_where_steps_are_recomputed() -> None:
    with pytest.raises(sc.ConfigError, match="torch.Generator of its own"):
        sc.wrap(_noisy_start(), granularity="layer")(torch.rand(9, 3, 10))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("listed", [False, True])
def test_a_p_field_computed_from_a_parameter_gets_the_loops_gradient(
    granularity: str, listed: bool
) -> None:
    # tau = softplus(raw) * 100 before the call, raw passed in params=: the stack differentiated
    # raw in every step through the one graph (torch's "backward through the graph a second
    # time"; a misleading UsageError with a recomputing plan)
    torch.manual_seed(0)
    raw = nn.Parameter(torch.linspace(-1, 2, 12))
    x = torch.rand(11, 3, 10) * 12

    def grad(wrapped: bool) -> Tensor:
        torch.manual_seed(0)
        net = norse.SequentialState(
            nn.Linear(10, 12), norse.LIFCell(), nn.Linear(12, 5), norse.LICell()
        )
        net[1].p = norse.LIFParameters(tau_mem_inv=nn.functional.softplus(raw) * 100)
        raw.grad = None
        if wrapped:
            options = dict(params=[raw]) if listed else {}
            seq = sc.wrap(net, granularity=granularity, plan=sc.plans.Revolve(2), **options)
            out = seq(x)[0]
        else:
            out = _loop(net, x)
        out.sum().backward()
        assert raw.grad is not None
        return raw.grad

    torch.testing.assert_close(grad(True), grad(False))


class _Scale(nn.Module):
    """Multiplies by ``raw.mean()`` where ``direct``; else passes its input on."""

    def __init__(self, raw: nn.Parameter | None, direct: bool) -> None:
        super().__init__()
        self.direct = direct
        if raw is not None:
            self.raw = raw

    def forward(self, x: Tensor) -> Tensor:
        return x * self.raw.mean() if self.direct else x


def _reparametrised(held_by: str, direct: bool = False) -> tuple[nn.Module, nn.Parameter]:
    """Linear-Scale-LIFCell-Linear-LICell whose LIFCell threshold is computed from ``raw`` (a
    parameter of the root, or of the layer before the cell) at each training step."""
    torch.manual_seed(0)
    raw = nn.Parameter(torch.linspace(-1, 1, 12))
    scale = _Scale(raw if held_by == "layer" else None, direct)
    net = norse.SequentialState(
        nn.Linear(10, 12), scale, norse.LIFCell(), nn.Linear(12, 5), norse.LICell()
    )
    if held_by == "root":
        net.register_parameter("raw", raw)
    return net, raw


def _set_threshold(net: nn.Module, raw: Tensor) -> None:
    net[2].p = norse.LIFParameters(v_th=0.2 + torch.sigmoid(raw))  # type: ignore[index]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("held_by", ["root", "layer"])
def test_a_p_field_recomputed_from_a_model_parameter_each_step_trains_as_the_loop(
    held_by: str, granularity: str
) -> None:
    # layer-wise refused raw held by the root ("not the tensors its blocks were built with");
    # "auto" crashed in its probes (requires_grad_ on the computed field; a probe's backward
    # through the field's graph, which the run then found freed)
    torch.manual_seed(1)
    x = torch.rand(9, 3, 10) * 6
    (net, raw), (twin, twin_raw) = _reparametrised(held_by), _reparametrised(held_by)
    seq = sc.wrap(twin, granularity=granularity)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (net, twin)]
    for _ in range(2):
        for opt in opts:
            opt.zero_grad()
        _set_threshold(net, raw)
        _loop(net, x).pow(2).sum().backward()
        _set_threshold(twin, twin_raw)
        seq(x)[0].pow(2).sum().backward()
        assert raw.grad is not None and twin_raw.grad is not None
        torch.testing.assert_close(twin_raw.grad, raw.grad)
        for opt in opts:
            opt.step()


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_a_parameter_used_directly_and_through_a_computed_p_field_is_refused_naming_the_way(
    granularity: str,
) -> None:
    # told before that raw is "neither a parameter of the model nor a tensor attribute"
    net, raw = _reparametrised("layer", direct=True)
    seq = sc.wrap(net, granularity=granularity)
    _set_threshold(net, raw)
    with pytest.raises(sc.UnlistedParamsError, match="directly, and through a tensor computed"):
        seq(torch.rand(9, 3, 10) * 6)[0].sum().backward()  # layer-wise: found in the backward


class _ComputedThreshold(norse.LIFCell):
    """The way that message names: the threshold built from ``raw`` inside the step."""

    def __init__(self, raw: nn.Parameter) -> None:
        super().__init__()
        self.raw = raw

    def forward(
        self, input_tensor: Tensor, state: LIFFeedForwardState | None = None
    ) -> tuple[Tensor, LIFFeedForwardState]:
        state = self.initial_state(input_tensor) if state is None else state
        p = norse.LIFParameters(v_th=0.2 + torch.sigmoid(self.raw))
        return lif_feed_forward_step(input_tensor, state, p, self.dt)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_a_threshold_computed_inside_the_step_trains_as_the_loop(granularity: str) -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        raw = nn.Parameter(torch.linspace(-1, 1, 12))
        cell = _ComputedThreshold(raw)
        return norse.SequentialState(
            nn.Linear(10, 12), _Scale(raw, True), cell, nn.Linear(12, 5), norse.LICell()
        )

    torch.manual_seed(1)
    _compare(make, torch.rand(9, 3, 10) * 6, granularity=granularity)


@pytest.mark.parametrize(
    "options",
    [dict(granularity="auto"), dict(granularity="layer", plan="auto", budget="64MiB")],
    ids=["auto", "layer-budget"],
)
def test_an_iaf_cell_run_per_step_is_planned(options: dict[str, object]) -> None:
    # IAFCell's initial_state marks p.v_reset requiring grad; a learnable alpha makes the cell
    # run per step, and the kernel check's start re-marked v_reset inside the planner's probe
    # without gradients: UnlistedParamsError ("Register them as nn.Parameter")
    def make() -> nn.Module:
        torch.manual_seed(0)
        p = norse.IAFParameters(alpha=nn.Parameter(torch.tensor(20.0)), method="tanh")
        return norse.SequentialState(
            nn.Linear(10, 12), norse.IAFCell(p=p), nn.Linear(12, 5), norse.LICell()
        )

    torch.manual_seed(1)
    _compare(make, torch.rand(9, 3, 10) * 6, **options)
