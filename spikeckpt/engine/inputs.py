"""The engine's input: how it reads its time-first input one step or one chunk at a time.

The engine's time-first input may be a dense tensor ``(T, B, ...)`` or a packed spike train
([`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain]; a ``torch.sparse_coo`` train is packed first by
`as_input`). A packed train stays packed where it is (on the host, or on the device at 1
bit per element); `step_of` and `chunk_of` unpack one step or one chunk on the
compute device when the run needs it, so the dense train never exists whole. A packed train
gets no gradient (it holds spikes, not a differentiable tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

import torch
from torch import Tensor

from spikeckpt.errors import BudgetTooSmall
from spikeckpt.storage.base import tensor_nbytes
from spikeckpt.storage.codecs import scan_binary
from spikeckpt.storage.spiketrain import SpikeTrain, as_spike_train
from spikeckpt.units import format_bytes

__all__ = [
    "SparseChunk",
    "TrainWindow",
    "as_fresh",
    "as_input",
    "chunk_of",
    "drop_first",
    "input_grad_nbytes",
    "input_nbytes",
    "is_packed",
    "one_step_repeated",
    "sparse_chunk_of",
    "step_of",
]


class TrainWindow:
    """Steps ``start <= t < stop`` of a packed train (``stop`` default: its ``T``), as a train
    of ``stop - start`` steps (no copy).

    Has the part of [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain]'s contract the engine uses:
    ``shape``, ``T``, ``dtype``, ``codec``, ``device``, ``nbytes``, ``step``, ``chunk``,
    ``chunk_positions`` and ``step_ones``.
    """

    def __init__(
        self, train: SpikeTrain | TrainWindow, start: int, stop: int | None = None
    ) -> None:
        if isinstance(train, TrainWindow):
            stop = train.start + (train.T if stop is None else stop)
            start, train = train.start + start, train.train
        stop = train.T if stop is None else stop
        if not 0 <= start <= stop <= train.T:
            raise IndexError(f"a window of steps {start}..{stop} of a train of T={train.T} steps")
        self.train: SpikeTrain = train  # a window of a window: of the same train
        self.start: int = start
        self.stop: int = stop

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.T, *self.train.shape[1:]))

    @property
    def T(self) -> int:
        return self.stop - self.start

    @property
    def dtype(self) -> torch.dtype:
        return self.train.dtype

    @property
    def codec(self) -> str:
        """The train's codec (``"bitpack"`` or ``"index"``)."""
        return self.train.codec

    @property
    def device(self) -> torch.device:
        return self.train.device

    def step_ones(self, dtype: torch.dtype = torch.int64) -> Tensor:
        """Ones of each of its steps, ``(T,)`` of ``dtype`` on the CPU."""
        return self.train.step_ones(dtype)[self.start : self.stop]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole packed train it is a window of (held as long as it lives)."""
        return self.train.nbytes

    def step(self, t: int, device: torch.device | str | None = None) -> Tensor:
        if not 0 <= t < self.T:
            raise IndexError(f"step {t} is out of range for a train of T={self.T} steps")
        return self.train.step(self.start + t, device)

    def chunk(self, a: int, b: int, device: torch.device | str | None = None) -> Tensor:
        if not 0 <= a <= b <= self.T:
            raise IndexError(f"chunk({a}, {b}) is out of range for a train of T={self.T} steps")
        return self.train.chunk(self.start + a, self.start + b, device)

    def chunk_positions(self, a: int, b: int, device: torch.device | str | None = None) -> Tensor:
        if not 0 <= a <= b <= self.T:
            raise IndexError(f"chunk({a}, {b}) is out of range for a train of T={self.T} steps")
        return self.train.chunk_positions(self.start + a, self.start + b, device)

    def __len__(self) -> int:
        return self.T


def is_packed(x: Any) -> bool:
    """Whether ``x`` is a packed train (a ``SpikeTrain`` or a window of one)."""
    return isinstance(x, (SpikeTrain, TrainWindow))


def as_input(x: Any) -> Any:
    """``x`` with a ``torch.sparse_coo`` train packed into a ``SpikeTrain``; else unchanged."""
    if isinstance(x, Tensor) and x.layout == torch.sparse_coo:
        return as_spike_train(x)
    return x


#: bytes a fresh CPU tensor's data is aligned to (c10's CPU allocator)
CPU_ALIGNMENT = 64


def _first_step(x: Any) -> int:
    """The step of the whole train that step 0 of ``x`` (a train or a window of one) is."""
    return x.start if isinstance(x, TrainWindow) else 0


def _placed(part: Tensor, t: int) -> Tensor:
    """``part`` (steps ``t, t + 1, ...`` of a train, unpacked into a new tensor) where those
    steps lie in a dense train ``(T, B, ...)`` of a fresh CPU allocation: at ``t`` steps'
    bytes past an aligned address, modulo `CPU_ALIGNMENT`. On the CPU, MKL's small
    products round differently with the input's address modulo 16 bytes (``Linear(5, 4)`` on
    a ``(3, 5)`` step: bitwise different at 12 of 16 float offsets), so an unpacked step
    placed otherwise than the dense train's would not give the dense train's outputs."""
    size = part.element_size()
    shift = (t * part[0].numel() * size) % CPU_ALIGNMENT
    if part.device.type != "cpu" or shift % size or shift == part.data_ptr() % CPU_ALIGNMENT:
        return part
    buf = torch.empty(part.numel() + CPU_ALIGNMENT // size, dtype=part.dtype)
    skip = (shift - buf.data_ptr() % CPU_ALIGNMENT) % CPU_ALIGNMENT // size
    placed = buf[skip : skip + part.numel()].view(part.shape)
    placed.copy_(part)
    return placed


def as_fresh(x_t: Tensor) -> Tensor:
    """``x_t``, or a copy of it where its data does not start where a new CPU tensor's would
    (a step of a chunk buffer is a view into it; the plain loop hands a later layer a new
    tensor): placed as `_placed` places step 0."""
    return _placed(x_t[None], 0)[0]


def one_step_repeated(x: Any) -> TypeGuard[Tensor]:
    """Whether the dense chunk ``x (k, B, ...)`` is one step's tensor at every step (a time
    stride of 0: ``img.expand(T, *img.shape)``, a static input fed at each step), with more
    than one step: a layer that acts on each step alone gives every step the same output."""
    return isinstance(x, Tensor) and x.dim() >= 2 and x.shape[0] > 1 and x.stride(0) == 0


def step_of(x: Any, t: int, device: torch.device) -> Tensor:
    """Step ``t`` of a time-first input ``x`` on ``device`` (a packed train: unpacked there,
    at the address modulo `CPU_ALIGNMENT` the dense train's step would have: see
    `_placed`)."""
    if is_packed(x):
        step = x.step(t, device)
        return _placed(step[None], _first_step(x) + t)[0]
    x_t = x[t]
    return x_t if x_t.device == device else x_t.to(device, non_blocking=True)


def chunk_of(x: Any, a: int, b: int, device: torch.device) -> Tensor:
    """Steps ``a <= t < b`` of a time-first input ``x`` on ``device``, ``(b - a, ...)`` (a
    packed train: unpacked there, placed as the dense train's steps: see `_placed`)."""
    if is_packed(x):
        part = x.chunk(a, b, device)
        return _placed(part, _first_step(x) + a) if b > a else part
    part = x[a:b]
    return part if part.device == device else part.to(device, non_blocking=True)


class SparseChunk:
    """Steps ``a <= t < b`` of a packed binary train as the positions of its ones: what a
    synapse that gathers over its input's non-zeros needs, without the dense chunk.

    Attributes:
        positions: flat row-major positions of the ones in the dense chunk, ``(ones,)`` int64,
            ascending, on the compute device.
        shape: the dense chunk's shape ``(b - a, B, ...)``.
        dtype: the dense chunk's dtype.
    """

    def __init__(self, positions: Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
        self.positions = positions
        self.shape = shape
        self.dtype = dtype
        self.device = positions.device

    @property
    def ones(self) -> int:
        """Number of ones."""
        return int(self.positions.numel())

    def numel(self) -> int:
        """Elements of the dense chunk."""
        return int(self.shape.numel())

    def dense(self) -> Tensor:
        """The dense chunk ``shape`` (a new tensor)."""
        out = torch.zeros(self.numel(), dtype=self.dtype, device=self.device)
        if self.ones:
            out.index_fill_(0, self.positions, 1)
        return out.reshape(self.shape)


def sparse_chunk_of(x: Any, a: int, b: int, device: torch.device) -> SparseChunk:
    """Steps ``a <= t < b`` of the packed train ``x`` as a `SparseChunk` on ``device``."""
    shape = torch.Size((b - a, *x.shape[1:]))
    return SparseChunk(x.chunk_positions(a, b, device), shape, x.dtype)


def input_nbytes(x: Any) -> int:
    """Bytes ``x`` holds: a packed train's packed bytes, a dense tensor's storage bytes (at
    most its elements'): a constant input ``img.expand(T, *img.shape)`` holds one step's."""
    if is_packed(x):
        return int(x.nbytes)
    try:
        held = x.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor without a storage of its own
        return tensor_nbytes(x)
    return min(tensor_nbytes(x), held)


def input_grad_nbytes(x: Any) -> int:
    """Bytes of the gradient a training step hands back for the input ``x``: a dense tensor
    that requires grad (a trainable layer before the wrapped model) gets one of its full
    size ``(T, B, ...)``, an expanded view's too (autograd sums it to the view's base after
    the step); a packed train, or a tensor that requires no grad, none."""
    if is_packed(x) or not isinstance(x, Tensor) or not x.requires_grad:
        return 0
    return tensor_nbytes(x) if torch.is_grad_enabled() else 0


def drop_first(x: Any) -> Any:
    """``x`` without its first step: ``x[1:]``, or a `TrainWindow` of a packed train."""
    return TrainWindow(x, 1) if is_packed(x) else x[1:]


def packing_hint(leaves: Sequence[Any], need: int) -> str | None:
    """For a refusal whose step needs ``need`` bytes: where a dense input holding only 0
    and 1 is half of it or more, how to pass it packed (None otherwise)."""
    dense = [x for x in leaves if isinstance(x, Tensor) and not is_packed(x)]
    if not dense:
        return None
    largest = max(dense, key=input_nbytes)
    held = input_nbytes(largest)
    if 2 * held < need or scan_binary(largest.detach()) is None:
        return None
    return (
        f"the input ({format_bytes(held)}) is most of it and holds only 0 and 1: pass it "
        "packed, spikeckpt.SpikeTrain.from_dense(x) (1 bit per element or less, unpacked a "
        "step or a chunk at a time; the data modules: packed=True)"
    )


def with_packing_hint(error: BudgetTooSmall, leaves: Sequence[Any]) -> BudgetTooSmall:
    """``error``, its message ending with `packing_hint` where that applies."""
    hint = packing_hint(leaves, error.minimum_bytes)
    if hint is None:
        return error
    return BudgetTooSmall(
        f"{error}; {hint}", budget_bytes=error.budget_bytes, minimum_bytes=error.minimum_bytes
    )
