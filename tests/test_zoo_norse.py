"""Model zoo, Norse: our own models with the structure of Norse's examples, each compared with
its own plain loop under Uniform, Double and Revolve (and layer-wise where it applies).

- ``models/conv.py`` ``ConvNet4``: its own loop, states starting at ``None``, ``10 * conv(z)``
  between layers, functional max pooling, a preallocated output buffer; restructured as a
  ``SequentialState`` with a ``Scale`` layer of ours; the max-over-time readout of
  ``task/mnist.py``;
- ``task/cifar10.py``: a LightningModule looping two ``SequentialState`` over a static input,
  with noise drawn inside the loop and a max over time;
- the parameters notebook: a cell of ours with learnable ``LIFParameters`` inside a model with
  its own loop;
- ``Lift`` / ``SequentialState`` with sequence modules: ``out, state = model(x)`` call sites.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from zoo_common import PLAN_IDS, PLANS, check, compare, run

import spikeckpt as sc

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    nt = pytest.importorskip("norse.torch")

T, B = 7, 3

# ----------------------------------------------------------------------------- ConvNet4


class ConvNet4(nn.Module):
    """Norse's ``ConvNet4`` (smaller): LIF cells from ``None``, ``10 * conv2(z)``, its own loop
    writing a preallocated ``voltages`` buffer."""

    def __init__(self, feature_size: int = 16, method: str = "super") -> None:
        super().__init__()
        self.features = int(((feature_size - 4) / 2 - 4) / 2)
        self.conv1 = nn.Conv2d(1, 4, 5, 1)
        self.conv2 = nn.Conv2d(4, 6, 5, 1)
        self.fc1 = nn.Linear(self.features * self.features * 6, 16)
        p = nt.LIFParameters(method=method, alpha=torch.tensor(100.0), v_th=torch.as_tensor(0.1))
        self.lif0 = nt.LIFCell(p=p)
        self.lif1 = nt.LIFCell(p=p)
        self.lif2 = nt.LIFCell(
            p=nt.LIFParameters(method=method, alpha=torch.tensor(100.0), v_th=torch.as_tensor(0.05))
        )
        self.out = nt.LILinearCell(16, 10)

    def body(self, x_t: Tensor, states: tuple[Any, ...]) -> tuple[Tensor, tuple[Any, ...]]:
        s0, s1, s2, so = states
        z = self.conv1(x_t)
        z, s0 = self.lif0(z, s0)
        z = F.max_pool2d(z, 2, 2)
        z = 10 * self.conv2(z)
        z, s1 = self.lif1(z, s1)
        z = F.max_pool2d(z, 2, 2)
        z = z.view(-1, self.features**2 * 6)
        z = self.fc1(z)
        z, s2 = self.lif2(z, s2)
        v, so = self.out(F.relu(z), so)
        return v, (s0, s1, s2, so)

    def forward(self, x: Tensor) -> Tensor:  # before
        seq_length, batch_size = x.shape[0], x.shape[1]
        states: tuple[Any, ...] = (None, None, None, None)
        voltages = torch.zeros(seq_length, batch_size, 10, device=x.device)
        for ts in range(seq_length):
            v, states = self.body(x[ts, :], states)
            voltages[ts, :, :] = v
        return voltages

    def scanned(self, x: Tensor, plan: Any, readout: Any = None) -> Tensor:  # after
        def step(states: tuple[Any, ...], x_t: Tensor) -> Any:
            v, states = self.body(x_t, states)
            return states, v

        voltages, _ = sc.scan(step, x, (None, None, None, None), plan=plan, readout=readout)
        return voltages


class Scale(nn.Module):
    """A stateless layer of ours (Norse's ``10 * conv(z)``): no registration needed."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return self.factor * x


def as_sequential_state(net: ConvNet4) -> nn.Module:
    """``ConvNet4`` restructured: the same modules in a ``SequentialState``."""
    return nt.SequentialState(
        net.conv1,
        net.lif0,
        nn.MaxPool2d(2, 2),
        net.conv2,
        Scale(10),
        net.lif1,
        nn.MaxPool2d(2, 2),
        nn.Flatten(),
        net.fc1,
        net.lif2,
        nn.ReLU(),
        net.out,
    )


def _frames() -> Tensor:
    return torch.rand(T, B, 1, 16, 16) * 8


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_convnet4_with_its_own_loop(plan: Any) -> None:
    """The loop body as a step, Norse's ``None`` initial states as written."""
    check(ConvNet4, lambda m, x: m(x), lambda m, x: m.scanned(x, plan), _frames(), "Norse ConvNet4")


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_convnet4_max_over_time_readout(plan: Any) -> None:
    """``task/mnist.py``: ``torch.max(voltages, 0)``, reduced inside the loop
    (``readout="max"``: max(0)'s gradient, ties included; test_zoo_edges has ties)."""
    check(
        ConvNet4,
        lambda m, x: torch.max(m(x), 0).values,
        lambda m, x: m.scanned(x, plan, readout="max"),
        _frames(),
        "Norse ConvNet4, max readout",
    )


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_convnet4_as_sequential_state(plan: Any, granularity: str) -> None:
    """Restructured with ``Scale(10)``; the wrapped model keeps Norse's ``(out, state)``."""

    def route(m: ConvNet4, x: Tensor) -> Tensor:
        seq = sc.wrap(as_sequential_state(m), plan=plan, granularity=granularity)
        voltages, state = seq(x)
        assert len(state) == 12 and state[1].v.shape == (B, 4, 12, 12)
        return voltages

    check(ConvNet4, lambda m, x: m(x), route, _frames(), "Norse ConvNet4 as SequentialState")


# ----------------------------------------------------------------------------- CIFAR-10 task


def _lightning_base() -> type:
    try:
        import lightning.pytorch as pl
    except ImportError:
        return nn.Module
    return pl.LightningModule


class LIFConvNet(_lightning_base()):  # type: ignore[misc]
    """``task/cifar10.py``'s LightningModule (smaller): two ``SequentialState`` looped over a
    static input, noise added inside the loop, max over time."""

    def __init__(self, seq_length: int = T, plan: Any = None) -> None:
        super().__init__()
        self.seq_length = seq_length
        self.plan = plan
        p = nt.LIFParameters(v_th=torch.as_tensor(0.3))
        self.features = nt.SequentialState(
            nn.Conv2d(3, 4, kernel_size=3, stride=1, padding=1, bias=False),
            nt.LIFCell(p),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 6, kernel_size=3, stride=1, padding=1, bias=False),
            nt.LIFCell(p),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.classification = nt.SequentialState(nn.Linear(6 * 2 * 2, 10, bias=False), nt.LICell())

    def forward(self, x: Tensor) -> Tensor:
        if self.plan is not None:
            return self.scanned(x)
        voltages = torch.empty(self.seq_length, x.shape[0], 10, device=x.device, dtype=x.dtype)
        sf = None
        sc_ = None
        for ts in range(self.seq_length):
            out_f, sf = self.features(x, sf)
            out_c, sc_ = self.classification(out_f, sc_)
            voltages[ts, :, :] = out_c + 0.001 * torch.randn(x.shape[0], 10, device=x.device)
        y_hat, _ = torch.max(voltages, 0)
        return y_hat

    def scanned(self, x: Tensor) -> Tensor:
        def step(state: Any, x: Tensor) -> Any:
            sf, sc_ = state
            out_f, sf = self.features(x, sf)
            out_c, sc_ = self.classification(out_f, sc_)
            return (sf, sc_), out_c + 0.001 * torch.randn(x.shape[0], 10, device=x.device)

        y_hat, _ = sc.scan(
            step, x, (None, None), steps=self.seq_length, plan=self.plan, readout="max"
        )
        return y_hat

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_cifar10_lightning_module(plan: Any) -> None:
    """Noise drawn in the loop is replayed; ``training_step`` gives the loop's gradients."""
    x = torch.rand(B, 3, 8, 8) * 3
    y = torch.tensor([1, 4, 7])

    def loss(m: LIFConvNet, x: Tensor) -> Tensor:
        return m.training_step((x, y), 0)

    def route(m: LIFConvNet, x: Tensor) -> Tensor:
        m.plan = plan
        return m.training_step((x, y), 0)

    check(LIFConvNet, loss, route, x, "Norse CIFAR-10 LightningModule (noise, max)")


# ----------------------------------------------------------------------------- parameters notebook


class ParametrizedLIFRecurrentCell(nn.Module):
    """The parameters notebook's cell of ours: learnable ``LIFParameters``,
    ``forward(x, s=None)``."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tau_mem_inv = nn.Parameter(
            nt.LIFParameters().tau_mem_inv + 20 * torch.randn(hidden_size)
        )
        self.v_th = nn.Parameter(0.5 + 0.1 * torch.randn(hidden_size))
        self.cell = nt.LIFRecurrentCell(
            input_size=input_size,
            hidden_size=hidden_size,
            p=nt.LIFParameters(tau_mem_inv=self.tau_mem_inv, v_th=self.v_th, alpha=100),
        )

    def forward(self, x: Tensor, s: Any = None) -> Any:
        return self.cell(x, s)


class NotebookSNN(nn.Module):
    """The notebook's ``SNN``: its own loop over ``x[ts].view(-1, features)``."""

    def __init__(self, input_features: int = 16, hidden: int = 12, out: int = 4) -> None:
        super().__init__()
        self.cell = ParametrizedLIFRecurrentCell(input_features, hidden)
        self.fc_out = nn.Linear(hidden, out, bias=False)
        self.out = nt.LICell()
        self.input_features = input_features

    def forward(self, x: Tensor) -> Tensor:
        seq_length = x.shape[0]
        s1 = so = None
        voltages = []
        for ts in range(seq_length):
            z = x[ts, :, :, :].view(-1, self.input_features)
            z, s1 = self.cell(z, s1)
            z = self.fc_out(z)
            vo, so = self.out(z, so)
            voltages += [vo]
        return torch.stack(voltages)

    def as_sequential(self) -> nn.Sequential:
        return nn.Sequential(nn.Flatten(), self.cell, self.fc_out, self.out)


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_parameters_notebook(plan: Any) -> None:
    """The cell of ours is a neuron by arity (``forward(x, s=None)``), starting from ``None``
    as in the loop; its learnable ``tau_mem_inv`` and ``v_th`` get the loop's gradients."""
    x = torch.rand(T, B, 1, 4, 4) * 2
    check(
        NotebookSNN,
        lambda m, x: m(x),
        lambda m, x: sc.wrap(m.as_sequential(), plan=plan)(x),
        x,
        "Norse parameters notebook",
    )


def test_parameters_notebook_refuses_layerwise_from_none() -> None:
    with pytest.raises(sc.UnsupportedLayerError, match=r"(?s)'1'.*builds its own state"):
        sc.wrap(NotebookSNN().as_sequential(), granularity="layer")
    assert sc.wrap(NotebookSNN().as_sequential(), granularity="auto").granularity == "auto"


# ----------------------------------------------------------------------------- call sites


def test_sequential_state_call_sites_stay_the_same() -> None:
    """``out, state = model(x)`` and ``out, state = model(x, state)`` as with Norse's own
    ``SequentialState`` over sequence modules."""
    torch.manual_seed(0)
    model = nt.SequentialState(nt.Lift(nn.Conv2d(2, 3, 3)), nn.Flatten(2), nt.LIF(), nt.LI())
    x = torch.rand(9, B, 2, 6, 6) * 3
    seq = sc.wrap(model, plan=sc.plans.Revolve(2))
    ref, _ = model(x)
    out, state = seq(x)
    assert torch.equal(out, ref)
    first, state = seq(x[:4])  # continue from the returned state, passed positionally
    rest, _ = seq(x[4:], state=state)
    assert torch.equal(torch.cat([first, rest]), ref)
    cell = sc.wrap(nt.LIFCell(), plan=sc.plans.Uniform(3))
    z, s = cell(x.flatten(2))
    assert z.shape == (9, B, 72) and s.v.shape == (B, 72)


def test_weight_shared_cell_keeps_one_state_per_position() -> None:
    """Norse passes each position its own state: a cell at two positions has two."""
    torch.manual_seed(0)
    lin, lif = nn.Linear(5, 5), nt.LIFCell(nt.LIFParameters(v_th=torch.as_tensor(0.2)))
    model = nt.SequentialState(lin, lif, lin, lif)
    x = torch.rand(T, B, 5) * 2

    def loop(m: nn.Module, x: Tensor) -> Tensor:
        state, out = None, []
        for t in range(x.shape[0]):
            z, state = m(x[t], state)
            out.append(z)
        return torch.stack(out)

    ref = run(loop, model, x)
    for plan in PLANS:
        got = run(lambda m, x, plan=plan: sc.wrap(m, plan=plan)(x)[0], model, x)
        compare(ref, got, "Norse weight sharing")


class LoopWithState(nn.Module):
    """A Norse model written with its own time loop and a state argument: ``forward(x (T, B,
    F), state=None) -> (outputs (T, B, H), state)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.lif = nt.LIFCell()

    def forward(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]:
        outs = []
        for t in range(x.shape[0]):
            z, state = self.lif(self.fc(x[t]), state)
            outs.append(z)
        return torch.stack(outs), state


class SubSteps(nn.Module):
    """One step of the input, two sub-steps of the cell (each on the whole batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.lif = nt.LIFCell()

    def forward(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]:
        z = self.fc(x)
        for _ in range(B):  # as many sub-steps as the batch has rows: not a loop over time
            y, state = self.lif(z, state)
        return y, state


def test_a_forward_that_loops_over_time_with_a_state_argument_is_refused() -> None:
    """Given one step ``x[t] (B, F)``, its loop ran over the batch, carrying the state from
    row to row, and the results were not its own loop's (before: no error)."""
    x = torch.rand(T, B, 4)
    with pytest.raises(sc.UnsupportedLayerError, match=r"called lif \(LIFCell\) 3 times") as err:
        sc.wrap(LoopWithState(), plan=sc.plans.Uniform(2))(x)
    assert "spikeckpt.scan" in str(err.value)


def test_sub_steps_on_the_whole_batch_are_not_a_time_loop() -> None:
    def loop(m: nn.Module, x: Tensor) -> Tensor:
        state, outs = None, []
        for t in range(x.shape[0]):
            y, state = m(x[t], state)
            outs.append(y)
        return torch.stack(outs)

    x = torch.rand(T, B, 4) * 4
    check(SubSteps, loop, lambda m, x: sc.wrap(m, plan=sc.plans.Uniform(2))(x)[0], x, "sub-steps")


def test_norses_own_model_with_a_time_loop_is_refused_with_scans_route() -> None:
    """``norse.torch.models.conv.ConvNet4`` loops over time in its ``forward(x)``: the error
    names its stateful layers and shows the route through ``spikeckpt.scan`` (before: "no
    per-step form", without a way forward)."""
    from norse.torch.models.conv import ConvNet4 as NorseConvNet4

    with pytest.raises(sc.UnsupportedLayerError, match=r"lif0, lif1, lif2, out") as err:
        sc.wrap(NorseConvNet4())
    assert "spikeckpt.scan(step, x, state" in str(err.value)
