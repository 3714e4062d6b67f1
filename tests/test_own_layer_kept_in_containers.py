"""A layer of yours that keeps its state in a container on itself (SpikingJelly's
``MemoryModule`` idiom: ``self.v = ...`` routed into a ``self._memories`` dict by
``__setattr__``; a list ``self.mem[0] = v``; a plain object ``self.h.v = v``) is refused
at its first step, naming the attribute, as ``self.v = ...`` is. Before, the attribute
check compared such containers by identity: ``plan=BPTT()`` gave other gradients than the
loop's, silently (0.03-0.13 apart on a 12-16-5 net), other plans torch's or a generic error."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt.plans import BPTT, Uniform


def _spike(v: Tensor) -> Tensor:
    """Heaviside forward, sigmoid-shaped gradient."""
    s = torch.sigmoid(4 * v)
    return s + ((v >= 0).to(v) - s).detach()


class MemoryModule(nn.Module):
    """SpikingJelly's idiom: memories in a dict, reached as attributes."""

    def __init__(self) -> None:
        super().__init__()
        self._memories: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        memories = self.__dict__.get("_memories")
        if memories is not None and name in memories:
            return memories[name]
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        memories = self.__dict__.get("_memories")
        if memories is not None and name in memories:
            memories[name] = value
        else:
            super().__setattr__(name, value)

    def reset(self) -> None:
        """Back to the state before the first step."""
        for k in self._memories:
            self._memories[k] = None


class DictLIF(MemoryModule):
    """A leaky neuron keeping ``self.v`` in ``self._memories``."""

    def __init__(self) -> None:
        super().__init__()
        self._memories["v"] = None

    def forward(self, x: Tensor) -> Tensor:
        v = torch.zeros_like(x) if self.v is None else self.v
        v = 0.5 * v + x
        s = _spike(v - 1.0)
        self.v = v - s
        return s


class ListLIF(nn.Module):
    """A leaky neuron keeping its membrane in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.mem: list[Tensor | None] = [None]

    def reset(self) -> None:
        """Back to the state before the first step."""
        self.mem[0] = None

    def forward(self, x: Tensor) -> Tensor:
        v = torch.zeros_like(x) if self.mem[0] is None else self.mem[0]
        v = 0.5 * v + x
        s = _spike(v - 1.0)
        self.mem[0] = v - s
        return s


class HolderLIF(nn.Module):
    """A leaky neuron keeping its membrane on a plain object."""

    def __init__(self) -> None:
        super().__init__()
        self.h = types.SimpleNamespace(v=None)

    def reset(self) -> None:
        """Back to the state before the first step."""
        self.h.v = None

    def forward(self, x: Tensor) -> Tensor:
        v = torch.zeros_like(x) if self.h.v is None else self.h.v
        v = 0.5 * v + x
        s = _spike(v - 1.0)
        self.h.v = v - s
        return s


def _loop(net: nn.Module, x: Tensor) -> Tensor:
    for m in net.modules():
        if hasattr(m, "reset"):
            m.reset()
    return torch.stack([net(x_t) for x_t in x])


@pytest.mark.parametrize("plan", [BPTT(), Uniform(3)], ids=["BPTT", "Uniform"])
@pytest.mark.parametrize(
    ("cls", "name"), [(DictLIF, "_memories"), (ListLIF, "mem"), (HolderLIF, "h")]
)
def test_state_in_a_container_is_refused(plan: Any, cls: type[nn.Module], name: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), cls(), nn.Linear(16, 5), cls())
    x = torch.rand(9, 4, 12) * 2
    ref = copy.deepcopy(net)
    _loop(ref, x).sum().backward()  # the loop runs: the model is a fair one to port
    seq = spikeckpt.wrap(net, plan=plan)
    with pytest.raises(
        spikeckpt.UnsupportedLayerError, match=rf"self\.{name}\b.*forward\(x, state\)"
    ):
        seq(x).sum().backward()


class Cached(nn.Module):
    """A stateless layer of yours with a container it fills once and then only reads."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[int, Tensor] = {}
        self.names = ["scale"]

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] not in self.cache:
            self.cache[x.shape[-1]] = torch.linspace(0.5, 1.5, x.shape[-1])
        return x * self.cache[x.shape[-1]]


def test_container_read_only_is_fine() -> None:
    """A container the wrapped steps leave as they find it (filled before the call) passes,
    with the loop's gradients."""
    torch.manual_seed(0)
    lif = nn.Sequential(nn.Linear(12, 16), Cached())
    net = nn.Sequential(*lif, nn.RNNCell(16, 5))
    x = torch.rand(6, 3, 12)
    net[1](net[0](x[0]))  # fills the cache
    ref = copy.deepcopy(net)
    h, ys = torch.zeros(3, 5), []
    for x_t in x:
        h = ref[2](ref[1](ref[0](x_t)), h)
        ys.append(h)
    torch.stack(ys).sum().backward()
    spikeckpt.wrap(net, plan=Uniform(2))(x).sum().backward()
    for p, q in zip(ref.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_layerwise_refusal_names_your_layers() -> None:
    """Layer-wise, a stack whose only neurons keep their state on themselves has no neuron
    spikeckpt knows: the refusal names the layers of yours it took for stateless ones."""
    net = nn.Sequential(nn.Linear(12, 16), DictLIF(), nn.Linear(16, 5), ListLIF())
    with pytest.raises(
        spikeckpt.UnsupportedLayerError, match=r"stateless: '1' \(DictLIF\), '3' \(ListLIF\)"
    ):
        spikeckpt.wrap(net, plan=Uniform(3), granularity="layer")(torch.rand(5, 2, 12))


class _Recorder(nn.Module):
    """A layer that appends what it sees to a list (a recorder, not state)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(float(x.detach().sum()))
        return x


class _LazyCache(nn.Module):
    """A layer that fills a dict at its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.cache: dict[str, float] = {}

    def forward(self, x: Tensor) -> Tensor:
        if "scale" not in self.cache:
            self.cache["scale"] = 0.5
        return self.lin(x) * self.cache["scale"]


@pytest.mark.parametrize("layer", [_Recorder, _LazyCache])
def test_a_container_only_added_to_is_refused_with_the_way_out(layer: type[nn.Module]) -> None:
    snn = pytest.importorskip("snntorch")
    net = nn.Sequential(nn.Linear(5, 5), layer(), snn.Leaky(beta=0.9, init_hidden=True))
    with pytest.raises(spikeckpt.UnsupportedLayerError) as err:
        spikeckpt.wrap(net, plan=BPTT())(torch.rand(4, 2, 5)).sum().backward()
    message = str(err.value)
    assert "layer '1'" in message
    assert "register_forward_hook" in message and "__init__" in message
