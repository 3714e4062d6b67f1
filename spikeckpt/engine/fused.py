"""A neuron run over a whole time chunk as one autograd node: the engine's side.

The layer-wise engine hands each block's neuron a chunk of ``k`` steps of synaptic input
``z (k, B, ...)``. Stepped under autograd, every step records a small graph that backward then
walks node by node: for the small tensors of one SNN step that bookkeeping, not the arithmetic,
is the cost. A `ChunkKernel` runs the chunk's recurrence instead with plain tensor ops,
without autograd, in its forward pass (states and spikes bitwise the framework's own step's)
and again, keeping what its gradients need, in the recomputation; its backward runs the state
gradient back through the chunk with hand-derived formulas. `run_fused` wraps a kernel in
one `torch.autograd.Function` node per chunk.

The engine knows kernels only through this protocol; the adapters build them for the neurons
they know (`spikeckpt.adapters.kernels`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from spikeckpt.engine import tree as pytree

__all__ = ["ChunkKernel", "Emit", "Emitted", "EmittedGrad", "run_fused"]

State = Any
#: the state leaves a kernel emits per step (`ChunkKernel.forward`'s ``emit``), or None
Emit = tuple[int, ...] | None
#: a kernel's per-step output besides the spikes: the membrane, or the emitted state leaves
Emitted = Tensor | tuple[Tensor, ...] | None
#: its gradient: one tensor, or one per emitted leaf (None where it has none)
EmittedGrad = Tensor | Sequence[Tensor | None] | None


class ChunkKernel(Protocol):
    """A neuron's recurrence over a chunk, forward and backward, without autograd.

    Attributes:
        name: what ran, for stats (``"fused"``, ``"compiled"``).
        params: the tensors the recurrence uses that may require grad.
        membrane: the index of the membrane among the state's leaves (``pytree`` order), or
            None when the neuron has none.
        emits_states: whether `forward` and `backward` take ``emit``: the kernel then returns
            the state leaves named there after each step (several per-step outputs, e.g. a
            neuron's call returning its current and its membrane), and takes their gradients.
        binary_leaves: the state leaves (``pytree`` order) that are the neuron's own spikes,
            exactly 0 or 1 whenever the kernel accepts a chunk (a recurrent neuron carrying
            its last spikes; empty where a graded factor may scale them): the planner counts
            them bit-packed in the stored chunk states, as the store keeps them.
        binary_output: whether its output ``y`` is exactly 0 or 1 (spikes with no graded
            factor, or a fixed factor of 1): the next block's stored input train is then
            counted bit-packed; False, dense, whatever the probe's first step showed.
    """

    name: str
    membrane: int | None
    emits_states: bool

    # read-only: kernels give these as plain attributes or as properties
    @property
    def params(self) -> tuple[Tensor, ...]: ...

    @property
    def binary_leaves(self) -> tuple[int, ...]: ...

    @property
    def binary_output(self) -> bool: ...

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        """Whether this chunk can run fused (shapes and dtypes the kernel handles)."""

    def forward(
        self,
        leaves: list[Tensor],
        z: Tensor,
        keep: bool,
        want_mem: bool,
        want_y: bool = True,
        into: Tensor | None = None,
        emit: Emit = None,
    ) -> tuple[list[Tensor], Tensor | None, Emitted, Any]:
        """``(final leaves, y (k, B, ...), mem (k, B, ...) or None, saved)``; ``saved`` (with
        ``keep``): a tuple of tensors (or None) that `backward` gets back; ``mem`` the
        membrane after each step (with ``want_mem``), or with ``emit`` a tuple of the state
        leaves numbered there after each step, ``(k, B, ...)`` each. Without ``want_y`` (a
        backward that needs only ``saved``) a kernel may return None for ``y``. ``into``: a
        ``(k + 1, B, ...)`` buffer whose rows ``1..`` are ``z``, which a kernel may overwrite
        with what it keeps (``z`` is then consumed)."""

    def backward(
        self,
        saved: Any,
        g_y: Tensor | None,
        g_final: list[Tensor | None],
        g_mem: EmittedGrad,
        need_z: bool,
        need_params: Sequence[bool],
        consume: bool = False,
        emit: Emit = None,
    ) -> tuple[Tensor | None, list[Tensor | None], list[Tensor | None]]:
        """``(dL/dz (k, B, ...), dL/d initial leaves, dL/d params)`` (None where not needed);
        ``g_mem``: dL/d ``mem``, or with ``emit`` a tuple of dL/d each emitted leaf (None
        where it has none); with ``consume`` the kernel may overwrite ``saved`` (its last
        backward)."""


def run_fused(
    kernel: ChunkKernel,
    state: State,
    z: Tensor,
    want_mem: bool,
    emit: Emit = None,
) -> tuple[State, Tensor, Emitted]:
    """Run ``kernel`` over ``z (k, B, ...)`` from ``state``.

    Returns ``(final state, y (k, B, ...), mem)``: ``mem`` the membrane ``(k, B, ...)``, or
    with ``emit`` (a kernel that `emits_states`) the tuple of those state leaves after each
    step, or None without ``want_mem``; differentiable with respect to ``z``, the state's
    floating leaves and ``kernel.params`` in grad mode.
    """
    leaves, spec = pytree.tree_flatten(state)
    params = [p for p in kernel.params if p.requires_grad]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (z, *leaves, *params)):
        with torch.no_grad():
            final, ys, mems, _ = kernel.forward(list(leaves), z, False, want_mem, emit=emit)
        return pytree.tree_unflatten(final, spec), cast(Tensor, ys), mems  # want_y: made
    outs = _FusedChunk.apply(kernel, want_mem, emit, len(leaves), z, *leaves, *params)
    m = len(leaves)
    final = list(outs[1 : 1 + m])
    mem = (tuple(outs[1 + m :]) if emit is not None else outs[1 + m]) if want_mem else None
    return pytree.tree_unflatten(final, spec), outs[0], mem


class _FusedChunk(torch.autograd.Function):
    """Inputs ``(kernel, want_mem, emit, m, z, *state leaves, *params)``; outputs ``(y,
    *final leaves[, mem | *emitted leaves])``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        kernel: ChunkKernel,
        want_mem: bool,
        emit: Emit,
        m: int,
        z: Tensor,
        *rest: Tensor,
    ) -> tuple[Tensor, ...]:
        final, ys, mems, saved = kernel.forward(list(rest[:m]), z, True, want_mem, emit=emit)
        ctx.kernel, ctx.m, ctx.want_mem, ctx.emit = kernel, m, want_mem, emit
        # saved through autograd (its saved-tensor hooks and accounting see them)
        ctx.present = [t is not None for t in saved]
        ctx.save_for_backward(*(t for t in saved if t is not None))
        ctx.set_materialize_grads(False)
        outs = [cast(Tensor, ys), *final]  # want_y: made
        if want_mem:
            assert mems is not None
            outs.extend(mems if isinstance(mems, tuple) else [mems])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        m = ctx.m
        it = iter(ctx.saved_tensors)
        saved = tuple(next(it) if present else None for present in ctx.present)
        g_mem: EmittedGrad = None
        if ctx.want_mem:
            g_mem = tuple(grads[1 + m :]) if ctx.emit is not None else grads[1 + m]
        needs = ctx.needs_input_grad
        g_z, g_state, g_params = ctx.kernel.backward(
            saved,
            grads[0],
            list(grads[1 : 1 + m]),
            g_mem,
            needs[4],
            needs[5 + m :],
            emit=ctx.emit,
        )
        g_state = [g if need else None for g, need in zip(g_state, needs[5 : 5 + m], strict=True)]
        return (None, None, None, None, g_z if needs[4] else None, *g_state, *g_params)
