"""scan() against the plain Python loop: outputs, final state and every gradient, for every plan,
tier, state structure and readout; ledger vs simulator; RNG replay; autocast; cleanup; errors."""

from __future__ import annotations

import gc
import types
import warnings
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt import plans as P
from spikeckpt.engine.saved import measure_step
from spikeckpt.plans import Advance, Backprop, Free, Load, Prefetch, Store, Tape, make_schedule

Pair = namedtuple("Pair", ["v1", "v2"])


class Spike(torch.autograd.Function):
    """Heaviside forward, fast-sigmoid surrogate backward."""

    @staticmethod
    def forward(ctx: Any, v: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(v)
        return (v > 0).to(v.dtype)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
        (v,) = ctx.saved_tensors
        return g / (1 + 10 * v.abs()) ** 2


def pack_state(kind: str, v1: Tensor, v2: Tensor) -> Any:
    if kind == "tuple":
        return (v1, v2)
    if kind == "namedtuple":
        return Pair(v1, v2)
    if kind == "dict":
        return {"a": v1, "b": v2}
    if kind == "nested":
        return {"layers": [Pair(v1, v2)], "extra": (torch.zeros(v1.shape[0], 1),)}
    return torch.cat([v1, v2], dim=1)  # "tensor"


def unpack_state(kind: str, state: Any, h: int) -> tuple[Tensor, Tensor]:
    if kind == "tuple":
        return state
    if kind == "namedtuple":
        return state.v1, state.v2
    if kind == "dict":
        return state["a"], state["b"]
    if kind == "nested":
        return state["layers"][0].v1, state["layers"][0].v2
    return state[:, :h], state[:, h:]


class LIF2(nn.Module):
    """Two LIF layers with learnable decays; the state structure is chosen by ``kind``."""

    def __init__(self, n_in: int = 5, hidden: int = 7, n_out: int = 3, kind: str = "tuple"):
        super().__init__()
        self.l1 = nn.Linear(n_in, hidden)
        self.l2 = nn.Linear(hidden, n_out)
        self.d1 = nn.Parameter(torch.tensor(1.0))
        self.d2 = nn.Parameter(torch.tensor(0.5))
        self.kind = kind
        self.hidden = hidden

    def initial(self, batch: int) -> Any:
        v1 = torch.randn(batch, self.hidden).requires_grad_()
        v2 = torch.randn(batch, self.l2.out_features).requires_grad_()
        return pack_state(self.kind, v1, v2)

    def forward(self, state: Any, x: Tensor) -> tuple[Any, Tensor]:
        v1, v2 = unpack_state(self.kind, state, self.hidden)
        v1 = torch.sigmoid(self.d1) * v1 + self.l1(x)
        z1 = Spike.apply(v1 - 1.0)
        v1 = v1 - z1
        v2 = torch.sigmoid(self.d2) * v2 + self.l2(z1)
        z2 = Spike.apply(v2 - 1.0)
        v2 = v2 - z2
        extra = state["extra"] if self.kind == "nested" else None
        new = pack_state(self.kind, v1, v2)
        if extra is not None:
            new["extra"] = (extra[0] + 0 * v1[:, :1],)
        return new, v2 + z2


def fold(acc: Tensor | None, y: Tensor, t: int) -> Tensor:
    return y if acc is None else 0.9 * acc + y


def reference(step: Any, inputs: Tensor, state: Any, readout: Any) -> tuple[Any, Any]:
    """The plain Python loop scan must match."""
    ys: list[Tensor] = []
    acc = None
    for t in range(inputs.shape[0]):
        state, y = step(state, inputs[t])
        if callable(readout):
            acc = readout(acc, y, t)
        elif readout in ("sum", "mean"):
            acc = y if acc is None else acc + y
        else:
            ys.append(y)
    T = inputs.shape[0]
    if readout is None:
        return torch.stack(ys), state
    if readout == "mean":
        return acc / T, state
    if readout == "last":
        return ys[-1], state
    return acc, state


def loss_of(ys: Tensor, state: Any) -> Tensor:
    leaves = torch.utils._pytree.tree_leaves(state)
    return (ys * torch.linspace(0.5, 1.5, ys.shape[-1], device=ys.device)).square().sum() + sum(
        (0.1 * leaf).sum() for leaf in leaves
    )


def grads_of(loss: Tensor, tensors: list[Tensor]) -> list[Tensor | None]:
    return list(torch.autograd.grad(loss, tensors, allow_unused=True))


def make_plan(kind: str, T: int, a: int, b: int) -> Any:
    if kind == "bptt":
        return P.BPTT()
    if kind == "uniform":
        return P.Uniform(a)
    if kind == "revolve":
        return P.Revolve(b, tape=1 + a % 4)
    if kind == "double":
        return P.Double(a + b, b)
    return P.TwoLevel(b)


def assert_same(got: list[Tensor | None], want: list[Tensor | None], exact: bool = True) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None or torch.count_nonzero(g) == 0
            continue
        assert g is not None
        if exact:
            assert torch.equal(g, w), (g - w).abs().max()
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


PRIMES = [1, 2, 3, 5, 7, 11, 13, 31, 97, 101, 211, 397]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    T=st.one_of(st.sampled_from(PRIMES), st.integers(1, 400)),
    plan_kind=st.sampled_from(["bptt", "uniform", "revolve", "double", "twolevel"]),
    a=st.integers(1, 60),
    b=st.integers(1, 8),
    storage=st.sampled_from(["device", "host", "disk"]),
    kind=st.sampled_from(["tensor", "tuple", "namedtuple", "dict", "nested"]),
    readout=st.sampled_from([None, "sum", "mean", "last", fold]),
    seed=st.integers(0, 2**16),
)
def test_matches_plain_loop(
    T: int, plan_kind: str, a: int, b: int, storage: str, kind: str, readout: Any, seed: int
) -> None:
    torch.manual_seed(seed)
    net = LIF2(kind=kind)
    inputs = (torch.rand(T, 4, 5) < 0.3).float().requires_grad_()
    state = net.initial(4)
    leaves = [t for t in torch.utils._pytree.tree_leaves(state) if t.requires_grad]
    wrt = [*net.parameters(), inputs, *leaves]

    want_ys, want_state = reference(net, inputs, state, readout)
    want = grads_of(loss_of(want_ys, want_state), wrt)

    plan = make_plan(plan_kind, T, a, b)
    ys, final = sc.scan(net, inputs, state, plan=plan, storage=storage, readout=readout)
    assert type(final) is type(want_state)
    assert torch.equal(ys, want_ys)
    for g, w in zip(
        torch.utils._pytree.tree_leaves(final),
        torch.utils._pytree.tree_leaves(want_state),
        strict=True,
    ):
        assert torch.equal(g, w)
    got = grads_of(loss_of(ys, final), wrt)
    assert_same(got, want, exact=True)


