"""A data-parallel wrapper around the model is refused, naming the order that works."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import spikeckpt
from spikeckpt.errors import UnsupportedLayerError

snn = pytest.importorskip("snntorch")


def _net() -> nn.Sequential:
    """A small snnTorch stack."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), snn.Leaky(0.9), nn.Linear(5, 3), snn.Leaky(0.9))


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real gloo process group of one rank (DDP needs one to be built)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_ddp_around_the_model_is_refused_naming_the_order_that_works() -> None:
    with pytest.raises(UnsupportedLayerError) as info:
        spikeckpt.wrap(DistributedDataParallel(_net()), plan=spikeckpt.plans.Uniform(4))
    message = str(info.value)
    assert "DistributedDataParallel(spikeckpt.wrap(model" in message
    assert "<root>" in message


@pytest.mark.usefixtures("one_rank_group")
def test_ddp_around_the_wrapped_model_gives_the_loops_gradients() -> None:
    net = _net()
    x = (torch.rand(20, 4, 6, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    ddp = DistributedDataParallel(spikeckpt.wrap(net, plan=spikeckpt.plans.Uniform(4)))
    ddp(x).sum().backward()
    wrapped = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    fc1, lif1, fc2, lif2 = net
    mem1 = mem2 = None
    total = torch.zeros(())
    for t in range(x.shape[0]):
        h = fc1(x[t])
        spk1, mem1 = lif1(h, torch.zeros_like(h) if mem1 is None else mem1)
        h = fc2(spk1)
        spk2, mem2 = lif2(h, torch.zeros_like(h) if mem2 is None else mem2)
        total = total + spk2.sum()
    total.backward()
    for got, want in zip(wrapped, (p.grad for p in net.parameters()), strict=True):
        assert torch.equal(got, want)


def test_data_parallel_around_the_model_is_refused_naming_the_order_that_works() -> None:
    with pytest.raises(UnsupportedLayerError, match=r"DataParallel\(spikeckpt.wrap\(model"):
        spikeckpt.wrap(nn.DataParallel(_net()))
