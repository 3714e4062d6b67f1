"""Norse cells and sequence modules wrapped by spikeckpt equal Norse's own time loop.

Reference loop as in Norse's tutorials: ``state = None; z, state = cell(x[t], state)`` (sequence
modules: ``z, state = lif(x)``). Outputs, final state and gradients must match under every plan.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from device_copies import HostToDeviceCopies
from hypothesis import given, settings
from hypothesis import strategies as st
from norse_cells import counted_gathers, norse_loop
from torch import Tensor, nn
from torch.utils import _pytree as pytree

import spikeckpt as sc
from spikeckpt.plans import BPTT, Double, Revolve, TwoLevel, Uniform

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    nt = pytest.importorskip("norse.torch")
from norse.torch.functional import izhikevich  # noqa: E402

PLANS = [BPTT(), Uniform(3), Revolve(2), Double(6, 2), TwoLevel(2, remote_interval=4)]
IN, N = 4, 5

FEEDFORWARD: dict[str, Callable[[], nn.Module]] = {
    "LIFCell": lambda: nt.LIFCell(),
    "LIFBoxCell": lambda: nt.LIFBoxCell(),
    "LIFAdExCell": lambda: nt.LIFAdExCell(),
    "LIFExCell": lambda: nt.LIFExCell(),
    "LIFRefracCell": lambda: nt.LIFRefracCell(),
    "LIFAdExRefracCell": lambda: nt.LIFAdExRefracCell(),
    "LICell": lambda: nt.LICell(),
    "LIBoxCell": lambda: nt.LIBoxCell(),
    "IAFCell": lambda: nt.IAFCell(),
    "LSNNCell": lambda: nt.LSNNCell(),
    "IzhikevichCell": lambda: nt.IzhikevichCell(izhikevich.tonic_spiking),
}
RECURRENT: dict[str, Callable[[], nn.Module]] = {
    "LIFRecurrentCell": lambda: nt.LIFRecurrentCell(IN, N),
    "LIFAdExRecurrentCell": lambda: nt.LIFAdExRecurrentCell(IN, N),
    "LIFExRecurrentCell": lambda: nt.LIFExRecurrentCell(IN, N),
    "LIFRefracRecurrentCell": lambda: nt.LIFRefracRecurrentCell(IN, N),
    "LSNNRecurrentCell": lambda: nt.LSNNRecurrentCell(IN, N),
    "LIFMCRecurrentCell": lambda: nt.LIFMCRecurrentCell(IN, N),
}
SEQUENCE: dict[str, Callable[[], nn.Module]] = {
    "LIF": lambda: nt.LIF(),
    "LI": lambda: nt.LI(),
    "LIFAdEx": lambda: nt.LIFAdEx(),
    "LSNN": lambda: nt.LSNN(),
    "LIFRecurrent": lambda: nt.LIFRecurrent(IN, N),
    "LIFRefracRecurrent": lambda: nt.LIFRefracRecurrent(IN, N),
}


def learnable_lif(kind: str) -> tuple[nn.Module, list[nn.Parameter]]:
    """A cell whose NamedTuple parameters hold nn.Parameters (not registered by Norse)."""
    tau = nn.Parameter(torch.full((N,), 150.0))
    v_th = nn.Parameter(torch.full((N,), 0.4))
    p = nt.LIFParameters(tau_mem_inv=tau, v_th=v_th)
    cell = {
        "LIFCell": lambda: nt.LIFCell(p),
        "LIFRecurrentCell": lambda: nt.LIFRecurrentCell(IN, N, p),
        "LICell": lambda: nt.LICell(nt.LIParameters(tau_mem_inv=tau)),
    }[kind]()
    return cell, ([tau] if kind == "LICell" else [tau, v_th])


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _loss(y: torch.Tensor, state: Any, w: torch.Tensor) -> torch.Tensor:
    return (y * w).sum() + sum(t.float().sum() for t in _leaves(state) if t.is_floating_point())


def compare(
    model: nn.Module,
    params: list[torch.Tensor],
    run_ref: Callable[[torch.Tensor], Any],
    x: torch.Tensor,
    sub: Callable[[Any], Any] = lambda s: s,
) -> None:
    """``run_ref(x) -> (ys, final_state)``; ``sub`` picks the same state out of the wrapped one.
    Gradients are compared for ``params`` and for the input ``x``."""
    x = x.detach().requires_grad_(True)
    params = [*params, x]
    ref_y, ref_s = run_ref(x)
    w = torch.randn(ref_y.shape[-1])
    _loss(ref_y, ref_s, w).backward()
    ref_g = _grads(params)
    for plan in PLANS:
        for p in params:
            p.grad = None
        y, s = sc.wrap(model, plan=plan)(x, return_state=True)
        _loss(y, sub(s), w).backward()
        torch.testing.assert_close(y, ref_y, rtol=0, atol=0, msg=f"outputs, {plan}")
        for a, b in zip(_leaves(sub(s)), _leaves(ref_s), strict=True):
            torch.testing.assert_close(a, b.expand_as(a).to(a.dtype), msg=f"state, {plan}")
        for a, b in zip(_grads(params), ref_g, strict=True):
            # a plan sums a parameter's gradient over the steps in its own order: round-off
            # relative to the gradient's largest entry (an LICell's: 1.25e-6 of 23.7, Revolve)
            scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale, msg=f"grads, {plan}")


def cell_loop(lin: nn.Module | None, cell: nn.Module) -> Callable[[torch.Tensor], Any]:
    def run(x: torch.Tensor) -> Any:
        state, out = None, []
        for t in range(x.shape[0]):
            z, state = cell(lin(x[t]) if lin is not None else x[t], state)
            out.append(z)
        return torch.stack(out), state

    return run


@pytest.mark.parametrize("name", list(FEEDFORWARD))
@settings(max_examples=3, deadline=None)
@given(T=st.integers(1, 9), B=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_feedforward_cell_equals_norse_loop(name: str, T: int, B: int, seed: int) -> None:
    torch.manual_seed(seed)
    lin, cell = nn.Linear(IN, N), FEEDFORWARD[name]()
    x = torch.rand(T, B, IN) * 4
    compare(
        nn.Sequential(lin, cell),
        list(lin.parameters()),
        cell_loop(lin, cell),
        x,
        sub=lambda s: s[1],
    )


@pytest.mark.parametrize("name", list(RECURRENT))
@settings(max_examples=3, deadline=None)
@given(T=st.integers(1, 9), B=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_recurrent_cell_equals_norse_loop(name: str, T: int, B: int, seed: int) -> None:
    torch.manual_seed(seed)
    cell = RECURRENT[name]()
    x = torch.rand(T, B, IN) * 4
    compare(cell, list(cell.parameters()), cell_loop(None, cell), x)


@pytest.mark.parametrize("name", list(SEQUENCE))
@settings(max_examples=3, deadline=None)
@given(T=st.integers(1, 9), B=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_sequence_module_equals_its_own_loop(name: str, T: int, B: int, seed: int) -> None:
    torch.manual_seed(seed)
    module = SEQUENCE[name]()
    x = torch.rand(T, B, IN if "Recurrent" in name else N) * 4
    compare(module, list(module.parameters()), module, x)


@pytest.mark.parametrize("kind", ["LIFCell", "LIFRecurrentCell", "LICell"])
@settings(max_examples=3, deadline=None)
@given(T=st.integers(1, 9), B=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_learnable_norse_parameters(kind: str, T: int, B: int, seed: int) -> None:
    """nn.Parameters inside ``cell.p`` (unregistered) get exact gradients too."""
    torch.manual_seed(seed)
    cell, extra = learnable_lif(kind)
    if kind == "LIFRecurrentCell":
        x = torch.rand(T, B, IN) * 4
        compare(cell, [*cell.parameters(), *extra], cell_loop(None, cell), x)
    else:
        lin = nn.Linear(IN, N)
        x = torch.rand(T, B, IN) * 4
        compare(
            nn.Sequential(lin, cell),
            [*lin.parameters(), *extra],
            cell_loop(lin, cell),
            x,
            sub=lambda s: s[1],
        )


def test_sequential_state_with_cells_does_not_mutate_user_state() -> None:
    torch.manual_seed(0)
    model = nt.SequentialState(nn.Linear(IN, N), nt.LIFCell(), nn.Linear(N, 3), nt.LICell())
    x = torch.rand(10, 2, IN) * 3

    def run(x: torch.Tensor) -> Any:
        state, out = None, []
        for t in range(x.shape[0]):
            z, state = model(x[t], state)
            out.append(z)
        return torch.stack(out), [s for s in state if s is not None]

    compare(model, list(model.parameters()), run, x, sub=lambda s: [s[i] for i in (1, 3)])
    # a Norse-style state list (None for stateless layers) is accepted and left untouched
    seq = sc.wrap(model, plan=Revolve(2))
    _, s0 = seq(x[:4], return_state=True)
    given_list = [None, s0[1], None, s0[3]]
    before = list(given_list)
    y1, _ = seq(x[4:], return_state=True, state=given_list)
    assert given_list == before
    y_ref, _ = run(x)
    torch.testing.assert_close(y1, y_ref[4:])


def test_sequential_state_with_sequence_modules() -> None:
    """Norse's docstring model: Lift(Conv2d), Flatten over (T, B, ...) tensors, LIFRecurrent."""
    torch.manual_seed(0)
    model = nt.SequentialState(
        nt.Lift(nn.Conv2d(2, 3, 3)),
        nn.Flatten(2),
        nt.LIFRecurrent(3 * 4 * 4, N),
        nt.LIF(),
    )
    x = torch.rand(8, 2, 2, 6, 6) * 2

    def run(x: torch.Tensor) -> Any:
        z, state = model(x)
        return z, [s for s in state if s is not None]

    compare(model, list(model.parameters()), run, x, sub=lambda s: [s[2], s[3]])


