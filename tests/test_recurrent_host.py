"""Norse's ``LIFRecurrentCell`` chunk with its elementwise step compiled
(`spikeckpt.adapters.recurrent_host`) equals the kernel's torch loop bitwise: the products
stay torch's, the step's operations are the same IEEE operations in the same order."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters import host_loops, jit_loops

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    nt = pytest.importorskip("norse.torch")

pytestmark = pytest.mark.skipif(not host_loops.USE_JIT, reason="Numba is not installed")

STEPS = ("lif_recurrent_step_jit", "lif_recurrent_back_carried_jit", "lif_recurrent_back_step_jit")


@contextmanager
def counted_steps(use_jit: bool) -> Iterator[dict[str, int]]:
    """The compiled loops on (``use_jit``) or off, counting the calls of each compiled step."""
    counts = dict.fromkeys(STEPS, 0)
    originals = {name: getattr(jit_loops, name) for name in STEPS}

    def counting(name: str) -> Callable[..., None]:
        def call(*args: Any) -> None:
            counts[name] += 1
            originals[name](*args)

        return call

    previous = host_loops.USE_JIT
    host_loops.USE_JIT = use_jit
    for name in STEPS:
        setattr(jit_loops, name, counting(name))
    try:
        yield counts
    finally:
        host_loops.USE_JIT = previous
        for name, original in originals.items():
            setattr(jit_loops, name, original)


def _fields(hidden: int, kind: str) -> Any:
    """The cell's parameters: Norse's defaults, per-neuron learnable fields, or a field of
    shape ``(1, H)`` (wider than a neuron's: the torch loop runs)."""
    if kind == "default":
        return nt.LIFParameters()
    if kind == "learnable":
        return nt.LIFParameters(
            tau_mem_inv=nn.Parameter(torch.linspace(60.0, 120.0, hidden)),
            tau_syn_inv=nn.Parameter(torch.tensor(150.0)),
            v_leak=nn.Parameter(torch.tensor(0.05)),
            v_th=nn.Parameter(torch.full((hidden,), 0.5)),
            v_reset=nn.Parameter(torch.tensor(-0.1)),
        )
    return nt.LIFParameters(method="tanh", v_th=torch.full((1, hidden), 0.4))


def _run(kind: str, x: Tensor, chunk: int, output: str, use_jit: bool) -> tuple[Any, ...]:
    torch.manual_seed(1)
    hidden = 37
    cell = nt.LIFRecurrentCell(x.shape[-1], hidden, p=_fields(hidden, kind))
    net = nt.SequentialState(cell)
    wrt = [*net.parameters(), *(t for t in vars(cell.p).values() if isinstance(t, nn.Parameter))]
    x = x.clone().requires_grad_()
    with counted_steps(use_jit) as counts:
        seq = sc.wrap(net, granularity="layer", chunk=chunk, output=output)
        out, final = seq(x)
        y = torch.cat(out, -1) if isinstance(out, tuple) else out
        weights = torch.randn(y.shape[-1], generator=torch.Generator().manual_seed(2))
        loss = (y * weights).sum() + final[0].v.sum()
        grads = torch.autograd.grad(loss, [x, *wrt], allow_unused=True)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    return y.detach(), [t.detach() for t in final[0]], grads, counts


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["default", "learnable", "wide field"]),
    T=st.integers(1, 9),
    chunk=st.integers(1, 5),
    batch=st.integers(1, 4),
    density=st.sampled_from([0.03, 0.5]),
    output=st.sampled_from(["spikes", "both"]),
    seed=st.integers(0, 2**16),
)
def test_compiled_recurrent_step_is_bitwise_the_torch_loop(
    kind: str, T: int, chunk: int, batch: int, density: float, output: str, seed: int
) -> None:
    """Spikes, membranes, final states and gradients (input, weights, learnable fields)
    bitwise equal with the compiled step on and off, over odd T, chunks longer than T, a
    sparse (gathered) and a dense input, with and without the membranes' gradients; the
    compiled steps run for every step, except the forward's where a field is wider than a
    neuron's."""
    torch.manual_seed(seed)
    x = (torch.rand(T, batch, 20) < density).float() * 2
    on = _run(kind, x, chunk, output, True)
    off = _run(kind, x, chunk, output, False)
    assert not any(off[3].values())
    counts = on[3]
    backward = counts["lif_recurrent_back_carried_jit"] + counts["lif_recurrent_back_step_jit"]
    # (the kernel's check against the cell's own step runs it too: counts beyond T)
    assert backward >= T
    # the general backward step only at a chunk's last step, where a carry may be None (and
    # at every step where a learnable field reads its terms)
    if kind != "learnable":
        assert counts["lif_recurrent_back_step_jit"] <= -(-T // chunk)
    # the forward steps only where every field is a neuron's (the backward's do not read v_th)
    assert (counts["lif_recurrent_step_jit"] >= T) == (kind != "wide field")
    assert kind != "wide field" or not counts["lif_recurrent_step_jit"]
    for a, b in zip([on[0], *on[1], *on[2]], [off[0], *off[1], *off[2]], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
