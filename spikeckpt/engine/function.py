"""The one autograd Function every run goes through, and the base of its jobs.

A run (the schedule executor of [`spikeckpt.scan`][spikeckpt.engine.scan.scan], or a layer-wise run) is a *job*: an
object with ``forward(needs, tensors) -> outputs``, ``backward(grads) -> input grads`` and
``close()``. `run_job` applies it as one custom `torch.autograd.Function`:

- the forward records the autocast state, so recomputation in backward runs under the same one;
- the backward runs inside `backward_draws` over the run's CUDA devices (replayed generator
  states never leak to the caller, which sees the generators where the backward functions'
  own draws leave them, as after the plain loop's backward), inside
  `recompute_phase`, and under the recorded autocast state;
- the job's stores (disk files) are closed when the autograd graph is dropped without backward;
- a second-order backward (``create_graph=True``) is refused with a clear error instead of
  silently returning gradients without a graph;
- an input the loss does not reach (no gradient, as in the plain loop) keeps ``.grad`` None
  even where its own tensor hooks cannot take None (`guard_hooks`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from spikeckpt.engine.amp import autocast_kinds
from spikeckpt.engine.phase import recompute_phase
from spikeckpt.engine.rng import backward_draws
from spikeckpt.engine.stats import ScanStats
from spikeckpt.errors import UsageError

__all__ = [
    "SECOND_BACKWARD",
    "Job",
    "close_runs_since",
    "most_open_runs",
    "refuse_func_transforms",
    "run_job",
    "run_serial",
    "watch_open_runs",
]

#: the end of the message a second backward through one forward gets (scan's and layer-wise)
SECOND_BACKWARD = (
    " (a second backward(retain_graph=True), torch.autograd.functional.jacobian or hessian, "
    "autograd.grad twice over the same outputs); run the forward again for each backward. "
    "A final state (return_state=True) passed on undetached as the next call's state= "
    "(windows of a long sequence) takes the next window's backward into this one again: "
    "detach it between windows (truncated BPTT), or add the windows' losses and call "
    "backward() once"
)

_NO_DOUBLE_BACKWARD = (
    "spikeckpt: a checkpointed time loop has no second-order gradients: backward was called "
    "with create_graph=True (double backward, e.g. a gradient penalty) through a wrapped model "
    "or scan. Compute the penalty on a plain (unwrapped) loop, or drop create_graph=True."
)

_NO_TRANSFORMS = (
    "spikeckpt: torch.func transforms (torch.func.grad, vmap, jacrev, jacfwd, jvp, "
    "hessian) cannot run through a checkpointed time loop: its backward recomputes steps "
    "outside the transform. Take gradients with loss.backward() or torch.autograd.grad; "
    "torch.func.functional_call(seq, params, (x,)) on its own works (stack granularity), "
    "and so does a plain (unwrapped) loop under the transform."
)

_NO_BATCHED_GRADS = (
    "spikeckpt: torch.autograd.grad(..., is_grads_batched=True) runs the backward under "
    "vmap, which a checkpointed time loop's backward (recomputed steps, in-place stores) "
    "cannot run in. Take one row of grad_outputs per call instead, running the forward again "
    "for each (a run backs up once), or compute per-sample gradients on a plain (unwrapped) "
    "loop."
)


def _under_transform() -> bool:
    """Whether a ``torch.func`` transform (or a batched backward's vmap) is active."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _batched(grads: Sequence[Tensor | None]) -> bool:
    """Whether the backward runs under ``autograd.grad(..., is_grads_batched=True)``'s vmap
    (its gradients are legacy batched tensors)."""
    functorch = getattr(torch._C, "_functorch", None)
    legacy = getattr(functorch, "is_legacy_batchedtensor", None)
    batched = getattr(functorch, "is_batchedtensor", None)
    return _under_transform() or any(
        g is not None and any(f is not None and f(g) for f in (legacy, batched)) for g in grads
    )


def refuse_func_transforms() -> None:
    """Raise [`UsageError`][spikeckpt.errors.UsageError] inside a ``torch.func`` transform
    (``grad``, ``vmap``, ...): the one Function of a run is not a functorch-aware Function,
    and torch's own error there (``setup_context``) does not say what to do."""
    if _under_transform():
        raise UsageError(_NO_TRANSFORMS)


class Job:
    """Base of a run's job: where it runs and stores, its stats, and the backward context.

    Subclasses implement `forward`, `backward` and `close`.

    Args:
        device: the compute device.
        cuda: the CUDA devices whose generators the run uses.
        storage: the tier its off-device data go to (``"device"``, ``"host"``, ``"disk"``).
        directory: the parent folder of the disk tier's files (None: the temp folder).
        stats: the run's [`ScanStats`][spikeckpt.engine.stats.ScanStats], filled as it runs.
    """

    def __init__(
        self,
        device: torch.device,
        cuda: Sequence[int],
        storage: str,
        directory: str | os.PathLike[str] | None,
        stats: ScanStats,
    ) -> None:
        self.device = device
        self.cuda_devices = list(cuda)
        self.storage = storage
        self.directory = directory if storage == "disk" else None
        self.stats = stats
        self.autocast: list[tuple[str, bool, torch.dtype]] = []
        self.autocast_cache = True
        #: positions of the Function's input tensors that backward reads again (autograd's
        #: version counter then raises if they were modified in place in between)
        self.referenced: list[int] = []

    def forward(self, needs: Sequence[bool], tensors: Sequence[Tensor]) -> list[Tensor]:
        """Run the forward phase on the Function's input tensors; return its outputs."""
        raise NotImplementedError

    def backward(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        """Run the backward phase; one gradient (or None) per input tensor."""
        raise NotImplementedError

    def close(self) -> None:
        """Release stores, tapes and states. Idempotent."""
        raise NotImplementedError

    def record_context(self) -> None:
        """Remember the autocast state of the forward pass (called by `run_job`)."""
        self.autocast = [
            (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in autocast_kinds(self.device)
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()

    @contextlib.contextmanager
    def backward_context(self) -> Iterator[None]:
        """The backward's own draws one stream (`backward_draws`: the caller's generators
        end where that stream ends), recompute phase on, the forward's autocast state."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(backward_draws(self.cuda_devices))
            stack.enter_context(recompute_phase(backward=True))
            for kind, enabled, dtype in self.autocast:
                stack.enter_context(
                    torch.autocast(kind, dtype, enabled, cache_enabled=self.autocast_cache)
                )
            yield


def _hooked(tensors: Sequence[Tensor]) -> list[tuple[int, weakref.ref[Tensor]]]:
    """(position, weak reference) of each of ``tensors`` that has tensor hooks of its own."""
    return [
        (i, weakref.ref(t)) for i, t in enumerate(tensors) if getattr(t, "_backward_hooks", None)
    ]


def _none_passing(hook: Any) -> Any:
    """``hook`` that passes None through without calling ``hook`` (marked, so never wrapped
    twice)."""
    if getattr(hook, "_spikeckpt_none_passing", False):
        return hook

    def guarded(grad: Tensor | None) -> Any:
        return None if grad is None else hook(grad)

    guarded._spikeckpt_none_passing = True  # type: ignore[attr-defined]
    return guarded


def guard_hooks(tensor: Tensor) -> None:
    """Let ``tensor``'s hooks (``tensor.register_hook``) pass a None gradient through.

    Where a custom Function returns None for an input, autograd still calls that input's
    tensor hooks, with None; in the plain loop the same input is not reached and its hooks
    are not called. A hook written for tensors then crashes (Norse's recurrent cells zero
    their weight gradient's diagonal: ``gradient.clone()``). Wrapped in place, under the same
    keys (their handles still remove them); a hook given a tensor runs as before.
    """
    # a dict here: the caller guards tensors that had hooks when the forward ran
    hooks = cast("dict[int, Callable[[Tensor], Tensor | None]]", tensor._backward_hooks)
    for key, hook in list(hooks.items()):
        hooks[key] = _none_passing(hook)


#: the runs whose graph is alive and not backpropagated yet, by their serial numbers
_OPEN: weakref.WeakValueDictionary[int, Job] = weakref.WeakValueDictionary()
_NEXT = [0]  # the serial number the next run gets
_WATCH = [0, 0]  # runs counted from this serial on; the most open at once among them


def run_serial() -> int:
    """The serial number the next run's forward gets (runs started from now on have this one
    or more): mark a training step's start for `close_runs_since`."""
    return _NEXT[0]


def watch_open_runs() -> None:
    """From now on, count how many runs are open at once (`most_open_runs`)."""
    _WATCH[:] = [_NEXT[0], 0]


def most_open_runs() -> int:
    """The most runs open at once (taped, not yet backpropagated) among those started since
    `watch_open_runs`: runs whose backward each ends before the next (an optimizer's closure
    evaluated again, truncated BPTT) count one."""
    return _WATCH[1]


def close_runs_since(serial: int) -> int:
    """Close every run started at or after ``serial`` whose graph is alive and not
    backpropagated (its checkpoints, stored trains, files freed; a backward of it then raises
    `UsageError`): a training step given up after out of memory holds them in its graph,
    which the framework's frames still reference while the step is retried. Returns how
    many."""
    closing = [(n, job) for n, job in list(_OPEN.items()) if n >= serial]
    for n, job in closing:
        job.close()
        _OPEN.pop(n, None)
    return len(closing)


def _opened(job: Job) -> int:
    """Register ``job``'s run as open; its serial number."""
    serial = _NEXT[0]
    _OPEN[serial] = job
    _NEXT[0] += 1
    _WATCH[1] = max(_WATCH[1], sum(1 for n in list(_OPEN.keys()) if n >= _WATCH[0]))
    return serial


def _owned(t: Any) -> Any:
    """``t``, copied when it is a view: a job's output may be a row of a chunk (a layer-wise
    final state ``mem[-1]``, an ``unbind`` row), which kept the whole ``(k, B, ...)`` chunk alive
    and which autograd refuses to change in place (``state.v.detach_()``, ``out -= m``), where
    the plain loop's tensors allow it."""
    return t.clone() if isinstance(t, Tensor) and t._is_view() else t


class _RunFunction(torch.autograd.Function):
    """Inputs: (job, *tensors); outputs: whatever ``job.forward`` returns."""

    @staticmethod
    def forward(ctx: Any, job: Job, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.set_materialize_grads(False)
        job.record_context()
        outs = job.forward(ctx.needs_input_grad[1:], tensors)
        ctx.job = job
        ctx.hooked = _hooked(tensors)
        ctx.save_for_backward(*(tensors[i] for i in job.referenced))
        weakref.finalize(ctx, job.close)  # free stores (disk files) when the graph is dropped
        ctx.serial = _opened(job)
        return tuple(_owned(t) for t in outs)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        """Forward-mode AD (``torch.autograd.forward_ad`` dual numbers): refused clearly."""
        raise UsageError(_NO_TRANSFORMS)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # Grad mode is on only in a create_graph=True backward: the gradients computed below
        # would have no graph, so a second-order term would silently vanish. Refuse it.
        if torch.is_grad_enabled():
            raise UsageError(_NO_DOUBLE_BACKWARD)
        if _batched(grads):
            raise UsageError(_NO_BATCHED_GRADS)
        ctx.saved_tensors  # noqa: B018  (raises if a referenced input was modified in place)
        out = ctx.job.backward(grads)
        _OPEN.pop(ctx.serial, None)
        for i, ref in ctx.hooked:
            tensor = ref()
            if out[i] is None and tensor is not None:
                guard_hooks(tensor)
        return (None, *out)


def run_job(job: Job, tensors: Sequence[Any]) -> list[Tensor]:
    """Apply ``job`` as one autograd Function to ``tensors`` (a packed input train among them
    passes as it is); returns its outputs."""
    refuse_func_transforms()
    return list(_RunFunction.apply(job, *tensors))
