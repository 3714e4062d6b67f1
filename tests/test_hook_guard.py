"""Forward hooks in a wrapped run (`spikeckpt.engine.hook_guard`): a loss built from what a
hook saw raises `UsageError` naming the layer (before: no gradient from it layer-wise,
silently, or torch's "backward through the graph a second time" with stack plans); hooks that
only watch see the loop's values and change no gradient."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt.plans import BPTT, Uniform

snn = pytest.importorskip("snntorch")

T, B = 9, 3
ROUTES: dict[str, dict[str, Any]] = {
    "bptt": {"plan": BPTT()},
    "uniform": {"plan": Uniform(2)},
    "auto": {},
    "layer": {"granularity": "layer", "plan": Uniform(4)},
}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 10), snn.Leaky(beta=0.9), nn.Linear(10, 4))
    net.append(snn.Leaky(beta=0.9))
    with torch.no_grad():
        net[0].weight.mul_(3)  # every layer spikes
    return net


def _input() -> Tensor:
    torch.manual_seed(1)
    return (torch.rand(T, B, 12) < 0.4).float()


def _loop(net: nn.Sequential, x: Tensor) -> Tensor:
    m1, m2, out = net[1].init_leaky(), net[3].init_leaky(), []
    for t in range(x.shape[0]):
        s1, m1 = net[1](net[0](x[t]), m1)
        s2, m2 = net[3](net[2](s1), m2)
        out.append(s2)
    return torch.stack(out)


def _record(net: nn.Sequential, where: str) -> list[Tensor]:
    """A hook on the hidden neuron's output (``"output"``) or the second ``Linear``'s input
    (``"input"``) that keeps the tensors it sees."""
    seen: list[Tensor] = []
    if where == "output":
        net[1].register_forward_hook(lambda m, args, out: seen.append(out[0]))
    else:
        net[2].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    return seen


@pytest.mark.parametrize("where", ["output", "input"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_loss_built_from_hooked_tensors_raises_naming_the_layer(route: str, where: str) -> None:
    net = _net()
    seen = _record(net, where)
    out = sc.wrap(net, **ROUTES[route])(_input())
    loss = out.sum() + 0.1 * sum(s.sum() for s in seen)  # a spike-count regulariser
    layer = re.escape("'1' (snntorch" if where == "output" else "'2' (torch.nn")
    with pytest.raises(sc.UsageError, match=f"forward hook of layer {layer}.*output='both'"):
        loss.backward()


def test_a_loss_from_the_taped_steps_hooked_tensors_names_hooks_under_bptt() -> None:
    """The last ``T`` records only (the shape probe's left out) are ``BPTT()``'s taped steps:
    the engine has backpropagated their graph when the loss's path reaches it; the message
    names the forward hook first (it named init_hidden and ``self.x`` alone, and BPTT())."""
    net = _net()
    seen = _record(net, "output")
    out = sc.wrap(net, plan=BPTT())(_input())
    loss = out.sum() + 0.1 * torch.stack(seen[-T:]).sum()
    with pytest.raises(sc.UsageError, match="the loss uses a tensor a forward hook kept"):
        loss.backward()


@pytest.mark.parametrize("route", list(ROUTES))
def test_watching_hooks_see_the_loops_values_and_change_no_gradient(route: str) -> None:
    x = _input()
    plain = _net()
    _loop(plain, x).sum().backward()
    ref = [p.grad.clone() for p in plain.parameters()]
    with torch.no_grad():
        spikes = torch.stack(_hidden_spikes(plain, x))

    net = _net()
    seen = _record(net, "output")
    out = sc.wrap(net, **ROUTES[route])(x)
    forward_pass = seen[:]  # the backward pass calls the hook again on recomputed steps
    out.sum().backward()
    assert torch.equal(torch.stack([s.detach() for s in forward_pass[-T:]]), spikes)
    assert all(s.requires_grad for s in forward_pass)  # as the loop's: a loss from them raises
    for p, g in zip(net.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    assert len(net[1]._forward_hooks) == 1  # the guard's own hooks are gone


def _hidden_spikes(net: nn.Sequential, x: Tensor) -> list[Tensor]:
    m1, out = net[1].init_leaky(), []
    for t in range(x.shape[0]):
        s1, m1 = net[1](net[0](x[t]), m1)
        out.append(s1)
    return out


def test_without_grad_hooks_see_the_layers_own_tensors() -> None:
    net = _net()
    seen = _record(net, "output")
    with torch.no_grad():
        sc.wrap(net, plan=BPTT())(_input())
    assert seen and all(s.grad_fn is None and not s.requires_grad for s in seen)


def test_a_hook_that_raises_leaves_no_guard_behind() -> None:
    net = _net()
    calls: list[int] = []

    def fails_at_the_third_step(m: nn.Module, args: Any, out: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the user's hook failed")

    net[1].register_forward_hook(fails_at_the_third_step)
    with pytest.raises(RuntimeError, match="the user's hook failed"):
        sc.wrap(net, plan=Uniform(2))(_input())
    assert len(net[1]._forward_hooks) == 1 and not net[1]._forward_pre_hooks


def test_a_hook_that_replaces_the_output_keeps_the_loops_gradients() -> None:
    """A hook returning a new output built from the tensors it saw makes them part of the
    model: their gradients flow, as in the loop (taped with ``BPTT()``)."""
    x = _input()
    plain = _net()
    plain[1].register_forward_hook(lambda m, args, out: (out[0] * 0.5, out[1]))
    ref_out = _loop(plain, x)
    ref_out.sum().backward()
    net = _net()
    net[1].register_forward_hook(lambda m, args, out: (out[0] * 0.5, out[1]))
    out = sc.wrap(net, plan=BPTT())(x)
    out.sum().backward()
    assert torch.equal(out, ref_out)
    for p, q in zip(net.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_a_frozen_model_gets_no_aliases() -> None:
    """No parameter requires grad: the loop's tensors carry no gradient, nor do the hooks'."""
    net = _net().requires_grad_(False)
    seen = _record(net, "output")
    sc.wrap(net, plan=BPTT())(_input())
    assert seen and not any(s.requires_grad for s in seen)


def test_a_norse_cells_hooked_spikes_in_a_loss_raise() -> None:
    nt = pytest.importorskip("norse.torch")
    torch.manual_seed(0)
    model = nt.SequentialState(nn.Linear(12, 10), nt.LIFCell(), nn.Linear(10, 4), nt.LICell())
    seen: list[Tensor] = []
    model[1].register_forward_hook(lambda m, args, out: seen.append(out[0]))
    out, _ = sc.wrap(model, plan=Uniform(3))(_input() * 5)
    with pytest.raises(sc.UsageError, match=re.escape("layer '1' (norse.torch")):
        (out.sum() + sum(s.sum() for s in seen)).backward()


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_hook_that_changes_the_output_in_place_runs_as_in_the_loop(route: str) -> None:
    """An in-place change in a hook reaches the layer's tensor (the aliases share its
    memory); a view made by an autograd Function refused it (before this was built so)."""
    x = _input()
    plain = _net()
    plain[0].register_forward_hook(lambda m, args, out: out.mul_(0.5))
    ref_out = _loop(plain, x)
    ref_out.sum().backward()
    net = _net()
    net[0].register_forward_hook(lambda m, args, out: out.mul_(0.5))
    out = sc.wrap(net, **ROUTES[route])(x)
    out.sum().backward()
    assert torch.equal(out, ref_out)
    for p, q in zip(net.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
