"""Chunks of neurons with recurrent weights with the elementwise part of each step compiled
(`spikeckpt.adapters.recurrent_host`: Norse's ``LIFRecurrentCell`` and
``LSNNRecurrentCell``, snnTorch's ``RLeaky`` and ``RSynaptic``) equal their kernels' torch loops bitwise: the products stay torch's, the step's
operations are the same IEEE operations in the same order."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import snntorch as snn
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

STEPS = (
    "lif_recurrent_step_jit",
    "lif_recurrent_back_carried_jit",
    "lif_recurrent_back_step_jit",
    "recurrent_leaky_step_jit",
    "lsnn_recurrent_step_jit",
    "lsnn_recurrent_back_step_jit",
)


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


def _snntorch_neuron(kind: str, reset: str, hidden: int) -> nn.Module:
    """``RLeaky`` / ``RSynaptic`` as users make them: the recurrent ``Linear`` or a
    one-to-one ``V``, learnable decays, per-neuron thresholds."""
    if kind == "RLeaky":
        return snn.RLeaky(beta=0.9, linear_features=hidden, reset_mechanism=reset)
    if kind == "RLeaky one-to-one learnable":
        return snn.RLeaky(
            beta=torch.rand(hidden), all_to_all=False, V=torch.rand(hidden),
            learn_beta=True, learn_recurrent=True, learn_threshold=True,
            threshold=torch.full((hidden,), 0.8), reset_mechanism=reset,
        )  # fmt: skip
    return snn.RSynaptic(
        alpha=0.8, beta=0.9, linear_features=hidden, reset_mechanism=reset,
        learn_alpha=kind.endswith("learnable"), learn_beta=kind.endswith("learnable"),
    )  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(
        ["RLeaky", "RLeaky one-to-one learnable", "RSynaptic", "RSynaptic learnable"]
    ),
    reset=st.sampled_from(["subtract", "zero", "none"]),
    T=st.integers(1, 9),
    chunk=st.integers(1, 5),
    output=st.sampled_from(["spikes", "both"]),
    seed=st.integers(0, 2**16),
)
def test_compiled_snntorch_recurrent_step_is_bitwise_the_torch_loop(
    kind: str, reset: str, T: int, chunk: int, output: str, seed: int
) -> None:
    """snnTorch's ``RLeaky`` and ``RSynaptic`` after a ``Linear``: spikes, membranes (and
    currents) and gradients (input, weights, learnable decays, thresholds, recurrent weights)
    bitwise equal with the compiled forward step on and off, every reset, odd T, chunks
    longer than T; the compiled step runs for every step of the forward pass."""
    torch.manual_seed(seed)
    x = ((torch.rand(T, 3, 12) < 0.4).float() * 2).requires_grad_()
    runs = []
    for use_jit in (True, False):
        torch.manual_seed(1)
        net = nn.Sequential(nn.Linear(12, 19), _snntorch_neuron(kind, reset, 19))
        with counted_steps(use_jit) as counts:
            seq = sc.wrap(net, granularity="layer", chunk=chunk, output=output)
            out = seq(x)
            y = torch.cat(out, -1) if isinstance(out, tuple) else out
            weights = torch.randn(y.shape[-1], generator=torch.Generator().manual_seed(2))
            grads = torch.autograd.grad((y * weights).sum(), [x, *net.parameters()])
        assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
        runs.append((y.detach(), grads, counts["recurrent_leaky_step_jit"]))
    (y_on, grads_on, calls), (y_off, grads_off, none) = runs
    assert calls >= T and none == 0
    for a, b in zip([y_on, *grads_on], [y_off, *grads_off], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_a_state_in_another_layout_keeps_the_torch_loop() -> None:
    """A state handed in another layout (a transposed tensor, every other row): the torch
    loop's operations keep it, and its recurrent products over spikes in that layout sum in
    another order than over contiguous ones. The compiled step declines such a state (its
    buffers are contiguous), so the run stays bitwise the torch loop's and Norse's own (helper
    h20 found the membranes 1.2e-7 apart when it ran)."""
    batch, hidden = 3, 16
    torch.manual_seed(1)
    cell = nt.LIFRecurrentCell(10, hidden)
    with torch.no_grad():
        cell.input_weights.mul_(4.0)
        cell.recurrent_weights.mul_(2.0)
    x = (torch.rand(9, batch, 10, generator=torch.Generator().manual_seed(0)) < 0.5).float() * 2
    big = nt.LIFState(
        z=(torch.rand(2 * batch, hidden) < 0.5).float(),
        v=torch.rand(2 * batch, hidden),
        i=torch.rand(2 * batch, hidden) * 3,
    )
    for layout in (lambda t: t[:batch].T.contiguous().T, lambda t: t[::2]):
        start = nt.LIFState(*(layout(t) for t in big))
        state, want = start, []
        for x_t in x:
            z, state = cell(x_t, state)
            want.append(z)
        runs = []
        for use_jit in (True, False):
            with counted_steps(use_jit):
                seq = sc.wrap(nt.SequentialState(cell), granularity="layer", chunk=4, output="both")
                (spikes, mems), final = seq(x, [start])
            runs.append((spikes, mems, final[0].v))
        for a, b in zip(*runs, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(runs[0][0], torch.stack(want))
        assert torch.equal(runs[0][2], state.v)


@settings(max_examples=20, deadline=None)
@given(
    kind=st.sampled_from(["default", "tanh adapting", "per-neuron autapses"]),
    T=st.integers(2, 9),
    chunk=st.integers(1, 5),
    density=st.sampled_from([0.03, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_compiled_lsnn_step_is_bitwise_the_torch_loop(
    kind: str, T: int, chunk: int, density: float, seed: int
) -> None:
    """Norse's ``LSNNRecurrentCell`` (its adaptive threshold) before a ``Linear`` and
    ``LICell`` readout: outputs, final states and gradients (input, weights) bitwise equal
    with the compiled forward step on and off, a gathered and a dense input, odd T; the
    compiled steps run for every step of the forward and backward passes. (T >= 2: over one
    step per call an LSNN runs per step by design, its input reaching no spike.)"""
    hidden = 19
    fields = {
        "default": lambda: nt.LSNNParameters(),
        "tanh adapting": lambda: nt.LSNNParameters(
            method="tanh", tau_adapt_inv=torch.tensor(60.0), v_th=torch.tensor(0.4),
            beta=torch.tensor(0.5), v_reset=torch.tensor(-0.1),
        ),
        "per-neuron autapses": lambda: nt.LSNNParameters(
            v_th=torch.linspace(0.3, 1.0, hidden), beta=torch.full((hidden,), 1.2)
        ),
    }  # fmt: skip
    torch.manual_seed(seed)
    x = ((torch.rand(T, 3, 20) < density).float() * 3).requires_grad_()
    runs = []
    for use_jit in (True, False):
        torch.manual_seed(1)
        cell = nt.LSNNRecurrentCell(20, hidden, p=fields[kind](), autapses="autapses" in kind)
        net = nt.SequentialState(cell, nn.Linear(hidden, 5), nt.LICell())
        with counted_steps(use_jit) as counts:
            seq = sc.wrap(net, granularity="layer", chunk=chunk)
            out, final = seq(x)
            weights = torch.randn(5, generator=torch.Generator().manual_seed(2))
            grads = torch.autograd.grad((out * weights).sum(), [x, *net.parameters()])
        assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
        runs.append(([out.detach(), *final[0], *grads], dict(counts)))
    (on, calls), (off, none) = runs
    assert not any(none.values())
    # the compiled forward and backward steps (`tests/test_lsnn_host.py`) run for every step
    assert calls["lsnn_recurrent_step_jit"] >= T and calls["lsnn_recurrent_back_step_jit"] >= T
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
