"""Blocks for the layer-wise granularity: adapters turned into the engine's plain callables.

`spikeckpt.adapters.sequential.split_blocks` cuts a feed-forward stack into blocks
(stateless synapse layers, then one neuron); [`layer_blocks`][spikeckpt.adapters.layered.layer_blocks] turns each into an
[`LayerBlock`][spikeckpt.engine.layerwise.LayerBlock]: a synapse over a whole time chunk (layers that
act on each sample alone are applied once to the ``(k * B, ...)`` reshaped chunk, the others
step by step), the neuron's step and membrane, whether the block draws random numbers, its
parameters and its cleanup. The engine sees only these callables.

**Fast neuron steps.** A layer-wise run evaluates every neuron step twice (forward pass and
recomputation), so the Python cost of one neuron call decides whether it beats the user's own
loop. snnTorch's ``Leaky.forward`` spends most of its time on module bookkeeping (it stores
``mem`` and ``reset`` as module buffers at every call; the adapter then clears them), not on
its five tensor ops. For a ``Leaky`` in explicit-state form with no hooks, quantisation,
inhibition or ``output=True``, the block's ``bind`` gives a step that runs exactly those ops
in the same order on the module's own tensors (``beta``, ``threshold``,
``graded_spikes_factor``, ``spike_grad``) without touching the module: bitwise the same
spikes, membranes and gradients, about 2.5x cheaper per call. Before its first use it is
checked against the adapter's own step on random data (values and every gradient, bitwise);
any difference (another snnTorch version) and the block keeps the adapter's step.

**Sparse first synapse.** A block whose synapse is one plain ``nn.Linear`` also gets a
``sparse_synapse``: on the CPU, for an input chunk with at most `SPARSE_DENSITY`
non-zeros, the synaptic input is a gather-sum over the non-zero inputs
(``embedding_bag(..., per_sample_weights=values)`` over the transposed weight) instead of
a dense matmul, and its weight gradient ``grad.T @ x`` is a gather-sum too (bags over the
input's columns; no weight-sized buffer outlives either gather); denser chunks take the dense
path. The
engine uses it only where no gradient with respect to the input is needed (the first block,
when ``x`` does not require grad), in both the forward pass and the recomputation, so
recomputed spikes stay bitwise those of the forward pass. Values agree with the dense
``Linear`` to float32 round-off (the sums run in another order), as the batched matmul does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from spikeckpt.adapters.generic import PER_SAMPLE_TYPES, StatelessAdapter, TimeLiftedAdapter
from spikeckpt.adapters.protocol import LayerAdapter
from spikeckpt.adapters.sequential import Block
from spikeckpt.engine.layerwise import LayerBlock

__all__ = ["SPARSE_DENSITY", "layer_blocks"]

#: the largest share of non-zero inputs for which ``sparse_synapse`` gathers (measured on one
#: CPU thread, 700 -> 512, 704 rows: 2x faster at 5%, break-even near 10%)
SPARSE_DENSITY = 1 / 16


def _batched_inner(layer: LayerAdapter) -> LayerAdapter | None:
    """The stateless adapter to apply to a whole ``(k * B, ...)`` chunk, or None (per step)."""
    inner = layer.inner if isinstance(layer, TimeLiftedAdapter) else layer
    if type(inner) is StatelessAdapter and isinstance(inner.module, PER_SAMPLE_TYPES):
        return inner
    return None


def _draws_random(block: Block) -> bool:
    """Whether the block's synapses draw random numbers (Dropout in training mode)."""
    return any(
        isinstance(s.module, nn.modules.dropout._DropoutNd) and s.module.training and s.module.p > 0
        for s in block.synapses
    )


def _synapse(synapses: Sequence[LayerAdapter]) -> Callable[[Tensor], Tensor]:
    batched = [_batched_inner(layer) for layer in synapses]

    def synapse(x: Tensor) -> Tensor:
        """The synaptic input of a whole chunk ``x (k, B, ...)`` -> ``(k, B, ...)``."""
        k, b = x.shape[0], x.shape[1]
        for layer, inner in zip(synapses, batched, strict=True):
            if inner is not None:
                _, y = inner.step((), x.reshape(k * b, *x.shape[2:]))
                x = y.reshape(k, b, *y.shape[1:])
            else:
                x = torch.stack([layer.step((), x_t)[1] for x_t in x.unbind(0)])
        return x

    return synapse


Step = Callable[[Any, Tensor], tuple[Any, Tensor]]


