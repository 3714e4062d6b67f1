"""``MemoryMeter``: peak bytes of tensor memory allocated inside a ``with`` block.

Three ways to measure, chosen by the device and ``mode``:

- CUDA (``device`` is a CUDA device and CUDA is available; ``mode`` ``"auto"`` or
  ``"allocator"``): the caching allocator's counters. At entry the peak statistic is reset;
  ``peak_bytes = max_memory_allocated() - allocated at entry``. Nested CUDA meters pass the peak
  seen so far to the enclosing ones before resetting. The first CUDA meter of a thread first
  allocates the GEMM libraries' workspaces (`spikeckpt.engine.gemm_workspaces`: cuBLAS keeps
  32 MiB per thread on Hopper GPUs, for the life of the process), so no block counts them.
- ``mode="tensors"`` (the default on the CPU): torch has no CPU allocator statistics, so a
  ``TorchDispatchMode`` records the storage of every tensor an op returns that does not alias
  an input (by the op's schema), counts each storage once, and subtracts it when the storage is
  freed (a ``weakref.finalize`` on it). ``peak_bytes`` is the peak of those live bytes. This
  matched the profiler within 1% and slows ops down (about 1.6x); backward passes run by this
  thread are seen (the autograd engine carries the mode to the CPU backward). Under an active
  dispatch mode, code compiled by ``torch.compile`` does **not** run compiled (dynamo skips the
  frame, the code runs eagerly) and autograd accumulates gradients out of place: a compiled
  training step is measured as if it were eager. With torch up to 2.13 a compiled function
  once called under it runs eagerly for the rest of the process (spikeckpt's own compiled
  paths do not call their compiled code under a dispatch mode: `spikeckpt.engine.compiled`).
- ``mode="allocator"`` on the CPU: the CPU allocator's own allocation and free events, recorded
  by the profiler (``torch.profiler.profile(profile_memory=True)``, CPU activity only) and
  replayed in order after the block: ``peak_bytes`` is the peak, above the level at entry, of
  the bytes allocated inside the block and not yet freed. Nothing about how the code runs
  changes: compiled functions run compiled (their own buffers are what is counted), gradients
  accumulate as they do in a plain run. Only known after the block (reading ``peak_bytes``
  inside raises); one such meter at a time, and not while another profiler runs (the profiler
  does not nest). The profiler adds a few microseconds per op: time runs separately. A free
  counts only for a block allocated inside the block (matched by address), so, as with
  ``"tensors"``, only what is allocated inside counts (plus
  [`MemoryMeter.track`][spikeckpt.engine.meter.MemoryMeter.track]). The
  profiler (kineto) prints its start and stop to stderr.

Tensors that exist before the block are not counted, unless passed to [`MemoryMeter.track`][spikeckpt.engine.meter.MemoryMeter.track]
inside it (a training step's parameters, gradients, optimizer state and input batch): they
then count as held from that moment until they are freed.

Not seen on the CPU: tensors made in other threads (e.g. DataLoader workers, a disk tier's I/O
thread), NumPy arrays (the CPU spike codec's temporaries while it codes a tensor: its bit-packed
bytes, or 8 bytes per one for index lists; at most 1 MiB while unpacking). With ``"tensors"``
only: tensors created without an op (``torch.load``, ``torch.from_numpy``, a generator state
from ``torch.get_rng_state``: 5,056 bytes on the CPU; the engine's own captures, which a
checkpoint keeps when the model draws random numbers, are counted: `count_made`), in-place
growth of
existing storages (``resize_``, ``out=`` into a smaller tensor), sparse tensors; the
``"allocator"`` mode sees every block the CPU allocator hands out on the thread (but not
``torch.from_numpy``'s, which NumPy owns).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from spikeckpt.engine.gemm_workspaces import warm_gemm_workspaces
from spikeckpt.errors import ConfigError, UsageError

__all__ = ["MemoryMeter", "MeterMode", "count_made", "unmetered"]

MeterMode = Literal["auto", "tensors", "allocator"]
_MODES = ("auto", "tensors", "allocator")

_ALIASES: dict[Any, tuple[bool, ...]] = {}
_CUDA_ACTIVE: list[MemoryMeter] = []
_PROFILED: list[_AllocatorEvents] = []  # the allocator-mode meter recording (one at a time)


class MemoryMeter:
    """Measure the peak tensor memory of a block: ``with MemoryMeter() as m: ...``.

    Args:
        device: the device to measure (``None`` means the CPU).
        mode: how (see the module docstring): ``"auto"`` (default: the allocator's statistics
            on CUDA, the tensor-storage tracker elsewhere), ``"tensors"`` (the tracker, a
            ``TorchDispatchMode``, on any device: readable inside the block, nests; compiled
            code runs eagerly under it) or ``"allocator"`` (the allocator's own figures:
            CUDA statistics, or on the CPU the profiler's memory events; compiled code runs
            compiled; on the CPU the figures exist after the block only). Measure compiled
            runs with ``"allocator"``:

            >>> import torch
            >>> with MemoryMeter(mode="allocator") as m:
            ...     y = torch.ones(1000).exp()  # 4000 bytes each, the first freed
            >>> m.peak_bytes, m.current_bytes
            (8000, 4000)

    Attributes:
        peak_bytes: most memory (bytes, relative to the block's entry) held at once by
            tensors allocated inside the block. Readable
            inside the block too (the peak so far).
        current_bytes: memory still held at exit by tensors allocated inside the block (CUDA:
            allocated at exit minus allocated at entry; may be negative if the block freed
            tensors made before it).
        device: the measured device.
    """

    def __init__(
        self, device: torch.device | str | None = None, *, mode: MeterMode = "auto"
    ) -> None:
        if mode not in _MODES:
            raise ConfigError(f"MemoryMeter mode must be one of {_MODES}, got {mode!r}")
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.mode = mode
        cuda_device = self.device.type == "cuda"
        self._cuda = cuda_device and mode != "tensors"  # the CUDA allocator's statistics
        self._profiled = not cuda_device and mode == "allocator"  # CPU allocator events
        if self._profiled and self.device.type != "cpu":
            raise ConfigError(
                f"MemoryMeter({str(self.device)!r}, mode='allocator'): the allocator's figures "
                "exist for CUDA and the CPU only; use mode='tensors' for this device"
            )
        if cuda_device:
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"MemoryMeter({str(self.device)!r}): CUDA is not available on this machine; "
                    "measure the CPU with MemoryMeter() instead"
                )
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        self._tracker: _StorageTracker | None = None
        self._events: _AllocatorEvents | None = None
        self._entry = 0
        self._tracked = 0  # CUDA: bytes of tensors from before the block passed to track()
        self._tracked_ptrs: set[int] = set()
        self._seen_peak = 0  # CUDA: allocator peak seen before inner meters reset it
        self._peak: int | None = None
        self._current: int | None = None

    @property
    def peak_bytes(self) -> int:
        """Peak bytes allocated inside the block (so far, while inside)."""
        if self._peak is not None:
            return self._peak
        if self._cuda:
            peak = max(self._seen_peak, torch.cuda.max_memory_allocated(self.device))
            return peak - self._entry + self._tracked
        if self._events is not None:
            raise UsageError(
                "MemoryMeter(mode='allocator') on the CPU knows its peak after the with-block "
                "only (the profiler's events are read at exit)"
            )
        return self._tracker.peak if self._tracker is not None else 0

    @property
    def current_bytes(self) -> int:
        """Bytes allocated inside the block and still held (at exit, once exited)."""
        if self._current is not None:
            return self._current
        if self._cuda:
            return torch.cuda.memory_allocated(self.device) - self._entry + self._tracked
        if self._events is not None:
            raise UsageError(
                "MemoryMeter(mode='allocator') on the CPU knows its bytes after the with-block "
                "only (the profiler's events are read at exit)"
            )
        return self._tracker.live if self._tracker is not None else 0

    def track(self, tensors: Iterable[Any]) -> int:
        """Count tensors that already existed at entry as held from now on.

        Call it inside the block. Each distinct storage on the measured device is counted
        once (views, tensors on other devices, non-tensors, sparse tensors and tensors the
        meter already follows are skipped); ``peak_bytes`` and ``current_bytes`` include them
        until they are freed. Use it to measure a whole training step: parameters,
        gradients, optimizer state and the input batch are held before the step starts.
        On CUDA pass only tensors from before the block (the allocator already counts what
        the block allocates); with ``mode="allocator"`` on the CPU likewise (a tensor made in
        the block is counted by its allocation event already). Returns the bytes added.

        >>> import torch
        >>> weights = torch.zeros(1000)                # 4000 bytes, made before the block
        >>> with MemoryMeter() as m:
        ...     added = m.track([weights, weights[:10]])  # a view: the same storage
        ...     scratch = torch.ones(250)              # 1000 bytes
        >>> added, m.peak_bytes
        (4000, 5000)
        """
        active = self._tracker is not None or self._events is not None or self in _CUDA_ACTIVE
        if self._peak is not None or not active:
            raise UsageError("MemoryMeter.track is used inside the with-block")
        if self._events is not None:
            return self._events.track(tensors)
        if self._tracker is not None:
            before = self._tracker.live
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    self._tracker._record(tensor, set())
            return self._tracker.live - before
        added = 0
        seen = self._tracked_ptrs
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                continue
            if tensor.device != self.device:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            added += storage.nbytes()
        self._tracked += added
        return added

    def __enter__(self) -> MemoryMeter:
        if (
            self._tracker is not None
            or self._events is not None
            or (self._cuda and self in _CUDA_ACTIVE)
        ):
            raise UsageError("this MemoryMeter is already in use: make one per with-block")
        self._peak = self._current = None
        if self.mode == "allocator" and _get_current_dispatch_mode_stack():
            warnings.warn(
                "MemoryMeter(mode='allocator') entered under an active TorchDispatchMode "
                f"({type(_get_current_dispatch_mode_stack()[-1]).__name__}, e.g. a "
                "MemoryMeter(mode='tensors') left open): under it torch.compile'd code runs "
                "eagerly, so this measures an eager run; close that mode first",
                stacklevel=2,
            )
        if self._cuda:
            warm_gemm_workspaces(self.device)  # a fixed cost of the device, never counted
            peak_now = torch.cuda.max_memory_allocated(self.device)
            for outer in _CUDA_ACTIVE:
                if outer.device == self.device:
                    outer._seen_peak = max(outer._seen_peak, peak_now)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._entry = torch.cuda.memory_allocated(self.device)
            self._seen_peak = 0
            self._tracked = 0
            self._tracked_ptrs = set()
            _CUDA_ACTIVE.append(self)
        elif self._profiled:
            events = _AllocatorEvents()
            events.start()
            self._events = events
        else:
            self._tracker = _StorageTracker(self.device)
            self._tracker.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._cuda:
            self._peak = self.peak_bytes
            self._current = self.current_bytes
            _CUDA_ACTIVE.remove(self)
        elif self._profiled:
            events = self._events
            assert events is not None
            self._events = None
            self._peak, self._current = events.stop()
        else:
            tracker = self._tracker
            assert tracker is not None
            tracker.__exit__(exc_type, exc, tb)
            self._peak, self._current = tracker.peak, tracker.live
            tracker.detach()
            self._tracker = None

    def __repr__(self) -> str:
        if self._events is not None:
            return f"MemoryMeter(device={str(self.device)!r}, mode={self.mode!r}, measuring)"
        return (
            f"MemoryMeter(device={str(self.device)!r}, mode={self.mode!r}, "
            f"peak_bytes={self.peak_bytes}, current_bytes={self.current_bytes})"
        )


def count_made(tensors: Iterable[torch.Tensor]) -> None:
    """Count ``tensors`` made without an op (no dispatch: a generator state from
    ``torch.get_rng_state``) in every tensor-mode meter active on this thread, from now until
    they are freed, as the meters count what ops make (the allocator mode sees them anyway)."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, _StorageTracker):
            for tensor in tensors:
                mode._record(tensor, set())


@contextlib.contextmanager
def unmetered() -> Iterator[None]:
    """Hide what the block allocates from every meter active on this thread: for one-time
    work that no later step repeats (an adapter checking a fused kernel or a fast step
    against the layer's own call at first use), so that a meter measures what a step
    allocates whenever it runs, whether or not the check happened to run inside it.

    Tensor-mode meters skip the block's ops; allocator-mode meters skip its allocations
    (their frees, matched by address, then free nothing counted); CUDA meters keep the peak
    seen before the block and reset the allocator's peak after it. What the block leaves
    allocated is counted from then on where the allocator's figures see it (CUDA), else not.
    """
    trackers = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, _StorageTracker)]
    for tracker in trackers:
        tracker.paused += 1
    devices = {m.device for m in _CUDA_ACTIVE}
    for device in devices:
        peak_now = torch.cuda.max_memory_allocated(device)
        for meter in _CUDA_ACTIVE:
            if meter.device == device:
                meter._seen_peak = max(meter._seen_peak, peak_now)
    events = _PROFILED[-1] if _PROFILED else None
    if events is not None:
        events.pause(True)
    try:
        yield
    finally:
        if events is not None:
            events.pause(False)
        for device in devices:
            torch.cuda.reset_peak_memory_stats(device)
        for tracker in trackers:
            tracker.paused -= 1


