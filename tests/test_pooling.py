"""``nn.MaxPool2d`` over a layer-wise chunk through torch's channels-last kernel
(`spikeckpt.adapters.pooling`): the values, and the gradients through the positions they came
from, bitwise torch's own (ties, NaNs, padding, ``ceil_mode``), and the pools it does not take
(overlapping windows, dilation, indices returned, a subclass) left to the module."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from collections.abc import Iterator

import pytest
import snntorch as snn
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn import functional as F

import spikeckpt as sc
from spikeckpt.adapters import pooling
from spikeckpt.adapters.generic import StatelessAdapter
from spikeckpt.adapters.pooling import fast_max_pool

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse


@pytest.fixture(autouse=True, scope="module")
def _small_inputs_taken() -> Iterator[None]:
    """These tests' small maps through the fast path (it declines inputs under
    `pooling.MIN_ELEMENTS` elements or `pooling.MIN_CHANNELS` channels, tested below)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pooling, "MIN_ELEMENTS", 0)
        patch.setattr(pooling, "MIN_CHANNELS", 1)
        yield


def _same(a: Tensor, b: Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    )


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 6),
    c=st.integers(1, 5),
    h=st.integers(3, 13),
    w=st.integers(3, 13),
    kernel=st.integers(1, 3),
    extra=st.integers(0, 1),
    pad=st.booleans(),
    ceil=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    odd=st.sampled_from(["none", "nan", "inf"]),
    seed=st.integers(0, 2**16),
)
def test_values_and_gradients_are_torchs_bitwise(
    n: int,
    c: int,
    h: int,
    w: int,
    kernel: int,
    extra: int,
    pad: bool,
    ceil: bool,
    dtype: torch.dtype,
    odd: str,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    padding = kernel // 2 if pad else 0
    module = nn.MaxPool2d(kernel, kernel + extra, padding=padding, ceil_mode=ceil)
    pool = fast_max_pool(module)
    assert pool is not None
    # few distinct values: many ties in a window, the first one's position wins
    x = (torch.randint(0, 3, (n, c, h, w), generator=g) * 0.5).to(dtype)
    if odd != "none":
        x.view(-1)[torch.randint(0, x.numel(), (3,), generator=g)] = float(odd)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = F.max_pool2d(a, kernel, kernel + extra, padding, ceil_mode=ceil), pool(b)
    assert got is not None and got.is_contiguous()
    assert _same(got, want)
    weights = torch.randn(want.shape, generator=g, dtype=dtype)
    want.backward(weights)
    got.backward(weights)
    assert a.grad is not None and b.grad is not None
    assert _same(b.grad, a.grad)


def test_it_keeps_the_positions_alone_in_32_bits() -> None:
    """The pooled output's backward holds one 32-bit position per output (torch's own keeps
    its input and 64-bit positions): N-MNIST's first block, 8 steps of batch 4."""
    pool = fast_max_pool(nn.MaxPool2d(2))
    assert pool is not None
    x = torch.rand(32, 12, 30, 30, requires_grad=True)
    kept: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = pool(x)
    assert y is not None
    assert [(t.dtype, t.shape) for t in kept] == [(torch.int32, y.shape)]
    y.sum().backward()
    want = torch.zeros_like(x).view(32, 12, -1)
    where = F.max_pool2d(x.detach(), 2, return_indices=True)[1].view(32, 12, -1)
    want.scatter_(2, where, 1.0)
    assert x.grad is not None and torch.equal(x.grad, want.view_as(x))


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_both_backwards_are_torchs_bitwise_over_slices(
    compiled: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled backward (32-bit positions read as they are) and torch's (a slice of the
    rows at a time, its positions widened) over a chunk pooled in several slices: values and
    gradients torch's own, signed zeros, NaN and infinite gradients included."""
    if compiled:
        assert pooling._scatter_jit is not None  # Numba is a dependency
    else:
        monkeypatch.setattr(pooling, "_scatter_jit", None)
    monkeypatch.setattr(pooling, "SLICE_BYTES", 3 * 4 * 10 * 10 * 8)  # 3 rows a slice
    g = torch.Generator().manual_seed(5)
    x = (torch.randint(0, 3, (10, 4, 10, 10), generator=g) * 0.5).to(dtype)
    x[1, 2, 3, 4] = float("nan")
    module = nn.MaxPool2d(2, padding=1, ceil_mode=True)
    pool = fast_max_pool(module)
    assert pool is not None
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = module(a), pool(b)
    assert got is not None and _same(got, want)
    weights = torch.randn(want.shape, generator=g, dtype=dtype)
    weights[0, 0, 0, :3] = torch.tensor([-0.0, float("nan"), float("-inf")], dtype=dtype)
    want.backward(weights)
    got.backward(weights)
    assert a.grad is not None and b.grad is not None
    assert _same(b.grad, a.grad)
    assert torch.equal(b.grad.signbit(), a.grad.signbit())


def test_a_negated_view_of_a_gradient_is_read() -> None:
    """A gradient handed over as a negated view (torch's lazy negation, no NumPy array of its
    own) gives torch's gradient."""
    pool = fast_max_pool(nn.MaxPool2d(2))
    assert pool is not None
    x = torch.rand(2, 3, 6, 6)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = torch.randn(2, 3, 3, 3)
    y = pool(b)
    assert y is not None
    y.backward(torch._neg_view(weights))
    F.max_pool2d(a, 2).backward(-weights)
    assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize(
    "module",
    [
        nn.MaxPool2d(3, 2),  # windows overlap: an input may sum two gradients
        nn.MaxPool2d(2, dilation=2),
        nn.MaxPool2d(2, return_indices=True),
        type("MyPool", (nn.MaxPool2d,), {})(2),
        nn.AvgPool2d(2),
        nn.MaxPool2d(2, stride=(2,)),  # torch broadcasts one number in a tuple
        nn.MaxPool2d(2, stride=()),  # torch: the kernel
    ],
    ids=["overlap", "dilation", "indices", "subclass", "avg", "stride-1-tuple", "stride-empty"],
)
def test_pools_it_does_not_take_are_left_to_the_module(module: nn.Module) -> None:
    assert fast_max_pool(module) is None


def test_inputs_it_does_not_take_are_left_to_the_module() -> None:
    pool = fast_max_pool(nn.MaxPool2d(2))
    assert pool is not None
    # channels-last: torch keeps that layout for the output and the gradient, whose sums the
    # layer before adds in their order (a conv's bias gradient 1.2e-7 off otherwise: h24)
    assert pool(torch.rand(2, 6, 8, 8).contiguous(memory_format=torch.channels_last)) is None
    assert pool(torch.rand(2, 6, 8, 8).transpose(2, 3)) is None
    with pytest.MonkeyPatch.context() as patch:  # the thresholds this module lowers
        patch.setattr(pooling, "MIN_ELEMENTS", 1 << 15)
        patch.setattr(pooling, "MIN_CHANNELS", 4)
        assert pool(torch.rand(1, 12, 24, 24)) is None  # the Function costs more than it saves
        assert pool(torch.rand(1, 1, 700, 700)) is None  # one channel: no rows to compare
        assert pool(torch.rand(16, 12, 30, 30)) is not None  # a step of tutorial 7's stack
    assert pool(torch.rand(2, 6, 6, dtype=torch.float32)) is None  # (C, H, W)
    assert pool(torch.rand(1, 2, 6, 6, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("granularity", ["layer", "stack"])
def test_a_conv_net_trains_as_the_loop_through_the_fast_pool(
    granularity: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """snnTorch's tutorial-7 shape (Conv -> MaxPool -> Leaky, twice) on sparse spikes: the
    pools see whole windows of equal values; the wrapped run's spikes are the loop's, its
    gradients at round-off, and every chunk (layer-wise) or step (the stack, `Uniform(4)`)
    pooled through the fast path."""
    calls = []
    apply = pooling._MaxPool2d.apply
    monkeypatch.setattr(pooling._MaxPool2d, "apply", lambda *a: calls.append(1) or apply(*a))
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 6, 3),
        nn.MaxPool2d(2),
        snn.Leaky(beta=0.9, init_hidden=True),
        nn.Conv2d(6, 8, 3),
        nn.MaxPool2d(2),
        snn.Leaky(beta=0.9, init_hidden=True),
        nn.Flatten(),
        nn.Linear(8 * 2 * 2, 5),
        snn.Leaky(beta=0.9, init_hidden=True, output=True),
    )
    x = (torch.rand(13, 3, 2, 14, 14) < 0.1).float()

    def loop() -> Tensor:
        from snntorch import utils

        utils.reset(net)
        return torch.stack([net(x_t)[0] for x_t in x])

    want = loop()
    want.sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    if granularity == "layer":
        seq = sc.wrap(net, granularity="layer", chunk=4)
    else:
        seq = sc.wrap(net, plan=sc.plans.Uniform(4), compile=False)
    got = seq(x)[0]
    got.sum().backward()
    assert torch.equal(got, want)
    # two pools, four chunks or 13 steps, forward and recomputation
    assert len(calls) >= 2 * (4 if granularity == "layer" else 13) * 2
    for a, p in zip(grads, net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-6 * float(a.abs().max()))


def test_a_norse_conv_net_layerwise_is_the_loop() -> None:
    torch.manual_seed(1)
    net = norse.SequentialState(
        nn.Conv2d(1, 4, 3),
        nn.MaxPool2d(2),
        norse.LIFCell(),
        nn.Flatten(),
        nn.Linear(64, 3),
        norse.LICell(),
    )
    x = (torch.rand(9, 2, 1, 10, 10) < 0.3).float()
    state, outs = None, []
    for x_t in x:
        y, state = net(x_t, state)
        outs.append(y)
    torch.stack(outs).pow(2).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    out = sc.wrap(net, granularity="layer", chunk=3)(x)[0]
    assert torch.equal(out, torch.stack(outs))
    out.pow(2).sum().backward()
    for a, p in zip(grads, net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-6 * float(a.abs().max()))


def test_a_channels_last_model_keeps_the_loops_gradients_bitwise() -> None:
    """A model and input in channels-last (``net.to(memory_format=torch.channels_last)``),
    the stack with `BPTT`: torch's pool runs (its layouts), every gradient bitwise the
    loop's (h24's repro: the fast pool's contiguous gradient summed the conv's bias in another
    order, 1.19e-7 off)."""
    from snntorch import utils

    def model() -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(
            nn.Conv2d(2, 8, 3, padding=1), nn.MaxPool2d(2),
            snn.Leaky(beta=0.7, init_hidden=True, threshold=0.3), nn.Flatten(),
            nn.Linear(8 * 5 * 5, 5), snn.Leaky(beta=0.7, init_hidden=True, output=True),
        )  # fmt: skip
        return net.to(memory_format=torch.channels_last)

    g = torch.Generator().manual_seed(1)
    x = (torch.rand(6, 1, 2, 10, 10, generator=g) < 0.4).float()
    x = torch.stack([t.contiguous(memory_format=torch.channels_last) for t in x])
    w = torch.randn(6, 1, 5, generator=g)
    loop_net, wrapped_net = model(), model()
    utils.reset(loop_net)
    (torch.stack([loop_net(x_t)[0] for x_t in x]) * w).sum().backward()
    (sc.wrap(wrapped_net, plan=sc.plans.BPTT())(x)[0] * w).sum().backward()
    for (name, a), b in zip(loop_net.named_parameters(), wrapped_net.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, b.grad), name


def test_a_second_derivative_is_refused_by_torch() -> None:
    """The backward is written for first derivatives (``once_differentiable``): a graph of it
    is refused with torch's error, never a wrong second derivative."""
    pool = fast_max_pool(nn.MaxPool2d(2))
    assert pool is not None
    x = torch.rand(2, 4, 6, 6, requires_grad=True)
    y = pool(x)
    assert y is not None
    (g,) = torch.autograd.grad((y**2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


_COMPILED_STEP = """
import warnings
warnings.simplefilter("ignore")
import torch, snntorch as snn
from torch import nn
import spikeckpt as sc
from spikeckpt.adapters import pooling
pooling.MIN_ELEMENTS, pooling.MIN_CHANNELS = 0, 1
torch.manual_seed(0)
net = nn.Sequential(nn.Conv2d(1, 4, 5), nn.MaxPool2d(2), snn.Leaky(beta=0.5, init_hidden=True))
seq = sc.wrap(net)
x = (torch.rand(4, 2, 1, 12, 12) < 0.3).float()

@torch.compile(backend="eager")
def train_step(x):
    seq(x).sum().backward()

train_step(x)
print("grad", float(net[0].weight.grad.abs().sum()))
"""


def test_a_compiled_training_step_runs_the_pools_first_backward() -> None:
    """``torch.compile`` of a step that calls the wrapped net and its backward, in a fresh
    process (the pool's compiled backward is loaded at its first call there): dynamo's frame
    hook must not trace Numba's loading (h24: an internal dynamo error before)."""
    done = subprocess.run(
        [sys.executable, "-c", _COMPILED_STEP], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) > 0


def test_a_bare_pool_adapter_pickles_and_pools_the_same() -> None:
    """The adapter keeps its pool as a partial of a module-level function: pickled and
    loaded, it pools through the fast kernel, bitwise the module's own values."""
    adapter = StatelessAdapter(nn.MaxPool2d(2))
    loaded = pickle.loads(pickle.dumps(adapter))
    assert loaded._pool is not None
    x = torch.randn(4, 8, 32, 32)  # 32,768 elements, 8 channels: the fast kernel's
    x.requires_grad_(True)
    _, pooled = loaded.step((), x)
    assert "_MaxPool2d" in type(pooled.grad_fn).__name__
    assert torch.equal(pooled, F.max_pool2d(x, 2))
