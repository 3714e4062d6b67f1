"""Norse's ``LSNNRecurrentCell`` kernel's backward with the elementwise part of each step
compiled (`spikeckpt.adapters.recurrent_host.lsnn_recurrent_backward_on_host`, its step
`jit_loops.lsnn_recurrent_back_step_jit`) equals its torch loop (`NorseLSNNKernel.
_backward_loop`) bitwise: the recurrent product stays torch's, the step's operations are the
same IEEE operations in the same order."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.adapters import host_loops, jit_loops, lsnn_kernel
from spikeckpt.adapters.lsnn_kernel import NorseLSNNKernel
from spikeckpt.adapters.recurrent_host import lsnn_recurrent_backward_on_host

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    nt = pytest.importorskip("norse.torch")

pytestmark = pytest.mark.skipif(not host_loops.USE_JIT, reason="Numba is not installed")

STEP = "lsnn_recurrent_back_step_jit"


@contextmanager
def compiled_backward(on: bool) -> Iterator[dict[str, int]]:
    """The compiled LSNN backward on (counting its steps' calls) or declining (the torch
    loop runs; the compiled forward stays on either way)."""
    counts = {STEP: 0}
    original = getattr(jit_loops, STEP)

    def call(*args: Any) -> None:
        counts[STEP] += 1
        original(*args)

    with mock.patch.object(jit_loops, STEP, call):
        if on:
            yield counts
        else:
            declined = mock.patch.object(
                lsnn_kernel, "lsnn_recurrent_backward_on_host", lambda *args: None
            )
            with declined:
                yield counts


def _fields(kind: str, method: str, hidden: int, dtype: torch.dtype) -> Any:
    """``LSNNParameters``: Norse's defaults, or scalar fields that adapt quickly, or
    per-neuron rates and thresholds, in ``dtype``."""
    if kind == "default":
        fields: dict[str, Tensor] = {}
    elif kind == "adapting":
        fields = {
            "tau_adapt_inv": torch.tensor(60.0), "v_th": torch.tensor(0.4),
            "beta": torch.tensor(0.5), "v_reset": torch.tensor(-0.1),
        }  # fmt: skip
    else:
        fields = {
            "tau_mem_inv": torch.linspace(60.0, 140.0, hidden),
            "tau_syn_inv": torch.linspace(150.0, 250.0, hidden),
            "tau_adapt_inv": torch.linspace(10.0, 80.0, hidden),
            "v_th": torch.linspace(0.3, 1.0, hidden),
            "beta": torch.full((hidden,), 1.2),
        }
    p = nt.LSNNParameters(method=method, **fields)
    return p._replace(**{f: getattr(p, f).to(dtype) for f in lsnn_kernel.FIELDS})


def _model_run(
    on: bool, setup: dict[str, Any], x: Tensor, split: int | None
) -> tuple[list[Tensor], int]:
    """Outputs, final states and gradients (input, weights) of a wrapped LSNN (alone, or
    before a ``Linear`` and ``LICell`` readout), run in one call or two (the states passed
    from the first to the second: their gradients reach the first call's chunks)."""
    hidden, dtype, readout = setup["hidden"], setup["dtype"], setup["readout"]
    torch.manual_seed(1)
    p = _fields(setup["kind"], setup["method"], hidden, dtype)
    cell = nt.LSNNRecurrentCell(x.shape[-1], hidden, p=p, autapses=setup["autapses"])
    li = nt.LIParameters()
    li = li._replace(**{f: t.to(dtype) for f, t in li._asdict().items() if isinstance(t, Tensor)})
    layers = [cell] if readout != "linear" else [cell, nn.Linear(hidden, 4), nt.LICell(p=li)]
    net = nt.SequentialState(*layers).to(dtype)
    output = "spikes" if readout == "linear" else readout
    x = x.to(dtype).requires_grad_()
    with compiled_backward(on) as counts:
        seq = sc.wrap(net, granularity="layer", chunk=setup["chunk"], output=output)
        parts = [x] if split is None else [x[:split], x[split:]]
        state, outs = None, []
        for part in parts:
            out, state = seq(part, state=state, return_state=True)
            outs.append(torch.cat(out, -1) if isinstance(out, tuple) else out)
        y = torch.cat(outs)
        weights = torch.randn(y.shape[-1], generator=torch.Generator().manual_seed(2))
        loss = (y * weights.to(dtype)).sum()
        if setup["final"]:  # the final states' gradients
            loss = loss + state[0].v.sum() + 0.5 * state[0].i.sum() - state[0].b.sum()
        grads = torch.autograd.grad(loss, [x, *net.parameters()])
    assert all(b.neuron == "fused" for b in seq.last_stats.blocks)
    return [y.detach(), *(t.detach() for t in state[0]), *grads], counts[STEP]


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(["default", "adapting", "per-neuron"]),
    method=st.sampled_from(["super", "tanh", "triangle", "circ", "heavi_erfc"]),
    autapses=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    readout=st.sampled_from(["spikes", "both", "mem", "linear"]),
    final=st.booleans(),
    T=st.integers(2, 9),
    chunk=st.integers(1, 5),
    split=st.one_of(st.none(), st.integers(2, 4)),
    batch=st.integers(1, 3),
    hidden=st.sampled_from([1, 3, 19]),
    seed=st.integers(0, 2**16),
)
def test_compiled_lsnn_backward_is_bitwise_the_torch_loop(
    T: int, split: int | None, batch: int, seed: int, **setup: Any
) -> None:
    """Outputs, final states and gradients (input, weights) bitwise equal with the compiled
    backward on and declining: every field layout and spike function, autapses or not, both
    float dtypes, losses on the spikes, the membranes (``output="both"``, ``"mem"``) or a
    readout's, with and without the final states' gradients, states passed between calls,
    odd T and chunks, one sample, one neuron; the compiled step runs for every step of every
    backward chunk (and not at all while declining)."""
    torch.manual_seed(seed)
    split = split if split is not None and split < T - 1 else None  # two calls of T >= 2
    x = (torch.rand(T, batch, 11) < 0.4).float() * 3
    on, calls = _model_run(True, setup, x, split)
    off, none = _model_run(False, setup, x, split)
    assert calls >= T and none == 0
    for a, b in zip(on, off, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wrapped_lsnn_gradients_are_norses_own(dtype: torch.dtype) -> None:
    """``SequentialState(LSNNRecurrentCell, Linear, LICell)`` wrapped layer-wise (the
    compiled backward running): outputs and gradients those of Norse's own loop over the
    steps, within round-off."""
    n_in, hidden, T = 30, 24, 23
    torch.manual_seed(0)
    cell = nt.LSNNRecurrentCell(n_in, hidden, p=_fields("adapting", "super", hidden, dtype))
    net = nt.SequentialState(cell, nn.Linear(hidden, 20), nt.LICell()).to(dtype)
    with torch.no_grad():
        cell.input_weights.mul_(3.0)
    x = ((torch.rand(T, 4, n_in) < 0.1).to(dtype) * 2).requires_grad_()
    weights = torch.randn(20, dtype=dtype, generator=torch.Generator().manual_seed(3))
    state, outs = None, []
    for x_t in x:
        out, state = net(x_t, state)
        outs.append(out)
    want = torch.stack(outs)
    grads_want = torch.autograd.grad((want * weights).sum(), [x, *net.parameters()])
    with compiled_backward(True) as counts:
        got, _ = sc.wrap(net, granularity="layer", chunk=7)(x)
        grads_got = torch.autograd.grad((got * weights).sum(), [x, *net.parameters()])
    assert counts[STEP] >= T
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-11}
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(g, w, **tol)