@pytest.mark.parametrize("storage", ["host", "disk"])
def test_hand_made_schedule_with_prefetch(storage: str, tmp_path: Path) -> None:
    T = 9
    actions = [
        Store(0, "remote"),
        Advance(0, 4),
        Store(4, "device"),
        Advance(4, 7),
        Tape(7, 9),
        Backprop(7, 9),
        Prefetch(0),
        Load(4, "device"),
        Tape(4, 7),
        Backprop(4, 7),
        Free(4, "device"),
        Load(0, "remote"),
        Free(0, "remote"),
        Store(0, "device"),
        Advance(0, 2),
        Store(2, "device"),
        Tape(2, 4),
        Backprop(2, 4),
        Free(2, "device"),
        Load(0, "device"),
        Tape(0, 2),
        Backprop(0, 2),
        Free(0, "device"),
    ]
    schedule = make_schedule(T, actions)
    P.simulate(schedule)
    torch.manual_seed(1)
    net = LIF2()
    inputs = torch.rand(T, 4, 5).requires_grad_()
    state = net.initial(4)
    wrt = [*net.parameters(), inputs, *state]
    want_ys, want_state = reference(net, inputs, state, None)
    want = grads_of(loss_of(want_ys, want_state), wrt)
    kwargs = {"directory": tmp_path} if storage == "disk" else {}
    ys, final = sc.scan(net, inputs, state, plan=schedule, storage=storage, **kwargs)
    assert_same(grads_of(loss_of(ys, final), wrt), want)