class _StorageTracker(TorchDispatchMode):
    """Live and peak bytes of the storages that ops on this thread allocate on ``device``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device_type = device.type
        self.device_index = device.index
        self.live = 0
        self.peak = 0
        self._lock = threading.RLock()
        self._finalizers: dict[int, weakref.finalize] = {}  # data_ptr -> finalizer
        self.paused = 0  # inside `unmetered` blocks: ops are not recorded

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        aliases = _ALIASES.get(func)
        if aliases is None:
            aliases = _ALIASES[func] = tuple(r.alias_info is not None for r in func._schema.returns)
        results = out if isinstance(out, (tuple, list)) else (out,)
        inputs: set[int] | None = None
        for i, result in enumerate(results):
            if i < len(aliases) and aliases[i]:
                continue
            for tensor in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(tensor, torch.Tensor):
                    if inputs is None:
                        inputs = _input_pointers(args, kwargs)
                    self._record(tensor, inputs)
        return out

    def _record(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        if tensor.layout != torch.strided or tensor.device.type != self.device_type:
            return
        if self.device_index is not None and tensor.device.index != self.device_index:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
            return
        nbytes = storage.nbytes()
        ptr = storage.data_ptr()
        if nbytes == 0 or ptr in inputs:
            return
        with self._lock:
            if ptr in self._finalizers:
                return
            self._finalizers[ptr] = weakref.finalize(storage, self._freed, ptr, nbytes)
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live

    def _freed(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._finalizers.pop(ptr, None)
            self.live -= nbytes

    def detach(self) -> None:
        """Stop following the storages still alive (after the block)."""
        with self._lock:
            for finalizer in self._finalizers.values():
                finalizer.detach()
            self._finalizers.clear()


def _input_pointers(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> set[int]:
    """Data pointers of the storages of every tensor among an op's arguments.

    Walks tuples and lists directly (ops take tensors at most one list deep); a generic pytree
    flatten here cost as much as the rest of the tracker together.
    """
    pointers: set[int] = set()
    pending: list[Any] = [*args, *(kwargs.values() if kwargs else ())]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            if value.layout == torch.strided:
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    pointers.add(value.untyped_storage().data_ptr())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return pointers


_MARK = "spikeckpt.MemoryMeter.track#"
_PAUSE = "spikeckpt.MemoryMeter.unmetered#"


class _AllocatorEvents:
    """The CPU allocator's events of one with-block: recorded by the profiler, replayed at exit.

    The profiler records, on the thread that starts it, every allocation and free the CPU
    allocator reports (``[memory]`` events, bytes signed) and every ``record_function``.
    Tensors passed to ``track`` become a marker event carrying their bytes, and a marker
    carrying minus those bytes when their storage is freed: the replay at ``stop`` adds every
    CPU event in time order and keeps the running maximum.
    """

    def __init__(self) -> None:
        self._profile: Any = None
        self._amounts: list[int] = []  # bytes of marker k (negative: tracked bytes freed)
        self._tracked: set[int] = set()  # data pointers of tracked storages
        self._finalizers: list[weakref.finalize] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        from torch.autograd import profiler as autograd_profiler
        from torch.profiler import ProfilerActivity, profile

        if autograd_profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled():
            raise UsageError(
                "MemoryMeter(mode='allocator') on the CPU records the profiler's memory events, "
                "and a profiler is already running (another such meter, or torch.profiler): "
                "the profiler does not nest; measure with one of them at a time"
            )
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        _PROFILED.append(self)

    def pause(self, on: bool) -> None:
        """Mark the start (``on``) or end of an `unmetered` block in the event stream."""
        with torch.profiler.record_function(f"{_PAUSE}{int(on)}"):
            pass

    def _mark(self, nbytes: int) -> None:
        with self._lock:
            index = len(self._amounts)
            self._amounts.append(nbytes)
        with torch.profiler.record_function(f"{_MARK}{index}"):
            pass

    def track(self, tensors: Iterable[Any]) -> int:
        """Count the storages of ``tensors`` (on the CPU, strided) as allocated now."""
        added = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                continue
            if tensor.device.type != "cpu":
                continue
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in self._tracked:
                continue
            self._tracked.add(ptr)
            self._finalizers.append(weakref.finalize(storage, self._mark, -nbytes))
            added += nbytes
        if added:
            self._mark(added)
        return added

    def stop(self) -> tuple[int, int]:
        """Stop recording; ``(peak, live at exit)`` in bytes above the level at entry.

        A free counts only for a block allocated inside the block (matched by address): the
        allocator also reports frees of blocks it handed out while an earlier profiler ran.
        """
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()
        profile = self._profile
        profile.__exit__(None, None, None)
        if self in _PROFILED:
            _PROFILED.remove(self)
        allocation = torch._C._profiler._ExtraFields_Allocation
        # (time, preorder index, value): an allocator event's fields, or a marker's bytes
        timeline: list[tuple[int, int, Any]] = []
        pending = list(reversed(profile.profiler.kineto_results.experimental_event_tree()))
        while pending:  # preorder: a parent before its children, children in time order
            event = pending.pop()
            pending.extend(reversed(event.children))
            fields = event.extra_fields
            if isinstance(fields, allocation):
                if fields.device.type == "cpu":
                    timeline.append((event.start_time_ns, len(timeline), fields))
            elif event.name.startswith(_MARK):
                amount = self._amounts[int(event.name[len(_MARK) :])]
                timeline.append((event.start_time_ns, len(timeline), amount))
            elif event.name.startswith(_PAUSE):
                timeline.append((event.start_time_ns, len(timeline), event.name[-1] == "1"))
        timeline.sort(key=lambda item: (item[0], item[1]))
        blocks: dict[int, int] = {}  # address -> bytes of the blocks allocated inside
        live = peak = paused = 0
        for _, _, value in timeline:
            if isinstance(value, bool):  # an `unmetered` block starts or ends
                paused += 1 if value else -1
            elif isinstance(value, int):
                live += value
            elif value.alloc_size > 0:
                if paused:
                    continue
                blocks[value.ptr] = value.alloc_size
                live += value.alloc_size
            else:
                live -= blocks.pop(value.ptr, 0)
            if live > peak:
                peak = live
        return peak, live