def _norse_loop(model: nn.Module, x: torch.Tensor, state: Any = None) -> Any:
    out = []
    for t in range(x.shape[0]):
        z, state = model(x[t], state)
        out.append(z)
    return torch.stack(out), state


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@settings(max_examples=4, deadline=None)
@given(T=st.integers(2, 12), B=st.integers(1, 3), seed=st.integers(0, 2**16), data=st.data())
def test_a_sequential_states_final_state_goes_back_into_norses_loop(
    granularity: str, T: int, B: int, seed: int, data: st.DataObject
) -> None:
    """The final state is Norse's own list (None at stateless positions, a nested
    SequentialState's list inside): Norse's loop assigns into it, so a tuple raised
    ``TypeError: 'tuple' object does not support item assignment``; continued there, the
    outputs are those of Norse's loop over the whole sequence."""
    torch.manual_seed(seed)
    split = data.draw(st.integers(1, T - 1), label="split")
    if granularity == "layer":  # layer-wise runs flat stacks only
        model = nt.SequentialState(nn.Linear(IN, N), nt.LIFCell(), nt.LILinearCell(N, 3))
    else:
        inner = nt.SequentialState(nn.Linear(N, N), nt.LIFCell())
        model = nt.SequentialState(nn.Linear(IN, N), nt.LIFCell(), inner, nt.LILinearCell(N, 3))
    x = torch.rand(T, B, IN) * 3
    y_ref, s_ref = _norse_loop(model, x)
    seq = sc.wrap(model, granularity=granularity, exact=granularity == "layer")
    _, state = seq(x[:split])
    assert type(state) is type(s_ref) is list
    assert [type(s) for s in state] == [type(s) for s in s_ref]  # None, states, lists
    y_wrapped, _ = seq(x[split:], state=state)  # back into the wrapped model: not mutated
    assert torch.equal(y_wrapped, y_ref[split:])
    y_rest, s_rest = _norse_loop(model, x[split:], state)  # Norse's loop assigns into it
    assert torch.equal(y_rest, y_ref[split:])
    for a, b in zip(_leaves(s_rest), _leaves(s_ref), strict=True):
        assert torch.equal(a, b)


