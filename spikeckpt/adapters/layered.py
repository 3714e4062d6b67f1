"""Blocks for the layer-wise granularity: adapters turned into the engine's plain callables.

`spikeckpt.adapters.sequential.split_blocks` cuts a feed-forward stack into blocks
(stateless synapse layers, then one neuron); [`layer_blocks`][spikeckpt.adapters.layered.layer_blocks] turns each into an
[`LayerBlock`][spikeckpt.engine.layerwise.LayerBlock]: a synapse over a whole time chunk (layers that
act on each sample alone are applied once to the ``(k * B, ...)`` reshaped chunk, the others
step by step), the neuron's step and membrane, whether the block draws random numbers, its
parameters and its cleanup. The engine sees only these callables.

**Fused neurons.** A block whose neuron's adapter offers a chunk kernel
(`chunk_kernel`) gets it as ``fused``, wrapped
in `VerifiedKernel`: used only after a check against the adapter's own step.

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

import numpy as np
import torch
from torch import Tensor, nn

from spikeckpt.adapters.generic import PER_SAMPLE_TYPES, StatelessAdapter, TimeLiftedAdapter
from spikeckpt.adapters.protocol import LayerAdapter
from spikeckpt.adapters.sequential import Block
from spikeckpt.engine.fused import ChunkKernel, run_fused
from spikeckpt.engine.grad import GradSink
from spikeckpt.engine.inputs import SparseChunk
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


class VerifiedKernel:
    """A neuron's `ChunkKernel`, used only after a check
    against the neuron's own step (run once, at the first chunk, on random data shaped like
    one sample of it): spikes, states and membranes bitwise, gradients with respect to the
    input, the state and every parameter within float32 round-off. A kernel that fails the
    check (another framework version, an option it does not model) is never used: the block
    keeps its per-step call, and ``last_stats`` says so."""

    def __init__(self, neuron: LayerAdapter, kernel: ChunkKernel) -> None:
        self.neuron = neuron
        self.kernel = kernel
        self.name = kernel.name
        self.membrane = kernel.membrane
        self.verified: bool | None = None

    @property
    def params(self) -> tuple[Tensor, ...]:
        return self.kernel.params

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        if not self.kernel.accepts(leaves, z):
            return False
        if self.verified is None:
            self.verified = _kernel_matches_step(self.neuron, self.kernel, leaves, z)
        return self.verified

    def forward(self, *args: Any) -> Any:
        return self.kernel.forward(*args)

    def backward(self, *args: Any) -> Any:
        return self.kernel.backward(*args)


def _sample_shape(step: torch.Size, params: Sequence[Tensor]) -> tuple[int, ...]:
    """One sample of a step's shape ``(B, ...)``, each dimension kept only where a parameter
    varies along it (aligned from the right, as broadcasting aligns them): the smallest input
    on which the kernel meets every parameter value."""
    dims = list(step[1:])
    kept = [1] * len(dims)
    for p in params:
        for i in range(1, min(p.dim(), len(dims)) + 1):
            if p.shape[-i] > 1:
                kept[-i] = dims[-i]
    return (1, *kept)


def _kernel_matches_step(
    neuron: LayerAdapter, kernel: ChunkKernel, leaves: Sequence[Tensor], z: Tensor
) -> bool:
    """Kernel and step on the same random chunk (4 steps, one sample shaped like ``z``'s):
    outputs, states and membranes bitwise; gradients of a weighted sum of them with respect
    to the input, the initial state and the kernel's parameters within float32 round-off."""
    from spikeckpt.engine import tree as pytree

    params = [p for p in kernel.params if p.requires_grad]
    shape = _sample_shape(z.shape[1:], kernel.params)
    spec = pytree.tree_structure(neuron.init_state(z[0, :1]))
    results = []
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            for fused in (False, True):
                torch.manual_seed(0)
                x = (torch.randn(4, *shape, dtype=leaves[0].dtype) * 2).to(z.device)
                x.requires_grad_()
                start = [
                    (torch.randn(shape, dtype=t.dtype) * 2).to(t.device).requires_grad_()
                    for t in leaves
                ]
                state = pytree.tree_unflatten(start, spec)
                if fused:
                    state, ys, mems = run_fused(kernel, state, x, kernel.membrane is not None)
                else:
                    steps = []
                    for x_t in x.unbind(0):
                        state, y = neuron.step(state, x_t)
                        steps.append((y, neuron.membrane(state)))
                    neuron.cleanup()
                    ys = torch.stack([y for y, _ in steps])
                    mems = None if kernel.membrane is None else torch.stack([v for _, v in steps])
                outs = [ys, *pytree.tree_leaves(state), *([] if mems is None else [mems])]
                taped = [o for o in outs if o.requires_grad]
                weights = [torch.linspace(-1, 1, o.numel()).to(o).reshape(o.shape) for o in taped]
                grads = torch.autograd.grad(taped, [x, *start, *params], weights, allow_unused=True)
                results.append(([o.detach() for o in outs], grads))
    except Exception:  # noqa: BLE001 - anything unexpected: keep the per-step call
        return False
    (outs_a, grads_a), (outs_b, grads_b) = results
    if not all(torch.equal(a, b) for a, b in zip(outs_a, outs_b, strict=True)):
        return False
    for a, b in zip(grads_a, grads_b, strict=True):
        if a is None or b is None:  # unused on one side: zero (or unused) on the other
            if not all(g is None or not bool(g.any()) for g in (a, b)):
                return False
            continue
        scale = 1 + float(torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0).abs().max())
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5 * scale, equal_nan=True):
            return False
    return True


