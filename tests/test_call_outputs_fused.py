"""A top ``Synaptic(output=True)`` / ``Alpha(output=True)`` / ``RSynaptic(output=True)`` stays
fused in the layer-wise run.

With ``init_hidden=True`` such a net's call returns ``spk, syn, mem`` (``Alpha``: ``spk,
syn_exc, syn_inh, mem``) each step, and the wrapped net returns them stacked over time. The
top block's fused kernel emits those state leaves per step (`ChunkKernel`'s ``emit``) and takes
their gradients, in the forward, the recomputation, the taped backward and the untaped one,
with the compiled (Numba) loops and the torch ones. Checked against snnTorch's own loop:
spikes and states bitwise (``exact=True``), gradients of a loss on any output (weights,
learnable decays, threshold and graded factor, input) within float32 round-off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import snntorch as snn
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snntorch import surrogate, utils
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters import host_loops
from spikeckpt.engine import layerwise_job


def _top(kind: str, reset: str, learn: bool, fast: bool) -> nn.Module:
    """The top neuron: ``output=True``, ``init_hidden=True``; ``learn``: every decay snnTorch
    lets learn (``Alpha``'s ``learn_alpha`` fails in its constructor) and the threshold;
    ``fast``: the fast sigmoid surrogate (else snnTorch's default). snnTorch 1.0's
    ``Synaptic`` and ``Alpha`` take no graded spike factor."""
    kw: dict[str, Any] = {
        "alpha": 0.85 if kind == "Alpha" else 0.8,
        "beta": 0.6 if kind == "Alpha" else 0.9,
        "threshold": 0.4,
        "reset_mechanism": reset,
        "init_hidden": True,
        "output": True,
        "learn_beta": learn,
        "learn_threshold": learn,
    }
    if kind != "Alpha":
        kw["learn_alpha"] = learn
    if kind == "RSynaptic":  # the recurrent weights inside: the top's width
        kw["linear_features"] = 5
    if fast:
        kw["spike_grad"] = surrogate.fast_sigmoid(slope=5)
    return getattr(snn, kind)(**kw)


def _net(top: nn.Module) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(7, 6), snn.Leaky(beta=0.9, threshold=0.4, init_hidden=True),
        nn.Linear(6, 5), top,
    )  # fmt: skip


def _loop(net: nn.Sequential, x: Tensor) -> list[Tensor]:
    """snnTorch's own loop: each call's outputs, stacked over time."""
    utils.reset(net)
    outs = [net(x_t) for x_t in x]
    return [torch.stack([o[i] for o in outs]) for i in range(len(outs[0]))]


def _loss(outs: list[Tensor], on: int | None) -> Tensor:
    """A weighted sum of output ``on`` (None: of every output)."""
    picked = outs if on is None else [outs[on]]
    total = torch.zeros(())
    for o in picked:
        total = total + (o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum()
    return total


def _close(want: Tensor | None, got: Tensor | None, what: str, largest: float = 0.0) -> None:
    """Within float32 round-off of ``want``'s own scale or of ``largest`` (the largest of the
    step's gradients, 1e-6 of it): a learnable decay's gradient sums terms of every step and
    neuron that cancel (alpha's -0.30485 of terms near 30: 5.7e-6 apart, seed 737)."""
    if want is None or got is None:
        assert all(g is None or not g.any() for g in (want, got)), what
        return
    scale = float(want.abs().max()) if want.numel() else 0.0
    atol = max(2e-6 * (1 + scale), 1e-6 * largest)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=what)


def _run(
    net: nn.Sequential, x: Tensor, chunk: int, untaped: bool, jit: bool
) -> tuple[Any, list[Tensor]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layerwise_job, "DIRECT_BACKWARD", untaped)
        patch.setattr(host_loops, "USE_JIT", jit and host_loops.USE_JIT)
        seq = sc.wrap(net, granularity="layer", chunk=chunk, exact=True)
        return seq, list(seq(x))


def _check(
    make: Callable[[], nn.Module], T: int, chunk: int, on: int | None, seed: int, ways: Any
) -> None:
    torch.manual_seed(seed)
    net = _net(make())
    with torch.no_grad():
        net[0].weight.mul_(3)
        net[2].weight.mul_(2)
    x = ((torch.rand(T, 3, 7) < 0.4).float() * 1.5).requires_grad_()
    params = [x, *net.parameters()]
    want = _loop(net, x)
    want_grads = torch.autograd.grad(_loss(want, on), params, allow_unused=True)
    seq, got = _run(net, x, chunk, *ways)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), f"output {i}"
    got_grads = torch.autograd.grad(_loss(got, on), params, allow_unused=True)
    largest = max((float(g.abs().max()) for g in want_grads if g is not None), default=0.0)
    for i, (a, b) in enumerate(zip(want_grads, got_grads, strict=True)):
        _close(a, b, f"gradient {i} (loss on output {on})", largest)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["Synaptic", "Alpha", "RSynaptic"]),
    reset=st.sampled_from(["subtract", "zero", "none"]),
    learn=st.booleans(),
    fast=st.booleans(),
    T=st.integers(1, 13),
    chunk=st.integers(1, 9),
    on=st.one_of(st.none(), st.integers(0, 3)),
    untaped=st.booleans(),
    jit=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_call_outputs_are_the_loops_and_the_top_block_is_fused(
    kind: str,
    reset: str,
    learn: bool,
    fast: bool,
    T: int,
    chunk: int,
    on: int | None,
    untaped: bool,
    jit: bool,
    seed: int,
) -> None:
    """Whatever the steps and the chunk (a chunk longer than the run, a last chunk shorter),
    the reset, learnable parameters, the surrogate, graded input spikes, and a loss on any of
    the call's outputs (the spikes, a current, the membrane) or all of them: both blocks fused, the
    outputs bitwise the loop's, the gradients at round-off, untaped or taped, through the
    Numba loops or the torch ones."""
    if kind != "Alpha" and on == 3:
        on = 2  # three outputs
    _check(lambda: _top(kind, reset, learn, fast), T, chunk, on, seed, (untaped, jit))


@pytest.mark.parametrize("kind", ["Synaptic", "Alpha"])
def test_output_mem_returns_the_call_outputs_after_the_spikes_only_once(kind: str) -> None:
    """``output="both"`` on such a net is the call form too; ``output="spikes"`` and ``"mem"``
    keep their meaning (the spikes; the membrane alone), fused."""
    torch.manual_seed(0)
    net = _net(_top(kind, "subtract", False, False))
    x = (torch.rand(9, 3, 7) < 0.4).float()
    want = _loop(net, x)
    for output, expected in (("spikes", want[0]), ("mem", want[-1])):
        seq = sc.wrap(net, granularity="layer", chunk=4, exact=True, output=output)
        got = seq(x)
        assert torch.equal(got, expected), output
        assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]


def test_the_numba_and_torch_loops_agree_on_a_loss_on_the_current() -> None:
    """The Synaptic backward's compiled loop adds the current's own gradient where the torch
    loop does, in the same order: the same gradients, bitwise."""
    if not host_loops.USE_JIT:
        pytest.skip("Numba is not installed")
    torch.manual_seed(3)
    net = _net(_top("Synaptic", "subtract", True, False))
    x = (torch.rand(11, 3, 7) < 0.4).float()
    found = []
    for jit in (True, False):
        _, got = _run(net, x, 4, True, jit)
        found.append(torch.autograd.grad(_loss(got, 1), list(net.parameters())))
    for a, b in zip(*found, strict=True):
        assert torch.equal(a, b)
