"""Packed input spike trains through ``scan`` and ``wrap``: the results of the dense train.

A :class:`~spikeckpt.storage.SpikeTrain` (bit-packed or index list) or a ``torch.sparse_coo``
train stays packed and is unpacked one step (stack) or one chunk (layer-wise) at a time. Every
case compares outputs and parameter gradients bitwise with the same model on the dense train.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spikeckpt
from spikeckpt import plans
from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.errors import NotBinaryError
from spikeckpt.models import LIFStack
from spikeckpt.storage import SpikeTrain

snn = pytest.importorskip("snntorch")

C, HIDDEN, CLASSES = 12, 16, 5


def _net(seed: int = 1) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(C, HIDDEN),
        snn.Leaky(beta=0.9, learn_beta=True),
        nn.Linear(HIDDEN, CLASSES),
        snn.Leaky(beta=0.8),
    )


def _train(T: int, B: int, seed: int = 0, density: float = 0.2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(T, B, C, generator=generator) < density).float()


def _pack(x: torch.Tensor, form: str) -> Any:
    if form == "sparse_coo":
        return x.to_sparse()
    return SpikeTrain.from_dense(x, form)


def _run(x: Any, granularity: str, plan: Any, storage: str, tmp_path: Any) -> Any:
    net = _net()
    kwargs = {"directory": str(tmp_path)} if storage == "disk" else {}
    seq = spikeckpt.wrap(net, plan=plan, storage=storage, granularity=granularity, **kwargs)
    out = seq(x)
    (out * torch.arange(1, CLASSES + 1)).sum().backward()
    return out.detach(), [p.grad.clone() for p in net.parameters()]


FORMS = ("bitpack", "index", "sparse_coo")
PLANS = {
    "bptt": plans.BPTT(),
    "uniform5": plans.Uniform(5),
    "double": plans.Double(8, 3),
    "revolve": plans.Revolve(3),
}


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
@pytest.mark.parametrize("storage", ["host", "disk"])
def test_packed_train_gives_the_dense_results_bitwise(
    granularity: str, plan: str, storage: str, tmp_path: Any
) -> None:
    x = _train(37, 3)
    want = _run(x, granularity, PLANS[plan], storage, tmp_path)
    for form in FORMS:
        got = _run(_pack(x, form), granularity, PLANS[plan], storage, tmp_path)
        assert torch.equal(got[0], want[0]), form
        for g, w in zip(got[1], want[1], strict=True):
            assert torch.equal(g, w), form


@settings(max_examples=12, deadline=None)
@given(
    T=st.integers(1, 23),
    B=st.integers(1, 4),
    interval=st.integers(1, 30),
    form=st.sampled_from(FORMS),
    granularity=st.sampled_from(["stack", "layer"]),
    density=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
)
def test_packed_train_matches_dense_on_random_cases(
    T: int, B: int, interval: int, form: str, granularity: str, density: float
) -> None:
    """Odd T, T smaller than the interval, empty and full trains."""
    x = _train(T, B, seed=T * 7 + B, density=density)
    plan = plans.Uniform(interval)
    want = _run(x, granularity, plan, "host", None)
    got = _run(_pack(x, form), granularity, plan, "host", None)
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1], want[1], strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("readout", [None, "sum", "last"])
def test_scan_takes_a_packed_train(readout: str | None) -> None:
    model = LIFStack([C, HIDDEN, CLASSES])
    x = _train(29, 4)
    results = []
    for inp in (x, SpikeTrain.from_dense(x), x.to_sparse()):
        model.zero_grad()
        ys, _ = spikeckpt.scan(
            model.step,
            inp,
            model.initial_state(x.shape[1]),
            plan=plans.Revolve(4),
            readout=readout,
            params=list(model.parameters()),
        )
        ys.float().sum().backward()
        results.append((ys.detach(), [p.grad.clone() for p in model.parameters()]))
    for ys, grads in results[1:]:
        assert torch.equal(ys, results[0][0])
        assert all(torch.equal(g, w) for g, w in zip(grads, results[0][1], strict=True))


def test_a_packed_train_on_the_host_stays_packed() -> None:
    """The dense train never exists whole: the step unpacks one step at a time, so a run on a
    packed train holds far less than the dense train's bytes beyond what the dense run needs."""
    T, B = 400, 8
    x = _train(T, B, density=0.05)
    packed = SpikeTrain.from_dense(x)
    assert packed.nbytes * 8 <= packed.numel  # at most 1 bit per element
    net = _net()
    seq = spikeckpt.wrap(net, plan=plans.Uniform(20))
    with MemoryMeter() as meter:
        seq(packed).sum().backward()
    assert meter.peak_bytes < x.numel() * x.element_size()  # less than the dense train alone


def test_packed_trains_are_refused_with_batch_first() -> None:
    seq = spikeckpt.wrap(_net(), plan=plans.Uniform(4), batch_first=True)
    with pytest.raises(ValueError, match="always time first"):
        seq(SpikeTrain.from_dense(_train(6, 2)))


def test_a_non_binary_sparse_train_is_refused() -> None:
    x = _train(6, 2)
    x[0, 0, 0] = 0.5
    seq = spikeckpt.wrap(_net(), plan=plans.Uniform(4))
    with pytest.raises(NotBinaryError):
        seq(x.to_sparse())


def test_wrap_checks_the_plan_at_wrap_time() -> None:
    for plan in ("bptt", 5, None):
        with pytest.raises(ValueError, match="plan must be a plan object"):
            spikeckpt.wrap(_net(), plan=plan)


@pytest.mark.parametrize("options", [{"granularity": "stack"}, {"exact": True, "chunk": 3}])
def test_a_packed_train_on_odd_widths_gives_the_dense_results_bitwise(options: Any) -> None:
    """A step of ``B * C`` elements whose bytes are not a multiple of 16: MKL's small products
    round differently with the input's address modulo 16 bytes, and an unpacked step (a new
    tensor) started where the dense train's step does not (membranes 4.8e-7 off in 15 of 30
    cases, found by fuzzing). Unpacked steps and chunks are now placed as the dense train's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), snn.Leaky(beta=0.9, init_hidden=True, output=True))
    with torch.no_grad():
        net[0].weight.mul_(3)
    x = (torch.rand(9, 3, 5) < 0.4).float()
    granularity = options.get("granularity", "layer")
    rest = {k: v for k, v in options.items() if k != "granularity"}
    dense = spikeckpt.wrap(net, granularity=granularity, **rest)(x)
    packed = spikeckpt.wrap(net, granularity=granularity, **rest)(SpikeTrain.from_dense(x))
    for a, b in zip(dense, packed, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
