"""Events -> fixed-step spike frames, time-first padded batches, seeded workers.

Time convention: bin ``k`` holds the events with ``k * dt_us <= t < (k + 1) * dt_us``, counted from
t = 0 (the start of the recording, not its first event). A recording whose last event is at
``t_last`` gives ``T = floor(t_last / dt_us) + 1`` steps; with ``duration_us`` every recording
gives ``T = ceil(duration_us / dt_us)`` steps (later events dropped, missing steps empty).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from spikeckpt.errors import ConfigError, NotBinaryError
from spikeckpt.storage.spiketrain import SpikeTrain


def steps_for(duration_us: float, dt_us: float) -> int:
    """Time steps ``T`` that ``duration_us`` microseconds give at ``dt_us`` per step (>= 1).

    ``steps_for(1_000_000, 1000) == 1000``; SHD's ~1 s recordings at 0.1 ms give ~10,000.
    """
    if dt_us <= 0:
        raise ConfigError(f"dt_us must be > 0 microseconds, got {dt_us}")
    if duration_us <= 0:
        raise ConfigError(f"duration_us must be > 0 microseconds, got {duration_us}")
    return max(1, math.ceil(duration_us / dt_us))


def steps_for_events(last_event_us: float, dt_us: float) -> int:
    """Time steps of a recording whose last event is at ``last_event_us`` (variable-length mode)."""
    return int(last_event_us // dt_us) + 1


@dataclass(frozen=True)
class EventsToSpikes:
    """Tonic transform: structured events -> float32 spike frames, time first.

    Bins like tonic's ``ToFrame(time_window=dt_us, start_time=0, ...)``, but exactly: event
    ``t`` goes to step ``t // dt_us`` (floor division, no rounding), so each event lands in one
    step. ToFrame places its windows at ``k * dt_us`` and ends them at ``k * dt_us + dt_us``,
    which differ in the last bit when ``dt_us`` is not a whole number (``1e6 / 300``): an
    event on a step boundary was counted in two steps, or in none. Also handles empty
    recordings (ToFrame returns a float64 array of another shape for them), a fixed length,
    binarisation, and refuses events outside the sensor (ToFrame's ``IndexError``, or a
    negative index that wraps around).

    Args:
        sensor_size: tonic's ``(X, Y, P)``: ``(channels, 1, 1)`` for SHD, ``(34, 34, 2)`` N-MNIST.
        dt_us: bin width (microseconds).
        duration_us: if set, every sample gets ``T = ceil(duration_us / dt_us)`` steps.
        binarize: clamp counts to 1 (spikes) instead of keeping counts per bin.
        flatten: for 2-D sensors, return ``(T, P*Y*X)`` instead of ``(T, P, Y, X)``.

    Returns (from ``__call__``): ``(T, X)`` for sensors without ``y`` (SHD, P must be 1),
    ``(T, P, Y, X)`` or ``(T, P*Y*X)`` otherwise; float32.
    """

    sensor_size: tuple[int, int, int]
    dt_us: float
    duration_us: float | None = None
    binarize: bool = True
    flatten: bool = False

    def __post_init__(self) -> None:
        steps_for(self.dt_us if self.duration_us is None else self.duration_us, self.dt_us)

    def frame_shape(self, has_y: bool) -> tuple[int, ...]:
        """Shape of one time step's frame."""
        x, y, p = self.sensor_size
        if not has_y:
            return (p * x,)
        return (p * y * x,) if self.flatten else (p, y, x)

    def __call__(self, events: np.ndarray) -> np.ndarray:
        has_y = "y" in (events.dtype.names or ())
        shape = self.frame_shape(has_y)
        if len(events) == 0:
            steps = 1 if self.duration_us is None else steps_for(self.duration_us, self.dt_us)
            return np.zeros((steps, *shape), dtype=np.float32)
        t = events["t"]
        if self.duration_us is None:
            steps = steps_for_events(float(t.max()), self.dt_us)
        else:
            steps = steps_for(self.duration_us, self.dt_us)
        step = np.floor_divide(t, self.dt_us)  # exact for float dt_us too
        keep = (step >= 0) & (step < steps)
        index = self._frame_index(events, keep, has_y)
        width = math.prod(shape)
        flat = step[keep].astype(np.int64) * width + index
        frames = np.zeros(steps * width, dtype=np.float32)
        if self.binarize:
            frames[flat] = 1.0
        else:
            np.add.at(frames, flat, 1.0)
        return frames.reshape(steps, *shape)

    def _frame_index(self, events: np.ndarray, keep: np.ndarray, has_y: bool) -> np.ndarray:
        """Each kept event's index within one step's frame, laid out ``(P, Y, X)`` as
        tonic's ``ToFrame``; refuses events outside ``sensor_size``."""
        size_x, size_y, size_p = self.sensor_size
        x = events["x"][keep].astype(np.int64)
        y = events["y"][keep].astype(np.int64) if has_y else np.zeros_like(x)
        p = events["p"][keep].astype(np.int64)
        if size_p == 1:
            if np.unique(p).size > 1:
                raise ConfigError(
                    f"events of {np.unique(p).size} polarities for a single-polarity sensor "
                    f"{self.sensor_size}: give sensor_size=(x, y, 2), or drop the polarity"
                )
            p = np.zeros_like(p)
        for name, values, size in (("x", x, size_x), ("y", y, size_y), ("p", p, size_p)):
            bad = (values < 0) | (values >= size)
            if bad.any():
                raise ConfigError(
                    f"{int(bad.sum())} event(s) with {name} outside the sensor's 0..{size - 1} "
                    f"(e.g. {name}={int(values[bad][0])}; sensor_size {self.sensor_size}): the "
                    "recording is damaged, or sensor_size is not the data set's"
                )
        return (p * size_y + y) * size_x + x