class FixedBytes(nn.Module):
    """A step whose tape holds the same bytes at every step (state always requires grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, state: tuple[Tensor, Tensor], x: Tensor) -> tuple[Any, Tensor]:
        v, w = state
        v = torch.tanh(self.lin(v) + x)
        w = w * v
        return (v, w), v.sum(1)


@pytest.mark.parametrize("storage", ["host", "disk"])
@pytest.mark.parametrize(
    "plan",
    [P.BPTT(), P.Uniform(7), P.Revolve(3), P.Revolve(3, 4), P.Double(12, 4), P.TwoLevel(3)],
    ids=repr,
)
def test_ledger_peak_equals_simulator(plan: Any, storage: str) -> None:
    T = 41
    net = FixedBytes()
    inputs = torch.randn(T, 3, 6)
    state = (torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True))
    probe = measure_step(net, state, inputs[0], list(net.parameters()))
    out = sc.scan(net, inputs, state, plan=plan, storage=storage)
    (ys, final), stats = out, out.stats
    loss_of(ys[..., None], final).backward()
    predicted = P.simulate(
        stats.schedule, state_bytes=probe.state_bytes, step_bytes=probe.step_bytes
    )
    assert stats.completed
    assert stats.tape_bytes_per_step == probe.step_bytes
    assert stats.peak_bytes["device"] == predicted.peak_bytes
    assert stats.ledger.current["device"] == 0
    assert stats.forward_steps == predicted.forward_steps
    assert stats.backward_steps == T
    assert stats.recompute_factor == predicted.forward_steps / T
    if predicted.peak_remote_states:
        assert stats.peak_bytes[storage] == predicted.peak_remote_states * probe.state_bytes
        assert stats.ledger.written[storage] == predicted.remote_writes * probe.state_bytes
        assert stats.ledger.read[storage] == predicted.remote_reads * probe.state_bytes


def test_rng_replay_dropout() -> None:
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
            v = torch.nn.functional.dropout(torch.tanh(self.lin(v) + x), 0.5, training=True)
            return v, v

    net = Drop()
    T = 37
    inputs = torch.randn(T, 2, 8, requires_grad=True)
    v0 = torch.randn(2, 8, requires_grad=True)
    wrt = [*net.parameters(), inputs, v0]
    torch.manual_seed(3)
    want_ys, want_v = reference(net, inputs, v0, None)
    after_plain = torch.random.get_rng_state()
    want = grads_of(loss_of(want_ys, want_v), wrt)
    for plan in [P.Uniform(5), P.Revolve(2), P.Double(10, 3)]:
        torch.manual_seed(3)
        ys, v = sc.scan(net, inputs, v0, plan=plan, storage="host")
        assert torch.equal(torch.random.get_rng_state(), after_plain)
        got = grads_of(loss_of(ys, v), wrt)
        assert torch.equal(torch.random.get_rng_state(), after_plain)  # backward forks the RNG
        assert torch.equal(ys, want_ys)
        assert_same(got, want)


def test_checkpoints_share_one_rng_state_when_nothing_draws() -> None:
    """A checkpoint remembers the generator states (5,056 bytes for the CPU's) so that the
    recomputation draws what the forward drew; when nothing drew in between, checkpoints
    share one capture: a step of 3 x 8 floats over 400 steps with 80 checkpoints held the
    CPU state 80 times (about 400 KB against 8 KB of checkpoints). Measured with the
    allocator's own events (a generator state is made without an op: the tensor meter does
    not see it)."""

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
            v = torch.tanh(self.lin(v) + x)
            return v, v

    torch.manual_seed(0)
    net = Tiny()
    inputs = torch.randn(400, 3, 8)
    v0 = torch.zeros(3, 8)
    sc.scan(net, inputs, v0, plan=P.Uniform(5), storage="host")  # warm-up
    with sc.MemoryMeter(mode="allocator") as meter:
        ys, v = sc.scan(net, inputs, v0, plan=P.Uniform(5), storage="host")
        (ys.sum() + v.sum()).backward()
    state = torch.random.get_rng_state().numel()
    outputs = ys.numel() * ys.element_size()  # 38.4 KB, held at the end
    assert meter.peak_bytes < outputs + 8 * state, (meter.peak_bytes, state)  # 80 held 0.46 MB


@pytest.mark.parametrize("cache", [False, True])
def test_autocast_bf16_cpu(cache: bool) -> None:
    """Recompute runs under the forward's autocast state. With the autocast weight-cast cache
    on, the plain loop sums weight gradients over all T steps in bf16 (one cached cast) while
    scan sums each segment in bf16 and the segments in float32: equal to bf16 precision."""
    torch.manual_seed(4)
    net = LIF2()
    T = 29
    inputs = (torch.rand(T, 4, 5) < 0.3).float()
    state = net.initial(4)
    wrt = [*net.parameters(), *state]
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
        want_ys, want_state = reference(net, inputs, state, None)
        ys, final = sc.scan(net, inputs, state, plan=P.Revolve(3))
    assert ys.dtype == torch.float32 and torch.equal(ys, want_ys)
    want = grads_of(loss_of(want_ys, want_state), wrt)
    got = grads_of(loss_of(ys, final), wrt)
    if cache:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    else:
        assert_same(got, want, exact=False)


def test_no_grad_path_is_a_plain_loop(tmp_path: Path) -> None:
    net = LIF2()
    inputs = torch.rand(17, 4, 5)
    state = net.initial(4)
    want_ys, want_state = reference(net, inputs, state, "sum")
    # the deprecated stats=True still returns the old triple (with a DeprecationWarning)
    with torch.no_grad(), pytest.warns(DeprecationWarning, match="stats=True"):
        ys, final, stats = sc.scan(
            net, inputs, state, plan=P.Uniform(4), storage="disk", readout="sum",
            directory=tmp_path, stats=True,
        )  # fmt: skip
    assert not ys.requires_grad and stats.schedule is None and stats.forward_steps == 17
    assert torch.equal(ys, want_ys) and torch.equal(final[0], want_state[0])
    assert list(tmp_path.iterdir()) == []


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


class Watcher(nn.Module):
    """Records whether checkpoint files exist while it runs; can raise on a chosen call."""

    def __init__(self, folder: Path, fail_at_call: int | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.folder = folder
        self.calls = 0
        self.fail_at_call = fail_at_call
        self.saw_files = False

    def forward(self, v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        self.calls += 1
        if self.calls > 20:
            self.saw_files |= bool(_files(self.folder))
        if self.fail_at_call is not None and self.calls == self.fail_at_call:
            raise RuntimeError("boom inside step")
        v = torch.tanh(self.lin(v) + x)
        return v, v


def test_disk_files_removed_after_backward(tmp_path: Path) -> None:
    net = Watcher(tmp_path)
    ys, v = sc.scan(
        net, torch.randn(20, 2, 4), torch.zeros(2, 4), plan=P.Double(5, 2), storage="disk",
        directory=tmp_path,
    )  # fmt: skip
    assert _files(tmp_path)
    ys.sum().backward()
    assert net.saw_files
    assert _files(tmp_path) == []


def test_disk_files_removed_after_exception_in_recompute(tmp_path: Path) -> None:
    net = Watcher(tmp_path, fail_at_call=25)
    ys, v = sc.scan(
        net, torch.randn(20, 2, 4), torch.zeros(2, 4), plan=P.Double(5, 2), storage="disk",
        directory=tmp_path,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom inside step"):
        ys.sum().backward()
    assert _files(tmp_path) == []


def test_disk_files_removed_after_exception_in_forward(tmp_path: Path) -> None:
    net = Watcher(tmp_path, fail_at_call=12)
    with pytest.raises(RuntimeError, match="boom inside step"):
        sc.scan(
            net, torch.randn(20, 2, 4), torch.zeros(2, 4), plan=P.Double(5, 2),
            storage="disk", directory=tmp_path,
        )  # fmt: skip
    assert _files(tmp_path) == []


def test_disk_files_removed_when_outputs_deleted(tmp_path: Path) -> None:
    net = Watcher(tmp_path)
    ys, v = sc.scan(
        net, torch.randn(20, 2, 4), torch.zeros(2, 4), plan=P.Double(5, 2), storage="disk",
        directory=tmp_path,
    )  # fmt: skip
    assert _files(tmp_path)
    del ys, v
    gc.collect()
    assert _files(tmp_path) == []


def test_backward_twice_is_a_clear_error() -> None:
    net = FixedBytes()
    ys, _ = sc.scan(net, torch.randn(5, 3, 6), (torch.zeros(3, 6),) * 2, plan=P.Uniform(2))
    ys.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        ys.sum().backward()


def test_integer_leaves_unused_outputs_and_sequence_inputs() -> None:
    lin = nn.Linear(3, 3)

    def step(state: dict[str, Tensor], x: Tensor) -> tuple[dict[str, Tensor], tuple]:
        v = torch.tanh(lin(state["v"]) + x)
        return {"v": v, "n": state["n"] + 1, "flag": state["flag"] | (v > 0.9)}, (v, x * 2)

    T = 13
    xs = [torch.randn(2, 3, requires_grad=True) for _ in range(T)]
    state = {"v": torch.zeros(2, 3), "n": torch.zeros((), dtype=torch.int64),
             "flag": torch.zeros(2, 3, dtype=torch.bool)}  # fmt: skip
    (ys, dbl), final = sc.scan(step, xs, state, plan=P.Revolve(2), params=list(lin.parameters()))
    assert int(final["n"]) == T and final["flag"].dtype == torch.bool
    assert dbl.shape == (T, 2, 3)
    ys.sum().backward()  # dbl unused by the loss; v0 has no grad
    ref = [x.grad.clone() for x in xs]
    wg = lin.weight.grad.clone()
    for x in xs:
        x.grad = None
    lin.weight.grad = None
    st_ = dict(state)
    total = 0
    for t in range(T):
        st_, (y, _) = step(st_, xs[t])
        total = total + y.sum()
    total.backward()
    torch.testing.assert_close(wg, lin.weight.grad)
    for r, x in zip(ref, xs, strict=True):
        torch.testing.assert_close(r, x.grad)


def test_closure_params_are_found_and_unreachable_ones_are_refused() -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def step(v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        v = torch.tanh(v @ w + x)
        return v, v

    inputs = torch.randn(9, 2, 4)
    v0 = torch.zeros(2, 4, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ys, _ = sc.scan(step, inputs, v0, plan=P.Uniform(3))  # w: found in the closure
    (g,) = torch.autograd.grad(ys.sum(), [w])
    want_ys, _ = reference(step, inputs, v0, None)
    (want,) = torch.autograd.grad(want_ys.sum(), [w])
    assert torch.equal(g, want)
    ys, _ = sc.scan(step, inputs, v0, plan=P.Uniform(3), params=[w])
    assert torch.equal(torch.autograd.grad(ys.sum(), [w])[0], want)

    holder = types.SimpleNamespace(w=w)  # an attribute of a plain object: not searched

    def hidden(v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        v = torch.tanh(v @ holder.w + x)
        return v, v

    with pytest.raises(sc.UnlistedParamsError, match="not in `params`"):  # not a warning
        sc.scan(hidden, inputs, v0, plan=P.Uniform(3))


def test_auto_plan_with_budget() -> None:
    net = FixedBytes()
    T = 200
    inputs = torch.randn(T, 3, 6)
    state = (torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True))
    probe = measure_step(net, state, inputs[0], list(net.parameters()))
    # a budget counts the whole step (input, outputs, gradients): 12 states and 4 tapes more
    # than the least that fits
    with pytest.raises(sc.BudgetTooSmall) as least:
        sc.scan(net, inputs, state, plan="auto", budget=1)
    budget = least.value.minimum_bytes + 12 * probe.state_bytes + 4 * probe.step_bytes
    out = sc.scan(net, inputs, state, plan="auto", budget=budget)
    (ys, final), stats = out, out.stats
    loss_of(ys[..., None], final).backward()
    assert stats.peak_bytes["device"] <= budget
    assert stats.planned is not None and stats.planned.total <= budget
    with pytest.raises(ValueError, match="budget"):
        sc.scan(net, inputs, state, plan="auto")


@pytest.mark.parametrize("readout", ["sum", "mean", "max", "last"])
def test_auto_plan_from_a_state_step_0_shapes_with_a_readout(readout: str) -> None:
    """snnTorch's ``init_leaky()`` (an empty state) with ``plan="auto"``, a budget and a
    reducing readout: the carried step returns no output (None), which the probe used to
    count as a tensor (AttributeError). The result is the plain loop's."""
    snn = pytest.importorskip("snntorch")
    torch.manual_seed(0)
    fc, lif = nn.Linear(6, 5), snn.Leaky(beta=0.9, reset_mechanism="none")

    def step(mem: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor]:
        _, mem = lif(fc(x_t), mem)
        return mem, mem

    inputs = torch.randn(30, 3, 6)
    ys, _ = sc.scan(step, inputs, lif.init_leaky(), plan="auto", budget="1MiB", readout=readout)
    ys.sum().backward()
    got = fc.weight.grad.clone()
    fc.zero_grad()
    mem, outs = lif.init_leaky(), []
    for x_t in inputs:
        mem, y = step(mem, x_t)
        outs.append(y)
    stacked = torch.stack(outs)
    want = {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.max(0).values}
    want["last"] = stacked[-1]
    torch.testing.assert_close(ys, want[readout])
    want[readout].sum().backward()
    torch.testing.assert_close(got, fc.weight.grad)


