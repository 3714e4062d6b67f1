"""scan() on a CUDA device: state on the GPU, inputs on the host, every tier, RNG replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_scan import LIF2, loss_of
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt import plans as P
from spikeckpt.engine.saved import measure_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def loop_host_inputs(step: Any, inputs: Tensor, state: Any) -> tuple[Tensor, Any]:
    ys = []
    for t in range(inputs.shape[0]):
        state, y = step(state, inputs[t].to(CUDA))
        ys.append(y)
    return torch.stack(ys), state


@pytest.mark.parametrize("storage", ["device", "host", "disk"])
@pytest.mark.parametrize(
    "plan", [P.BPTT(), P.Uniform(6), P.Revolve(3), P.Double(10, 3), P.TwoLevel(2)], ids=repr
)
def test_cuda_state_host_inputs(plan: Any, storage: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = LIF2(n_in=40, hidden=64, n_out=8).to(CUDA)
    T = 53
    inputs = (torch.rand(T, 32, 40) < 0.2).float().requires_grad_()  # on the host
    v1 = torch.randn(32, 64, device=CUDA, requires_grad=True)
    v2 = torch.randn(32, 8, device=CUDA, requires_grad=True)
    wrt = [*net.parameters(), inputs, v1, v2]
    want_ys, want_state = loop_host_inputs(net, inputs, (v1, v2))
    want = torch.autograd.grad(loss_of(want_ys, want_state), wrt)
    kwargs = {"directory": tmp_path} if storage == "disk" else {}
    ys, final = sc.scan(net, inputs, (v1, v2), plan=plan, storage=storage, **kwargs)
    assert ys.device.type == "cuda"
    got = torch.autograd.grad(loss_of(ys, final), wrt)
    assert got[-3].device.type == "cpu"  # the input gradient lives where the inputs do
    torch.testing.assert_close(ys, want_ys, rtol=0, atol=0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_cuda_dropout_replay_and_ledger() -> None:
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
            v = torch.nn.functional.dropout(torch.tanh(self.lin(v) + x), 0.3, training=True)
            return v, v

    net = Drop().to(CUDA)
    T = 41
    inputs = torch.randn(T, 16, 64, device=CUDA)
    v0 = torch.randn(16, 64, device=CUDA, requires_grad=True)
    torch.manual_seed(5)
    want_ys, want_v = loop_host_inputs(net, inputs, v0)
    want = torch.autograd.grad(loss_of(want_ys, want_v), [*net.parameters(), v0])
    probe = measure_step(net, v0, inputs[0], list(net.parameters()))
    for plan in [P.Uniform(5), P.Revolve(2), P.Double(9, 3)]:
        torch.manual_seed(5)
        out = sc.scan(net, inputs, v0, plan=plan, storage="host")
        (ys, v), stats = out, out.stats
        got = torch.autograd.grad(loss_of(ys, v), [*net.parameters(), v0])
        torch.testing.assert_close(ys, want_ys, rtol=0, atol=0)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        predicted = P.simulate(
            stats.schedule, state_bytes=probe.state_bytes, step_bytes=probe.step_bytes
        )
        assert stats.peak_bytes["device"] == predicted.peak_bytes
