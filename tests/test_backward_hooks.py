"""Backward hooks in a wrapped run: the plain loop's gradients and the plain loop's calls.

A tensor hook on a parameter (``p.register_hook``: a per-layer gradient scale, a clamp) runs
once per backward, on the whole gradient, as in the loop (the engine differentiates each
parameter once per segment, with respect to the sum so far: the hook ran on every partial sum
and on the whole again, 0.05x the loop's gradient after ``Uniform(4)``'s segments). A module's
backward hooks (``register_full_backward_hook``, ``..._pre_hook``, a global one) run once per
step with that step's gradients (layer-wise, the fused and untaped paths skipped them: a hook
scaling ``grad_output`` by 0.1 ran 0 times, the gradients 9x the loop's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from snn_loops import leaky_loop
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.plans import BPTT, Revolve, Uniform

snn = pytest.importorskip("snntorch")

T, B = 21, 3

OPTIONS: dict[str, dict[str, Any]] = {
    "BPTT": dict(plan=BPTT()),
    "Uniform(4)": dict(plan=Uniform(4)),
    "Revolve(3)": dict(plan=Revolve(3)),
    "layer": dict(granularity="layer", chunk=4),
    "layer-exact": dict(granularity="layer", chunk=4, exact=True),
    "layer-taped": dict(granularity="layer", chunk=4, fuse=False),  # autograd per chunk
}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 16), snn.Leaky(beta=0.9), nn.Linear(16, 4), snn.Leaky(beta=0.9)
    )


def _x() -> Tensor:
    return (torch.rand(T, B, 12, generator=torch.Generator().manual_seed(1)) < 0.3).float() * 2


def _grads(run: Callable[[nn.Sequential, Tensor], Tensor], hook: Callable[..., Any]) -> Any:
    """Run ``run(net, x)`` on a fresh net with ``hook(net, calls)`` installed; backpropagate a
    loss on the top membranes. Returns each parameter's ``.grad`` and the hook's calls."""
    net, calls = _net(), []
    with hook(net, calls):
        mem = run(net, _x())
        (mem.pow(2) * torch.arange(1, 5)).sum().backward()
    return [p.grad for p in net.parameters()], calls


def _loop(net: nn.Sequential, x: Tensor) -> Tensor:
    return leaky_loop(net, x)[1]


def _wrapped(options: dict[str, Any]) -> Callable[[nn.Sequential, Tensor], Tensor]:
    return lambda net, x: sc.wrap(net, output="mem", **options)(x)


def _assert_as_loop(hook: Callable[..., Any], options: dict[str, Any]) -> list[Any]:
    want, want_calls = _grads(_loop, hook)
    got, calls = _grads(_wrapped(options), hook)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=1e-6)
    assert len(calls) == len(want_calls), (len(calls), len(want_calls))
    assert sorted(calls) == sorted(want_calls)  # what each saw (autograd orders parameters)
    return calls


@contextmanager
def _scaled_weight(net: nn.Sequential, calls: list[Any]) -> Iterator[None]:
    """A per-layer learning-rate multiplier: the first weight's gradient scaled by 0.1."""

    def hook(g: Tensor) -> Tensor:
        calls.append(tuple(g.shape))
        return g * 0.1

    handle = net[0].weight.register_hook(hook)
    yield
    handle.remove()


