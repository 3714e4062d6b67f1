"""What a wrapped model returns is changed in place by users, as the plain loop's tensors are.

Logits are stabilised as ``out -= out.max(1, keepdim=True).values``, and truncated BPTT detaches a
returned state with ``state.v.detach_()`` (snnTorch's ``detach_hidden`` does ``mem.detach_()``).
Layer-wise, ``readout="last"`` returned a row of ``unbind`` over the last chunk and the final
states were rows of the fused neuron's chunk: autograd raised its own "Output 0 of _RunFunction is
a view and is being modified inplace" where the loop (``torch.stack(...)[-1]``) and the stack
granularity run; and each such row kept its whole ``(chunk, B, ...)`` tensor alive.
"""

from __future__ import annotations

import norse.torch as norse
import pytest
import snntorch as snn
import torch
from snntorch import utils
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

import spikeckpt as sc

T, B = 12, 3


def _snn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        snn.Leaky(0.9, init_hidden=True),
        nn.Linear(16, 4),
        snn.Leaky(0.9, init_hidden=True, output=True),
    )


def _stabilised_loss(last_mem: Tensor, y: Tensor) -> Tensor:
    last_mem -= last_mem.max(1, keepdim=True).values.detach()
    return nn.functional.cross_entropy(last_mem, y)


@pytest.mark.parametrize("granularity", ["stack", "layer", "auto"])
def test_last_readout_changed_in_place_as_the_loop(granularity: str) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(T, B, 8), torch.tensor([0, 1, 2])
    net = _snn()
    utils.reset(net)
    mems = torch.stack([net(x[t])[1] for t in range(T)])
    _stabilised_loss(mems[-1], y).backward()
    expected = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()

    seq = sc.wrap(net, readout="last", output="mem", granularity=granularity)
    out = seq(x)
    assert not out._is_view()
    _stabilised_loss(out, y).backward()
    for p, g in zip(net.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def _plain_snn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), snn.Leaky(0.9), nn.Linear(16, 4), snn.Leaky(0.9))


def _norse() -> norse.SequentialState:
    torch.manual_seed(0)
    return norse.SequentialState(
        nn.Linear(8, 16), norse.LIFCell(), nn.Linear(16, 4), norse.LICell()
    )


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("kind", ["snntorch", "norse"])
def test_final_state_changed_in_place_as_the_loop(granularity: str, kind: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(T, B, 8)
    net = _norse() if kind == "norse" else _plain_snn()
    if kind == "norse":
        state, outs = None, []
        for t in range(T):
            v, state = net(x[t], state)
            outs.append(v)
    else:
        mems = [net[1].init_leaky(), net[3].init_leaky()]
        outs = []
        for t in range(T):
            z, mems[0] = net[1](net[0](x[t]), mems[0])
            z, mems[1] = net[3](net[2](z), mems[1])
            outs.append(z)
        state = mems

    def loss(out: Tensor, final: object) -> Tensor:
        total = out.sum() * 0.1
        for leaf in tree_leaves(final):
            if isinstance(leaf, Tensor):
                leaf.mul_(2)  # in place, as a user scaling or detaching the state
                total = total + leaf.pow(2).sum()
        return total

    loss(torch.stack(outs), state).backward()
    expected = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()

    seq = sc.wrap(net, granularity=granularity)
    if kind == "norse":
        out, final = seq(x)
    else:
        out, final = seq(x, return_state=True)
    for leaf in tree_leaves(final):
        if isinstance(leaf, Tensor):
            assert not leaf._is_view()
    loss(out, final).backward()
    for p, g in zip(net.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)


def test_returned_state_detached_in_place() -> None:
    """Truncated BPTT: ``detach_()`` on the returned state, then the next window from it."""
    torch.manual_seed(1)
    x = torch.randn(2 * T, B, 8)
    seq = sc.wrap(_norse(), granularity="layer")
    _, state = seq(x[:T])
    for leaf in tree_leaves(state):
        if isinstance(leaf, Tensor):
            leaf.detach_()
    out, _ = seq(x[T:], state=state)
    out.sum().backward()
