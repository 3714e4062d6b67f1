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
``sparse_synapse``: on the CPU, for an input chunk with at most the share of non-zeros at
which a gather is measured faster (`spikeckpt.adapters.affine.sparse_share`: by the outputs
each torch thread computes), the synaptic input is a gather-sum over the non-zero inputs
(``embedding_bag(..., per_sample_weights=values)`` over the transposed weight) instead of
a dense matmul, and its weight gradient ``grad.T @ x`` is a gather-sum too (bags over the
input's columns; no weight-sized buffer outlives either gather); denser chunks take the dense
path. The
engine uses it only where no gradient with respect to the input is needed (the first block,
when ``x`` does not require grad), in both the forward pass and the recomputation, so
recomputed spikes stay bitwise those of the forward pass. Values agree with the dense
``Linear`` to float32 round-off only (the sums run in another order): a membrane within
round-off of the threshold then spikes on one side and not the other, which on large layers
happens (Linear(8192, 8192) + Leaky, batch 16, 5% input spikes: 20 of 65.5 million spikes
flipped in 500 steps, the first at step 182). ``wrap(..., exact=True)`` leaves the sparse
synapse out and runs every synapse step by step (``layer_blocks``): spikes bitwise the plain
loop's on any device. The gathers live in `spikeckpt.adapters.gather`.

**Untaped backward.** Such a block also gets ``affine``, the ``Linear`` written out
(`spikeckpt.adapters.affine.LinearChunk`, computing what ``synapse`` and ``sparse_synapse``
compute, bitwise): with a fused neuron the engine recomputes and backpropagates the block over
a chunk without autograd (`spikeckpt.engine.direct`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
from torch import Tensor, nn

from spikeckpt.adapters.affine import LinearChunk, SparseLimit, sparse_positions
from spikeckpt.adapters.gather import GatherLinear, Transposed
from spikeckpt.adapters.generic import PER_SAMPLE_TYPES, StatelessAdapter
from spikeckpt.adapters.protocol import LayerAdapter, backward_hooked, no_hooks
from spikeckpt.adapters.recurrent_kernel import NorseCellKernel
from spikeckpt.adapters.sequential import Block
from spikeckpt.adapters.time_lifted import TimeLiftedAdapter
from spikeckpt.engine.fused import ChunkKernel, run_fused
from spikeckpt.engine.grad import GradSink, tensor_hooks_held
from spikeckpt.engine.inputs import SparseChunk, as_fresh, one_step_repeated
from spikeckpt.engine.layerwise import LayerBlock
from spikeckpt.engine.meter import unmetered
from spikeckpt.engine.step import in_place_error
from spikeckpt.errors import UnsupportedLayerError

__all__ = ["layer_blocks", "with_current_modes"]


def _batched_inner(layer: LayerAdapter) -> LayerAdapter | None:
    """The stateless adapter to apply to a whole chunk, or None (per step: a module with a
    backward hook sees each step's gradients, as the loop's call hands them). It takes the
    ``(k * B, ...)`` reshaped chunk, or for a layer written for sequences (a
    `TimeLiftedAdapter`'s) the ``(k, B, ...)`` chunk itself, as Norse's call hands it one."""
    inner = layer.inner if isinstance(layer, TimeLiftedAdapter) else layer
    if (
        type(inner) is StatelessAdapter
        and isinstance(inner.module, PER_SAMPLE_TYPES)
        and not backward_hooked(inner.module)
    ):
        return inner
    return None


def _draws_random(block: Block) -> bool:
    """Whether the block's synapses draw random numbers (Dropout in training mode)."""
    return any(
        isinstance(s.module, nn.modules.dropout._DropoutNd) and s.module.training and s.module.p > 0
        for s in block.synapses
    )


def _synapse(
    synapses: Sequence[LayerAdapter], per_step: bool = False, fresh: bool = False
) -> Callable[[Tensor], Tensor]:
    """The block's synapse over a chunk: layers that act on each sample alone run once on the
    ``(k * B, ...)`` reshaped chunk, unless ``per_step`` (every layer step by step, the plain
    loop's own calls: see ``exact`` in `layer_blocks`). ``fresh``: each step's input is read
    where a new tensor's data would start (`as_fresh`), as the plain loop hands a block
    after the first its neuron's new output. A static input (`one_step_repeated`: every step
    the same tensor) through leading layers of torch's own that act on each sample alone
    and draw nothing (`_pure`, asked at each call: a Dropout's mode may change) runs those on
    one step and repeats it, as the loop computes the same values at every step; the layers
    after them (a BatchNorm normalising each step's batch, a Dropout drawing) run on every
    step as usual."""
    batched = [None if per_step else _batched_inner(layer) for layer in synapses]

    def one_step(x_t: Tensor) -> Tensor:
        """Every layer on one step, each on the one before's new output (the loop's calls)."""
        for layer in synapses:
            x_t = layer.step((), x_t)[1]
        return x_t

    def static_lead() -> int:
        """How many leading layers compute the same values at every step of a static input."""
        lead = 0
        for layer, inner in zip(synapses, batched, strict=True):
            if inner is None or not _pure(layer.module):
                break
            lead += 1
        return lead

    def writes_in_place() -> bool:
        """Whether a layer of the block writes its input in place (``nn.Dropout(inplace=
        True)``, ``nn.ReLU(inplace=True)``, read at each call; also after a view such as
        ``nn.Flatten``, so any layer of the block counts): the chunk is the stored spikes,
        handed over as a leaf when the block is recomputed, which torch refuses to change in
        place (before 2026-11-29: "a view of a leaf Variable that requires grad is being used
        in an in-place operation"); the loop's layer changed the neuron's fresh output, which
        a copy is too."""
        return any(
            getattr(m, "inplace", False) is True
            for layer in synapses
            for m in layer.module.modules()
        )

    def synapse(x: Tensor) -> Tensor:
        """The synaptic input of a whole chunk ``x (k, B, ...)`` -> ``(k, B, ...)``."""
        try:
            return chunk(x, Tensor.clone if writes_in_place() else _same)
        except RuntimeError as err:
            if not in_place_error(err):
                raise
            paths = ", ".join(repr(layer.path) for layer in synapses)
            raise UnsupportedLayerError(
                f"layer-wise run: a layer among {paths} changes its input in place (x.mul_(2) "
                "in a layer of yours): a recomputed block gets its stored input spikes back as "
                "a tensor torch will not let it change (torch said: "
                f"{str(err).splitlines()[0]!r}); compute out of place (x = x * 2), or wrap with "
                "granularity='stack', which runs it as your loop does"
            ) from err

    def chunk(x: Tensor, own: Callable[[Tensor], Tensor]) -> Tensor:
        """`synapse`'s work; ``own``: what the first layer gets of its input (a copy where
        a layer writes in place)."""
        if per_step:
            steps = x.unbind(0)
            return torch.stack([one_step(own(as_fresh(x_t) if fresh else x_t)) for x_t in steps])
        lead = static_lead() if one_step_repeated(x) else 0
        if not lead:
            return run(own(x), 0)
        # a static input (every step the same tensor): the leading layers' values are step
        # 0's at every step; a BatchNorm after them normalises (and counts) each step, and
        # its backward sees each step's gradient, as in the loop (summed first, it rounded
        # off up to 4e-4 of the largest gradient over T = 300 steps of small groups)
        z0 = run(own(x[:1]), 0, lead)
        z = z0.expand(x.shape[0], *z0.shape[1:])
        return z.contiguous() if lead == len(synapses) else run(z, lead)

    def run(x: Tensor, start: int, stop: int | None = None) -> Tensor:
        """Layers ``start`` to ``stop`` (the last) over ``x (k, B, ...)``."""
        k, b = x.shape[0], x.shape[1]
        for layer, inner in list(zip(synapses, batched, strict=True))[start:stop]:
            if isinstance(layer, TimeLiftedAdapter) and inner is not None:
                layer.check_time_local(x[0])
                x = inner.step((), x)[1]
            elif inner is not None:
                _, y = inner.step((), x.reshape(k * b, *x.shape[2:]))
                x = y.reshape(k, b, *y.shape[1:])
            else:
                x = torch.stack([layer.step((), x_t)[1] for x_t in x.unbind(0)])
        return x

    return synapse


def _same(x: Tensor) -> Tensor:
    return x


def _pure(module: nn.Module) -> bool:
    """Whether ``module``'s output is a function of its input alone, computed by torch's own
    ``forward`` and nothing else: a torch.nn class (not a subclass of yours), no hooks, no
    random draws (Dropout in training mode)."""
    if not type(module).__module__.startswith("torch.nn.") or not no_hooks(module):
        return False
    dropout = nn.modules.dropout._DropoutNd
    return not (isinstance(module, dropout) and module.training and module.p > 0)


Step = Callable[[Any, Tensor], tuple[Any, Tensor]]


class VerifiedKernel:
    """A neuron's `ChunkKernel`, used only after a check
    against the neuron's own step (run once, at the first chunk, on random data shaped like
    one sample of it): spikes, states and membranes bitwise, gradients with respect to the
    input, the state and every parameter within float32 round-off. A kernel that fails the
    check (another framework version, an option it does not model) is never used: the block
    keeps its per-step call, and ``last_stats`` says so. Nor is a kernel used while the module
    has forward hooks (its own or global ones): the kernel never calls the module, so they
    would not run; the per-step call runs them."""

    def __init__(self, neuron: LayerAdapter, kernel: ChunkKernel) -> None:
        self.neuron = neuron
        self.kernel = kernel
        self.name = kernel.name
        self.membrane = kernel.membrane
        self.emits_states = kernel.emits_states
        self.verified: bool | None = None

    @property
    def params(self) -> tuple[Tensor, ...]:
        return self.kernel.params

    @property
    def binary_leaves(self) -> tuple[int, ...]:
        return self.kernel.binary_leaves

    @property
    def input_delay(self) -> int:
        """Steps before the input reaches the spikes (`NorseLSNNKernel`'s 1; else 0)."""
        return int(getattr(self.kernel, "input_delay", 0))

    @property
    def binary_output(self) -> bool:
        return self.kernel.binary_output

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        if not no_hooks(self.neuron.module) or not self.kernel.accepts(leaves, z):
            return False
        if self.verified is None:
            with unmetered():  # once per kernel, not part of any step: no meter counts it
                self.verified = _kernel_matches_step(self.neuron, self.kernel, leaves, z)
        return self.verified

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel.forward(*args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel.backward(*args, **kwargs)


#: rows and steps of the random chunk `_kernel_matches_step` runs: enough that most rows
#: spike and reset within it, and some do not
CHECK_ROWS, CHECK_STEPS = 16, 8


def _sample_shape(step: torch.Size, params: Sequence[Tensor]) -> tuple[int, ...]:
    """`CHECK_ROWS` samples of a step's shape ``(B, ...)``, each dimension kept only where a
    parameter varies along it (aligned from the right, as broadcasting aligns them): a small
    input on which the kernel meets every parameter value, on many random values."""
    dims = list(step[1:])
    kept = [1] * len(dims)
    for p in params:
        for i in range(1, min(p.dim(), len(dims)) + 1):
            if p.shape[-i] > 1:
                kept[-i] = dims[-i]
    return (CHECK_ROWS, *kept)


def _kernel_matches_step(
    neuron: LayerAdapter, kernel: ChunkKernel, leaves: Sequence[Tensor], z: Tensor
) -> bool:
    """Kernel and step on the same random chunk (`CHECK_STEPS` steps, `_sample_shape`):
    outputs, states and membranes bitwise; gradients of a weighted sum of them with respect
    to the input, the initial state and the kernel's parameters within float32 round-off."""
    from spikeckpt.engine import tree as pytree

    params = [p for p in kernel.params if p.requires_grad]
    shape = _sample_shape(z.shape[1:], kernel.params)
    shapes = [shape] * len(leaves)
    if any(t.shape[1:] != z.shape[2:] for t in leaves):  # a cell weighting its own input
        shape = (CHECK_ROWS, *z.shape[2:])
        shapes = [(CHECK_ROWS, *t.shape[1:]) for t in leaves]
    # a start may mark a tensor requiring grad (Norse's IAFCell: p.v_reset); a check that
    # only wants its structure leaves the flags as they were (a probe froze them)
    flags = [(t, t.requires_grad) for t in kernel.params if t.is_leaf]
    spec = pytree.tree_structure(neuron.init_state(z[0, :1]))
    for t, flag in flags:
        t.requires_grad_(flag)
    results = []
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            for fused in (False, True):
                torch.manual_seed(0)
                x = torch.randn(CHECK_STEPS, *shape, dtype=leaves[0].dtype) * 2
                x = x.to(z.device)
                x.requires_grad_()
                start = [
                    (torch.randn(size, dtype=t.dtype) * 2).to(t.device).requires_grad_()
                    for t, size in zip(leaves, shapes, strict=True)
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
                    mems = (
                        None
                        if kernel.membrane is None
                        else torch.stack(cast(list[Tensor], [v for _, v in steps]))
                    )
                outs = [ys, *pytree.tree_leaves(state), *([] if mems is None else [mems])]
                taped = [o for o in outs if o.requires_grad]
                weights = [torch.linspace(-1, 1, o.numel()).to(o).reshape(o.shape) for o in taped]
                with tensor_hooks_held(params):  # a check's gradients, not yours
                    grads = torch.autograd.grad(
                        taped, [x, *start, *params], weights, allow_unused=True
                    )
                results.append(([o.detach() for o in outs], grads))
    except Exception:  # noqa: BLE001 - anything unexpected: keep the per-step call
        return False
    (outs_a, grads_a), (outs_b, grads_b) = results
    if not all(
        a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(outs_a, outs_b, strict=True)
    ):
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


def _cleanup(block: Block, *caches: Transposed | SparseLimit) -> Callable[[], None]:
    def cleanup() -> None:
        for layer in (*block.synapses, block.neuron):
            layer.cleanup()
        for cache in caches:
            cache.clear()

    return cleanup


def _kernel_limits(kernel: object) -> tuple[SparseLimit, ...]:
    """The gather limit of a Norse cell's own input product (its cleanup drops its sums)."""
    return (kernel.inputs.limit,) if isinstance(kernel, NorseCellKernel) else ()


def _plain_linear(synapses: Sequence[LayerAdapter]) -> nn.Linear | None:
    """The block's synapse when it is exactly one plain ``nn.Linear`` (its own ``forward``),
    else None."""
    inner = _batched_inner(synapses[0]) if len(synapses) == 1 else None
    linear = inner.module if inner is not None else None
    if type(linear) is not nn.Linear or "forward" in vars(linear):
        return None
    return linear


def _sparse_synapse(
    synapses: Sequence[LayerAdapter],
    sink: GradSink | None,
    transposed: Transposed,
    limit: SparseLimit,
) -> Callable[[Tensor | SparseChunk], Tensor] | None:
    """A synapse for inputs that need no gradient, gathering over their non-zeros (see the
    module docstring), or None unless the synapse is exactly one plain ``nn.Linear``. It takes
    the dense chunk or a packed train's `SparseChunk`; ``transposed`` keeps a small weight's
    transpose for the pass; ``limit`` is the block's gather limit."""
    linear = _plain_linear(synapses)
    if linear is None:
        return None
    dense = _synapse(synapses)

    def synapse(x: Tensor | SparseChunk) -> Tensor:
        if one_step_repeated(x):  # once for the chunk (as `LinearChunk` computes it too)
            return dense(x)
        found = sparse_positions(x, linear, limit)
        if found is None:
            return dense(x.dense() if isinstance(x, SparseChunk) else x)
        n_rows, rows, cols, values = found
        weight = linear.weight
        t_weight = transposed.of(weight)
        z = GatherLinear.apply(weight, linear.bias, n_rows, rows, cols, values, sink, t_weight)
        return z.reshape(*x.shape[:-1], z.shape[-1])

    return synapse


def _weight_sink(
    synapses: Sequence[LayerAdapter],
) -> tuple[GradSink | None, tuple[tuple[Tensor, GradSink], ...]]:
    """A gradient sink for the weight of a block whose synapse is one plain ``nn.Linear``
    (its sparse synapse adds each chunk's weight gradient into the engine's running sum)."""
    linear = _plain_linear(synapses)
    if linear is None:
        return None, ()
    sink = GradSink()
    return sink, ((linear.weight, sink),)


def layer_blocks(blocks: Sequence[Block], exact: bool = False) -> list[LayerBlock]:
    """The engine's view of each block (bottom-up). ``exact``: every synapse runs step by
    step, as the plain loop runs it (no ``sparse_synapse``, no product over a chunk), so its
    values are bitwise the loop's whatever the BLAS: one product over ``k * B`` rows may sum in
    another order than ``k`` products over ``B`` rows (cuBLAS does; this VM's CPU does not);
    a Norse recurrent cell's kernel keeps the cell's own input product per step."""
    out = []
    for index, block in enumerate(blocks):
        params = _block_params(block)
        kernel = block.neuron.chunk_kernel()
        if exact and isinstance(kernel, NorseCellKernel):
            kernel.inputs.gathers = False  # a Norse cell's own input product, per step
        sink, sinks = _weight_sink(block.synapses)
        transposed, limit = Transposed(), SparseLimit()
        linear = _plain_linear(block.synapses)
        out.append(
            LayerBlock(
                name=block.name,
                synapse=_synapse(block.synapses, per_step=exact, fresh=exact and index > 0),
                step=block.neuron.step,
                membrane=block.neuron.membrane,
                draws_random=_draws_random(block),
                params=params,
                cleanup=_cleanup(block, transposed, limit, *_kernel_limits(kernel)),
                sparse_synapse=None
                if exact
                else _sparse_synapse(block.synapses, sink, transposed, limit),
                sinks=sinks,
                fused=None if kernel is None else VerifiedKernel(block.neuron, kernel),
                affine=None
                if linear is None
                else LinearChunk(linear, transposed, limit, exact, fresh=exact and index > 0),
            )
        )
    return out


def with_current_modes(layers: Sequence[LayerBlock], blocks: Sequence[Block]) -> list[LayerBlock]:
    """``layers`` (made by `layer_blocks` from ``blocks``) with each block's ``draws_random``
    read now: a ``Dropout`` made in eval mode draws once the model is put in training mode,
    and the run must then replay its masks in the recomputation."""
    out = []
    for layer, block in zip(layers, blocks, strict=True):
        draws = _draws_random(block)
        # and the tensors its layers hold outside their parameters read now: one may require
        # grad since the blocks were made (Norse's IAFCell.initial_state marks its
        # p.v_reset, the initial state's v). Parameters stay those the blocks were made with:
        # others swapped in (functional_call) are refused (`refuse_swapped`)
        parts = (*block.synapses, block.neuron)
        known = {id(t) for t in (*layer.params, *(p for q in parts for p in q.module.parameters()))}
        extra = {id(t): t for part in parts for t in part.extra_params() if id(t) not in known}
        if layer.draws_random != draws or extra:
            layer = replace(layer, draws_random=draws, params=[*layer.params, *extra.values()])
        out.append(layer)
    return out


def _block_params(block: Block) -> list[Tensor]:
    """The tensors ``block``'s layers differentiate: their parameters and the tensors
    requiring grad that they hold outside them (``extra_params``, read now)."""
    params = {
        id(t): t
        for layer in (*block.synapses, block.neuron)
        for t in (*layer.module.parameters(), *layer.extra_params())
    }
    return list(params.values())


def draws_apart(blocks: Sequence[Block], model: nn.Module, auto: bool) -> str | None:
    """A warning for a layer-wise run of ``model`` in which two or more ``blocks`` draw
    random numbers (Dropout in training mode), else None. Each block draws for a chunk of
    steps before the next block runs, where your time loop draws at every position in turn
    at each step: other masks under the same seed (gradients exact for the masks drawn).
    One block drawing draws the loop's masks. ``auto``: ``granularity="auto"`` chose
    layer-wise."""
    drawing = [block for block in blocks if _draws_random(block)]
    if len(drawing) < 2:
        return None
    names = {id(m): name for name, m in model.named_modules()}
    found = [
        names.get(id(s.module), type(s.module).__name__)
        for block in drawing
        for s in block.synapses
        if isinstance(s.module, nn.modules.dropout._DropoutNd) and s.module.training
    ]
    chose = "granularity='auto' chose layer-wise" if auto else "granularity='layer'"
    return (
        f"spikeckpt: Dropout in {len(drawing)} blocks ({', '.join(map(repr, found[:4]))}) of a layer-wise "
        f"run ({chose}): each block draws its masks for a chunk of steps before the next "
        "block runs, where your time loop draws at every position in turn, so in training "
        "mode the masks differ from your loop's under the same seed (the gradients are exact "
        "for the masks drawn). For your loop's masks pass granularity='stack', or keep Dropout "
        "in one block"
    )
