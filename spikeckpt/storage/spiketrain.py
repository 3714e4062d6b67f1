"""``SpikeTrain``: a time-first binary train ``(T, B, ...)`` kept bit-packed or as index lists.

A spike train of ``T`` steps is stored in one of two exact layouts (see
`spikeckpt.storage.codecs` for the codecs they come from):

- ``"bitpack"``: the codec's bit-pack of the whole train in row-major (time-first) order,
  ``(ceil(N / 8),)`` uint8 for ``N = T * B * ...`` elements: 1 bit per element. Step ``t`` is the
  bit range ``[t*n, (t+1)*n)`` with ``n = B * ...``; unpacking it reads only its bytes.
- ``"index"``: the codec's 16-bit index lists, with blocks aligned to time steps: each step is
  cut into ``ceil(n / 65536)`` blocks of up to 65,536 elements; ``(n_ones,)`` int16 holds each
  one's position in its block minus 32768 (the codec's bijection), in order; ``(blocks + 1,)``
  int64 offsets (always on the CPU, so that slicing never waits for a device; copied once to
  each other device a step is unpacked on, so that no step copies from the host) say where
  each block's ones start. ``2 * n_ones + 8 * (T * ceil(n / 65536) + 1)`` bytes.

``codec="auto"`` picks whichever of the two takes fewer bytes (bit-pack on ties). Round trips
are exact: ``dense()`` gives back every element bitwise, with the dtype and shape passed in
(``-0.0`` and any value other than 0 and 1 are refused with [`NotBinaryError`][spikeckpt.errors.NotBinaryError]).

**Contract the engine relies on** (``wrap`` / ``scan`` will take a ``SpikeTrain`` in place of
the dense input ``x``; anything else is a convenience):

- ``T`` (int, steps) and ``shape`` (``torch.Size`` ``(T, B, ...)``) of the dense train;
  ``dtype`` of the dense values;
- ``step(t, device=None) -> Tensor (B, ...)``: step ``t`` (``-T <= t < T``) unpacked on
  ``device`` (default: where the train is); cost and memory proportional to one step;
- ``chunk(a, b, device=None) -> Tensor (b - a, B, ...)``: steps ``a <= t < b`` unpacked
  (``0 <= a <= b <= T``); cost and memory proportional to ``b - a`` steps, never to ``T``;
- ``nbytes`` (int): bytes the packed train holds (payload and offsets), whatever the device;
- ``device``: where the packed payload is (``.to(device)`` moves it; offsets stay on the CPU).

Unpacked steps are new contiguous tensors (never views of the train), so freeing them frees
their memory. ``to``, ``pin_memory`` and pickling (``torch.save``, DataLoader workers) keep the
type; ``torch.load`` needs no ``weights_only=False`` (the class is registered as safe).
``to_sparse_coo`` / ``from_sparse_coo`` convert to and from a ``torch.sparse_coo`` train with
0/1 values, exactly. [`as_spike_train`][spikeckpt.storage.spiketrain.as_spike_train] turns a dense tensor, a sparse COO tensor or a
``SpikeTrain`` into a ``SpikeTrain``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from spikeckpt.errors import ConfigError, ConfigTypeError, NotBinaryError
from spikeckpt.storage.base import tensor_nbytes
from spikeckpt.storage.codecs import (
    BLOCK,
    bitpack,
    bitunpack,
    dtype_size,
    not_binary_message,
    packable_dtype,
    scan_binary,
    shape_numel,
)

__all__ = ["SPIKE_TRAIN_CODECS", "SpikeTrain", "as_spike_train", "concat_steps", "packed_nbytes"]

SPIKE_TRAIN_CODECS = ("auto", "bitpack", "index")
_HALF = BLOCK // 2
#: payload bytes `SpikeTrain.step_ones` counts at a time on a bit-packed train (or one step's)
ONES_SLAB_BYTES = 1 << 20
#: ones in each byte value
_POP8 = np.array([bin(v).count("1") for v in range(256)], dtype=np.uint8)
#: block-start tensors an index train keeps (`SpikeTrain._kept_starts`), per run length
_KEPT_STARTS = 8


class SpikeTrain:
    """A binary train ``(T, B, ...)`` stored packed; see the module docstring for the layouts.

    Build one with [`from_dense`][spikeckpt.storage.spiketrain.SpikeTrain.from_dense], [`from_sparse_coo`][spikeckpt.storage.spiketrain.SpikeTrain.from_sparse_coo], [`from_indices`][spikeckpt.storage.spiketrain.SpikeTrain.from_indices] or
    [`as_spike_train`][spikeckpt.storage.spiketrain.as_spike_train], not with the constructor.

    Attributes:
        codec: ``"bitpack"`` or ``"index"``.
        shape: shape of the dense train, ``(T, B, ...)``.
        dtype: dtype of the dense train (what ``step``, ``chunk`` and ``dense`` return).
        ones: number of elements equal to 1.
    """

    def __init__(
        self,
        codec: str,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        data: Tensor,
        offsets: Tensor | None,
        ones: int,
    ) -> None:
        if codec not in ("bitpack", "index"):
            raise ConfigError(f"unknown spike-train codec {codec!r}: use 'bitpack' or 'index'")
        self.codec = codec
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._data = data
        self._offsets = offsets
        #: the offsets copied to each other device once (`_offsets_on`)
        self._offsets_copies: dict[torch.device, Tensor] = {}
        self._offsets_view: Any = None  # `_bounds`
        #: a run of blocks' first positions plus the local offsets' bias, per (blocks,
        #: device), made once (`_kept_starts`): a chunk's unpack does not recompute them
        self._starts: dict[tuple[int, torch.device], Tensor] = {}
        self.ones = int(ones)

    # ------------------------------------------------------------------------- building

    @classmethod
    def from_dense(cls, x: Tensor, codec: str = "auto") -> SpikeTrain:
        """Pack the dense train ``x`` ``(T, B, ...)`` (any packable dtype, any device).

        The payload stays on ``x``'s device. Raises ``NotBinaryError`` (naming the first
        offending value) when ``x`` is not exactly 0/1, ``ValueError`` for a bad ``codec`` or
        a 0-d ``x``, ``TypeError`` for a sparse ``x`` (use [`from_sparse_coo`][spikeckpt.storage.spiketrain.SpikeTrain.from_sparse_coo]).
        """
        _check_codec(codec)
        if not isinstance(x, Tensor):
            raise ConfigTypeError(
                f"from_dense needs a torch.Tensor (T, B, ...), got {type(x).__name__}"
            )
        if x.layout == torch.sparse_coo:
            raise ConfigTypeError("x is a sparse COO tensor: use SpikeTrain.from_sparse_coo(x)")
        _check_shape(x.shape)
        found = scan_binary(x)
        if found is None:
            raise NotBinaryError(not_binary_message(x, "spike train"))
        mask, ones = found
        shape, n = x.shape, shape_numel(x.shape[1:])
        codec = _choose(codec, shape, ones)
        if codec == "bitpack":
            return cls("bitpack", shape, x.dtype, bitpack(mask), None, ones)
        positions = torch.nonzero(mask).reshape(-1)
        data, offsets = _index_encode(positions, shape[0], n)
        return cls("index", shape, x.dtype, data, offsets, ones)

    @classmethod
    def from_indices(
        cls,
        positions: Tensor,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        codec: str = "auto",
        device: torch.device | str | None = None,
    ) -> SpikeTrain:
        """Build a train from the flat (row-major) positions of its ones.

        Args:
            positions: ``(n_ones,)`` integer tensor, strictly increasing, each in ``[0, N)``
                with ``N = prod(shape)``.
            shape: ``(T, B, ...)`` of the dense train.
            dtype: dtype of the dense values.
            codec: ``"auto"``, ``"bitpack"`` or ``"index"``.
            device: where to put the payload (default: ``positions``' device).
        """
        _check_codec(codec)
        shape = torch.Size(shape)
        _check_shape(shape)
        if not packable_dtype(dtype):
            raise ConfigError(f"dtype {dtype} cannot hold packed spikes: use bool, int or float")
        if positions.dtype == torch.bool or positions.is_floating_point() or positions.is_complex():
            # .to(long) truncated floats (0.7 -> 0) silently; a bool mask read as positions 0/1
            raise ConfigTypeError(
                f"positions must be an integer tensor of flat indices, got {positions.dtype}; "
                "a 0/1 mask of the train goes in as SpikeTrain.from_dense(mask.reshape(shape))"
            )
        device = positions.device if device is None else torch.device(device)
        positions = positions.reshape(-1).to(device=device, dtype=torch.long)
        numel = shape_numel(shape)
        if positions.numel():
            if int(positions[0]) < 0 or int(positions[-1]) >= numel:
                raise ConfigError(
                    f"positions must lie in [0, {numel}) for shape {tuple(shape)}, got "
                    f"{int(positions.min())}..{int(positions.max())}"
                )
            if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
                raise ConfigError("positions must be strictly increasing (sorted, no repeats)")
        ones = positions.numel()
        codec = _choose(codec, shape, ones)
        if codec == "bitpack":
            data = torch.zeros((numel + 7) // 8, dtype=torch.uint8, device=device)
            bits = torch.ones_like(positions, dtype=torch.uint8) << (positions & 7).to(torch.uint8)
            data.index_add_(0, positions >> 3, bits)  # distinct bits of a byte: sum == or
            return cls("bitpack", shape, dtype, data, None, ones)
        data, offsets = _index_encode(positions, shape[0], shape_numel(shape[1:]))
        return cls("index", shape, dtype, data, offsets, ones)

    @classmethod
    def from_sparse_coo(
        cls, t: Tensor, codec: str = "auto", dtype: torch.dtype | None = None
    ) -> SpikeTrain:
        """Pack a ``torch.sparse_coo`` train ``(T, B, ...)`` whose values are exactly 0 or 1.

        Explicitly stored zeros are dropped; repeated indices are summed first (as
        ``coalesce`` does), so two ones at the same place are a 2 and refused. ``dtype``
        defaults to the values' dtype. Raises ``NotBinaryError`` naming the first bad value.
        """
        _check_codec(codec)
        if not isinstance(t, Tensor) or t.layout != torch.sparse_coo:
            got = t.layout if isinstance(t, Tensor) else type(t).__name__
            raise ConfigTypeError(f"from_sparse_coo needs a torch.sparse_coo tensor, got {got}")
        if t.dense_dim() != 0:
            raise ConfigError(
                f"hybrid sparse tensors (dense_dim={t.dense_dim()}) are not supported: build the "
                "sparse train with every dimension sparse, or pass t.to_dense() to from_dense"
            )
        _check_shape(t.shape)
        t = t if t.is_coalesced() else t.coalesce()
        values = t.values()
        found = scan_binary(values)
        if found is None:
            raise NotBinaryError(not_binary_message(values, "sparse spike train values"))
        keep, _ = found
        indices = t.indices()[:, keep]
        strides = _row_major_strides(t.shape, indices.device)
        positions = (indices * strides.unsqueeze(1)).sum(0) if indices.numel() else indices[0]
        dtype = values.dtype if dtype is None else dtype
        return cls.from_indices(positions, t.shape, dtype, codec)

    # ------------------------------------------------------------------------- properties

    @property
    def T(self) -> int:
        """Number of time steps."""
        return int(self.shape[0])

    @property
    def device(self) -> torch.device:
        """Device of the packed payload (default target of ``step``, ``chunk``, ``dense``)."""
        return self._data.device

    @property
    def nbytes(self) -> int:
        """Bytes the packed train holds: payload plus offsets (index codec), metadata aside."""
        total = tensor_nbytes(self._data)
        if self._offsets is not None:
            total += tensor_nbytes(self._offsets)
        return total

    def tensors(self) -> list[Tensor]:
        """The tensors that hold the packed train: the payload, and the index codec's
        offsets (always on the CPU). For counting memory (``MemoryMeter.track``)."""
        return [self._data] if self._offsets is None else [self._data, self._offsets]

    @property
    def payload_nbytes(self) -> int:
        """Bytes of the payload alone (what ``.to(device)`` moves; index offsets stay on CPU)."""
        return tensor_nbytes(self._data)

    @property
    def numel(self) -> int:
        """Elements of the dense train."""
        return shape_numel(self.shape)

    @property
    def dense_nbytes(self) -> int:
        """Bytes the dense train takes in ``dtype``."""
        return self.numel * dtype_size(self.dtype)

    @property
    def density(self) -> float:
        """Share of elements equal to 1 (0.0 for an empty train)."""
        return self.ones / self.numel if self.numel else 0.0

    def __len__(self) -> int:
        return self.T

    def __repr__(self) -> str:
        return (
            f"SpikeTrain(shape={tuple(self.shape)}, dtype={self.dtype}, codec={self.codec!r}, "
            f"device={self.device}, nbytes={self.nbytes}, density={self.density:.4g})"
        )

    # ------------------------------------------------------------------------- unpacking

    def step(self, t: int, device: torch.device | str | None = None) -> Tensor:
        """Step ``t`` (``-T <= t < T``) dense, ``(B, ...)``, on ``device`` (default: here)."""
        T = self.T
        index = int(t)
        if not -T <= index < T:
            raise IndexError(f"step {t} is out of range for a spike train of T={T} steps")
        index %= T
        return self.chunk(index, index + 1, device).reshape(self.shape[1:])

    def chunk(self, a: int, b: int, device: torch.device | str | None = None) -> Tensor:
        """Steps ``a <= t < b`` dense, ``(b - a, B, ...)``, on ``device`` (default: here).

        Only the bytes of those steps are read and moved.
        """
        a, b = int(a), int(b)
        if not 0 <= a <= b <= self.T:
            raise IndexError(
                f"chunk({a}, {b}) is out of range for a spike train of T={self.T} steps: "
                "need 0 <= a <= b <= T"
            )
        target = self.device if device is None else torch.device(device)
        n = shape_numel(self.shape[1:])
        out_shape = (b - a, *self.shape[1:])
        if self.codec == "bitpack":
            lo, hi = a * n, b * n
            first, last = lo >> 3, (hi + 7) >> 3
            raw = _moved(self._data[first:last], target)
            skip = lo - 8 * first
            flat = bitunpack(raw, skip + hi - lo, self.dtype)[skip:]
            if skip:
                flat = flat.clone()  # a view would keep the extra leading elements alive
            return flat.reshape(out_shape)
        out = torch.zeros((b - a) * n, dtype=self.dtype, device=target)
        positions = self._index_positions(a, b, target)
        if positions.numel():
            out.index_fill_(0, positions, 1)
        return out.reshape(out_shape)

    def step_ones(self, dtype: torch.dtype = torch.int64) -> Tensor:
        """Ones of each step, ``(T,)`` of ``dtype`` (an integer type: ``torch.int32`` holds
        4 bytes a step) on the CPU. The index codec reads them off its offsets; a bit-packed
        train counts its bits on the host (NumPy), `ONES_SLAB_BYTES` of payload at a time
        (never a dense step)."""
        n = shape_numel(self.shape[1:])
        if self.codec == "index":
            counts = self._offsets_on(torch.device("cpu")).diff()
            return counts.reshape(self.T, _blocks_per_step(n)).sum(dim=1, dtype=dtype)
        out = np.zeros(self.T, dtype=torch.empty((), dtype=dtype).numpy().dtype)
        per = max(1, ONES_SLAB_BYTES * 8 // max(n, 1))  # steps per slab
        for a in range(0, self.T, per):
            b = min(self.T, a + per)
            first = a * n // 8  # the slab's bytes: its bits lie in them
            raw = self._data[first : -(-b * n // 8)].cpu().numpy()
            # ones before each step boundary (bit positions from the slab's first byte):
            # the whole bytes before it, and the bits of its byte below it
            bits = np.arange(a, b + 1, dtype=np.int64) * n - first * 8
            whole = np.concatenate(([0], np.cumsum(_POP8[raw], dtype=np.int64)))
            below = raw[np.minimum(bits // 8, raw.size - 1)] & ((1 << (bits % 8)) - 1)
            before = whole[bits // 8] + np.where(bits % 8 > 0, _POP8[below], 0)
            out[a:b] = np.diff(before)
        return torch.from_numpy(out)

    def chunk_positions(self, a: int, b: int, device: torch.device | str | None = None) -> Tensor:
        """Where the ones of steps ``a <= t < b`` are: flat row-major positions in the dense
        chunk ``(b - a, B, ...)``, ``(ones,)`` int64, ascending, on ``device`` (default: here).

        An index-list train reads them off its lists (no dense chunk is made); a bit-packed one
        unpacks the chunk's bits.
        """
        a, b = int(a), int(b)
        if not 0 <= a <= b <= self.T:
            raise IndexError(
                f"chunk_positions({a}, {b}) is out of range for a spike train of T={self.T} "
                "steps: need 0 <= a <= b <= T"
            )
        target = self.device if device is None else torch.device(device)
        if self.codec == "bitpack":
            return torch.nonzero(self.chunk(a, b, target).reshape(-1)).reshape(-1)
        return self._index_positions(a, b, target)

    def _index_positions(self, a: int, b: int, target: torch.device) -> Tensor:
        """``chunk_positions`` of an index-list train."""
        n = shape_numel(self.shape[1:])
        per_step = _blocks_per_step(n)
        k0, k1 = a * per_step, b * per_step
        bounds = self._bounds()
        start, end = int(bounds[k0]), int(bounds[k1])  # read on the host: no device wait
        if end <= start:
            return torch.zeros(0, dtype=torch.int64, device=target)
        local = _moved(self._data[start:end], target)
        if k1 - k0 == 1:  # one block (a step of up to 65,536 elements): no counts to spread
            return local.to(torch.int64).add_(_HALF)
        there = self._offsets_on(target)
        counts = there[k0 + 1 : k1 + 1] - there[k0:k1]
        starts = self._kept_starts(k1 - k0, per_step, n, target)
        positions = torch.repeat_interleave(starts, counts, output_size=end - start)
        return positions.add_(local)

    def _bounds(self) -> Any:
        """The offsets as a NumPy view (no copy): an element reads in well under a microsecond,
        where a tensor's ``int(offsets[k])`` dispatches two ops."""
        if self._offsets_view is None:
            assert self._offsets is not None
            self._offsets_view = self._offsets.numpy()
        return self._offsets_view

    def _kept_starts(self, blocks: int, per_step: int, n: int, device: torch.device) -> Tensor:
        """`_block_starts`, kept for the few run lengths a run asks for (a chunk and the last,
        shorter chunk)."""
        key = (blocks, device)
        starts = self._starts.get(key)
        if starts is None:
            if len(self._starts) >= _KEPT_STARTS:
                self._starts.clear()  # a run asks for a few lengths; a clear is thread-safe
            starts = self._starts[key] = _block_starts(blocks, per_step, n, device)
        return starts

    def _offsets_on(self, device: torch.device) -> Tensor:
        """The offsets on ``device``: the CPU's own, or a copy made once per device (a copy per
        step from pageable host memory would make the host wait for the device's queue)."""
        offsets = self._offsets
        assert offsets is not None
        if device.type == "cpu":
            return offsets
        copy = self._offsets_copies.get(device)
        if copy is None:
            copy = self._offsets_copies[device] = offsets.to(device)
        return copy

    def dense(self, device: torch.device | str | None = None) -> Tensor:
        """The whole train dense, ``(T, B, ...)`` in ``dtype``, on ``device`` (default: here)."""
        return self.chunk(0, self.T, device)

    def to_dense(self) -> Tensor:
        """`dense` here, by torch's name for it (``Tensor.to_dense``)."""
        return self.dense()

    def positions(self) -> Tensor:
        """Flat row-major positions of the ones, ``(ones,)`` int64, ascending, on ``device``."""
        if self.codec == "bitpack":
            mask = bitunpack(self._data, self.numel, torch.bool)
            return torch.nonzero(mask).reshape(-1)
        offsets = self._offsets
        assert offsets is not None
        n = shape_numel(self.shape[1:])
        per_step = _blocks_per_step(n)
        blocks = offsets.numel() - 1
        there = self._offsets_on(self.device)
        counts = there[1:] - there[:-1]
        starts = _block_starts(blocks, per_step, n, self.device)
        out = torch.repeat_interleave(starts, counts, output_size=self.ones)
        return out.add_(self._data)

    def to_sparse_coo(self) -> Tensor:
        """The train as a coalesced ``torch.sparse_coo`` tensor ``(T, B, ...)`` of ``dtype``,
        values all 1, on ``device``; ``from_sparse_coo`` of it gives this train back."""
        positions = self.positions()
        if self.shape.numel() and len(self.shape):
            indices = torch.stack(torch.unravel_index(positions, self.shape))
        else:
            indices = positions.new_zeros((len(self.shape), 0))
        values = torch.ones(positions.numel(), dtype=self.dtype, device=self.device)
        return torch.sparse_coo_tensor(
            indices,
            values,
            self.shape,
            device=self.device,
            is_coalesced=True,
            check_invariants=False,
        )

    # ------------------------------------------------------------------------- moving

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SpikeTrain:
        """The same train with its payload on ``device`` (``self`` when already there)."""
        device = torch.device(device)
        data = self._data.to(device, non_blocking=non_blocking)
        if data is self._data:
            return self
        return SpikeTrain(self.codec, self.shape, self.dtype, data, self._offsets, self.ones)

    def cpu(self) -> SpikeTrain:
        """The same train with its payload in CPU memory."""
        return self.to("cpu")

    def pin_memory(self, device: Any = None) -> SpikeTrain:
        """The same train with its payload in pinned (page-locked) CPU memory, for fast and
        asynchronous copies to a GPU (DataLoader ``pin_memory=True`` calls this)."""
        data = self._data.pin_memory()
        return SpikeTrain(self.codec, self.shape, self.dtype, data, self._offsets, self.ones)

    def is_pinned(self) -> bool:
        """Whether the payload is in pinned CPU memory."""
        return self._data.is_pinned()

    # ------------------------------------------------------------------------- pickling

    def __getstate__(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "shape": tuple(self.shape),
            "dtype": self.dtype,
            "data": self._data,
            "offsets": self._offsets,
            "ones": self.ones,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["codec"],
            state["shape"],
            state["dtype"],
            state["data"],
            state["offsets"],
            state["ones"],
        )


def _moved(part: Tensor, target: torch.device) -> Tensor:
    """``part`` of a payload on ``target``: a copy from pinned host memory to a GPU is queued
    without waiting (the payload outlives it; torch's pinned allocator tracks its use), any
    other copy is an ordinary one."""
    asynchronous = target.type == "cuda" and part.device.type == "cpu" and part.is_pinned()
    return part.to(target, non_blocking=asynchronous)


def as_spike_train(x: Tensor | SpikeTrain, codec: str = "auto") -> SpikeTrain:
    """``x`` as a [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain]: returned as it is, packed from a dense tensor, or from a
    ``torch.sparse_coo`` tensor (values exactly 0 or 1). Raises ``NotBinaryError`` otherwise."""
    if isinstance(x, SpikeTrain):
        return x
    if isinstance(x, Tensor) and x.layout == torch.sparse_coo:
        return SpikeTrain.from_sparse_coo(x, codec)
    return SpikeTrain.from_dense(x, codec)


# ------------------------------------------------------------------------------------- helpers


def _check_codec(codec: str) -> None:
    if codec not in SPIKE_TRAIN_CODECS:
        raise ConfigError(
            f"unknown spike-train codec {codec!r}: use one of "
            f"{', '.join(map(repr, SPIKE_TRAIN_CODECS))}"
        )


def _check_shape(shape: torch.Size | tuple[int, ...]) -> None:
    if len(shape) == 0:
        raise ConfigError("a spike train needs a time axis: shape (T, B, ...), got a 0-d tensor")


def _block_starts(blocks: int, per_step: int, n: int, device: torch.device) -> Tensor:
    """The flat position of the first element of each of ``blocks`` consecutive index-list
    blocks, from a step's first block, plus the bias of the stored local offsets (``_HALF``):
    ``(blocks,)`` int64 on ``device`` (``n`` elements per step, ``per_step`` blocks each)."""
    block = torch.arange(blocks, device=device)
    per_step = max(per_step, 1)
    return (block // per_step) * n + (block % per_step) * BLOCK + _HALF


def concat_steps(trains: Sequence[SpikeTrain]) -> SpikeTrain:
    """The trains one after the other in time, ``(sum T_i, B, ...)``: one codec, dtype,
    device and step shape; bit-packed ones whole bytes each but the last (``T_i * B * ...``
    a multiple of 8). Payloads are concatenated, never unpacked."""
    if not trains:
        raise ConfigError("concat_steps needs at least one train")
    first = trains[0]
    for t in trains[1:]:
        if (t.codec, t.dtype, t.device, t.shape[1:]) != (
            first.codec, first.dtype, first.device, first.shape[1:]
        ):  # fmt: skip
            raise ConfigError(
                "concat_steps needs one codec, dtype, device and step shape: "
                f"{first.codec} {first.dtype} {first.device} {tuple(first.shape[1:])} against "
                f"{t.codec} {t.dtype} {t.device} {tuple(t.shape[1:])}"
            )
    if first.codec == "bitpack" and any(shape_numel(t.shape) % 8 for t in trains[:-1]):
        raise ConfigError("concat_steps: a bit-packed train before the last ends inside a byte")
    shape = (sum(t.T for t in trains), *first.shape[1:])
    ones = sum(t.ones for t in trains)
    data = torch.cat([t._data for t in trains])
    if first.codec == "bitpack":
        return SpikeTrain("bitpack", shape, first.dtype, data, None, ones)
    counts = torch.cat([cast(Tensor, t._offsets).diff() for t in trains])
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=offsets[1:])
    return SpikeTrain("index", shape, first.dtype, data, offsets, ones)


def _blocks_per_step(n: int) -> int:
    """Index-list blocks per time step of ``n`` elements (each holds up to 65,536)."""
    return (n + BLOCK - 1) // BLOCK


def packed_nbytes(codec: str, shape: torch.Size | tuple[int, ...], ones: int) -> int:
    """Bytes a train of ``shape`` ``(T, B, ...)`` with ``ones`` ones holds in ``codec``
    (``"bitpack"`` or ``"index"``): payload plus offsets, as `SpikeTrain.nbytes` counts."""
    if codec == "bitpack":
        return (shape_numel(shape) + 7) // 8
    blocks = int(shape[0]) * _blocks_per_step(shape_numel(shape[1:]))
    return 2 * ones + 8 * (blocks + 1)


def _choose(codec: str, shape: torch.Size | tuple[int, ...], ones: int) -> str:
    if codec != "auto":
        return codec
    index = packed_nbytes("index", shape, ones)
    return "index" if index < packed_nbytes("bitpack", shape, ones) else "bitpack"


def _index_encode(positions: Tensor, steps: int, n: int) -> tuple[Tensor, Tensor]:
    """Flat ascending positions in a ``(steps, n)`` train -> (int16 local, CPU int64 offsets)."""
    per_step = _blocks_per_step(n)
    if positions.numel():
        step, within = positions // n, positions % n
        block = step * per_step + (within >> 16)
        local = ((within & (BLOCK - 1)) - _HALF).to(torch.int16)
        counts = torch.bincount(block, minlength=steps * per_step).cpu()
    else:
        local = positions.to(torch.int16)
        counts = torch.zeros(steps * per_step, dtype=torch.long)
    offsets = torch.zeros(steps * per_step + 1, dtype=torch.long)
    torch.cumsum(counts, 0, out=offsets[1:])
    return local, offsets


def _row_major_strides(shape: torch.Size, device: torch.device) -> Tensor:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    return torch.tensor(strides, dtype=torch.long, device=device)


torch.serialization.add_safe_globals([SpikeTrain])
