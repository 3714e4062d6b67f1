"""``spikeckpt.models``: the reference LIF stack and its ``nn.Sequential`` form."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import spikeckpt as sc
from spikeckpt.models import LIFNeuron, LIFStack, spike_train
from spikeckpt.plans import BPTT, Double, Uniform


def _model(widths: list[int], seed: int = 0) -> LIFStack:
    torch.manual_seed(seed)
    model = LIFStack(widths)
    with torch.no_grad():
        for synapse in model.synapses:
            synapse.weight.mul_(4.0)
    return model


def _grads(model: LIFStack) -> list[Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


def test_sequential_form_shares_parameters_and_loops_bitwise() -> None:
    model = _model([12, 9, 5])
    seq = model.as_sequential()
    assert [type(m) for m in seq] == [torch.nn.Linear, LIFNeuron] * 2
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}
    x = spike_train(23, 3, 12, 0.3, seed=2)
    expected = model(x)
    expected.square().sum().backward()
    reference = _grads(model)
    wrapped = sc.wrap(seq, plan=BPTT())
    y = wrapped(x)
    y.square().sum().backward()
    assert y.sum() > 0
    assert torch.equal(y, expected)
    assert all(torch.equal(g, r) for g, r in zip(_grads(model), reference, strict=True))
    assert sc.unwrap(wrapped) is seq


@settings(max_examples=12, deadline=None)
@given(
    T=st.integers(1, 40),
    chunk=st.integers(1, 50),
    blocks=st.integers(1, 3),
    storage=st.sampled_from(["host", "disk", "device"]),
    granularity=st.sampled_from(["stack", "layer"]),
)
def test_wrapped_sequential_gradients_equal_the_lif_stack_loop(
    T: int, chunk: int, blocks: int, storage: str, granularity: str
) -> None:
    model = _model([11, *([8] * (blocks - 1)), 4], seed=T)
    x = spike_train(T, 2, 11, 0.25, seed=T + 1)
    model(x).sum(0).square().mean().backward()
    reference = _grads(model)
    plan = Uniform(chunk) if granularity == "layer" else Double(max(chunk, 2), max(chunk // 2, 1))
    wrapped = sc.wrap(model.as_sequential(), plan=plan, storage=storage, granularity=granularity)
    wrapped(x).sum(0).square().mean().backward()
    grads = _grads(model)
    assert len(grads) == len(reference)
    for g, r in zip(grads, reference, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_neuron_initial_state_is_zeros_shaped_like_the_input() -> None:
    neuron = LIFNeuron(torch.nn.Parameter(torch.zeros(1)), 0)
    v, s = neuron.initial_state(torch.ones(3, 4))
    assert v.shape == s.shape == (3, 4) and not v.any() and not s.any()


@pytest.mark.parametrize("widths", [[5], []])
def test_too_few_widths_is_a_clear_error(widths: list[int]) -> None:
    with pytest.raises(ValueError, match="at least two sizes"):
        LIFStack(widths)