@contextmanager
def _clamped_weights(net: nn.Sequential, calls: list[Any]) -> Iterator[None]:
    """Every weight's gradient clamped (not linear: a partial sum clamped differs)."""

    def hook(g: Tensor) -> Tensor:
        calls.append(tuple(g.shape))
        return g.clamp(-0.05, 0.05)

    handles = [net[i].weight.register_hook(hook) for i in (0, 2)]
    yield
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("hook", [_scaled_weight, _clamped_weights], ids=["scale", "clamp"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_parameter_s_tensor_hook_runs_once_on_the_whole_gradient(
    hook: Callable[..., Any], option: str
) -> None:
    calls = _assert_as_loop(hook, OPTIONS[option])
    assert calls and len(calls) <= 2  # once per hooked parameter


def _normalised(g: Tensor) -> Tensor:
    """A gradient divided by its norm over the batch: a batched call's norm differs."""
    return g / (g.norm() + 1e-3)


@contextmanager
def _full_hook(net: nn.Sequential, calls: list[Any], where: int = 2) -> Iterator[None]:
    def hook(module: nn.Module, g_in: Any, g_out: Any) -> Any:
        calls.append(tuple(g_out[0].shape))
        return tuple(None if g is None else _normalised(g) for g in g_in)

    handle = net[where].register_full_backward_hook(hook)
    yield
    handle.remove()


@contextmanager
def _pre_hook(net: nn.Sequential, calls: list[Any], where: int = 0) -> Iterator[None]:
    def hook(module: nn.Module, g_out: Any) -> Any:
        calls.append(tuple(g_out[0].shape))
        return tuple(None if g is None else _normalised(g) for g in g_out)

    handle = net[where].register_full_backward_pre_hook(hook)
    yield
    handle.remove()


@contextmanager
def _neuron_hook(net: nn.Sequential, calls: list[Any]) -> Iterator[None]:
    """A backward pre-hook on the first neuron (snnTorch's ``Leaky``), scaling its outputs'
    gradients."""

    def hook(module: nn.Module, g_out: Any) -> Any:
        calls.append(tuple(tuple(g.shape) for g in g_out if g is not None))
        return tuple(None if g is None else g * 0.5 for g in g_out)

    handle = net[1].register_full_backward_pre_hook(hook)
    yield
    handle.remove()


@contextmanager
def _global_hook(net: nn.Sequential, calls: list[Any]) -> Iterator[None]:
    """A global full backward hook: every module of every model (the top layer's only acts)."""
    top = net[2]

    def hook(module: nn.Module, g_in: Any, g_out: Any) -> Any:
        if isinstance(module, sc.CheckpointedSequence):
            return None  # the wrapped model's own call (the loop has none), once
        calls.append((type(module).__name__, [() if g is None else tuple(g.shape) for g in g_out]))
        if module is not top:
            return None
        return tuple(None if g is None else _normalised(g) for g in g_in)

    handle = nn.modules.module.register_module_full_backward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # torch's, the loop's too
@pytest.mark.parametrize(
    "hook",
    [_full_hook, _pre_hook, _neuron_hook, _global_hook],
    ids=["full", "pre", "neuron", "global"],
)
@pytest.mark.parametrize("option", ["Uniform(4)", "layer", "layer-exact"])
def test_a_module_s_backward_hooks_see_each_step_s_gradients(
    hook: Callable[..., Any], option: str
) -> None:
    calls = _assert_as_loop(hook, OPTIONS[option])
    assert len(calls) >= T


def test_a_hooked_synapse_runs_step_by_step_and_the_rest_stays_fused() -> None:
    """Layer-wise, only the block whose synapse has the hook is taped step by step; the
    other block keeps its fused neuron."""
    net = _net()
    calls: list[Any] = []
    with _full_hook(net, calls, where=2):
        seq = sc.wrap(net, output="mem", granularity="layer", chunk=4)
        seq(_x()).sum().backward()
    blocks = seq.last_stats.blocks
    assert blocks[0].untaped_chunks > 0 and blocks[1].untaped_chunks == 0, blocks
    assert len(calls) == T


@pytest.mark.parametrize("granularity", ["stack", "layer", "auto"])
def test_the_planner_s_probes_leave_tensor_hooks_alone(granularity: str) -> None:
    """``plan="auto"`` with a budget probes (and times) short runs on each new input shape,
    again when ``.grad`` is held: their gradients are not the user's, and a hook logging
    gradient norms ran on each (74 calls in a call of this net's stack plan, 11 layer-wise)."""
    net, calls = _net(), []
    net[0].weight.register_hook(lambda g: calls.append(tuple(g.shape)))
    seq = sc.wrap(net, plan="auto", budget="64KiB", storage="disk", granularity=granularity)
    x = (torch.rand(40, 3, 12, generator=torch.Generator().manual_seed(1)) < 0.3).float()
    for held in (False, True):  # planned with .grad None, then again with it held
        seq(x).sum().backward()
        assert calls == [(16, 12)] * (1 + held)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("option", ["Uniform(4)", "layer", "layer-taped"])
def test_norse_cells_see_the_loop_s_backward_hooks(option: str) -> None:
    """Norse's ``SequentialState(Linear, LIFCell, Linear, LICell)`` with a tensor hook on the
    first weight and a full backward hook normalising the second ``Linear``'s input gradient:
    the gradients and calls of Norse's own loop."""
    norse = pytest.importorskip("norse.torch")
    from norse_cells import norse_loop

    x = _x()

    def run(wrapped: bool) -> tuple[list[Tensor], list[Any]]:
        torch.manual_seed(0)
        net = norse.SequentialState(
            nn.Linear(12, 16), norse.LIFCell(), nn.Linear(16, 4), norse.LICell()
        )
        calls: list[Any] = []
        net[0].weight.register_hook(lambda g: (calls.append(tuple(g.shape)), g * 0.1)[1])
        with _full_hook(net, calls, where=2):
            out = sc.wrap(net, **OPTIONS[option])(x)[0] if wrapped else norse_loop(net, x)
            (out.pow(2) * torch.arange(1, 5)).sum().backward()
        return [p.grad for p in net.parameters()], calls

    (want, want_calls), (got, calls) = run(False), run(True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=1e-6)
    assert sorted(calls) == sorted(want_calls) and len(calls) == T + 1