def _no_hooks(module: nn.Module) -> bool:
    from torch.nn.modules import module as torch_module

    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or getattr(torch_module, "_global_forward_hooks", None)
        or getattr(torch_module, "_global_forward_pre_hooks", None)
    )


def _snntorch_leaky(neuron: LayerAdapter) -> Callable[[], Step] | None:
    """``bind() -> step`` running snnTorch ``Leaky.forward``'s ops without its bookkeeping, or
    None when the neuron is not a plain explicit-state ``Leaky`` (see the module docstring).

    The ops are those of snnTorch 1.0.0's ``Leaky.forward`` with ``init_hidden=False``:
    ``reset = spike_grad(mem - threshold).clone().detach()``, then ``_base_sub`` /
    ``_base_zero`` / ``_base_int`` (whichever is the module's ``state_function``), then
    ``spk = spike_grad(mem - threshold) * graded_spikes_factor``.
    """
    m = getattr(neuron, "module", None)
    cls = type(m)
    if cls.__name__ != "Leaky" or not cls.__module__.startswith("snntorch"):
        return None
    state_cls = getattr(neuron, "state_cls", None)
    function = getattr(getattr(m, "state_function", None), "__func__", None)
    kinds = {getattr(cls, name, None): name for name in ("_base_sub", "_base_zero", "_base_int")}
    if (
        state_cls is None
        or getattr(state_cls, "_fields", None) != ("mem",)
        or function not in kinds
        or m.init_hidden  # type: ignore[union-attr]
        or getattr(m, "state_quant", True)
        or getattr(m, "inhibition", True)
        or getattr(m, "output", True)
        or not getattr(m, "reset_delay", False)
        or "forward" in vars(m)
    ):
        return None
    kind = kinds[function]

    def bind() -> Step:
        beta, threshold = m.beta, m.threshold  # type: ignore[union-attr]
        graded, spike = m.graded_spikes_factor, m.spike_grad  # type: ignore[union-attr]

        def step(state: Any, x: Tensor) -> tuple[Any, Tensor]:
            mem = state[0]
            if mem.shape != x.shape:  # snnTorch's own rule (an empty initial state)
                mem = torch.zeros_like(x, device=mem.device)
            reset = spike(mem - threshold).detach()
            if kind == "_base_sub":
                mem = beta.clamp(0, 1) * mem + x - reset * threshold
            elif kind == "_base_zero":
                mem = (1 - reset) * mem
                mem = beta.clamp(0, 1) * mem + x
            else:
                mem = beta.clamp(0, 1) * mem + x
            return state_cls(mem), spike(mem - threshold) * graded

        return step

    return bind


class _FastNeuron:
    """A neuron's fast ``bind() -> step`` that falls back to the adapter's own step unless a
    check on random data gives bitwise the same outputs, states and gradients (run once)."""

    def __init__(self, neuron: LayerAdapter, bind: Callable[[], Step]) -> None:
        self.neuron = neuron
        self.fast = bind
        self.verified: bool | None = None

    def __call__(self) -> Step:
        m = self.neuron.module
        if self.verified is None:
            self.verified = self._check()
        if self.verified and _no_hooks(m) and not getattr(m, "init_hidden", True):
            return self.fast()
        return self.neuron.step

    def _check(self) -> bool:
        """Both steps on random data from a random state: outputs, new state and the gradients
        of a weighted sum of both with respect to input, state and parameters, bitwise."""
        neuron = self.neuron
        m = neuron.module
        try:
            floats = [t for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()]
            like = floats[0] if floats else torch.zeros(())
            params = [p for p in m.parameters() if p.requires_grad]
            results = []
            with torch.random.fork_rng(devices=[]), torch.enable_grad():
                for step in (neuron.step, self.fast()):
                    torch.manual_seed(0)  # the same data for both (and the same SSO draws)
                    x = (torch.randn(3, 5) * 2).to(like).requires_grad_()
                    mem = (torch.randn(3, 5) * 2).to(like).requires_grad_()
                    state = neuron.init_state(x.detach())
                    new, y = step(type(state)(mem), x)
                    outs = [y, new[0]]
                    weights = [
                        torch.linspace(-1, 1, o.numel()).to(o).reshape(o.shape) for o in outs
                    ]
                    grads = torch.autograd.grad(outs, [x, mem, *params], weights, allow_unused=True)
                    results.append([*(o.detach() for o in outs), *grads])
                    neuron.cleanup()
        except Exception:  # noqa: BLE001 - anything unexpected: keep the adapter's own step
            return False
        return all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(*results, strict=True)
        )