def _cleanup(block: Block, *caches: _Transposed) -> Callable[[], None]:
    def cleanup() -> None:
        for layer in (*block.synapses, block.neuron):
            layer.cleanup()
        for cache in caches:
            cache.clear()

    return cleanup


#: a gather transposes the weight a block of output rows at a time, at most this many
#: elements (256 KiB of float32) per block: no weight-sized temporary
GATHER_BLOCK = 1 << 16


class _Transposed:
    """A small weight transposed, ``(in, out)`` contiguous, made once per pass of the engine
    and dropped by the block's cleanup at the end of the pass (a weight changed between
    passes, even through ``.data``, is transposed afresh): only weights of at most
    `GATHER_BLOCK` elements, so it costs at most 256 KiB."""

    def __init__(self) -> None:
        self.value: Tensor | None = None
        self.key: tuple[int, int] = (0, 0)

    def of(self, weight: Tensor) -> Tensor | None:
        """``weight.T`` contiguous, or None for a weight above `GATHER_BLOCK` elements."""
        if weight.numel() > GATHER_BLOCK:
            return None
        key = (weight.data_ptr(), weight._version)
        if self.value is None or self.key != key:
            self.value, self.key = weight.detach().t().contiguous(), key
        return self.value

    def clear(self) -> None:
        self.value = None