def test_norse_state_round_trips() -> None:
    lif = pytest.importorskip("norse.torch.functional.lif")
    State = lif.LIFFeedForwardState
    p = lif.LIFParameters()

    def step(s: Any, x: Tensor) -> tuple[Any, Tensor]:
        z, s = lif.lif_feed_forward_step(x, s, p)
        return s, z

    s0 = State(v=torch.zeros(2, 3, requires_grad=True), i=torch.zeros(2, 3))
    inputs = torch.rand(30, 2, 3, requires_grad=True) * 3
    ys, final = sc.scan(step, inputs, s0, plan=P.Revolve(2))
    assert type(final) is State
    want_ys, want_final = reference(step, inputs, s0, None)
    assert torch.equal(ys, want_ys) and torch.equal(final.v, want_final.v)


# ----------------------------------------------------------------------------- errors


def _tiny(v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    return v + x, v


def test_error_step_not_a_pair() -> None:
    with pytest.raises(TypeError, match=r"2-tuple .* step 0"):
        sc.scan(lambda v, x: v + x, torch.ones(3, 2), torch.zeros(2, requires_grad=True),
                plan=P.BPTT())  # fmt: skip


def test_error_state_shape_changes() -> None:
    def grow(v: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        return (torch.cat([v, x[:1]]) if v.shape[0] < 3 else v), x

    with pytest.raises(ValueError, match=r"step 0 changed state"):
        sc.scan(grow, torch.ones(5, 2), torch.zeros(2, requires_grad=True), plan=P.Uniform(2))
    with pytest.raises(ValueError, match=r"step 3 changed state\[1\]"):
        sc.scan(
            lambda s, x: ((s[0], s[1].double() if x[0] > 2 else s[1]), x),
            torch.arange(6.0)[:, None].expand(6, 2),
            (torch.zeros(2, requires_grad=True), torch.zeros(2)),
            plan=P.Uniform(2),
        )


def test_error_state_structure_changes() -> None:
    with pytest.raises(ValueError, match="structure must not change"):
        sc.scan(lambda s, x: ((s[0],), x), torch.ones(3, 2),
                (torch.zeros(2, requires_grad=True), torch.zeros(2)), plan=P.BPTT())  # fmt: skip


def test_error_inputs_without_time() -> None:
    v = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="leading time dimension"):
        sc.scan(_tiny, torch.tensor(1.0), v, plan=P.BPTT())
    with pytest.raises(ValueError, match="T=0"):
        sc.scan(_tiny, torch.ones(0, 2), v, plan=P.BPTT())
    with pytest.raises(ValueError, match="T=0"):
        sc.scan(_tiny, [], v, plan=P.BPTT())


def test_error_bad_arguments() -> None:
    v = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="schedule is for T=4"):
        sc.scan(_tiny, torch.ones(5, 2), v, plan=P.BPTT().schedule(4))
    with pytest.raises(ValueError, match="storage"):
        sc.scan(_tiny, torch.ones(5, 2), v, plan=P.BPTT(), storage="tape")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="readout"):
        sc.scan(_tiny, torch.ones(5, 2), v, plan=P.BPTT(), readout="median")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="state leaf"):
        sc.scan(_tiny, torch.ones(5, 2), (v, 3), plan=P.BPTT())
    with pytest.raises(sc.ScheduleError):
        sc.scan(_tiny, torch.ones(2, 2), v, plan=make_schedule(2, [Tape(0, 2)]))
    with torch.no_grad(), pytest.raises(sc.ConfigError, match="cannot parse '25%'"):
        sc.scan(_tiny, torch.ones(5, 2), v, plan="auto", budget="25%")  # read as wrap reads it


