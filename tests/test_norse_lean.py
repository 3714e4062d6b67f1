"""Norse's feed-forward kernel (`spikeckpt.adapters.kernels.NorseKernel`) keeps only the
membranes before each reset (over the chunk's input where the untaped backward recomputes a
chunk) where no field of ``p`` is learnable (`NorseKernel._forward_lean`); its backward then
takes the spike and the SuperSpike slope from them in one compiled pass. Its gradients are bitwise those of the
path that keeps the states, the input and the spikes, and the backward holds about one
chunk-sized tensor where that path held six (`test_kernel_memory`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters.kernels import NorseKernel

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import norse.torch as norse
    from norse.torch.functional.reset import reset_subtract

    from spikeckpt.adapters.norse import norse_kernel


def _cell(
    kind: str, per_neuron: bool, n: int, method: str, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """A Norse cell of ``kind`` with scalar or per-neuron (``(n,)``) fields in ``dtype``
    (Norse's ``p`` does not follow ``.to(dtype)``)."""
    g = torch.Generator().manual_seed(n)

    def field(value: float) -> Any:
        if not per_neuron:
            return torch.tensor(value, dtype=dtype)
        return (value * (0.5 + torch.rand(n, generator=g))).to(dtype)

    if kind == "lif":
        p = norse.LIFParameters(
            tau_syn_inv=field(150.0),
            tau_mem_inv=field(80.0),
            v_leak=field(0.02),
            v_th=field(0.4),
            v_reset=field(-0.05),
            method=method,
        )
        return norse.LIFCell(p)
    if kind == "li":
        q = norse.LIParameters(
            tau_syn_inv=field(120.0), tau_mem_inv=field(90.0), v_leak=field(0.05)
        )
        return norse.LICell(q)
    reset = {"box": {}, "box-subtract": {"reset_method": reset_subtract}}[kind]
    b = norse.LIFBoxParameters(
        tau_mem_inv=field(70.0), v_leak=field(0.01), v_th=field(0.3), v_reset=field(-0.02),
        method=method, **reset,
    )  # fmt: skip
    return norse.LIFBoxCell(b)


def _both_ways(
    kernel: NorseKernel, leaves: list[Tensor], z: Tensor, grads: dict[str, Tensor | None]
) -> tuple[tuple[Any, ...], list[tuple[Any, ...]], list[Any]]:
    """The backward's gradients after the full forward (the lean path switched off), and
    after the lean one as the untaped backward runs it (over ``into``, consumed) and as
    autograd runs it (a new buffer, outputs made, not consumed); what the lean ones saved."""

    def backward(saved: Any, consume: bool) -> tuple[Any, ...]:
        g_final = [grads["v"], grads["i"]][: len(leaves)]
        return kernel.backward(saved, grads["y"], g_final, grads["mem"], True, [], consume)

    lean_slope = kernel._lean_slope
    kernel._lean_slope = lambda recomputing: None  # type: ignore[method-assign]
    finals_full, y_full, _, saved = kernel.forward(leaves, z, True, False)
    del kernel._lean_slope
    assert kernel._lean_slope == lean_slope
    full = backward(saved, False)
    room = torch.cat([z[:1], z])  # rows 1.. are z, as the untaped backward hands it
    finals, _, _, untaped = kernel.forward(leaves, room[1:], True, False, False, room)
    lean = [backward(untaped, True)]
    found = [untaped]
    if kernel.mode != "li":  # autograd's chunk keeps its own buffer
        finals_taped, y, _, taped = kernel.forward(leaves, z, True, False)
        assert y is not None and torch.equal(y, y_full)
        lean.append(backward(taped, False))
        lean.append(backward(taped, False))  # again: nothing was consumed
        found.append(taped)
        for a, b in zip(finals_full, finals_taped, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(finals_full, finals, strict=True):
        assert torch.equal(a, b)
    return full, lean, found


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["lif", "li", "box", "box-subtract"]),
    per_neuron=st.booleans(),
    k=st.integers(1, 9),
    n=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    which=st.sets(st.sampled_from(["y", "mem", "v", "i"])),
    seed=st.integers(0, 2**16),
)
def test_the_lean_backward_is_bitwise_the_full_one(
    kind: str,
    per_neuron: bool,
    k: int,
    n: int,
    dtype: torch.dtype,
    which: set[str],
    seed: int,
) -> None:
    cell = _cell(kind, per_neuron, n, "super", dtype)
    kernel = norse_kernel(cell)
    assert isinstance(kernel, NorseKernel)
    g = torch.Generator().manual_seed(seed)
    B = 3
    z = (torch.randn(k, B, n, generator=g) * 4).to(dtype)
    leaves = [
        (torch.randn(B, n, generator=g) * 0.3).to(dtype) for _ in range(1 if "box" in kind else 2)
    ]

    def grad(name: str, shape: tuple[int, ...]) -> Tensor | None:
        return torch.randn(shape, generator=g).to(dtype) if name in which else None

    grads = {
        "y": grad("y", (k, B, n)),
        "mem": grad("mem", (k, B, n)),
        "v": grad("v", (B, n)),
        "i": grad("i", (B, n)),
    }
    full, leans, saved = _both_ways(kernel, leaves, z, grads)
    assert all(len(s) == 1 for s in saved)  # the membranes before each reset alone
    for lean in leans:
        for a, b in zip(full[:2], lean[:2], strict=True):
            as_list = [a] if not isinstance(a, list) else a, [b] if not isinstance(b, list) else b
            for x, y in zip(*as_list, strict=True):
                assert x is not None and y is not None
                assert torch.equal(x, y), (x - y).abs().max()