def _gather(
    weight: Tensor,
    n_rows: int,
    rows: Tensor,
    cols: Tensor,
    values: Tensor | None,
    transposed: Tensor | None = None,
) -> Tensor:
    """``flat @ weight.T`` (``(n_rows, out)``) from the non-zeros of ``flat``: a gather-sum
    over the rows of ``weight.T``, for a block of output features at a time (each block's
    transposed copy is a contiguous slice of rows of ``weight``, fast to transpose). Every
    output element is the same sum, in the same order, whatever the blocks; ``transposed``
    is ``weight.T`` contiguous when the caller keeps one."""
    out, n_in = weight.shape
    counts = torch.bincount(rows, minlength=n_rows)
    offsets = counts.cumsum(0) - counts
    weight = weight.detach()
    step = max(1, GATHER_BLOCK // max(1, n_in))
    if step >= out:
        if transposed is None:
            transposed = weight.t().contiguous()
        return nn.functional.embedding_bag(
            cols, transposed, offsets, mode="sum", per_sample_weights=values
        )
    z = weight.new_empty(n_rows, out)
    for o0 in range(0, out, step):
        z[:, o0 : o0 + step] = nn.functional.embedding_bag(
            cols, weight[o0 : o0 + step].t().contiguous(), offsets, mode="sum",
            per_sample_weights=values,
        )  # fmt: skip
    return z


class _GatherLinear(torch.autograd.Function):
    """``flat @ weight.T + bias`` for a ``flat (rows, in)`` input given by its non-zeros
    (``rows``, ``cols`` ascending row-major, ``values`` or None for ones): a gather-sum over
    the transposed weight (`_gather`); the weight gradient ``grad.T @ flat`` is a gather-sum
    over the rows of ``grad``, one bag per input column, a block of columns at a time, added
    into the engine's running sum when it offers a `GradSink` (kept transposed, ``(in, out)``
    row-major, so each block adds into contiguous rows). No weight-sized temporaries. The
    input needs no gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        weight: Tensor,
        bias: Tensor | None,
        n_rows: int,
        rows: Tensor,
        cols: Tensor,
        values: Tensor | None,
        sink: GradSink | None,
        transposed: Tensor | None,
    ) -> Tensor:
        z = _gather(weight, n_rows, rows, cols, values, transposed)
        if bias is not None:
            z.add_(bias)
        ctx.save_for_backward(rows, cols, values)
        ctx.has_bias = bias is not None
        ctx.n_in = weight.shape[1]
        ctx.weight_shape = weight.shape
        ctx.sink = sink
        return z

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        rows, cols, values = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[0]:
            # grad.T @ flat as a gather-sum too: column j of the weight gradient sums the rows
            # of ``grad`` where input j is non-zero (bags over the input's columns, rows
            # ascending in each), for a block of output rows at a time: each block's bags come
            # out (in, block) and are added, transposed, into the sum's contiguous rows
            order = _column_order(cols, ctx.n_in)
            counts = torch.bincount(cols, minlength=ctx.n_in)
            rows = rows[order]
            offsets = counts.cumsum(0) - counts
            weights = None if values is None else values[order]
            sink: GradSink | None = ctx.sink if ctx.sink is not None and ctx.sink.active else None
            out, n_in = ctx.weight_shape
            target = None if sink is None else sink.target
            add = target is not None
            if target is None:
                target = grad.new_empty(out, n_in)
                if sink is not None:
                    sink.target = target
            step = max(1, GATHER_BLOCK // max(1, n_in))
            for o0 in range(0, out, step):
                part = nn.functional.embedding_bag(
                    rows, grad[:, o0 : o0 + step].contiguous(), offsets, mode="sum",
                    per_sample_weights=weights,
                ).t().contiguous()  # fmt: skip
                if add:
                    target[o0 : o0 + step] += part
                else:
                    target[o0 : o0 + step] = part
            grad_w = None if sink is not None else target
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return grad_w, grad_b, None, None, None, None, None, None


def _column_order(cols: Tensor, n_in: int) -> Tensor:
    """``argsort(cols, stable=True)``: on the CPU with fewer than 65,536 columns through
    NumPy's radix sort of 16-bit keys (about 15x faster than torch's sort here)."""
    if cols.device.type == "cpu" and n_in <= 65536:
        keys = cols.numpy().astype(np.uint16)
        return torch.from_numpy(np.argsort(keys, kind="stable").astype(np.int64))
    return torch.argsort(cols, stable=True)


def _sparse_synapse(
    synapses: Sequence[LayerAdapter],
    sink: GradSink | None = None,
    transposed: _Transposed | None = None,
) -> Callable[[Tensor | SparseChunk], Tensor] | None:
    """A synapse for inputs that need no gradient, gathering over their non-zeros (see the
    module docstring), or None unless the synapse is exactly one plain ``nn.Linear``. It takes
    the dense chunk or a packed train's `SparseChunk`; ``transposed`` keeps a small weight's
    transpose for the pass."""
    if len(synapses) != 1:
        return None
    inner = _batched_inner(synapses[0])
    linear = inner.module if inner is not None else None
    if type(linear) is not nn.Linear or "forward" in vars(linear):
        return None
    dense = _synapse(synapses)

    def synapse(x: Tensor | SparseChunk) -> Tensor:
        weight, bias = linear.weight, linear.bias
        shape = x.shape
        if (
            x.device.type != "cpu"
            or weight.device.type != "cpu"
            or x.dtype != weight.dtype
            or not x.dtype.is_floating_point
            or (isinstance(x, Tensor) and x.requires_grad)
            or len(shape) < 2
            or shape[-1] != weight.shape[1]
            or not _no_hooks(linear)
        ):
            return dense(x.dense() if isinstance(x, SparseChunk) else x)
        n_rows = shape[:-1].numel()
        values = None
        if isinstance(x, SparseChunk):
            if x.ones > SPARSE_DENSITY * x.numel():
                return dense(x.dense())
            rows, cols = x.positions.div(shape[-1], rounding_mode="floor"), x.positions
            cols = cols - rows * shape[-1]
        else:
            flat = x.reshape(n_rows, shape[-1])
            if int(torch.count_nonzero(flat)) > SPARSE_DENSITY * flat.numel():
                return dense(x)
            where = torch.nonzero(flat)
            rows, cols = where[:, 0], where[:, 1]
            values = flat[rows, cols]
        t_weight = None if transposed is None else transposed.of(weight)
        z = _GatherLinear.apply(weight, bias, n_rows, rows, cols, values, sink, t_weight)
        return z.reshape(*shape[:-1], z.shape[-1])

    return synapse


def _weight_sink(
    synapses: Sequence[LayerAdapter],
) -> tuple[GradSink | None, tuple[tuple[Tensor, GradSink], ...]]:
    """A gradient sink for the weight of a block whose synapse is one plain ``nn.Linear``
    (its sparse synapse adds each chunk's weight gradient into the engine's running sum)."""
    inner = _batched_inner(synapses[0]) if len(synapses) == 1 else None
    linear = inner.module if inner is not None else None
    if type(linear) is not nn.Linear:
        return None, ()
    sink = GradSink()
    return sink, ((linear.weight, sink),)


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
        kernel = block.neuron.chunk_kernel()
        sink, sinks = _weight_sink(block.synapses)
        transposed = _Transposed()
        out.append(
            LayerBlock(
                name=block.name,
                synapse=_synapse(block.synapses),
                step=block.neuron.step,
                membrane=block.neuron.membrane,
                draws_random=_draws_random(block),
                params=list(params.values()),
                cleanup=_cleanup(block, transposed),
                sparse_synapse=_sparse_synapse(block.synapses, sink, transposed),
                sinks=sinks,
                fused=None if kernel is None else VerifiedKernel(block.neuron, kernel),
            )
        )
    return out
