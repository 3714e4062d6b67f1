"""The stack granularity never waits for the device.

On CUDA, reading a value of a device tensor (``.item()``, ``bool()``, ``tolist()``,
``nonzero``) makes the host wait until the device's queue is done: one such read per step
removes all overlap of the host's launches with the device's work. The "meta" device stands in
for a GPU: its tensors have shapes and no data, so any such read raises, and a forward +
backward that runs there reads no device value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import norse.torch as norse
import pytest
import snntorch as snn
import torch
from torch import nn

import spikeckpt
from spikeckpt.engine.amp import autocast_kinds, autocast_on
from spikeckpt.plans import BPTT, Revolve, Uniform

META = torch.device("meta")
PLANS = [BPTT(), Uniform(5), Revolve(3)]


def _snntorch() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 16),
        snn.Leaky(0.9, init_hidden=True),
        nn.Linear(16, 4),
        snn.Synaptic(0.8, 0.9, init_hidden=True, output=True),
    )


def _norse() -> nn.Module:
    return norse.SequentialState(
        nn.Linear(16, 16), norse.LIFCell(), nn.Linear(16, 4), norse.LICell()
    )


def _spikes(codec: str | None) -> Any:
    x = (torch.rand(12, 4, 16, generator=torch.Generator().manual_seed(0)) < 0.1).float()
    return x.to(META) if codec is None else spikeckpt.SpikeTrain.from_dense(x, codec).to(META)


@pytest.mark.parametrize("plan", PLANS, ids=repr)
@pytest.mark.parametrize("build", [_snntorch, _norse], ids=["snntorch", "norse"])
@pytest.mark.parametrize("codec", [None, "bitpack", "index"])
@pytest.mark.parametrize("storage", ["host", "device"])
def test_stack_forward_and_backward_read_no_device_value(
    plan: Any, build: Callable[[], nn.Module], codec: str | None, storage: str
) -> None:
    model = build().to(META)
    wrapped = spikeckpt.wrap(model, plan=plan, storage=storage)
    out = wrapped(_spikes(codec))
    out = out if isinstance(out, torch.Tensor) else out[0]
    assert out.device == META and out.shape == (12, 4, 4)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())


def test_a_device_without_autocast_is_asked_nothing_of_it() -> None:
    """``torch.is_autocast_enabled("meta")`` raises: the engine asks only the CPU there."""
    with pytest.raises(RuntimeError):
        torch.is_autocast_enabled("meta")
    assert autocast_kinds(META) == ("cpu",)
    assert not autocast_on(META)
    with torch.autocast("cpu", torch.bfloat16):
        assert autocast_on(META)