@dataclass(frozen=True)
class Chain:
    """Apply transforms in order. Unlike ``tonic.transforms.Compose``, which stops at an empty
    recording and returns the raw (empty) events, this always runs every step."""

    steps: tuple[Callable[[Any], Any], ...]

    def __call__(self, data: Any) -> Any:
        for step in self.steps:
            data = step(data)
        return data


def pad_time_first(
    batch: Sequence[tuple[np.ndarray | torch.Tensor, int | np.integer | torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate ``(frames (T_i, ...), label)`` pairs into ``(T_max, B, ...)`` float32 and ``(B,)``
    int64, zero-padding the end of shorter samples. Same result as tonic's
    ``PadTensors(batch_first=False)``, with the dtypes fixed."""
    if not batch:
        raise ConfigError("cannot collate an empty batch")
    frames = [torch.as_tensor(np.asarray(x), dtype=torch.float32) for x, _ in batch]
    shapes = {tuple(f.shape[1:]) for f in frames}
    if len(shapes) != 1:
        raise ConfigError(f"samples in a batch have different frame shapes {sorted(shapes)}")
    steps = max(len(f) for f in frames)
    out = torch.zeros((steps, len(frames), *frames[0].shape[1:]), dtype=torch.float32)
    for i, f in enumerate(frames):
        out[: len(f), i] = f
    labels = torch.tensor([int(y) for _, y in batch], dtype=torch.int64)
    return out, labels


@dataclass(frozen=True)
class PackTimeFirst:
    """Collate ``(frames (T_i, ...), label)`` pairs into a packed train and labels.

    Returns ``(x, y)``: ``x`` a [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain] ``(T_max, B, ...)`` of
    ``dtype`` (the same values as [`pad_time_first`][spikeckpt.data.frames.pad_time_first]'s float32 batch, zero-padded at the
    end, bit-packed or as index lists, whichever is smaller unless ``codec`` forces one); ``y``
    ``(B,)`` int64. Packs once per batch from each sample's ones, without building the dense
    batch. Frames must be exactly 0 or 1 (``binarize=True``), else ``NotBinaryError``.
    """

    codec: str = "auto"
    dtype: torch.dtype = torch.float32

    def __call__(
        self,
        batch: Sequence[tuple[np.ndarray | torch.Tensor, int | np.integer | torch.Tensor]],
    ) -> tuple[SpikeTrain, torch.Tensor]:
        if not batch:
            raise ConfigError("cannot collate an empty batch")
        frames = [np.asarray(x) for x, _ in batch]
        shapes = {tuple(f.shape[1:]) for f in frames}
        if len(shapes) != 1:
            raise ConfigError(f"samples in a batch have different frame shapes {sorted(shapes)}")
        frame_shape = frames[0].shape[1:]
        n = math.prod(frame_shape)
        width = len(frames) * n  # elements per time step of the batch
        steps = max(len(f) for f in frames)
        parts = []
        for b, f in enumerate(frames):
            flat = f.reshape(len(f), n)
            t, j = np.nonzero(flat)
            _check_spikes(flat, t, j, b)
            parts.append(t.astype(np.int64) * width + b * n + j)
        positions = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        x = SpikeTrain.from_indices(
            torch.from_numpy(positions), (steps, len(frames), *frame_shape), self.dtype, self.codec
        )
        labels = torch.tensor([int(y) for _, y in batch], dtype=torch.int64)
        return x, labels


def _check_spikes(flat: np.ndarray, t: np.ndarray, j: np.ndarray, sample: int) -> None:
    """Raise ``NotBinaryError`` unless the nonzero elements are 1 and no zero is ``-0.0``."""
    values = flat[t, j]
    bad = np.flatnonzero(values != 1)
    if bad.size:
        k = int(bad[0])
        raise NotBinaryError(
            f"sample {sample} of the batch: frame element at step {int(t[k])}, index {int(j[k])} "
            f"is {values[k].item()!r}, not a spike (0 or 1); {bad.size} such elements. Packed "
            "batches need spikes: use binarize=True (counts cannot be bit-packed)"
        )
    if np.issubdtype(flat.dtype, np.floating) and np.signbit(flat).any():
        raise NotBinaryError(
            f"sample {sample} of the batch holds -0.0 (negative zero), which 1 bit cannot keep; "
            "add 0.0 to the frames first"
        )


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: seed NumPy and ``random`` from the worker's torch seed.

    Tonic's random transforms draw from NumPy's global RNG, which forked workers would share.
    """
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