def _signed(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> Tensor:
    """Values with exact zeros of both signs among them (``0.0 + -0.0`` is ``+0.0``: a
    skipped or added zero shows)."""
    t = torch.randn(shape, generator=gen, dtype=dtype)
    pick = torch.rand(shape, generator=gen)
    t[pick < 0.2] = 0.0
    t[pick > 0.8] = -0.0
    return t


def _g_final(kind: str, shape: tuple[int, int], gen: torch.Generator, dtype: torch.dtype) -> Any:
    """A final state's gradient: None, ``(B, H)``, ``(1, H)`` or ``(H,)`` (broadcast)."""
    if kind == "none":
        return None
    return _signed({"full": shape, "row": (1, shape[1]), "neuron": shape[1:]}[kind], gen, dtype)


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 6),
    batch=st.integers(1, 3),
    hidden=st.sampled_from([1, 2, 5]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    has_y=st.sampled_from(["none", "given", "expanded"]),
    has_mem=st.booleans(),
    finals=st.lists(st.sampled_from(["none", "full", "row", "neuron"]), min_size=4, max_size=4),
    per_neuron=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_compiled_lsnn_back_step_signed_zeros_and_broadcast_carries(
    k: int,
    batch: int,
    hidden: int,
    dtype: torch.dtype,
    has_y: str,
    has_mem: bool,
    finals: list[str],
    per_neuron: bool,
    seed: int,
) -> None:
    """The loop alone, on values with signed zeros everywhere (gradients, slopes, carries),
    without a spike's or a membrane's gradient, a spike gradient broadcast from one value
    (stride 0), final states' gradients None or broadcast from a row or a neuron's, rates per
    neuron or 0-d: ``g_jump`` and the carries bitwise the torch loop's."""
    gen = torch.Generator().manual_seed(seed)
    shape = (k, batch, hidden)
    w_rec = torch.randn(hidden, hidden, generator=gen, dtype=dtype)
    rate_shape = (hidden,) if per_neuron else ()
    rates = tuple(torch.rand(rate_shape, generator=gen, dtype=dtype) * s for s in (0.1, -0.2, 0.01))
    ys = (torch.rand(shape, generator=gen) < 0.4).to(dtype)
    slope = _signed(shape, gen, dtype)
    g_y = {
        "none": None,
        "given": _signed(shape, gen, dtype),
        "expanded": torch.ones((), dtype=dtype).expand(shape),
    }[has_y]
    g_mem = _signed(shape, gen, dtype) if has_mem else None
    g_final = [_g_final(kind, (batch, hidden), gen, dtype) for kind in finals]
    p = nt.LSNNParameters()
    kernel = NorseLSNNKernel(lambda: (p, w_rec, w_rec), 0.001, lambda u: u)
    jumps = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(2)]
    want = kernel._backward_loop(g_y, g_final, g_mem, slope, ys, rates, jumps[0])
    with compiled_backward(True) as counts:
        got = lsnn_recurrent_backward_on_host(
            g_y, g_final, g_mem, slope, ys, w_rec, rates, jumps[1]
        )
    assert got is not None and counts[STEP] == k
    for a, b in zip([jumps[1], *got], [jumps[0], *want], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        # bitwise: the signs of zeros too
        assert torch.equal(a.view(torch.int64 if dtype == torch.float64 else torch.int32),
                           b.view(torch.int64 if dtype == torch.float64 else torch.int32))  # fmt: skip


def test_the_compiled_lsnn_backward_declines_where_the_torch_loop_must_run() -> None:
    """None (nothing written) for a carry in another layout, half precision, mixed dtypes,
    a rate wider than a neuron's, an empty chunk, a gradient not of the chunk's shape."""
    k, batch, hidden = 3, 2, 4
    shape = (k, batch, hidden)
    ys = (torch.rand(shape) < 0.5).float()
    slope, w_rec = torch.rand(shape), torch.randn(hidden, hidden)
    rates = (torch.tensor(0.1), torch.tensor(-0.2), torch.tensor(0.01))
    g_jump = torch.empty(shape)
    args: Callable[..., tuple[Any, ...]] = lambda **kw: tuple(  # noqa: E731
        kw.get(name, default)
        for name, default in (
            ("g_y", torch.rand(shape)), ("g_final", [None] * 4), ("g_mem", None),
            ("slope", slope), ("ys", ys), ("w_rec", w_rec), ("rates", rates), ("g_jump", g_jump),
        )
    )  # fmt: skip
    assert lsnn_recurrent_backward_on_host(*args()) is not None
    transposed = torch.rand(hidden, batch).T
    half = {name: t.half() for name, t in (("ys", ys), ("slope", slope), ("w_rec", w_rec))}
    for case in (
        {"g_final": [None, None, transposed, None]},
        {"g_jump": torch.empty(batch, k, hidden).transpose(0, 1)},
        {**half, "g_y": torch.rand(shape).half(), "g_jump": g_jump.half(),
         "rates": tuple(r.half() for r in rates)},
        {"g_y": torch.rand(shape, dtype=torch.float64)},
        {"rates": (torch.full((batch, hidden), 0.1), *rates[1:])},
        {"ys": ys[:0], "slope": slope[:0], "g_y": None, "g_jump": g_jump[:0]},
        {"g_mem": torch.rand(1, batch, hidden)},
    ):  # fmt: skip
        jump = case.get("g_jump", g_jump).fill_(7.0)
        assert lsnn_recurrent_backward_on_host(*args(**case)) is None
        assert bool((jump == 7.0).all())  # nothing written
