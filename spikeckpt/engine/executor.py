"""One executor for every schedule: runs the actions of [`spikeckpt.plans.schedule`][spikeckpt.plans.schedule] on tensors.

The executor works on flat lists of tensors (state leaves) and a step function
``fn(t, leaves, x_leaves, check) -> (leaves, y_leaves)``. It keeps the current state, the
stored checkpoints (through [`StateStore`][spikeckpt.storage.base.StateStore] tiers), the live tapes
and the running gradients, and counts memory in a [`Ledger`][spikeckpt.storage.base.Ledger].

Ledger convention (the simulator's, see `spikeckpt.plans.simulate`): after every action,
``ledger["device"]`` = bytes of the device checkpoints + bytes of the prefetch buffers + bytes
of the working state when it is not itself a device checkpoint + bytes saved by the live tapes
(counted by `SavedBytes` for the first two steps of each taped
segment, the second step's count charged for each later step; every step with ``pack_tape``).
Remote states are counted under the remote tier's name (``"host"`` or
``"disk"``) at their unpacked size; with ``storage="device"`` remote states are device memory
and are counted under ``"device"``. With a step that saves the same bytes every step,
``ledger.peak["device"]`` equals
``simulate(schedule, state_bytes=S, step_bytes=A).peak_bytes`` exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spikeckpt.engine.grad import FeedGrads, grad
from spikeckpt.engine.inputs import is_packed, step_of
from spikeckpt.engine.rng import RngState
from spikeckpt.engine.saved import SavedBytes
from spikeckpt.engine.sums import plain, sum_in_place_from_first
from spikeckpt.engine.tree import is_float, leaf_bytes
from spikeckpt.errors import ConfigTypeError, UsageError
from spikeckpt.plans.schedule import Action, Advance, Backprop, Free, Load, Prefetch, Store, Tape
from spikeckpt.storage.base import Ledger, StateStore

StepFn = Callable[[int, list[Tensor], list[Tensor], bool], tuple[list[Tensor], list[Tensor]]]
YGrad = Callable[[int], Sequence[Tensor | None]]

__all__ = ["Executor", "StepFn", "YGrad"]


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
        inputs: time-first input leaves, each ``(T, ...)``; may live off the compute device. A
            packed train (`spikeckpt.engine.inputs`) is unpacked one step at a time on
            the compute device (``x.step(t, device)``) and gets no gradient.
        input_grad: which input leaves need a gradient (never a packed train).
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
        self._sums_started = False  # `sum_in_place_from_first` ran (the first Backprop)
        self.grad_inputs: list[Tensor | None] = [None] * len(self.inputs)
        self.y_grad: YGrad | None = None
        self._lock = threading.Lock()
        self.counters.state_bytes = leaf_bytes(self.initial)
        # Running byte totals behind _account (the ledger is updated after every action).
        self._held_bytes = {"device": 0, "remote": 0}
        self._prefetched_bytes = 0
        self._tape_bytes = 0
        self._current_bytes = self.counters.state_bytes
        # RNG replay: `None` until the forward phase ends, then whether any step drew from the
        # global generators (see end_forward).
        self.rng_used: bool | None = None
        self._rng_start = RngState.capture(self.cuda_devices)
        self._rng_last: RngState | None = self._rng_start
        # Per-step input slices: views made once (indexing a (T, ...) tensor per step costs
        # more than the list lookup); leaves off the compute device are sliced and moved,
        # packed trains unpacked one step at a time.
        self._x_views: list[Sequence[Tensor] | None] = [
            leaf.unbind(0) if not is_packed(leaf) and leaf.device == self.device else None
            for leaf in self.inputs
        ]
        self._x_local = all(views is not None for views in self._x_views)
        self._saved: SavedBytes | None = None
        self.ledger.add("device", 0)
        self._account()

    # -- bookkeeping -----------------------------------------------------------------

    def _account(self) -> None:
        """Set ``ledger["device"]`` to the simulator's formula for the present moment."""
        now = self._held_bytes["device"] + self._prefetched_bytes + self._tape_bytes
        if self.remote_kind == "device":
            now += self._held_bytes["remote"]
        if self.current is not None and not self.stored_here:
            now += self._current_bytes
        delta, self.device_bytes = now - self.device_bytes, now
        if delta > 0:
            self.ledger.add("device", delta)
        elif delta < 0:
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
        self._x_views = []
        errors: list[BaseException] = []
        for store in self.stores.values():
            try:
                store.close()
            except BaseException as err:  # noqa: BLE001 - close every store, re-raise first
                errors.append(err)
        if errors:
            raise errors[0]

    # -- running -----------------------------------------------------------------

    def run(self, actions: Iterable[Action]) -> None:
        """Execute ``actions`` in order."""
        account = self._account
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
                raise ConfigTypeError(f"unknown action {action!r}")
            account()

    def end_forward(self) -> None:
        """Call after the forward phase: decide whether RNG states need replaying.

        Checkpoints remember the generator states (CPU and ``cuda_devices``) so that
        recomputation draws the same random numbers. When the generators are exactly where
        they were before the forward phase, no step drew from them: every step is then
        deterministic given its state and input, the recomputed steps (the same steps on the
        same states) draw nothing either, and the backward phase neither captures nor restores
        RNG states (one capture per stored checkpoint and one restore per load saved). The
        forward phase evaluates every step once, so a step that draws only at some ``t`` is
        still seen. (Skipping restores never changes the generators the caller sees: the
        backward phase leaves them where its own draws end, `backward_draws`.)
        """
        if self.rng_used is None:
            self.rng_used = not RngState.capture(self.cuda_devices).same_as(self._rng_start)
            if not self.rng_used:
                self.rng.clear()

    def _x(self, t: int) -> list[Tensor]:
        if self._x_local:
            return [views[t] for views in self._x_views]  # type: ignore[index]
        out = []
        for leaf, views in zip(self.inputs, self._x_views, strict=True):
            if views is not None:
                out.append(views[t])
            else:
                out.append(step_of(leaf, t, self.device))
        return out

    def _steps(self, a: int, b: int, *, taped: bool) -> None:
        assert self.current is not None and self.index == a
        leaves = self._taped(a, b) if taped else self._untaped(a, b)
        self.counters.forward_steps += b - a
        if leaves is not self.current:
            self._current_bytes = leaf_bytes(leaves)
        self.current, self.index, self.stored_here = leaves, b, False

    def _untaped(self, a: int, b: int) -> list[Tensor]:
        """Steps ``a..b-1`` without a tape; returns the state leaves after them."""
        leaves = self.current
        assert leaves is not None
        fn, emit, check, x = self.fn, self.emit if self.in_forward else None, self.check, self._x
        with torch.no_grad():
            for t in range(a, b):
                leaves, ys = fn(t, leaves, x(t), check)
                if emit is not None:
                    emit(t, ys)
        return leaves

    def _segments(self, a: int, b: int) -> list[Tensor | None]:
        """Steps ``a..b-1`` of each input that needs a gradient, as a leaf requiring grad
        (None for the others)."""
        segs: list[Tensor | None] = []
        for leaf, need in zip(self.inputs, self.input_grad, strict=False):
            if need:
                segs.append(leaf[a:b].detach().to(self.device).requires_grad_())
            else:
                segs.append(None)
        return segs

    def _taped(self, a: int, b: int) -> list[Tensor]:
        """Steps ``a..b-1`` taped (kept in `tapes`); returns the state leaves after."""
        assert self.current is not None
        fn, emit, check, x = self.fn, self.emit if self.in_forward else None, self.check, self._x
        initial_grad = self.initial_grad
        first = [
            leaf.detach().requires_grad_(is_float(leaf) and (a > 0 or initial_grad[i]))
            for i, leaf in enumerate(self.current)
        ]
        segs = self._segments(a, b)
        plain = not any(seg is not None for seg in segs)
        if self._saved is None:  # one counter (and hook pair) for the whole run
            self._saved = SavedBytes(exclude=self.params, pack=self.pack_tape)
        counter = self._saved
        # Saved-tensor hooks cost a Python call per saved tensor (about a fifth of a small
        # LIF step on a CPU): without packing, count the first two steps of the segment
        # and charge the second step's bytes for each later one (the first step starts
        # from fresh leaves, the second is what every later step does). Packing hooks all.
        sample = b - a if self.pack_tape else min(2, b - a)
        before = counter.bytes
        later = 0
        leaves, tape_ys = first, []
        with torch.enable_grad():
            # per-step views through one unbind (taped): indexing seg[t] per step would make
            # each step's backward allocate and fill a zero gradient of the whole segment
            seg_steps = [seg.unbind(0) if seg is not None else None for seg in segs]
            for t in range(a, b):
                if plain:
                    xs = x(t)
                else:
                    xs = [
                        steps[t - a] if steps is not None else xt
                        for steps, xt in zip(seg_steps, x(t), strict=False)
                    ]
                if t - a < sample:
                    mark = counter.bytes
                    with counter:
                        leaves, ys = fn(t, leaves, xs, check)
                    later = counter.bytes - mark
                else:
                    leaves, ys = fn(t, leaves, xs, check)
                tape_ys.append(ys)
                if emit is not None:
                    emit(t, [y.detach() for y in ys])
        nbytes = counter.bytes - before + later * (b - a - sample)
        self.tapes.append(_Tape(a, b, first, leaves, tape_ys, segs, nbytes))
        self._tape_bytes += nbytes
        self.counters.taped_steps += b - a
        self.counters.tape_bytes += nbytes
        return leaves

    def _hold(self, tier: str, i: int, size: int) -> None:
        held = self.held[tier]
        self._held_bytes[tier] += size - held.get(i, 0)
        held[i] = size

    def _store(self, i: int, tier: str) -> None:
        assert self.current is not None and self.index == i
        detached = [x.detach() for x in self.current]
        self.stores[tier].put(i, detached)
        size = self._current_bytes
        self._hold(tier, i, size)
        if tier == "remote":
            self._remote_count(size, written=size)
        if self.rng_used is not False and i not in self.rng:
            self.rng[i] = self._rng_now()
        if tier == "device":
            self.stored_here = True
            self.current = detached

    def _rng_now(self) -> RngState:
        """The generator states now, sharing the last capture's tensors when nothing drew in
        between: a CPU generator's state is 5,056 bytes, which every checkpoint of the forward
        phase held (a model that draws nothing: one copy in all; 0.39 MB against 12.8 KB of
        checkpoints for 3 x 8 neurons, T = 2000, `Revolve(slots=73)`)."""
        now = RngState.capture(self.cuda_devices)
        last = self._rng_last
        if last is not None and now.same_as(last):
            return last
        self._rng_last = now
        return now

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
        current = self.stores[tier].get(i)
        self.current = current
        self._current_bytes = leaf_bytes(current)
        self.index = i
        self.stored_here = tier == "device"
        if tier == "remote":
            size = self.prefetched.pop(i, None)
            if size is None:
                self._remote_count(0, read=self.held["remote"][i])
            else:
                self._prefetched_bytes -= size
        if self.rng_used is not False:
            self.rng[i].restore()

    def _free(self, i: int, tier: str) -> None:
        self.stores[tier].drop(i)
        size = self.held[tier].pop(i)
        self._held_bytes[tier] -= size
        if tier == "remote":
            self._remote_count(-size)
        if tier == "device" and self.index == i:
            self.stored_here = False
        if i not in self.held["device"] and i not in self.held["remote"]:
            self.rng.pop(i, None)

    def _prefetch(self, i: int) -> None:
        self.stores["remote"].prefetch(i)
        size = self.held["remote"][i]
        self._prefetched_bytes += size - self.prefetched.get(i, 0)
        self.prefetched[i] = size
        self._remote_count(0, read=size)

    # -- backward ------------------------------------------------------------------

    def start_backward(self, grad_final: Sequence[Tensor | None], y_grad: YGrad) -> None:
        """Enter the backward phase with ``dL/dx_T`` and a function giving ``dL/dy_t``."""
        self.end_forward()
        self.in_forward = False
        self.check = False
        self.grad_state = list(grad_final)
        self.y_grad = y_grad

    def _backprop(self, a: int, b: int) -> None:
        if self.in_forward:  # the first Backprop ends the forward phase (simulate's rule)
            raise UsageError("Backprop reached during the forward phase")
        tape = self.tapes.pop()
        self._tape_bytes -= tape.nbytes
        assert (tape.start, tape.stop) == (a, b) and self.y_grad is not None
        outs, grads = self._roots(tape)
        first, params = tape.first, self.params
        wrt_state = [i for i, x in enumerate(first) if x.requires_grad]
        wrt_inputs = [j for j, seg in enumerate(tape.inputs) if seg is not None]
        inputs = [first[i] for i in wrt_state] + params
        inputs += [tape.inputs[j] for j in wrt_inputs]  # type: ignore[misc]
        new_state: list[Tensor | None] = [None] * len(first)
        if outs and inputs:
            n, m = len(wrt_state), len(params)
            with torch.enable_grad():
                if not self._sums_started:  # the first contributions made plain, once a call
                    self._sums_started = True
                    sum_in_place_from_first(outs, params)
                self._feed(outs, grads)
                found = grad(outs, inputs, grads)
            del outs, grads
            for i, g in zip(wrt_state, found[:n], strict=False):
                new_state[i] = g
            for k, g in enumerate(found[n : n + m]):
                if g is not None:
                    self.grad_params[k] = plain(g)  # a view fed on would be added out of place
            self._input_grads(a, b, wrt_inputs, found[n + m :])
            del found
        del tape
        self.grad_state = new_state
        self.counters.backward_steps += b - a
        self.current, self.index, self.stored_here = None, None, False

    def _roots(self, tape: _Tape) -> tuple[list[Tensor], list[Tensor]]:
        """The tape's outputs and final state leaves that get a gradient, and those
        gradients (``dL/dy_t`` and the carried state gradient)."""
        assert self.y_grad is not None
        y_grad = self.y_grad
        outs: list[Tensor] = []
        grads: list[Tensor] = []
        for t, ys in enumerate(tape.ys, tape.start):
            for y, g in zip(ys, y_grad(t), strict=False):
                if g is not None and y.requires_grad:
                    outs.append(y)
                    grads.append(g)
        for x, g in zip(tape.last, self.grad_state, strict=False):
            if g is not None and x.requires_grad:
                outs.append(x)
                grads.append(g)
        return outs, grads

    def _feed(self, outs: list[Tensor], grads: list[Tensor]) -> None:
        """Feed the gradient accumulated so far into each parameter first (one more root), so
        the sum runs in the same order as one backward pass over the whole loop (bitwise)."""
        params = self.params
        fed = [k for k, acc in enumerate(self.grad_params) if acc is not None]
        if fed:
            box = [tuple(self.grad_params[k] for k in fed)]  # type: ignore[misc]
            for k in fed:  # hand the tensors over: autograd adds into them in place
                self.grad_params[k] = None
            outs.append(FeedGrads.apply(box, *(params[k] for k in fed)))
            grads.append(outs[-1].new_zeros(()))
            del box

    def _input_grads(
        self, a: int, b: int, wrt_inputs: list[int], found: Sequence[Tensor | None]
    ) -> None:
        """Write the inputs' gradients of steps ``a..b-1`` into their full buffers."""
        for j, g in zip(wrt_inputs, found, strict=False):
            if g is None:
                continue
            buf = self.grad_inputs[j]
            if buf is None:
                buf = self.grad_inputs[j] = torch.zeros_like(self.inputs[j])
            buf[a:b] = g.to(buf.device)