def test_a_nested_stack_is_refused_layer_wise_naming_its_own_container() -> None:
    """Flattened into an nn.Sequential, a SequentialState of cells would return no state."""
    for outer, kind in [(nt.SequentialState, "SequentialState"), (nn.Sequential, "nn.Sequential")]:
        model = outer(nn.Linear(IN, N), nt.LIFCell(), outer(nn.Linear(N, 3), nt.LIFCell()))
        with pytest.raises(sc.UnsupportedLayerError, match=f"flatten it into one {kind}$"):
            sc.wrap(model, granularity="layer")(torch.rand(3, 2, IN))


def test_parameters_follow_dtype() -> None:
    """``p`` is a plain NamedTuple that ``.double()`` does not convert; the adapter does."""
    torch.manual_seed(0)
    tau = nn.Parameter(torch.full((N,), 150.0))
    model = nn.Sequential(nn.Linear(IN, N), nt.LIFCell(nt.LIFParameters(tau_mem_inv=tau)))
    model.double()
    x = torch.rand(12, 2, IN, dtype=torch.float64) * 4
    y, s = sc.wrap(model, plan=Uniform(4))(x, return_state=True)
    assert y.dtype == s[1].v.dtype == s[1].i.dtype == torch.float64
    ref_y, _ = cell_loop(model[0], model[1])(x)
    torch.testing.assert_close(y, ref_y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parameters_follow_device() -> None:
    """Norse's own loop fails on CUDA (``p`` stays on the CPU); the wrapped model runs there and
    matches the CPU loop."""
    torch.manual_seed(0)
    tau = torch.linspace(100.0, 200.0, N)  # per-neuron: a CPU tensor in p cannot broadcast
    cpu = nn.Sequential(nn.Linear(IN, N), nt.LIFCell(nt.LIFParameters(tau_mem_inv=tau)))
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.rand(12, 2, IN) * 4
    ref_y, _ = cell_loop(cpu[0], cpu[1])(x)
    ref_y.sum().backward()
    y = sc.wrap(gpu, plan=Uniform(4))(x.cuda())
    y.sum().backward()
    assert y.is_cuda
    torch.testing.assert_close(y.cpu(), ref_y)
    for a, b in zip(gpu.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_wise_on_cuda_runs_the_fused_neuron_with_p_on_the_cpu() -> None:
    """A ``LIFCell`` whose ``p`` stayed on the CPU runs fused on CUDA, layer-wise, with its
    own loop's outputs there (Norse's loop takes 0-d CPU parameters as scalars)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(IN, N), nt.LIFCell()).cuda()
    x = torch.rand(12, 2, IN, device="cuda") * 4
    ref_y, _ = cell_loop(net[0], net[1])(x)
    seq = sc.wrap(net, granularity="layer", chunk=4)
    y = seq(x)
    assert seq.last_stats.blocks[0].neuron == "fused", seq.last_stats.blocks[0].neuron_chunks
    torch.testing.assert_close(y, ref_y)


def test_unsupported_norse_modules() -> None:
    with pytest.raises(sc.UnsupportedLayerError, match=r"(?s)layer '1' .*PoissonEncoder"):
        sc.wrap(nn.Sequential(nn.Linear(IN, N), nt.PoissonEncoder(10)))


def test_training_loss_falls() -> None:
    torch.manual_seed(0)
    model = nt.SequentialState(nn.Linear(8, 16), nt.LIFCell(), nn.Linear(16, 2), nt.LICell())
    seq = sc.wrap(model, plan=Double(10, 3), readout="last")
    x = (torch.rand(30, 16, 8) < 0.3).float()
    target = torch.tensor([1.0, -1.0]).expand(16, 2)
    opt = torch.optim.Adam(seq.parameters(), lr=0.05)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        out, _ = seq(x)  # a Norse model keeps returning (output, state)
        loss = ((out - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("per_neuron", [False, True], ids=["0-d", "per-neuron"])
def test_steps_on_another_device_copy_the_parameters_at_most_once(per_neuron: bool) -> None:
    """Norse's ``p`` stays on the CPU when the model moves to a GPU. Its 0-d tensors are used
    as they are (scalars, as Norse's own loop uses them); a per-neuron tensor is copied to the
    device once, not at every step (a copy per step from pageable host memory makes the host
    wait for the GPU's queue: 6 copies per step before). The "meta" device stands in for a
    GPU."""
    from spikeckpt.adapters.norse import NorseAdapter

    tau = torch.linspace(100.0, 200.0, 5) if per_neuron else torch.as_tensor(100.0)
    adapter = NorseAdapter(nt.LIFCell(nt.LIFParameters(tau_mem_inv=tau)), "1")
    x = torch.rand(3, 5, device="meta")
    state = adapter.init_state(x)
    with HostToDeviceCopies() as copies:
        for _ in range(10):
            state, z = adapter.step(state, x)
    assert z.device.type == "meta"
    assert copies.count <= (1 if per_neuron else 0), copies.count


def test_the_fused_kernel_takes_norse_parameters_left_on_the_cpu() -> None:
    """The fused chunk of a ``LIFCell`` whose ``p`` stayed on the CPU runs on the device of
    its input (before, it ran step by step there); checked on the "meta" device for shapes."""
    from spikeckpt.adapters.norse import NorseAdapter

    adapter = NorseAdapter(nt.LIFCell(), "1")
    kernel = adapter.chunk_kernel()
    assert kernel is not None
    z = torch.rand(4, 3, 5, device="meta")
    leaves = list(pytree.tree_leaves(adapter.init_state(z[0])))
    assert kernel.accepts(leaves, z)
    final, y, _, saved = kernel.forward(leaves, z, keep=True, want_mem=False)
    assert y is not None and y.shape == z.shape and y.device.type == "meta"
    g_z, g_final, _ = kernel.backward(saved, torch.ones_like(y), [None, None], None, True, [])
    assert g_z is not None and g_z.shape == z.shape


class _ClampedLIFCell(nt.LIFCell):
    """A user's cell: Norse's step, then the membrane clamped (its own ``forward``)."""

    def forward(self, x: torch.Tensor, state: Any = None) -> Any:
        z, s = super().forward(x, state)
        return z, s._replace(v=s.v.clamp(max=0.5))


class _ClampedLIF(nt.LIF):
    """A user's sequence module: its input clamped, then Norse's loop."""

    def forward(self, x: torch.Tensor, state: Any = None) -> Any:
        return super().forward(x.clamp(max=0.5), state)


def _tutorial_loop(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    state, out = None, []
    for x_t in x:
        z, state = model(x_t, state)
        out.append(z)
    return torch.stack(out)


def test_a_cell_with_its_own_forward_is_not_fused() -> None:
    """A ``LIFCell`` subclass whose ``forward`` clamps the membrane keeps its per-step call
    layer-wise (the fused kernel ran Norse's step instead: other spikes, silently; the check
    on random data missed the clamp)."""
    torch.manual_seed(0)
    model = nt.SequentialState(nn.Linear(IN, N), _ClampedLIFCell())
    _layerwise_runs_per_step_as_the_loop(model, (torch.rand(8, 2, IN) < 0.7).float() * 3, 0.0)


def _layerwise_runs_per_step_as_the_loop(model: nn.Module, x: Tensor, rtol: float) -> None:
    """Layer-wise, the one block's neuron runs per step: outputs (``rtol``) and gradients as
    Norse's own loop."""
    ref = _tutorial_loop(model, x)
    ref.sum().backward()
    ref_g = _grads(list(model.parameters()))
    model.zero_grad()
    seq = sc.wrap(model, plan=Uniform(4), granularity="layer")
    y, _ = seq(x)
    y.sum().backward()
    assert [b.neuron for b in seq.last_stats.blocks] == ["per-step"]
    torch.testing.assert_close(y, ref, rtol=rtol, atol=rtol / 10)
    for a, b in zip(_grads(list(model.parameters())), ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_cell_with_a_forward_hook_runs_per_step_with_the_hook() -> None:
    """A hook that clamps a ``LIFCell``'s membrane runs layer-wise as in Norse's loop: the
    fused kernel, which never calls the cell, is not used while the cell has hooks (the check
    on random data missed the clamp)."""
    torch.manual_seed(0)
    model = nt.SequentialState(nn.Linear(IN, N), nt.LIFCell(), nn.Linear(N, 3), nt.LICell())
    model[1].register_forward_hook(
        lambda m, args, out: (out[0], out[1]._replace(v=out[1].v.clamp(max=0.5)))
    )
    x = (torch.rand(8, 2, IN) < 0.7).float() * 3
    ref = _tutorial_loop(model, x)
    seq = sc.wrap(model, plan=Uniform(4), granularity="layer")
    y, _ = seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["per-step", "fused"]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_a_sequence_module_with_its_own_forward_or_hooks_is_refused() -> None:
    """A sequence module is stepped through its activation, never called: a ``forward`` of
    its own or a forward hook would silently not run, so both are refused, naming the layer."""
    model = nt.SequentialState(nn.Linear(IN, N), _ClampedLIF())
    x = torch.rand(6, 2, IN)
    for granularity in ("stack", "layer"):
        with pytest.raises(sc.UnsupportedLayerError, match=r"layer '1' .*overrides Norse's"):
            sc.wrap(model, plan=Uniform(3), granularity=granularity)(x)
    hooked = nt.SequentialState(nn.Linear(IN, N), nt.LIF())
    hooked[1].register_forward_hook(lambda m, args, out: out)
    with pytest.raises(sc.UnsupportedLayerError, match=r"layer '1' .*forward hooks"):
        sc.wrap(hooked, plan=Uniform(3))(x)


def _set_dt(cell: nn.Module) -> None:
    cell.dt = 0.004


def _set_reset_subtract(cell: nn.Module) -> None:
    from norse.torch.functional.reset import reset_subtract

    cell.p = cell.p._replace(reset_method=reset_subtract)


def _set_forward(cell: nn.Module) -> None:
    def forward(x: torch.Tensor, state: Any = None) -> Any:
        z, s = type(cell).forward(cell, x, state)
        return z, s._replace(v=s.v.clamp(max=0.3))

    cell.forward = forward


@pytest.mark.parametrize(
    ("cell", "change"),
    [
        (lambda: nt.LIFCell(), _set_dt),
        (lambda: nt.LIFBoxCell(nt.LIFBoxParameters(v_th=torch.tensor(0.3))), _set_reset_subtract),
        (lambda: nt.LIFCell(), _set_forward),
    ],
    ids=["dt", "reset_method", "forward"],
)
def test_a_cell_changed_after_the_first_forward_is_not_fused_with_its_old_step(
    cell: Callable[[], nn.Module], change: Callable[[nn.Module], None]
) -> None:
    """The fused kernel is built at the first layer-wise forward; a cell whose ``dt``,
    ``reset_method`` or ``forward`` changes after it ran the old step (other spikes,
    silently): the block is made again from the cell as it is now, as a fresh wrap makes it
    (fused where the kernel models the new step, else per step), bitwise Norse's loop."""
    torch.manual_seed(0)
    model = nt.SequentialState(nn.Linear(IN, N), cell())
    x = (torch.rand(8, 2, IN) < 0.7).float() * 3
    seq = sc.wrap(model, plan=Uniform(4), granularity="layer")
    seq(x)
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    change(model[1])
    y, _ = seq(x)
    fresh = sc.wrap(model, plan=Uniform(4), granularity="layer")
    fresh(x)
    assert [b.neuron for b in seq.last_stats.blocks] == [b.neuron for b in fresh.last_stats.blocks]
    torch.testing.assert_close(y, _tutorial_loop(model, x), rtol=0, atol=0)


@pytest.mark.parametrize("jit", [True, False], ids=["compiled-loop", "torch-loop"])
@pytest.mark.parametrize(
    "cell",
    [
        lambda: nt.LIFBoxCell(nt.LIFBoxParameters(tau_mem_inv=150.0, v_th=0.3)),
        lambda: nt.LIFBoxCell(nt.LIFBoxParameters(v_th=0.3, v_reset=-0.1)),
        lambda: nt.LICell(nt.LIParameters(tau_mem_inv=150.0, tau_syn_inv=150.0)),
        lambda: nt.LICell(nt.LIParameters(tau_mem_inv=70)),
    ],
    ids=["LIFBoxCell", "LIFBoxCell-reset", "LICell", "LICell-int"],
)
def test_python_number_parameters_are_fused_as_the_loop(
    cell: Callable[[], nn.Module], jit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LIFBoxCell`` and ``LICell`` keep Python numbers in ``p`` as given (``LIFCell``
    makes them tensors; users write ``LIParameters(tau_mem_inv=50.0)``). Layer-wise, the
    backward first asked each one ``requires_grad`` (``AttributeError``); then such a cell ran
    per step (1.5-2x the time of a 200-256-10 net). Now fused: outputs at round-off of Norse's
    loop (bitwise with ``exact=True``), gradients at round-off.

    ``LICell``'s outputs are voltages, so the chunk's one input product shows: on the 16-core
    CPU of the H100 machine (2026-11-27) they were not bitwise the per-step products' by
    default, bitwise on the 2-core VM."""
    from spikeckpt.adapters import host_loops

    monkeypatch.setattr(host_loops, "USE_JIT", jit and host_loops.USE_JIT)
    torch.manual_seed(0)
    model = nt.SequentialState(nn.Linear(IN, N), cell())
    x = (torch.rand(9, 2, IN) < 0.6).float() * 3
    ref = _tutorial_loop(model, x)
    (ref * torch.linspace(-1, 1, N)).sum().backward()
    ref_g = _grads(list(model.parameters()))
    model.zero_grad()
    for exact in (False, True):
        model.zero_grad()
        seq = sc.wrap(model, plan=Uniform(4), granularity="layer", exact=exact)
        y, _ = seq(x)
        (y * torch.linspace(-1, 1, N)).sum().backward()
        assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
        assert ref.abs().sum() > 0
        if exact:
            assert torch.equal(y, ref)
        else:
            torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
        for a, b in zip(_grads(list(model.parameters())), ref_g, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_reset_subtract_gives_v_reset_no_gradient_layer_wise() -> None:
    """``reset_subtract`` does not read ``v_reset``: Norse's loop leaves its gradient None.
    The fused kernel gave it ``reset_value``'s gradient: the check on random data refused
    the kernel here (per step), and where its sample did not spike it passed and the
    gradient was wrong (fuzzer: 0.56 against None). Now fused, and None."""
    from norse.torch.functional.reset import reset_subtract

    v_reset = nn.Parameter(torch.full((N,), -0.1))
    tau = nn.Parameter(torch.full((N,), 150.0))
    p = nt.LIFBoxParameters(
        tau_mem_inv=tau, v_th=torch.tensor(0.3), v_reset=v_reset, reset_method=reset_subtract
    )
    torch.manual_seed(0)
    model = nt.SequentialState(nn.Linear(IN, N), nt.LIFBoxCell(p))
    x = (torch.rand(9, 2, IN) < 0.6).float() * 3
    w = torch.randn(N)
    ref = _tutorial_loop(model, x)
    (ref * w).sum().backward()
    assert v_reset.grad is None and ref.any()
    ref_g = _grads([*model.parameters(), tau])
    model.zero_grad()
    tau.grad = None
    seq = sc.wrap(model, plan=Uniform(4), granularity="layer")
    y, _ = seq(x)
    (y * w).sum().backward()
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused"]
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    assert v_reset.grad is None or not v_reset.grad.any(), v_reset.grad
    for a, b in zip(_grads([*model.parameters(), tau]), ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _ScaledSequentialState(nt.SequentialState):
    """A user's ``SequentialState`` whose ``forward`` scales its input."""

    def forward(self, x: torch.Tensor, state: Any = None) -> Any:
        return super().forward(x * 2, state)


def _hooked_sequential_state() -> nn.Module:
    model = nt.SequentialState(nn.Linear(IN, N), nt.LIFCell(), nn.Linear(N, 3), nt.LICell())
    model.register_forward_hook(lambda m, args, out: (out[0] * 2, out[1]))
    return model


@pytest.mark.parametrize(
    "make",
    [
        lambda: _ScaledSequentialState(
            nn.Linear(IN, N), nt.LIFCell(), nn.Linear(N, 3), nt.LICell()
        ),
        _hooked_sequential_state,
    ],
    ids=["own forward", "forward hook"],
)
def test_a_sequential_state_with_its_own_forward_or_hooks_runs_through_its_call(
    make: Callable[[], nn.Module],
) -> None:
    """A ``SequentialState`` subclass's ``forward`` and a hook on the model were skipped (it
    was stepped as a stack of its layers: other outputs, silently). It now runs through its
    call, as Norse's loop calls it; layer-wise, which needs a stack of blocks, refuses it."""
    torch.manual_seed(0)
    model = make()
    x = (torch.rand(7, 2, IN) < 0.6).float()
    ref = _tutorial_loop(model, x)
    ref.sum().backward()
    ref_g = _grads(list(model.parameters()))
    model.zero_grad()
    y, _ = sc.wrap(model, plan=Uniform(3))(x)
    y.sum().backward()
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    for a, b in zip(_grads(list(model.parameters())), ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(
        sc.UnsupportedLayerError,
        match="forward hooks or a forward of its own, so it runs through its call",
    ):
        sc.wrap(model, plan=Uniform(3), granularity="layer")(x)


@settings(max_examples=15, deadline=None)
@given(
    T=st.integers(1, 19),
    B=st.integers(1, 3),
    chunk=st.integers(1, 8),
    autapses=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_recurrent_cell_first_in_a_stack_runs_fused_layer_wise(
    T: int, B: int, chunk: int, autapses: bool, seed: int
) -> None:
    """``SequentialState(LIFRecurrentCell(in, n), Linear, LICell())``, the cell weighting the
    network's input itself (no ``Linear`` before it), layer-wise: the cell runs fused
    (`NorseRecurrentKernel`), its spikes bitwise Norse's (checked through ``output="both"``
    of a wrap cut after the cell), the output and every gradient (the autapse hook's zero
    diagonal included) within round-off of Norse's loop."""
    torch.manual_seed(seed)
    cell = nt.LIFRecurrentCell(IN, N, autapses=autapses)
    net = nt.SequentialState(cell, nn.Linear(N, 3), nt.LICell())
    x = (torch.rand(T, B, IN) < 0.5).float() * 30
    params = list(net.parameters())

    def loop(model: nn.Module) -> Tensor:
        state, out = None, []
        for x_t in x:
            y, state = model(x_t, state)
            out.append(y)
        return torch.stack(out)

    want = loop(net)
    weights = torch.linspace(-1, 1, want.numel()).reshape(want.shape)
    want_grads = torch.autograd.grad((want * weights).sum(), params)
    seq = sc.wrap(net, granularity="layer", chunk=chunk)
    got = seq(x)[0]
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got_grads = torch.autograd.grad((got * weights).sum(), params)
    for a, b in zip(want_grads, got_grads, strict=True):
        scale = max(1.0, float(a.abs().max()))
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * scale)
    if not autapses:
        assert not got_grads[1].diagonal().any()  # the recurrent weights' hook ran
    spikes = sc.wrap(nt.SequentialState(cell), granularity="layer", chunk=chunk)(x)[0]
    assert torch.equal(spikes, torch.stack(_cell_spikes(cell, x)))


def _cell_spikes(cell: nn.Module, x: Tensor) -> list[Tensor]:
    state, out = None, []
    for x_t in x:
        z, state = cell(x_t, state)
        out.append(z)
    return out


@settings(max_examples=15, deadline=None)
@given(
    T=st.integers(1, 19),
    B=st.integers(1, 3),
    chunk=st.integers(1, 8),
    exact=st.booleans(),
    lsnn=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_recurrent_cell_first_gathers_its_sparse_input(
    T: int, B: int, chunk: int, exact: bool, lsnn: bool, seed: int
) -> None:
    """A ``LIFRecurrentCell`` or ``LSNNRecurrentCell`` weighting a sparse spike input
    itself: its kernel sums ``x
    W_in^T`` over the chunk's non-zeros (one gather per chunk, `spikeckpt.adapters.gather`)
    and ``W_in``'s gradient over them, unless ``exact=True`` (the cell's own product per
    step). Weights on a 1/4 grid, so every sum is exact in any order: spikes and outputs
    bitwise Norse's loop either way, gradients within round-off."""

    torch.manual_seed(seed)
    n_in, hidden = 64, 48
    cell = (nt.LSNNRecurrentCell if lsnn else nt.LIFRecurrentCell)(n_in, hidden)
    net = nt.SequentialState(cell, nn.Linear(hidden, 3), nt.LICell())
    with torch.no_grad():
        cell.input_weights.copy_(torch.randint(-8, 48, cell.input_weights.shape) / 4)
        cell.recurrent_weights.copy_(torch.randint(-8, 9, cell.recurrent_weights.shape) / 4)
    x = (torch.rand(T, B, n_in) < 0.04).float()
    params = list(net.parameters())
    state, want_list = None, []
    for x_t in x:
        y, state = net(x_t, state)
        want_list.append(y)
    want = torch.stack(want_list)
    # (an LSNN's input reaches the membrane a step later: at T = 1, W_in is unused)
    want_grads = torch.autograd.grad(want.sum(), params, allow_unused=True)
    with counted_gathers() as calls:
        seq = sc.wrap(net, granularity="layer", chunk=chunk, exact=exact)
        got = seq(x)[0]
        got_grads = torch.autograd.grad(got.sum(), params, allow_unused=True)
        spikes = sc.wrap(nt.SequentialState(cell), granularity="layer", chunk=chunk, exact=exact)
        got_spikes = spikes(x)[0]
    # an LSNN over T = 1 steps per call: its input reaches no spike, and the loop's graph
    # gives the layers below no gradient path (.grad None), which a kernel's zeros would not
    stepped = lsnn and T == 1
    assert [b.neuron for b in seq.last_stats.blocks] == ["per-step" if stepped else "fused"] * 2
    # the tests' gather rule (conftest): a chunk of at most 1/16 ones gathers
    sparse = any(bool(c.count_nonzero() <= c.numel() / 16) for c in x.split(chunk))
    assert bool(calls) == (not exact and sparse and not stepped)
    assert torch.equal(got_spikes, torch.stack(_cell_spikes(cell, x)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b, p in zip(want_grads, got_grads, params, strict=True):
        a, b = (torch.zeros_like(p) if g is None else g for g in (a, b))
        scale = max(1.0, float(a.abs().max()))
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize(
    "field", ["tau_mem_inv", "tau_syn_inv", "v_leak", "v_th", "v_reset", "tau_mem_inv v_th"]
)
@pytest.mark.parametrize("sparse", [False, True])
def test_a_recurrent_cell_learning_some_fields_runs_fused(field: str, sparse: bool) -> None:
    """The fused ``LIFRecurrentCell`` keeps per step only what the learnable fields'
    gradients read (each field alone, and two): gradients of the weights and of those fields
    within round-off of Norse's loop, layer-wise, over a dense and a sparse (gathered) input."""
    torch.manual_seed(0)
    values = {"tau_mem_inv": 90.0, "tau_syn_inv": 180.0, "v_leak": 0.1, "v_th": 0.6}
    values["v_reset"] = -0.2
    # per neuron where Norse allows it (its initial state takes v_leak as a number)
    hidden = 32
    shape = {"tau_mem_inv": (hidden,), "v_th": (hidden,)}
    learned = {f: nn.Parameter(torch.full(shape.get(f, ()), values[f])) for f in field.split()}
    p = nt.LIFParameters(**{f: learned.get(f, torch.tensor(v)) for f, v in values.items()})
    cell = nt.LIFRecurrentCell(16, hidden, p=p)
    net = nt.SequentialState(cell, nn.Linear(hidden, 3), nt.LICell())
    # sparse: chunks of at most 1/16 ones gather (the tests' rule, conftest)
    x = (torch.rand(13, 3, 16) < 0.03).float() * 8 if sparse else torch.rand(13, 3, 16) * 4
    params = [*net.parameters(), *learned.values()]
    state, out = None, []
    for x_t in x:
        y, state = net(x_t, state)
        out.append(y)
    want = torch.stack(out)
    want_grads = torch.autograd.grad(want.sum(), params)
    seq = sc.wrap(net, granularity="layer", chunk=5)
    got = seq(x)[0]
    assert [b.neuron for b in seq.last_stats.blocks] == ["fused", "fused"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(want_grads, torch.autograd.grad(got.sum(), params), strict=True):
        assert a.abs().sum() > 0
        scale = max(1.0, float(a.abs().max()))
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * scale)


def test_an_lsnn_cell_learning_its_parameters_runs_per_step() -> None:
    """The fused ``LSNNRecurrentCell`` (`NorseLSNNKernel`) takes no gradient for its
    ``LSNNParameters``: a cell with a learnable field keeps its per-step call, every
    gradient (the field's too) within round-off of Norse's loop."""
    torch.manual_seed(0)
    tau = nn.Parameter(torch.full((8,), 50.0))
    cell = nt.LSNNRecurrentCell(4, 8, p=nt.LSNNParameters(tau_adapt_inv=tau))
    net = nt.SequentialState(cell, nn.Linear(8, 3), nt.LICell())
    x = torch.rand(11, 2, 4) * 4
    params = [*net.parameters(), tau]
    state, out = None, []
    for x_t in x:
        y, state = net(x_t, state)
        out.append(y)
    want_grads = torch.autograd.grad(torch.stack(out).sum(), params)
    seq = sc.wrap(net, granularity="layer", chunk=4)
    got = seq(x)[0]
    assert [b.neuron for b in seq.last_stats.blocks] == ["per-step", "fused"]
    assert want_grads[-1].abs().sum() > 0
    for a, b in zip(want_grads, torch.autograd.grad(got.sum(), params), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * max(1.0, float(a.abs().max())))


@pytest.mark.parametrize("T", [1, 2, 8])
def test_a_recurrent_cells_autapse_hook_never_gets_none_from_the_stack(T: int) -> None:
    """``LSNNRecurrentCell`` (autapses off: Norse zeroes its recurrent gradient's diagonal in a
    tensor hook that cannot take None) in the stack granularity. At T = 1 the output does not
    reach the cell's weights (LSNN's membrane reads the old current): Norse's loop leaves
    their ``.grad`` None; autograd calls the hooks of a Function's input with None, and the
    hook crashed (``'NoneType' object has no attribute 'clone'``). Now ``.grad`` stays None
    as in the loop; from T = 2 the hook still runs (T = 8: the diagonal zero)."""
    torch.manual_seed(T)
    net = nt.SequentialState(nt.LSNNRecurrentCell(IN, N), nn.Linear(N, 3), nt.LICell())
    x = (torch.rand(T, 2, IN) < 0.5).float() * 30
    state, out = None, []
    for x_t in x:
        y, state = net(x_t, state)
        out.append(y)
    torch.stack(out).sum().backward()
    want = {name: p.grad for name, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    sc.wrap(net, granularity="stack")(x)[0].sum().backward()
    for name, p in net.named_parameters():
        if want[name] is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-6)
    weights = net[0].recurrent_weights
    assert (weights.grad is None) == (T == 1)
    if T == 8:
        assert weights.grad.abs().sum() > 0 and not weights.grad.diagonal().any()


@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_gradients_that_reach_nothing_stay_none_as_in_norses_loop(granularity: str) -> None:
    """A ``heaviside`` spike has no gradient, so Norse's loop leaves ``.grad`` of the layers
    below None (an optimizer skips them); layer-wise gave zeros (the fused kernel's backward),
    and AdamW's weight decay moved a layer the loop leaves alone. A ``CobaLIFCell``'s input
    gets no gradient in the loop: layer-wise returned a zero ``x.grad``."""

    def build(cell: nn.Module) -> nn.Module:
        torch.manual_seed(0)
        return nt.SequentialState(nn.Linear(8, 6), cell, nn.Linear(6, 5), nt.LICell())

    torch.manual_seed(5)
    x = torch.rand(20, 3, 8) * 3
    heaviside = nt.LIFParameters(method="heaviside")
    for cell in (nt.LIFCell(p=heaviside), nt.CobaLIFCell(6, 6)):
        loop, net = build(copy.deepcopy(cell)), build(copy.deepcopy(cell))
        x_loop, x_net = x.clone().requires_grad_(), x.clone().requires_grad_()
        norse_loop(loop, x_loop).sum().backward()
        sc.wrap(net, plan=Uniform(4), granularity=granularity)(x_net)[0].sum().backward()
        assert x_loop.grad is None and x_net.grad is None
        for (name, p), q in zip(loop.named_parameters(), net.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
        assert net[0].weight.grad is None


def test_scalar_parameter_rows_are_stacked_once_and_follow_their_values() -> None:
    # the compiled Norse loops read a (5, B*H) array of the parameters, made at every
    # chunk's forward, recomputation and backward (a LIFCell at T = 25 1.29x its loop's time)
    from spikeckpt.adapters import host_loops

    like = torch.zeros(3, 4)
    v_th = torch.tensor(0.5)
    first = host_loops._stacked(like.shape, like, 0.1, None, v_th)
    assert first is not None and first[2, 0] == np.float32(0.5) and not first[1].any()
    assert host_loops._stacked(like.shape, like, 0.1, None, v_th) is first  # kept
    v_th.fill_(0.7)  # the same tensor, another value: made anew
    again = host_loops._stacked(like.shape, like, 0.1, None, v_th)
    assert again is not first and again[2, 0] == np.float32(0.7)
    per_neuron = torch.linspace(0, 1, 4)  # not numbers: made at each call, as before
    a = host_loops._stacked(like.shape, like, per_neuron)
    assert a is not None and a is not host_loops._stacked(like.shape, like, per_neuron)
