"""A wrapped model changed between calls, as users change one (replaced or appended layers, a
neuron's options, eval then train, copies): the next call runs the model as it is now, with
the plain loop's outputs and gradients, not what spikeckpt made from it at the first call."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import Tensor, nn
from zoo_common import compare, run

import spikeckpt as sc
from spikeckpt.plans import Uniform

snn = pytest.importorskip("snntorch")
surrogate = pytest.importorskip("snntorch.surrogate")
snn_utils = pytest.importorskip("snntorch.utils")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    nt = pytest.importorskip("norse.torch")

GRANULARITIES = ["stack", "layer"]


def x_in() -> Tensor:
    """Input spikes ``(T=9, B=4, 5)``."""
    g = torch.Generator().manual_seed(3)
    return (torch.rand(9, 4, 5, generator=g) < 0.5).float()


def leaky_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8),
        snn.Leaky(beta=0.9, init_hidden=True),
        nn.Linear(8, 3),
        snn.Leaky(beta=0.8, init_hidden=True),
    )


def loop(net: nn.Module, x: Tensor) -> Tensor:
    """snnTorch's plain loop over ``x (T, B, ...)``."""
    snn_utils.reset(net)
    return torch.stack([net(x_t) for x_t in x])


def through(seq: sc.CheckpointedSequence):
    return lambda model, x: seq(x)


def atan_spike(u: Tensor) -> Tensor:
    """snnTorch's ATan surrogate as a module-level function (picklable, unlike
    ``surrogate.atan()``'s closure)."""
    return surrogate.ATan.apply(u, 2.0)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_layers_replaced_and_appended_after_a_call_are_run(granularity: str) -> None:
    net, x = leaky_net(), x_in()
    seq = sc.wrap(net, plan=Uniform(3), granularity=granularity)
    run(through(seq), net, x)
    net[1] = snn.Leaky(beta=0.5, threshold=0.3, init_hidden=True)  # was beta 0.9, threshold 1
    net.append(nn.Linear(3, 2))
    net.append(snn.Leaky(beta=0.7, threshold=0.2, init_hidden=True))
    got = run(through(seq), net, x)
    assert got.outputs[0].shape == (9, 4, 2)  # was the old net's (9, 4, 3), its old values
    compare(run(loop, copy.deepcopy(net), x), got)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_a_surrogate_set_after_a_call_gives_its_gradients(granularity: str) -> None:
    net, x = leaky_net(), x_in()
    seq = sc.wrap(net, plan=Uniform(3), granularity=granularity)
    run(through(seq), net, x)
    for lif in (net[1], net[3]):  # fine-tuning with another surrogate
        lif.spike_grad = surrogate.fast_sigmoid(slope=5)
    compare(run(loop, copy.deepcopy(net), x), run(through(seq), net, x))


