"""Regressions found by differentially fuzzing ``scan`` against the plain Python loop (step
functions and calls as users write them): each test compares with the loop it stands for."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

import spikeckpt as sc
from spikeckpt import plans as P


def _loop(step: Any, xs: list[Any], state: Any) -> tuple[list[Any], Any]:
    ys = []
    for x_t in xs:
        state, y = step(state, x_t)
        ys.append(y)
    return ys, state


@pytest.mark.parametrize("kind", ["tuple", "dict"])
@pytest.mark.parametrize("shaped", [True, False])
def test_steps_with_a_pytree_input_feeds_it_at_every_step(kind: str, shaped: bool) -> None:
    """``steps=`` with one step's input as a tuple (or dict) of tensors: the tuple was read as a
    sequence of per-step inputs (T = its length, x_t a whole leaf), a dict was refused."""
    torch.manual_seed(0)
    w = torch.randn(3, 2, requires_grad=True)
    a, b = torch.randn(4, 2), torch.randn(4, 2, requires_grad=True)
    x = (a, b) if kind == "tuple" else {"a": a, "b": b}

    def step(v: Tensor, x_t: Any) -> tuple[Tensor, Tensor]:
        xa, xb = (x_t[0], x_t[1]) if kind == "tuple" else (x_t["a"], x_t["b"])
        v = 0.9 * v + (xa + 0.5 * xb) @ w.t() if v.numel() else (xa + 0.5 * xb) @ w.t()
        return v, torch.sigmoid(v)

    T = 5
    v0 = torch.zeros(4, 3) if shaped else torch.zeros(0)
    ys_ref, v_ref = _loop(step, [x] * T, v0)
    ys, v = sc.scan(step, x, v0, steps=T, plan=P.Uniform(2))
    assert torch.equal(ys, torch.stack(ys_ref)) and torch.equal(v, v_ref)
    got = torch.autograd.grad(ys.sum() + v.sum(), [w, b])
    want = torch.autograd.grad(torch.stack(ys_ref).sum() + v_ref.sum(), [w, b])
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("readout", ["sum", "mean", "max", "min", "last", None])
@pytest.mark.parametrize("T", [1, 4])
def test_none_output_from_a_state_step_0_shapes_with_a_reducing_readout(
    readout: Any, T: int
) -> None:
    """A step that outputs ``None`` (the state is what matters), started from a state with a
    ``None`` leaf, with a reducing readout: scan raised "state[1] is NoneType" (its own
    carried accumulator) instead of returning ``None`` as the loop reduces it."""
    w = torch.randn(3, 2, requires_grad=True)

    def step(s: Any, x: Tensor) -> tuple[Any, None]:
        v, a = s
        a = torch.zeros_like(v) if a is None else a
        return (0.9 * v + x @ w.t() - 0.1 * a, a + 1), None

    x = torch.randn(T, 2, 2)
    s0 = (torch.zeros(2, 3), None)
    _, (v_ref, a_ref) = _loop(step, list(x), s0)
    ys, (v, a) = sc.scan(step, x, s0, plan=P.Uniform(2), readout=readout)
    assert ys is None and torch.equal(v, v_ref) and torch.equal(a, a_ref)
    (g,) = torch.autograd.grad(v.sum(), [w])
    torch.testing.assert_close(g, torch.autograd.grad(v_ref.sum(), [w])[0])


@pytest.mark.parametrize("readout", [None, "sum", "last"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("shaped", [True, False])
def test_a_none_leaf_in_the_output_is_refused_the_same_way(
    readout: Any, T: int, shaped: bool
) -> None:
    """``y_t = (v, None)``: refused naming the output leaf whether or not step 0 runs apart (it
    was an AttributeError, or "state[1][1] is NoneType", or, at T=1 with ``"sum"``, accepted)."""
    w = torch.randn(3, 2, requires_grad=True)

    def step(v: Tensor, x: Tensor) -> tuple[Tensor, Any]:
        v = 0.9 * v + x @ w.t() if v.numel() else x @ w.t()
        return v, (v, None)

    v0 = torch.zeros(2, 3) if shaped else torch.zeros(0)
    with pytest.raises(TypeError, match=r"step output y\[1\] is NoneType, not a tensor"):
        sc.scan(step, torch.randn(T, 2, 2), v0, plan=P.Uniform(2), readout=readout)


LOG_W = torch.randn(3, 2, requires_grad=True)


@pytest.mark.parametrize("how", ["closure", "global", "params"])
def test_a_weight_computed_before_the_loop_gets_its_gradient(how: str) -> None:
    """``w = log_w.exp()`` computed once before the loop and used by the step (a closure, a
    global, or passed in ``params``): scan refused it with ``UnlistedParamsError`` naming
    ``log_w``, which the plain loop (and scan, differentiating ``w``) reaches through ``w``."""
    w = LOG_W.exp()
    globals()["W_EXP"] = w

    def step(v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        return 0.9 * v + x @ (W_EXP if how == "global" else w).t(), v  # noqa: F821

    x = torch.randn(5, 4, 2)
    params = [w] if how == "params" else None
    ys, v = sc.scan(step, x, torch.zeros(4, 3), plan=P.Revolve(2), params=params)
    (got,) = torch.autograd.grad(ys.sum() + v.sum(), [LOG_W], retain_graph=True)
    ys_ref, v_ref = _loop(step, list(x), torch.zeros(4, 3))
    assert torch.equal(ys, torch.stack(ys_ref)) and torch.equal(v, v_ref)
    (want,) = torch.autograd.grad(torch.stack(ys_ref).sum() + v_ref.sum(), [LOG_W])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("shaped", [True, False])
def test_steps_with_an_encoded_input_reaches_the_encoder(shaped: bool) -> None:
    """``scan(step, enc(img), state, steps=T)``: the constant input is the output of an encoder
    (not a leaf); scan refused the encoder's parameters as unlisted instead of letting the
    gradient flow on to them as the loop does."""
    torch.manual_seed(0)
    enc = torch.nn.Linear(5, 2)
    w = torch.randn(4, 2, requires_grad=True)

    def step(v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        v = 0.9 * v + x @ w.t() if v.numel() else x @ w.t()
        return v, torch.sigmoid(v)

    x = enc(torch.randn(3, 5))
    v0 = torch.zeros(3, 4) if shaped else torch.zeros(0)
    ys, v = sc.scan(step, x, v0, steps=4, plan=P.Uniform(2))
    got = torch.autograd.grad(ys.sum() + v.sum(), [enc.weight, w], retain_graph=True)
    ys_ref, v_ref = _loop(step, [x] * 4, v0)
    assert torch.equal(ys, torch.stack(ys_ref)) and torch.equal(v, v_ref)
    want = torch.autograd.grad(torch.stack(ys_ref).sum() + v_ref.sum(), [enc.weight, w])
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("shaped", [True, False])
def test_a_fold_returning_none_is_refused_the_same_way(shaped: bool) -> None:
    """A callable readout that returns ``None`` (a step whose output is ``None``): refused as a
    readout error whether or not step 0 runs apart (it was "state[1] is NoneType")."""

    def step(v: Tensor, x: Tensor) -> tuple[Tensor, None]:
        return (0.9 * v + x if v.numel() else x), None

    v0 = torch.zeros(2, 3, requires_grad=True) if shaped else torch.zeros(0)
    with pytest.raises(TypeError, match="callable readout must return a tensor"):
        sc.scan(step, torch.randn(3, 2, 3), v0, plan=P.Uniform(2), readout=lambda a, y, t: y)


@pytest.mark.parametrize("start", ["shaped", "empty"])
@pytest.mark.parametrize("readout", [None, "sum"])
@pytest.mark.parametrize("where", ["closure", "module"])
def test_a_generator_of_the_step_s_own_is_refused_when_steps_are_recomputed(
    start: str, readout: Any, where: str
) -> None:
    """Dropout drawn with ``generator=g``: scan replays the default generators only, so a
    recomputing plan drew other masks in the backward pass and the gradient was silently wrong
    (off by the size of the gradient itself). Now refused; BPTT (no recomputation) runs it
    exactly."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(2, 4)
    if where == "module":
        layer.gen = gen  # type: ignore[assignment]

    def step(v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        c = layer(x)
        c = c * (torch.rand(c.shape, generator=gen) < 0.7)
        v = 0.9 * v + c if v.numel() else c
        return v, torch.tanh(v) * v

    x = torch.randn(9, 3, 2)
    v0 = torch.zeros(3, 4) if start == "shaped" else torch.zeros(0)
    with pytest.raises(sc.ConfigError, match=r"torch\.Generator of its own.*BPTT"):
        sc.scan(step, x, v0, plan=P.Revolve(2), readout=readout)
    gen.manual_seed(0)
    ys, _ = sc.scan(step, x, v0, plan=P.BPTT(), readout=readout)
    got = torch.autograd.grad(ys.sum(), [layer.weight])
    gen.manual_seed(0)
    ys_ref, _ = _loop(step, list(x), v0)
    ref = sum(ys_ref[1:], ys_ref[0]) if readout == "sum" else torch.stack(ys_ref)  # in order
    assert torch.equal(ys, ref)
    torch.testing.assert_close(got, torch.autograd.grad(ref.sum(), [layer.weight]))


@pytest.mark.parametrize("how", ["auto in a budget", "BPTT in a budget", "half precision"])
def test_what_scan_runs_before_the_steps_draws_nothing_from_the_step_s_generator(how: str) -> None:
    """A step drawing from a generator of its own runs exactly under ``BPTT()``; but the budget
    planner's probes (``plan="auto"`` or ``BPTT()`` with a budget) and the untaped step 0 that
    checks a half-precision state's dtype drew from it first: the run then differed from the
    loop by 1.8, 0.99 and 5.7 (max abs). Now their draws are put back."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float16 if how == "half precision" else torch.float32
    fc = torch.nn.Linear(6, 8).to(dtype)

    def step(v: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
        h = (fc(x_t) + torch.randn(v.shape, generator=gen).to(dtype)).float() + v
        return h.to(dtype) if how != "half precision" else h, h

    x = torch.rand(12, 2, 6).to(dtype)
    v0 = torch.zeros(2, 8, dtype=dtype)
    gen.manual_seed(3)
    ref = torch.stack(_loop(step, list(x), v0)[0])
    kw: dict[str, Any] = {"plan": P.BPTT()}
    if how == "auto in a budget":
        kw = {"plan": "auto", "budget": "10MiB"}
    elif how == "BPTT in a budget":
        kw["budget"] = "10MiB"
    gen.manual_seed(3)
    ys, _ = sc.scan(step, x, v0, **kw)
    assert torch.equal(ys, ref)


def test_a_tuple_of_time_first_tensors_is_refused_naming_the_per_step_pairs() -> None:
    """``scan(step, (spikes, current), ...)`` with two ``(T, ...)`` tensors of different shapes:
    a tuple is a sequence of per-step inputs (here 2 steps), and ``torch.stack``'s own error
    ("stack expects each tensor to be equal size") named neither the steps nor the fix."""
    w = torch.randn(3, 4, requires_grad=True)
    spikes, current = torch.randn(10, 2, 3), torch.randn(10, 2, 4)

    def step(v: Tensor, x_t: Any) -> tuple[Tensor, Tensor]:
        s, c = x_t
        v = 0.9 * v + s @ w + c
        return v, v

    with pytest.raises(sc.ConfigError, match=r"input 1 is \(10, 2, 4\).*2 steps.*list\(zip"):
        sc.scan(step, (spikes, current), torch.zeros(2, 4), plan=P.Uniform(3))
    pairs = list(zip(spikes, current, strict=True))
    ys, v = sc.scan(step, pairs, torch.zeros(2, 4), plan=P.Uniform(3))
    ys_ref, v_ref = _loop(step, pairs, torch.zeros(2, 4))
    assert torch.equal(ys, torch.stack(ys_ref)) and torch.equal(v, v_ref)


def test_a_packed_train_among_per_step_inputs_is_refused_naming_it() -> None:
    """``scan(step, (train, current), ...)`` with a packed ``SpikeTrain``: the refusal read
    "per-step input 0 is not a pytree * like input 0" (input 0 against itself, its structure
    printed as ``*``); a ``str`` leaf in input 0 read the same."""
    w = torch.randn(3, 4, requires_grad=True)
    spikes, current = (torch.rand(10, 2, 3) < 0.3).float(), torch.randn(10, 2, 4)
    train = sc.SpikeTrain.from_dense(spikes)

    def step(v: Tensor, x_t: Any) -> tuple[Tensor, Tensor]:
        s, c = x_t
        v = 0.9 * v + s @ w + c
        return v, v

    for inputs, t in (((train, current), 0), ((current, train), 1), ([train], 0)):
        with pytest.raises(sc.ConfigTypeError, match=rf"input {t} holds a packed train.*dense"):
            sc.scan(step, inputs, torch.zeros(2, 4), plan=P.Uniform(3))
    with pytest.raises(sc.ConfigTypeError, match=r"input 0 holds a str where a tensor"):
        sc.scan(step, [(spikes[0], "c")], torch.zeros(2, 4), plan=P.Uniform(3))
    pairs = list(zip(train.dense(), current, strict=True))
    ys, _ = sc.scan(step, pairs, torch.zeros(2, 4), plan=P.Uniform(3))
    assert torch.equal(ys, torch.stack(_loop(step, pairs, torch.zeros(2, 4))[0]))
