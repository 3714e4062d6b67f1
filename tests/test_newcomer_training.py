"""A newcomer's second hour, round 3: an snnTorch user training their own model for real, each
against the plain snnTorch loop: batches in a row with optimizer steps (the last one smaller, T
changing, train/eval toggled, inference under ``no_grad`` and ``inference_mode``),
``snntorch.functional`` losses and metrics on the wrapped output with ``spikegen`` inputs and
gradient clipping, and a state carried into a batch of another size. (``torch.compile``
around the wrapped model: tests/test_outer_compile.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import spikeckpt as sc

snn = pytest.importorskip("snntorch")
SF = pytest.importorskip("snntorch.functional")
spikegen = pytest.importorskip("snntorch.spikegen")
utils = pytest.importorskip("snntorch.utils")

C, H, K = 12, 16, 4
PLANS = [sc.plans.Uniform(3), sc.plans.Revolve(2)]


def _net(dropout: float = 0.0) -> nn.Sequential:
    """Tutorial 6's shape: ``init_hidden=True`` neurons, the last with ``output=True``."""
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(C, H),
        snn.Leaky(0.9, init_hidden=True, learn_beta=True),
        nn.Dropout(dropout),
        nn.Linear(H, K),
        snn.Leaky(0.8, init_hidden=True, output=True),
    )


