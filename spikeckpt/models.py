"""A reference spiking network in plain torch: a feed-forward stack of LIF layers.

Used by ``spikeckpt plan --model``, the benchmarks and the tests as a framework-free workload
whose step is a pure function, the shape ``spikeckpt.scan`` expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from spikeckpt.errors import ConfigError


class FastSigmoidSpike(torch.autograd.Function):
    """Heaviside spike forward, fast-sigmoid surrogate gradient ``1 / (1 + slope*|v|)^2``."""

    slope = 25.0

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, v: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(v)
        return (v > 0).to(v.dtype)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (v,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad / (1.0 + FastSigmoidSpike.slope * v.abs()) ** 2


def spike(v: Tensor) -> Tensor:
    """Spikes ``(v > 0)`` as ``v``'s dtype, with a fast-sigmoid surrogate gradient."""
    return FastSigmoidSpike.apply(v)  # type: ignore[no-any-return]


class LIFStack(nn.Module):
    """``Linear -> LIF`` blocks for layer widths ``(inputs, hidden..., outputs)``.

    Each LIF layer: ``v = beta*v + W x - threshold*s_prev`` (reset by subtraction, detached as
    in snnTorch), ``s = spike(v - threshold)``. The state is a tuple of per-layer
    ``(membrane (B, n), spikes (B, n))`` pairs. ``beta`` is learnable per layer (sigmoid of a
    parameter, so it stays in (0, 1)).

    Args:
        widths: layer sizes, at least two, e.g. ``(700, 256, 256, 20)``.
        beta: initial decay per step.
        threshold: firing threshold.
    """

    def __init__(self, widths: Sequence[int], beta: float = 0.9, threshold: float = 1.0) -> None:
        super().__init__()
        if len(widths) < 2 or any(int(w) < 1 for w in widths):
            raise ConfigError(f"widths must list at least two sizes >= 1, got {list(widths)}")
        self.widths = [int(w) for w in widths]
        self.synapses = nn.ModuleList(
            nn.Linear(a, b) for a, b in zip(self.widths[:-1], self.widths[1:], strict=True)
        )
        logit = torch.logit(torch.tensor(beta))
        self.beta_logits = nn.Parameter(logit.repeat(len(self.synapses)))
        self.threshold = threshold

    def initial_state(
        self, batch: int, *, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> tuple[tuple[Tensor, Tensor], ...]:
        """Zero membranes and spikes, ``(B, n)`` per layer."""
        weight = cast(nn.Linear, self.synapses[0]).weight  # the synapses are Linear layers
        dtype = dtype or weight.dtype
        device = device or weight.device
        return tuple(
            (torch.zeros(batch, n, device=device, dtype=dtype),) * 2 for n in self.widths[1:]
        )

    def step(
        self, state: tuple[tuple[Tensor, Tensor], ...], x_t: Tensor
    ) -> tuple[tuple[tuple[Tensor, Tensor], ...], Tensor]:
        """One time step: ``x_t`` ``(B, inputs)`` -> output spikes ``(B, outputs)``. Pure."""
        betas = torch.sigmoid(self.beta_logits)
        new_state = []
        h = x_t
        for layer, (synapse, (v, s)) in enumerate(zip(self.synapses, state, strict=True)):
            v = betas[layer] * v + synapse(h) - self.threshold * s.detach()
            s = spike(v - self.threshold)
            new_state.append((v, s))
            h = s
        return tuple(new_state), h

    def as_sequential(self) -> nn.Sequential:
        """The same network as ``nn.Sequential(Linear, LIFNeuron, Linear, LIFNeuron, ...)``.

        The layers share this module's parameters (the ``Linear`` modules themselves and
        ``beta_logits``), so gradients of either form land in the same tensors. The sequential
        form is what [`spikeckpt.wrap`][spikeckpt.wrapping.wrap] splits into blocks for the layer-wise granularity;
        its plain loop computes bitwise what [`step`][spikeckpt.models.LIFStack.step] computes.
        """
        layers: list[nn.Module] = []
        for index, synapse in enumerate(self.synapses):
            layers += [synapse, LIFNeuron(self.beta_logits, index, self.threshold)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Plain BPTT loop over ``x`` ``(T, B, inputs)`` -> output spikes ``(T, B, outputs)``."""
        state = self.initial_state(x.shape[1], device=x.device, dtype=x.dtype)
        outputs = []
        for x_t in x:
            state, y = self.step(state, x_t)
            outputs.append(y)
        return torch.stack(outputs)


class LIFNeuron(nn.Module):
    """One LIF layer of [`LIFStack`][spikeckpt.models.LIFStack] as a neuron module: ``forward(x, state) -> (s, state)``.

    ``x`` is the synaptic input ``(B, n)``; ``state`` is ``(membrane (B, n), spikes (B, n))``
    (zeros from [`initial_state`][spikeckpt.models.LIFNeuron.initial_state]). The decay is ``sigmoid(beta_logits[index])``; the
    parameter is shared with the [`LIFStack`][spikeckpt.models.LIFStack] it came from.
    """

    def __init__(self, beta_logits: nn.Parameter, index: int, threshold: float = 1.0) -> None:
        super().__init__()
        self.beta_logits = beta_logits
        self.index = index
        self.threshold = threshold

    def initial_state(self, x_t: Tensor) -> tuple[Tensor, Tensor]:
        """Zero membrane and spikes shaped like the synaptic input ``x_t`` ``(B, n)``."""
        return torch.zeros_like(x_t), torch.zeros_like(x_t)

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Any]:
        v, s = state
        beta = torch.sigmoid(self.beta_logits)[self.index]
        v = beta * v + x - self.threshold * s.detach()
        s = spike(v - self.threshold)
        return s, (v, s)


def spike_train(T: int, batch: int, channels: int, density: float, *, seed: int = 0) -> Tensor:
    """A random binary spike train ``(T, batch, channels)`` float32 with the given density."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(T, batch, channels, generator=generator) < density).float()


def lif_stack_sizes(widths: Sequence[int], *, batch: int) -> tuple[int, int]:
    """Measured ``(S, A)`` in bytes of one [`LIFStack`][spikeckpt.models.LIFStack] step at ``batch`` (float32)."""
    from spikeckpt.engine.saved import measure_step

    model = LIFStack(widths)
    state = model.initial_state(batch)
    x_t = torch.zeros(batch, model.widths[0])
    probe = measure_step(model.step, state, x_t, list(model.parameters()))
    return probe.state_bytes, probe.step_bytes