def test_pack_tape_spares_bytes_and_keeps_gradients() -> None:
    torch.manual_seed(6)
    net = LIF2(n_in=40, hidden=64, n_out=8)
    T = 30
    inputs = (torch.rand(T, 32, 40) < 0.05).float()
    state = net.initial(32)
    wrt = [*net.parameters(), *state]
    results = {}
    for pack in (False, True):
        out = sc.scan(net, inputs, state, plan=P.Uniform(6), pack_tape=pack)
        (ys, final), stats = out, out.stats
        results[pack] = (grads_of(loss_of(ys, final), wrt), stats.tape_bytes_per_step)
        if not pack:  # packed sizes depend on the number of spikes, so vary per step
            probe = measure_step(net, state, inputs[0], list(net.parameters()), pack=pack)
            assert stats.tape_bytes_per_step == probe.step_bytes
    assert_same(results[True][0], results[False][0])
    assert results[True][1] < results[False][1]


def test_spikes_option_rejects_non_binary_inputs() -> None:
    def leaky(state: torch.Tensor, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = 0.5 * state + x_t
        return state, state

    binary = (torch.rand(6, 3) < 0.3).float()
    ys, _ = sc.scan(leaky, binary, torch.zeros(3), plan=P.BPTT(), spikes=True)
    assert ys.shape == (6, 3)
    with pytest.raises(sc.NotBinaryError, match=r"0\.5.*Fix"):
        sc.scan(leaky, torch.full((6, 3), 0.5), torch.zeros(3), plan=P.BPTT(), spikes=True)


@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_double_backward_is_refused_with_a_clear_error(granularity: str) -> None:
    from spikeckpt.models import LIFStack

    net = LIFStack((6, 8, 3)).as_sequential()
    chunk = 3 if granularity == "layer" else None  # the stack has no chunk (refused)
    seq = sc.wrap(net, plan=sc.plans.Uniform(3), granularity=granularity, chunk=chunk)
    x = (torch.rand(7, 2, 6) < 0.5).float()
    loss = seq(x).sum()
    weight = next(net.parameters())
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.grad(loss, weight, create_graph=True)
    (grad,) = torch.autograd.grad(seq(x).sum(), weight)  # a first-order backward still works
    assert grad.shape == weight.shape