def _loop(net: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """The tutorials' loop: ``utils.reset``, one call per step, ``spk, mem`` stacked."""
    utils.reset(net)
    spk, mem = zip(*(net(x[t]) for t in range(x.shape[0])), strict=True)
    return torch.stack(spk), torch.stack(mem)


def _wrap(net: nn.Module, plan: object, granularity: str) -> sc.CheckpointedSequence:
    return sc.wrap(net, plan=plan, granularity=granularity, exact=granularity == "layer")


def _assert_grads(ref: nn.Module, seq: nn.Module) -> None:
    for (name, p), q in zip(ref.named_parameters(), seq.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("plan", PLANS, ids=repr)
def test_batches_in_a_row_with_optimizer_steps(plan: object, granularity: str) -> None:
    """Adam steps between batches whose T and batch size change (the last batch smaller, one
    step alone), Dropout replayed, one batch in eval mode; then inference in both modes under
    ``no_grad`` and ``inference_mode``: spikes and membranes bitwise, gradients and the
    parameters after each step at round-off."""
    ref, seq = _net(0.2), _wrap(_net(0.2), plan, granularity)
    opt_ref = torch.optim.Adam(ref.parameters(), 1e-2)
    opt = torch.optim.Adam(seq.parameters(), 1e-2)
    torch.manual_seed(0)
    for i, (steps, batch, train) in enumerate(
        [(9, 8, 1), (13, 8, 1), (9, 8, 0), (5, 3, 1), (1, 2, 1)]
    ):
        x = (torch.rand(steps, batch, C) < 0.4).float()
        ref.train(bool(train))
        seq.train(bool(train))
        torch.manual_seed(100 + i)
        spk_ref, mem_ref = _loop(ref, x)
        torch.manual_seed(100 + i)
        spk, mem = seq(x)
        assert torch.equal(spk, spk_ref) and torch.equal(mem, mem_ref)
        for optimizer, (s, m) in ((opt_ref, (spk_ref, mem_ref)), (opt, (spk, mem))):
            optimizer.zero_grad()
            ((m**2).mean() + 0.01 * s.sum()).backward()
            optimizer.step()
        _assert_grads(ref, seq)
        for p, q in zip(ref.parameters(), seq.parameters(), strict=True):
            torch.testing.assert_close(q, p)
        seq.load_state_dict(ref.state_dict())  # round-off must not accumulate over steps
    x = (torch.rand(7, 3, C) < 0.4).float()
    for context in (torch.no_grad, torch.inference_mode):
        for train in (False, True):
            ref.train(train)
            seq.train(train)
            with context():
                torch.manual_seed(5)
                expected = _loop(ref, x)
                torch.manual_seed(5)
                got = seq(x)
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


LOSSES = {
    "ce_rate": lambda spk, mem, y: SF.ce_rate_loss()(spk, y),
    "mse_count": lambda spk, mem, y: SF.mse_count_loss(correct_rate=0.8, incorrect_rate=0.2)(
        spk, y
    ),
    "ce_count": lambda spk, mem, y: SF.ce_count_loss()(spk, y),
    "mse_membrane": lambda spk, mem, y: SF.mse_membrane_loss(on_target=1.0, off_target=0.0)(mem, y),
}


@pytest.mark.parametrize("granularity", ["stack", "layer"])
@pytest.mark.parametrize("encoding", ["rate", "latency"])
def test_snntorch_functional_losses_on_the_wrapped_output(granularity: str, encoding: str) -> None:
    """Tutorial 5/6's training step: ``spikegen`` input, an ``SF`` loss on ``spk_rec`` (or
    ``mem_rec``), ``clip_grad_norm_``, ``SF.accuracy_rate``: as the loop's."""
    torch.manual_seed(0)
    img, y = torch.rand(6, C), torch.randint(0, K, (6,))
    if encoding == "rate":
        x = spikegen.rate(img, num_steps=12)
    else:
        x = spikegen.latency(img, num_steps=12, normalize=True, linear=True)
    for name, loss_fn in LOSSES.items():
        ref, seq = _net(), _wrap(_net(), PLANS[0], granularity)
        spk_ref, mem_ref = _loop(ref, x)
        loss_fn(spk_ref, mem_ref, y).backward()
        norm_ref = nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        spk, mem = seq(x)
        loss_fn(spk, mem, y).backward()
        norm = nn.utils.clip_grad_norm_(seq.parameters(), 0.1)
        assert torch.equal(spk, spk_ref) and torch.equal(mem, mem_ref), name
        torch.testing.assert_close(norm, norm_ref, msg=name)
        _assert_grads(ref, seq)
        assert SF.accuracy_rate(spk, y) == SF.accuracy_rate(spk_ref, y)


@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_a_state_of_another_batch_is_refused_naming_the_layer(granularity: str) -> None:
    """A previous batch's final state carried into a smaller last batch: snnTorch's own call
    silently restarts a state whose shape is not the input's from zeros. Layer-wise ran so,
    silently; the stack refused it as "step 0 changed state[1].mem". Now both refuse it,
    naming the layer and the batches; a state of the same batch goes on as the loop does."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(C, H), snn.Leaky(0.9), nn.Linear(H, K), snn.Synaptic(0.7, 0.8))
    seq = _wrap(net, PLANS[0], granularity)
    x = (torch.rand(8, 4, C) < 0.4).float()
    _, state = seq(x[:4], return_state=True)
    with pytest.raises(sc.ConfigError, match=r"layer 1 \(Leaky\).*batch of 4.*batch of 2"):
        seq(x[4:, :2], state=state)
    ys = seq(x[4:], state=state)  # the same batch: as the loop going on
    fc1, lif1, fc2, lif2 = net
    mem1, (syn2, mem2) = lif1.init_leaky(), lif2.init_synaptic()
    spikes = []
    for t in range(8):
        spk1, mem1 = lif1(fc1(x[t]), mem1)
        spk2, syn2, mem2 = lif2(fc2(spk1), syn2, mem2)
        spikes.append(spk2)
    assert torch.equal(ys, torch.stack(spikes[4:]))


@pytest.mark.parametrize("shape", [(H,), (4, 1)], ids=["unbatched", "one neuron"])
@pytest.mark.parametrize("granularity", ["stack", "layer"])
def test_a_state_of_another_shape_is_refused_naming_the_layer(
    granularity: str, shape: tuple[int, ...]
) -> None:
    """A membrane of one neuron's start for the whole batch, ``(H,)``, or ``(B, 1)``: snnTorch
    restarts it from zeros. Layer-wise ran so, silently; the stack refused it blaming the
    input's layout (batch-first)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(C, H), snn.Leaky(0.9), nn.Linear(H, K), snn.Leaky(0.9))
    seq = _wrap(net, PLANS[0], granularity)
    x = (torch.rand(8, 4, C) < 0.4).float()
    _, state = seq(x, return_state=True)
    given = (*state[:1], type(state[1])(torch.full(shape, 0.7)), *state[2:])
    with pytest.raises(sc.ConfigError, match=r"layer 1 \(Leaky\): its mem is .*expand\(4, 16\)"):
        seq(x, state=given)