def test_a_learnable_field_or_another_slope_keeps_the_full_path() -> None:
    z = torch.randn(4, 2, 8) * 3
    room = torch.cat([z[:1], z])
    learnable = norse.LIFCell(norse.LIFParameters(v_th=nn.Parameter(torch.tensor(0.4))))
    for cell in (learnable, _cell("lif", False, 8, "tanh")):
        kernel = norse_kernel(cell)
        assert isinstance(kernel, NorseKernel)
        leaves = [torch.zeros(2, 8), torch.zeros(2, 8)]
        saved = kernel.forward(leaves, room[1:], True, False, False, room)[3]
        assert len(saved) == 4  # the states, the input and the spikes
        assert torch.equal(room[1:], z)  # the input left as it came


def test_a_layerwise_lif_net_trains_as_the_loop_with_the_lean_path() -> None:
    torch.manual_seed(3)
    net = norse.SequentialState(
        nn.Linear(40, 32), norse.LIFCell(), nn.Linear(32, 5), norse.LICell()
    )
    x = (torch.rand(23, 4, 40) < 0.2).float()

    def loss(out: Any) -> Tensor:
        return (out[0] if isinstance(out, tuple) else out).pow(2).sum()

    state = None
    outs = []
    for t in range(x.shape[0]):
        y, state = net(x[t], state)
        outs.append(y)
    loss(torch.stack(outs)).backward()
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    seq = sc.wrap(net, granularity="layer", chunk=5)
    loss(seq(x)).backward()
    assert seq.last_stats.blocks[0].untaped_chunks == 5
    for a, p in zip(want, net.parameters(), strict=True):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-6 * float(a.abs().max()))


def test_the_lean_backward_holds_no_chunk_sized_tensor() -> None:
    K, B, N = 20, 4, 64
    kernel = norse_kernel(norse.LIFCell())
    assert isinstance(kernel, NorseKernel)
    room = torch.randn(K + 1, B, N) * 3
    leaves = [torch.zeros(B, N), torch.zeros(B, N)]
    saved = kernel.forward(leaves, room[1:], True, False, False, room)[3]
    g_y = torch.linspace(-1, 1, K * B * N).view(K, B, N)
    with sc.MemoryMeter() as meter:
        g_z = kernel.backward(saved, g_y, [None, None], None, True, [], consume=True)[0]
    assert g_z is not None and g_z.data_ptr() == room[1:].data_ptr()  # over the membranes
    assert meter.peak_bytes <= 0.25 * K * B * N * 4, meter.peak_bytes
