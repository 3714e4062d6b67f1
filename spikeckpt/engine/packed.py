"""Packed input trains: how the engine reads its input one step or one chunk at a time.

The engine's time-first input may be a dense tensor ``(T, B, ...)`` or a packed spike train
([`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain]; a ``torch.sparse_coo`` train is packed first by
`as_input`). A packed train stays packed where it is (on the host, or on the device at 1
bit per element); `step_of` and `chunk_of` unpack one step or one chunk on the
compute device when the run needs it, so the dense train never exists whole. A packed train
gets no gradient (it holds spikes, not a differentiable tensor).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from spikeckpt.storage.spiketrain import SpikeTrain, as_spike_train

__all__ = [
    "TrainWindow",
    "as_input",
    "chunk_of",
    "drop_first",
    "input_nbytes",
    "is_packed",
    "step_of",
]


class TrainWindow:
    """Steps ``start <= t < T`` of a packed train, as a train of ``T - start`` steps (no copy).

    Has the part of [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain]'s contract the engine uses:
    ``shape``, ``T``, ``dtype``, ``device``, ``nbytes``, ``step`` and ``chunk``.
    """

    def __init__(self, train: SpikeTrain | TrainWindow, start: int) -> None:
        if isinstance(train, TrainWindow):
            train, start = train.train, train.start + start
        if not 0 <= start <= train.T:
            raise IndexError(f"a window from step {start} of a train of T={train.T} steps")
        self.train = train
        self.start = start

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.train.T - self.start, *self.train.shape[1:]))

    @property
    def T(self) -> int:
        return self.train.T - self.start

    @property
    def dtype(self) -> torch.dtype:
        return self.train.dtype

    @property
    def device(self) -> torch.device:
        return self.train.device

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


def step_of(x: Any, t: int, device: torch.device) -> Tensor:
    """Step ``t`` of a time-first input ``x`` on ``device`` (a packed train: unpacked there)."""
    if is_packed(x):
        return x.step(t, device)
    x_t = x[t]
    return x_t if x_t.device == device else x_t.to(device, non_blocking=True)


def chunk_of(x: Any, a: int, b: int, device: torch.device) -> Tensor:
    """Steps ``a <= t < b`` of a time-first input ``x`` on ``device``, ``(b - a, ...)``."""
    if is_packed(x):
        return x.chunk(a, b, device)
    part = x[a:b]
    return part if part.device == device else part.to(device, non_blocking=True)


def input_nbytes(x: Any) -> int:
    """Bytes ``x`` holds: a packed train's packed bytes, a dense tensor's storage bytes."""
    if is_packed(x):
        return int(x.nbytes)
    return x.numel() * x.element_size()


def drop_first(x: Any) -> Any:
    """``x`` without its first step: ``x[1:]``, or a `TrainWindow` of a packed train."""
    return TrainWindow(x, 1) if is_packed(x) else x[1:]
