"""A layer of yours whose forward hands the whole sequence to a method of its own that loops
over time (SpikingJelly's multi-step mode: ``forward`` calls ``self.multi_step_forward``,
whose ``for t in range(T)`` loop runs the neuron) is refused, naming the method, as a loop in
``forward`` itself is. Before, it was stepped as a stateless layer: called on one step
``(B, ...)`` it ran its loop over the batch axis, and gradients came out other than the
model's own call's, silently (0.04 apart on a 12-16-5 net)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt.plans import BPTT, Uniform


def _spike(v: Tensor) -> Tensor:
    """Heaviside forward, sigmoid-shaped gradient."""
    s = torch.sigmoid(4 * v)
    return s + ((v >= 0).to(v) - s).detach()


class MultiStepLIF(nn.Module):
    """SpikingJelly-like neuron in step_mode 'm': takes (T, B, ...), loops in a method."""

    def single_step_forward(self, x: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """One step: spikes and the next membrane."""
        v = v + (x - v) / 2.0
        s = _spike(v - 1.0)
        return s, v * (1 - s)

    def multi_step_forward(self, x_seq: Tensor) -> Tensor:
        """The whole sequence, step by step."""
        v, out = torch.zeros_like(x_seq[0]), []
        for t in range(x_seq.shape[0]):
            s, v = self.single_step_forward(x_seq[t], v)
            out.append(s)
        return torch.stack(out)

    def forward(self, x: Tensor) -> Tensor:
        return self.multi_step_forward(x)


class TwoDeep(MultiStepLIF):
    """The loop two methods down."""

    def forward(self, x: Tensor) -> Tensor:
        return self._run(x)

    def _run(self, x: Tensor) -> Tensor:
        return self.multi_step_forward(x) * 1.0


@pytest.mark.parametrize("granularity", ["stack", "layer", "auto"])
@pytest.mark.parametrize("cls", [MultiStepLIF, TwoDeep])
def test_loop_in_a_method_is_refused(cls: type[nn.Module], granularity: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), cls(), nn.Linear(16, 5), cls())
    x = torch.rand(9, 4, 12) * 2
    copy.deepcopy(net)(x).sum().backward()  # the model's own call over the sequence runs
    plan = BPTT() if granularity == "stack" else "auto"
    with pytest.raises(
        spikeckpt.UnsupportedLayerError, match=r"layer '1'.*loops over range.*multi_step_forward"
    ):
        spikeckpt.wrap(net, plan=plan, granularity=granularity)(x)


class Scaled(nn.Module):
    """A stateless layer whose forward calls helper methods without a loop over time."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])

    def _apply_all(self, x: Tensor) -> Tensor:
        for layer in self.layers:  # over its own layers: not a time loop
            x = layer(x)
        return x

    @staticmethod
    def _double(x: Tensor) -> Tensor:
        return 2 * x

    def forward(self, x: Tensor) -> Tensor:
        return self._double(self._apply_all(x))


def test_helper_methods_without_a_time_loop_run() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), Scaled(), nn.RNNCell(16, 5))
    ref = copy.deepcopy(net)
    x = torch.rand(7, 3, 12)
    h, ys = torch.zeros(3, 5), []
    for x_t in x:
        h = ref[2](ref[1](ref[0](x_t)), h)
        ys.append(h)
    torch.stack(ys).pow(2).sum().backward()
    spikeckpt.wrap(net, plan=Uniform(3))(x).pow(2).sum().backward()
    for p, q in zip(ref.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