def test_dropout_in_eval_mode_when_wrapped_draws_once_trained() -> None:
    """Blocks made while the model was in eval mode (validated first): the Dropout's masks of
    the training run are replayed in the recomputation (they were not: other masks, wrong
    gradients)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.3), snn.Leaky(beta=0.9, init_hidden=True))
    net.eval()
    x = x_in()
    seq = sc.wrap(net, plan=Uniform(3), granularity="layer")
    with torch.no_grad():
        seq(x)
    net.train()
    compare(run(loop, copy.deepcopy(net), x), run(through(seq), net, x))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_after_a_layerwise_call_steps_its_own_modules(how: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(5, 8),
        snn.Leaky(beta=0.9, init_hidden=True, spike_grad=atan_spike),
        nn.Linear(8, 3),
        snn.Leaky(beta=0.8, init_hidden=True, spike_grad=atan_spike),
    )
    x = x_in()
    seq = sc.wrap(net, plan=Uniform(3), granularity="layer")
    run(through(seq), net, x)
    twin = copy.deepcopy(seq) if how == "deepcopy" else pickle.loads(pickle.dumps(seq))
    with torch.no_grad():  # a training step on the copy alone
        for p in twin.parameters():
            p.mul_(1.5)
    compare(run(loop, copy.deepcopy(twin.module), x), run(through(twin), twin.module, x))
    compare(run(loop, copy.deepcopy(net), x), run(through(seq), net, x))


def test_norse_parameters_reassigned_after_a_call_are_used() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nt.LIFCell(), nn.Linear(8, 3), nt.LICell())
    x = x_in() * 4

    def norse_loop(model: nn.Module, x: Tensor) -> Tensor:
        s1 = s3 = None
        out = []
        for x_t in x:
            z, s1 = model[1](model[0](x_t), s1)
            v, s3 = model[3](model[2](z), s3)
            out.append(v)
        return torch.stack(out)

    seq = sc.wrap(net, plan=Uniform(3), granularity="layer", output="spikes")
    run(through(seq), net, x)
    net[1].p = nt.LIFParameters(v_th=torch.tensor(0.1), tau_mem_inv=torch.tensor(50.0))
    net[3] = nt.LICell(p=nt.LIParameters(tau_mem_inv=torch.tensor(20.0)))
    compare(run(norse_loop, copy.deepcopy(net), x), run(through(seq), net, x))


def test_output_mem_refused_when_the_last_neuron_was_replaced_by_a_layer() -> None:
    net, x = leaky_net(), x_in()
    seq = sc.wrap(net, plan=Uniform(3), output="mem")
    seq(x)
    net[3] = nn.ReLU()
    with pytest.raises(sc.errors.ConfigError, match="output='mem'.*wrap it again"):
        seq(x)


def call_loop(net: nn.Module, x: Tensor) -> Tensor | tuple[Tensor, ...]:
    """snnTorch's plain loop, each of the net's outputs stacked (``spk, mem = net(x_t)``)."""
    snn_utils.reset(net)
    outs = [net(x_t) for x_t in x]
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(list(field)) for field in zip(*outs, strict=True))
    return torch.stack(outs)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_the_outputs_follow_the_last_neurons_output_option_set_after_a_call(
    granularity: str,
) -> None:
    """``wrap(net)`` (``output=None``) returns what the net's call returns: once the last
    neuron is replaced by one with ``output=True``, ``spk, mem``, as a fresh wrap does (it
    kept returning the spikes alone); and the spikes again once ``output`` is unset."""
    net, x = leaky_net(), x_in()
    seq = sc.wrap(net, plan=Uniform(3), granularity=granularity)
    assert isinstance(seq(x), Tensor)
    net[3] = snn.Leaky(beta=0.8, init_hidden=True, output=True)
    got = run(through(seq), net, x)
    assert len(got.outputs) == 2  # spk, mem
    compare(run(call_loop, copy.deepcopy(net), x), got)
    net[3].output = False
    got = run(through(seq), net, x)
    assert len(got.outputs) == 1
    compare(run(call_loop, copy.deepcopy(net), x), got)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_a_graded_spikes_factor_written_through_data_scales_the_spikes(granularity: str) -> None:
    """``.data`` writes keep the tensor's version counter: the factor is read again at each
    forward (it was taken as 1.0 from the first call: the spikes unscaled)."""
    net, x = leaky_net(), x_in()
    seq = sc.wrap(net, plan=Uniform(3), granularity=granularity)
    run(through(seq), net, x)
    net[3].graded_spikes_factor.data.fill_(0.5)
    got = run(through(seq), net, x)
    assert got.outputs[0].max() == 0.5
    compare(run(loop, copy.deepcopy(net), x), got)


def norse_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nt.LIFCell(),
        nn.Linear(32, 32),
        nt.LIFCell(),
        nn.Linear(32, 4),
        nt.LIFCell(),
    )


def _plan_of(seq: sc.CheckpointedSequence, x: Tensor) -> str:
    seq.zero_grad()  # a training step's: a `.grad` held from before counts in the step
    seq(x).sum().backward()
    assert seq.last_stats is not None
    return str(seq.last_stats.plan)


@pytest.mark.usefixtures("quiet_costs")  # the two wraps measure apart: noise chose apart
def test_a_budgeted_plan_is_chosen_again_once_frozen_layers_are_thawed() -> None:
    """Fine-tuning: a plan chosen while layers were frozen (fewer gradients) is not kept once
    they are thawed; it is the plan a fresh wrap chooses."""
    x = (torch.rand(60, 4, 16, generator=torch.Generator().manual_seed(0)) < 0.1).float()
    net = norse_stack()
    for p in net[:2].parameters():
        p.requires_grad_(False)
    seq = sc.wrap(net, plan="auto", budget="72KiB")
    frozen = _plan_of(seq, x)
    for p in net.parameters():
        p.requires_grad_(True)
    thawed = _plan_of(seq, x)
    assert thawed == _plan_of(sc.wrap(copy.deepcopy(net), plan="auto", budget="72KiB"), x)
    assert thawed != frozen


def test_a_budgeted_plan_is_checked_again_after_double() -> None:
    x = (torch.rand(60, 4, 16, generator=torch.Generator().manual_seed(0)) < 0.1).float()
    net = norse_stack()
    seq = sc.wrap(net, plan="auto", budget="72KiB")
    _plan_of(seq, x)
    net.double()
    with pytest.raises(sc.BudgetTooSmall, match="the smallest budget that fits"):
        seq(x.double())


@pytest.mark.parametrize("how", ["requires_grad_", "Parameter"])
def test_a_decay_made_learnable_after_a_layerwise_call_gets_its_gradient(how: str) -> None:
    """``lif.beta`` (a buffer) made to require grad after the blocks were made: they are made
    again with it among their parameters (was refused: a swapped parameter, or one unlisted)."""
    net, x = leaky_net(), x_in()
    seq = sc.wrap(net, plan=Uniform(3), granularity="layer")
    run(through(seq), net, x)
    if how == "Parameter":
        net[1].beta = nn.Parameter(net[1].beta.detach().clone())
    else:
        net[1].beta.requires_grad_(True)
    compare(run(loop, copy.deepcopy(net), x), run(through(seq), net, x))
    assert net[1].beta.grad is not None and net[1].beta.grad.abs().sum() > 0


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_the_plain_loop_between_calls_is_no_change(granularity: str) -> None:
    """The model's own loop run between wrapped calls (a baseline, an evaluation) leaves
    snnTorch's ``init_hidden`` buffers holding its graph: no change to the model. Counted as
    one, every wrapped call after a plain one made its adapter again and planned again (1.0 s
    of probes inside each timed call of an RLeaky model on an H200, 2.14x the loop instead
    of 0.46x)."""
    net, x = leaky_net(), x_in()
    seq = sc.wrap(net, budget="1GiB", granularity=granularity)
    run(through(seq), net, x)
    adapter, planner = seq.adapter, seq._own_planner().budgeted
    assert planner is not None and planner.probes > 0
    probes = planner.probes
    for _ in range(2):
        ref = run(loop, net, x)
        assert net[1].mem.requires_grad and not net[1].mem.is_leaf  # the loop's graph
        compare(ref, run(through(seq), net, x))
    assert seq.adapter is adapter
    assert seq._own_planner().budgeted is planner and planner.probes == probes
