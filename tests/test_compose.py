"""A wrapped model under the PyTorch features users combine it with: the plain loop's
gradients, or a clear spikeckpt error naming the way forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import spikeckpt as sc
from spikeckpt.plans import BPTT, Revolve, Uniform

snn = pytest.importorskip("snntorch")

T, B = 10, 3


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8), snn.Leaky(0.9, learn_beta=True), nn.Linear(8, 3), snn.Leaky(0.8)
    )


def spikes() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.rand(T, B, 5, generator=g) < 0.4).float()


def loop(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    fc1, lif1, fc2, lif2 = model
    mem1, mem2, out = lif1.init_leaky(), lif2.init_leaky(), []
    for t in range(x.shape[0]):
        spk1, mem1 = lif1(fc1(x[t]), mem1)
        spk2, mem2 = lif2(fc2(spk1), mem2)
        out.append(mem2)
    return torch.stack(out)


def loss(y: torch.Tensor) -> torch.Tensor:
    return (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum()


def test_functional_call_recomputes_with_the_parameters_of_the_call() -> None:
    # functional_call swaps its tensors in for the forward call only; the backward phase
    # recomputed with the module's own (gradients silently wrong before)
    model, other, x = net(), net(), spikes()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.2)
    seq = sc.wrap(model, plan=Revolve(2), output="mem")
    names = [k for k, _ in seq.named_parameters()]
    params = {
        k: p.detach().clone().requires_grad_()
        for k, p in zip(names, other.parameters(), strict=True)
    }
    loss(torch.func.functional_call(seq, params, (x,))).backward()
    loss(loop(other, x)).backward()
    for (name, p), q in zip(params.items(), other.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert all(p.grad is None for p in model.parameters())


def test_functional_call_layerwise_is_refused_naming_the_way() -> None:
    seq = sc.wrap(net(), plan=Uniform(5), granularity="layer")
    params = {k: p.detach().clone().requires_grad_() for k, p in seq.named_parameters()}
    with pytest.raises(sc.ConfigError, match="functional_call.*granularity='stack'"):
        torch.func.functional_call(seq, params, (spikes(),))


def test_functional_call_granularity_auto_runs_the_stack_and_leaves_the_model_usable() -> None:
    # "auto" weighed layer-wise under the swap (a misleading UnlistedParamsError), and the
    # blocks it built there held the call's tensors: the model's next plain call was refused
    model, other, x = net(), net(), spikes()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.2)
    seq = sc.wrap(model, plan=Uniform(5), granularity="auto", output="mem")
    names = [k for k, _ in seq.named_parameters()]
    params = {
        k: p.detach().clone().requires_grad_()
        for k, p in zip(names, other.parameters(), strict=True)
    }
    loss(torch.func.functional_call(seq, params, (x,))).backward()
    assert seq.last_decision is not None and seq.last_decision.granularity == "stack"
    loss(loop(other, x)).backward()
    for (name, p), q in zip(params.items(), other.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    loss(seq(x)).backward()  # the model's own parameters again
    reference = net()
    loss(loop(reference, x)).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_batched_grad_outputs_are_refused_naming_the_way(granularity: str) -> None:
    # autograd.grad(..., is_grads_batched=True) runs the backward under vmap: torch's raw
    # "vmap: aten::copy_ is not possible" before
    x = spikes().requires_grad_()
    y = sc.wrap(net(), plan=Uniform(5), granularity=granularity)(x).sum(dim=(0, 2))
    with pytest.raises(sc.UsageError, match="is_grads_batched=True.*one row"):
        torch.autograd.grad(y, x, torch.eye(B), is_grads_batched=True)


def test_torch_func_transforms_are_refused_clearly() -> None:
    seq = sc.wrap(net(), plan=Uniform(5))
    params = {k: p.detach() for k, p in seq.named_parameters()}

    def f(ps: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(seq, ps, (spikes(),)).sum()

    with pytest.raises(sc.UsageError, match=r"torch\.func transforms.*loss\.backward"):
        torch.func.grad(f)(params)


def test_a_second_backward_names_retain_graph_and_jacobian() -> None:
    y = sc.wrap(net(), plan=Uniform(5))(spikes()).sum()
    y.backward(retain_graph=True)
    with pytest.raises(sc.UsageError, match="retain_graph=True.*jacobian"):
        y.backward()


def test_spectral_norm_in_training_mode_is_refused_and_exact_in_eval_mode() -> None:
    model, x = net(), spikes()
    parametrizations.spectral_norm(model[0])
    seq = sc.wrap(model, plan=Revolve(2), output="mem")
    # each weight access updates u, v: recomputed steps used others (1.5e-5 off before)
    with pytest.raises(sc.UnsupportedLayerError, match="spectral_norm.*eval mode"):
        seq(x)
    model[0].parametrizations.weight[0].eval()
    loss(loop(model, x)).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss(seq(x)).backward()
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_parametrize_cached_around_the_call_keeps_every_gradient() -> None:
    # a weight cached outside the run is no input of its Function: the taped steps'
    # gradients never reached weight_norm's parameters (0.18 off before, None with BPTT);
    # and a backward inside cached() reused one recomputed segment's weight in the next
    # (g, v gradients 12.5 off with output="mem"): the recomputation is uncached too
    plain, model, x = net(), net(), spikes()
    for m in (plain, model):
        parametrizations.weight_norm(m[0])
    with parametrize.cached():
        loss(loop(plain, x)).backward()
    seq = sc.wrap(model, plan=Revolve(2), output="mem")
    with parametrize.cached():
        loss(seq(x)).backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_wrapping_a_compiled_model_names_the_way() -> None:
    # torch.compile(model) is lazy (nothing compiles here); its wrapper is not a layer
    with pytest.raises(sc.errors.UnsupportedLayerError, match="compile=True"):
        sc.wrap(torch.compile(net()))


class _SoftLIF(nn.Module):
    """A smooth neuron of yours (``forward(x, state) -> (y, state)``): forward-mode AD runs
    through its plain loop."""

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None) -> Any:
        v = x if state is None else 0.9 * state + x
        return torch.sigmoid(4 * (v - 1)), v


@pytest.mark.parametrize("plan", [BPTT(), Uniform(3)])
def test_forward_mode_ad_is_refused_clearly(plan: Any) -> None:
    """Dual numbers (``torch.autograd.forward_ad``) reach the run's Function, which has no
    forward-mode rule: a `UsageError` naming the way (was torch's NotImplementedError)."""
    import torch.autograd.forward_ad as fwad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), _SoftLIF())
    x = torch.rand(T, B, 5)
    with fwad.dual_level(), pytest.raises(sc.UsageError, match="loss.backward"):
        sc.wrap(model, plan=plan)(fwad.make_dual(x, torch.ones_like(x)))


def test_parameters_assigned_after_wrapping_layerwise_name_load_state_dict_without_assign() -> None:
    """``load_state_dict(sd, assign=True)`` right after wrapping (no call yet) was refused
    saying a parameter was "replaced after the first forward"; the blocks are built when
    wrapping. The refusal names assign=True, and the way it gives (without assign) runs as
    the loop does."""
    trained, x = net(), spikes()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.2)
    saved = {k: v.clone() for k, v in trained.state_dict().items()}
    seq = sc.wrap(net(), plan=Uniform(5), granularity="layer")
    seq.load_state_dict(saved, assign=True)
    with pytest.raises(sc.ConfigError, match=r"assign=True.*load_state_dict without assign=True"):
        seq(x)
    model = net()
    seq = sc.wrap(model, plan=Uniform(5), granularity="layer", output="mem")
    seq.load_state_dict(saved)
    loss(seq(x)).backward()
    loss(loop(trained, x)).backward()
    for p, q in zip(model.parameters(), trained.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
