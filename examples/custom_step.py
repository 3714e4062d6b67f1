"""A custom neuron model for ``spikeckpt.scan``: an adaptive LIF layer written as a pure step.

The step takes the state and one time step's input and returns the new state and an output,
without touching anything else, so ``scan`` can run it again from a checkpoint in the backward
pass. The gradients are compared with the plain BPTT loop of the same step. About 10 s on 2 CPU
cores:

    python examples/custom_step.py
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

import spikeckpt
from spikeckpt.models import spike  # Heaviside forward, fast-sigmoid surrogate gradient

T, B, IN, N = 300, 8, 50, 64


class ALIFState(NamedTuple):
    v: Tensor  # membrane potential (B, N)
    a: Tensor  # threshold adaptation (B, N)
    s: Tensor  # last spikes (B, N)


class AdaptiveLIF(nn.Module):
    """``v = beta*v + W x - theta*s``, ``theta = 1 + a``, ``a = rho*a + s``: spikes raise the
    threshold, which decays back with ``rho``."""

    def __init__(self, inputs: int, neurons: int) -> None:
        super().__init__()
        self.fc = nn.Linear(inputs, neurons)
        self.beta_logit = nn.Parameter(torch.full((neurons,), 2.0))  # beta = sigmoid(2) ~ 0.88
        self.rho = 0.95

    def initial_state(self, batch: int) -> ALIFState:
        zeros = torch.zeros(batch, self.fc.out_features)
        return ALIFState(zeros, zeros, zeros)

    def step(self, state: ALIFState, x_t: Tensor) -> tuple[ALIFState, Tensor]:
        """Pure: new tensors out, nothing modified in place, no attribute written."""
        theta = 1.0 + state.a
        v = torch.sigmoid(self.beta_logit) * state.v + self.fc(x_t) - theta * state.s.detach()
        s = spike(v - theta)
        a = self.rho * state.a + s
        return ALIFState(v, a, s), s


def plain_loop(model: AdaptiveLIF, x: Tensor) -> Tensor:
    state, count = model.initial_state(x.shape[1]), 0
    for x_t in x:
        state, s = model.step(state, x_t)
        count = count + s
    return count


def main() -> None:
    # Small tensors: one thread is fastest, and on a busy machine two threads per process
    # fighting other jobs for the cores ran these examples 5-10 times slower.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AdaptiveLIF(IN, N)
    x = (torch.rand(T, B, IN) < 0.1).float()  # (T, B, IN) input spikes
    target = torch.rand(B, N) * 20

    # Plain BPTT: autograd keeps every step's graph.
    with spikeckpt.MemoryMeter() as plain_mem:
        nn.functional.mse_loss(plain_loop(model, x), target).backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    # scan: model.step is a bound method of an nn.Module, so its parameters get gradients
    # (tensors a step closes over must be passed with params=[...]).
    with spikeckpt.MemoryMeter() as scan_mem:
        out = spikeckpt.scan(
            model.step,
            x,
            model.initial_state(B),
            plan=spikeckpt.plans.Revolve(16),  # 16 device checkpoints
            readout="sum",  # sum of y_t inside the loop: (B, N), no (T, B, N) stack
        )
        (count, final), stats = out, out.stats  # what the run did beside (ys, state)
        nn.functional.mse_loss(count, target).backward()
    diff = max(
        (g - p.grad).abs().max().item()
        for g, p in zip(plain_grads, model.parameters(), strict=True)
    )

    fmt = spikeckpt.format_bytes
    print(f"adaptive LIF {IN}-{N}, T={T}, batch {B}; final state: {type(final).__name__}")
    print(f"plain loop peak: {fmt(plain_mem.peak_bytes)}")
    print(f"scan peak:       {fmt(scan_mem.peak_bytes)} with {stats.plan}")
    print(
        f"scan stats: S={stats.state_bytes} B per state, A={stats.tape_bytes_per_step:.0f} B "
        f"taped per step, {stats.recompute_factor:.2f} evaluations per step"
    )
    print(f"max |grad diff| vs the plain loop: {diff:.3g}")
    assert diff < 1e-5, diff


if __name__ == "__main__":
    main()