def _bind(neuron: LayerAdapter) -> Callable[[], Step] | None:
    """The block's ``bind`` for a neuron with a fast step, else None."""
    fast = _snntorch_leaky(neuron)
    return _FastNeuron(neuron, fast) if fast is not None else None


def _cleanup(block: Block) -> Callable[[], None]:
    def cleanup() -> None:
        for layer in (*block.synapses, block.neuron):
            layer.cleanup()

    return cleanup


class _GatherLinear(torch.autograd.Function):
    """``flat @ weight.T + bias`` from the non-zeros of ``flat`` (``cols``, per-row
    ``offsets``, ``values``): a gather-sum over the transposed weight; the weight gradient
    ``grad.T @ flat`` is a gather-sum over the rows of ``grad``, one bag per input column (no
    weight-sized temporaries kept: the transposed copy lives only during the gather).
    ``flat`` needs no gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        flat: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        cols: Tensor,
        offsets: Tensor,
        values: Tensor,
    ) -> Tensor:
        z = nn.functional.embedding_bag(
            cols, weight.t().contiguous(), offsets, mode="sum", per_sample_weights=values
        )
        if bias is not None:
            z.add_(bias)
        ctx.save_for_backward(flat)  # a view of the input chunk, alive anyway
        ctx.has_bias = bias is not None
        return z

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (flat,) = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[1]:
            # grad.T @ flat as a gather-sum too: column j of the weight gradient sums the
            # rows of ``grad`` where input j is non-zero (bags over ``flat``'s columns); it
            # comes out transposed, (in, out), and is returned as its (out, in) view
            where = torch.nonzero(flat.t())
            cols, rows = where[:, 0], where[:, 1]
            counts = torch.bincount(cols, minlength=flat.shape[1])
            grad_w = nn.functional.embedding_bag(
                rows,
                grad.contiguous(),
                counts.cumsum(0) - counts,
                mode="sum",
                per_sample_weights=flat[rows, cols],
            ).t()
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return None, grad_w, grad_b, None, None, None


def _sparse_synapse(synapses: Sequence[LayerAdapter]) -> Callable[[Tensor], Tensor] | None:
    """A synapse for inputs that need no gradient, gathering over their non-zeros (see the
    module docstring), or None unless the synapse is exactly one plain ``nn.Linear``."""
    if len(synapses) != 1:
        return None
    inner = _batched_inner(synapses[0])
    linear = inner.module if inner is not None else None
    if type(linear) is not nn.Linear or "forward" in vars(linear):
        return None
    dense = _synapse(synapses)

    def synapse(x: Tensor) -> Tensor:
        weight, bias = linear.weight, linear.bias
        if (
            x.device.type != "cpu"
            or weight.device.type != "cpu"
            or x.dtype != weight.dtype
            or not x.is_floating_point()
            or x.requires_grad
            or x.dim() < 2
            or x.shape[-1] != weight.shape[1]
            or not _no_hooks(linear)
        ):
            return dense(x)
        flat = x.reshape(-1, x.shape[-1])
        ones = int(torch.count_nonzero(flat))
        if ones > SPARSE_DENSITY * flat.numel():
            return dense(x)
        where = torch.nonzero(flat)
        rows, cols = where[:, 0], where[:, 1]
        counts = torch.bincount(rows, minlength=flat.shape[0])
        z = _GatherLinear.apply(
            flat, weight, bias, cols, counts.cumsum(0) - counts, flat[rows, cols]
        )
        return z.reshape(*x.shape[:-1], z.shape[-1])

    return synapse


def layer_blocks(blocks: Sequence[Block]) -> list[LayerBlock]:
    """The engine's view of each block (bottom-up)."""
    out = []
    for block in blocks:
        layers = (*block.synapses, block.neuron)
        params = {
            id(t): t
            for layer in layers
            for t in (*layer.module.parameters(), *layer.extra_params())
        }
        out.append(
            LayerBlock(
                name=block.name,
                synapse=_synapse(block.synapses),
                step=block.neuron.step,
                membrane=block.neuron.membrane,
                draws_random=_draws_random(block),
                params=list(params.values()),
                cleanup=_cleanup(block),
                bind=_bind(block.neuron),
                sparse_synapse=_sparse_synapse(block.synapses),
            )
        )
    return out
