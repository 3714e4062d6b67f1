"""One executor for every schedule: runs the actions of :mod:`spikeckpt.plans.schedule` on tensors.

The executor works on flat lists of tensors (state leaves) and a step function
``fn(t, leaves, x_leaves, check) -> (leaves, y_leaves)``. It keeps the current state, the
stored checkpoints (through :class:`~spikeckpt.storage.base.StateStore` tiers), the live tapes
and the running gradients, and counts memory in a :class:`~spikeckpt.storage.base.Ledger`.

Ledger convention (the simulator's, see :mod:`spikeckpt.plans.simulate`): after every action,
``ledger["device"]`` = bytes of the device checkpoints + bytes of the prefetch buffers + bytes
of the working state when it is not itself a device checkpoint + bytes saved by the live tapes
(counted by :class:`~spikeckpt.engine.probe.SavedBytes`). Remote states are counted under the
remote tier's name (``"host"`` or ``"disk"``) at their unpacked size; with ``storage="device"``
remote states are device memory and are counted under ``"device"``. With a step that saves the
same bytes every step, ``ledger.peak["device"]`` equals
``simulate(schedule, state_bytes=S, step_bytes=A).peak_bytes`` exactly.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from spikeckpt.engine.probe import SavedBytes
from spikeckpt.engine.tree import is_float, leaf_bytes
from spikeckpt.errors import StorageError
from spikeckpt.plans.schedule import Action, Advance, Backprop, Free, Load, Prefetch, Store, Tape
from spikeckpt.storage.base import Ledger, StateStore

StepFn = Callable[[int, list[Tensor], list[Tensor], bool], tuple[list[Tensor], list[Tensor]]]
YGrad = Callable[[int], Sequence[Tensor | None]]

__all__ = ["Executor", "RngState", "open_store"]


# ----------------------------------------------------------------------------- RNG


@dataclass(frozen=True)
class RngState:
    """CPU and CUDA generator states, captured before a step (as torch.utils.checkpoint does)."""

    cpu: Tensor
    cuda: tuple[tuple[int, Tensor], ...] = ()

    @staticmethod
    def capture(cuda_devices: Sequence[int]) -> RngState:
        cuda = tuple((d, torch.cuda.get_rng_state(d)) for d in cuda_devices)
        return RngState(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)


# ----------------------------------------------------------------------------- stores


class _FallbackStore:
    """Minimal tiers used until :func:`spikeckpt.storage.tiers.make_store` exists.

    ``device`` keeps references, ``host`` keeps CPU copies, ``disk`` writes one file per key in
    a private temporary folder (removed by :meth:`close`).
    """

    def __init__(self, kind: str, device: torch.device, ledger: Ledger, directory: Any) -> None:
        self.kind = kind
        self._device = device
        self._ledger = ledger
        self._items: dict[int, list[Tensor]] = {}
        self._sizes: dict[int, int] = {}
        self._folder: str | None = None
        if kind == "disk":
            try:
                self._folder = tempfile.mkdtemp(prefix="spikeckpt-", dir=directory)
            except OSError as err:
                raise StorageError(
                    f"cannot create a checkpoint folder in {directory}: {err}"
                ) from err

    def _path(self, key: int) -> str:
        assert self._folder is not None
        return os.path.join(self._folder, f"x{key}.pt")

    def put(self, key: int, tensors: Sequence[Tensor]) -> None:
        size = leaf_bytes(tensors)
        if self.kind == "device":
            self._items[key] = [t.detach() for t in tensors]
        elif self.kind == "host":
            self._items[key] = [t.detach().to("cpu", copy=True) for t in tensors]
        else:
            try:
                torch.save([t.detach().cpu() for t in tensors], self._path(key))
            except OSError as err:
                raise StorageError(f"cannot write checkpoint x_{key} to disk: {err}") from err
        self._sizes[key] = size
        self._ledger.add(self.kind, size)
        self._ledger.moved(self.kind, written=size)

    def prefetch(self, key: int) -> None:
        if self.kind == "disk" and key not in self._items:
            self._items[key] = torch.load(self._path(key), weights_only=True)

    def get(self, key: int) -> list[Tensor]:
        if self.kind == "disk":
            self.prefetch(key)
            tensors = self._items.pop(key)
        else:
            tensors = self._items[key]
        self._ledger.moved(self.kind, read=self._sizes[key])
        return [t.to(self._device) for t in tensors]

    def drop(self, key: int) -> None:
        self._items.pop(key, None)
        self._ledger.remove(self.kind, self._sizes.pop(key, 0))
        if self.kind == "disk":
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path(key))

    def close(self) -> None:
        for key in list(self._sizes):
            self._ledger.remove(self.kind, self._sizes.pop(key))
        self._items.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def open_store(
    kind: str, device: torch.device, ledger: Ledger, directory: str | os.PathLike | None = None
) -> StateStore:
    """A store of tier ``kind`` (``device``/``host``/``disk``) from the storage package.

    Falls back to a minimal built-in store while ``spikeckpt.storage.tiers`` is not available.
    """
    try:
        from spikeckpt.storage.tiers import make_store
    except ImportError:
        return _FallbackStore(kind, device, ledger, directory)  # type: ignore[return-value]
    return make_store(kind, device, ledger, directory=directory if kind == "disk" else None)


# ----------------------------------------------------------------------------- executor


@dataclass
class _Tape:
    """A taped segment: its start leaves (grad inputs), end leaves, outputs and input slices."""

    start: int
    stop: int
    first: list[Tensor]
    last: list[Tensor]
    ys: list[list[Tensor]]
    inputs: list[Tensor | None]
    nbytes: int


@dataclass
class Counters:
    """Step and byte counts of one run (filled while it executes)."""

    forward_steps: int = 0
    backward_steps: int = 0
    taped_steps: int = 0
    tape_bytes: int = 0
    state_bytes: int = 0


@dataclass
class Executor:
    """Runs schedule actions on tensors.

    Args:
        fn: the flat step ``fn(t, leaves, x_leaves, check) -> (leaves, y_leaves)``.
        inputs: time-first input leaves, each ``(T, ...)``; may live off the compute device.
        input_grad: which input leaves need a gradient.
        params: tensors (requiring grad) whose gradients are accumulated.
        device: the compute device.
        stores: ``{"device": store, "remote": store}``.
        remote_kind: ledger name of the remote tier (``"host"``, ``"disk"`` or ``"device"``).
        initial: the leaves of ``x_0``; ``initial_grad`` which of them need a gradient.
        emit: forward-phase callback ``emit(t, y_leaves)`` (the readout).
        cuda_devices: CUDA devices whose RNG is replayed.
        pack_tape: keep binary tensors saved by taped steps packed (1 bit or index lists).
    """

    fn: StepFn
    inputs: list[Tensor]
    input_grad: list[bool]
    params: list[Tensor]
    device: torch.device
    stores: dict[str, StateStore]
    remote_kind: str
    initial: list[Tensor]
    initial_grad: list[bool]
    emit: Callable[[int, list[Tensor]], None] | None
    cuda_devices: list[int] = field(default_factory=list)
    pack_tape: bool = False
    ledger: Ledger = field(default_factory=Ledger)
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self) -> None:
        self.current: list[Tensor] | None = list(self.initial)
        self.index: int | None = 0
        self.stored_here = False  # the current state is a device checkpoint
        self.held: dict[str, dict[int, int]] = {"device": {}, "remote": {}}
        self.prefetched: dict[int, int] = {}
        self.rng: dict[int, RngState] = {}
        self.tapes: list[_Tape] = []
        self.in_forward = True
        self.check = True
        self.device_bytes = 0
        self.closed = False
        self.grad_state: list[Tensor | None] = []
        self.grad_params: list[Tensor | None] = [None] * len(self.params)
        self.grad_inputs: list[Tensor | None] = [None] * len(self.inputs)
        self.y_grad: YGrad | None = None
        self._lock = threading.Lock()
        self.counters.state_bytes = leaf_bytes(self.initial)
        self._account()

    # -- bookkeeping -----------------------------------------------------------------

    def _account(self) -> None:
        """Set ``ledger["device"]`` to the simulator's formula for the present moment."""
        now = sum(self.held["device"].values()) + sum(self.prefetched.values())
        if self.remote_kind == "device":
            now += sum(self.held["remote"].values())
        if self.current is not None and not self.stored_here:
            now += leaf_bytes(self.current)
        now += sum(tape.nbytes for tape in self.tapes)
        delta, self.device_bytes = now - self.device_bytes, now
        if delta >= 0:
            self.ledger.add("device", delta)
        else:
            self.ledger.remove("device", -delta)

    def close(self) -> None:
        """Release stores (files, buffers), tapes and states. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self.tapes.clear()
        self.current = None
        self.initial = []
        errors: list[BaseException] = []
        for store in self.stores.values():
            try:
                store.close()
            except BaseException as err:  # noqa: BLE001 - close every store, re-raise first
                errors.append(err)
        if errors:
            raise errors[0]

    # -- running -----------------------------------------------------------------

    def run(self, actions: Sequence[Action]) -> None:
        """Execute ``actions`` in order."""
        for action in actions:
            kind = type(action)
            if kind is Advance or kind is Tape:
                self._steps(action.start, action.stop, taped=kind is Tape)  # type: ignore[union-attr]
            elif kind is Backprop:
                self._backprop(action.start, action.stop)  # type: ignore[union-attr]
            elif kind is Store:
                self._store(action.index, action.tier)  # type: ignore[union-attr]
            elif kind is Load:
                self._load(action.index, action.tier)  # type: ignore[union-attr]
            elif kind is Free:
                self._free(action.index, action.tier)  # type: ignore[union-attr]
            elif kind is Prefetch:
                self._prefetch(action.index)  # type: ignore[union-attr]
            else:  # pragma: no cover - simulate() rejects these first
                raise TypeError(f"unknown action {action!r}")
            self._account()

    def _x(self, t: int) -> list[Tensor]:
        out = []
        for leaf in self.inputs:
            x = leaf[t]
            if x.device != self.device:
                x = x.to(self.device, non_blocking=True)
            out.append(x)
        return out

    def _steps(self, a: int, b: int, *, taped: bool) -> None:
        assert self.current is not None and self.index == a
        leaves = self.current
        fn, emit, check = self.fn, self.emit if self.in_forward else None, self.check
        if not taped:
            with torch.no_grad():
                for t in range(a, b):
                    leaves, ys = fn(t, leaves, self._x(t), check)
                    if emit is not None:
                        emit(t, ys)
        else:
            first = [
                x.detach().requires_grad_(is_float(x) and (a > 0 or self.initial_grad[i]))
                for i, x in enumerate(leaves)
            ]
            segs: list[Tensor | None] = []
            for leaf, need in zip(self.inputs, self.input_grad, strict=False):
                if need:
                    segs.append(leaf[a:b].detach().to(self.device).requires_grad_())
                else:
                    segs.append(None)
            leaves, tape_ys = first, []
            with (
                torch.enable_grad(),
                SavedBytes(exclude=self.params, pack=self.pack_tape) as counter,
            ):
                plain = any(seg is None for seg in segs)
                for t in range(a, b):
                    moved = self._x(t) if plain else segs
                    xs = [
                        seg[t - a] if seg is not None else x  # type: ignore[index]
                        for seg, x in zip(segs, moved, strict=False)
                    ]
                    leaves, ys = fn(t, leaves, xs, check)
                    tape_ys.append(ys)
                    if emit is not None:
                        emit(t, [y.detach() for y in ys])
            self.tapes.append(_Tape(a, b, first, leaves, tape_ys, segs, counter.bytes))
            self.counters.taped_steps += b - a
            self.counters.tape_bytes += counter.bytes
        self.counters.forward_steps += b - a
        self.current, self.index, self.stored_here = leaves, b, False

    def _store(self, i: int, tier: str) -> None:
        assert self.current is not None and self.index == i
        self.stores[tier].put(i, [x.detach() for x in self.current])
        size = self.held[tier][i] = leaf_bytes(self.current)
        if tier == "remote":
            self._remote_count(size, written=size)
        if i not in self.rng:
            self.rng[i] = RngState.capture(self.cuda_devices)
        if tier == "device":
            self.stored_here = True
            self.current = [x.detach() for x in self.current]

    def _remote_count(self, held: int, *, written: int = 0, read: int = 0) -> None:
        """Count remote bytes under the remote tier's name (device-held ones in _account)."""
        kind = self.remote_kind
        if kind != "device":
            if held >= 0:
                self.ledger.add(kind, held)
            else:
                self.ledger.remove(kind, -held)
        self.ledger.moved(kind, written=written, read=read)

    def _load(self, i: int, tier: str) -> None:
        self.current = self.stores[tier].get(i)
        self.index = i
        self.stored_here = tier == "device"
        if tier == "remote" and self.prefetched.pop(i, None) is None:
            self._remote_count(0, read=self.held["remote"][i])
        self.rng[i].restore()

    def _free(self, i: int, tier: str) -> None:
        self.stores[tier].drop(i)
        size = self.held[tier].pop(i)
        if tier == "remote":
            self._remote_count(-size)
        if tier == "device" and self.index == i:
            self.stored_here = False
        if i not in self.held["device"] and i not in self.held["remote"]:
            self.rng.pop(i, None)

    def _prefetch(self, i: int) -> None:
        self.stores["remote"].prefetch(i)
        size = self.prefetched[i] = self.held["remote"][i]
        self._remote_count(0, read=size)

    # -- backward ------------------------------------------------------------------

    def start_backward(self, grad_final: Sequence[Tensor | None], y_grad: YGrad) -> None:
        """Enter the backward phase with ``dL/dx_T`` and a function giving ``dL/dy_t``."""
        self.in_forward = False
        self.check = False
        self.grad_state = list(grad_final)
        self.y_grad = y_grad

    def _backprop(self, a: int, b: int) -> None:
        if self.in_forward:  # the first Backprop ends the forward phase (simulate's rule)
            raise RuntimeError("Backprop reached during the forward phase")
        tape = self.tapes.pop()
        assert (tape.start, tape.stop) == (a, b) and self.y_grad is not None
        outs: list[Tensor] = []
        grads: list[Tensor] = []
        for t in range(a, b):
            for y, g in zip(tape.ys[t - a], self.y_grad(t), strict=False):
                if g is not None and y.requires_grad:
                    outs.append(y)
                    grads.append(g)
        for x, g in zip(tape.last, self.grad_state, strict=False):
            if g is not None and x.requires_grad:
                outs.append(x)
                grads.append(g)
        wrt_state = [i for i, x in enumerate(tape.first) if x.requires_grad]
        wrt_inputs = [j for j, seg in enumerate(tape.inputs) if seg is not None]
        inputs = [tape.first[i] for i in wrt_state] + self.params
        inputs += [tape.inputs[j] for j in wrt_inputs]  # type: ignore[misc]
        new_state: list[Tensor | None] = [None] * len(tape.first)
        if outs and inputs:
            with torch.enable_grad():
                # Feed the gradient accumulated so far into each parameter first, so the sum
                # runs in the same order as one backward pass over the whole loop (bitwise).
                for p, acc in zip(self.params, self.grad_params, strict=False):
                    if acc is not None:
                        outs.append(p.view_as(p))
                        grads.append(acc)
                found = torch.autograd.grad(outs, inputs, grads, allow_unused=True)
            n = len(wrt_state)
            for i, g in zip(wrt_state, found[:n], strict=False):
                new_state[i] = g
            for k, g in enumerate(found[n : n + len(self.params)]):
                if g is not None:
                    self.grad_params[k] = g
            for j, g in zip(wrt_inputs, found[n + len(self.params) :], strict=False):
                if g is None:
                    continue
                buf = self.grad_inputs[j]
                if buf is None:
                    buf = self.grad_inputs[j] = torch.zeros_like(self.inputs[j])
                buf[a:b] = g.to(buf.device)
        del tape
        self.grad_state = new_state
        self.counters.backward_steps += b - a
        self.current, self.index, self.stored_here = None, None, False
