"""Spike codecs: store exactly-binary tensors in 1 bit per element or as index lists.

Codecs (``Packed.codec``):

- ``"dense"``: the tensor itself (a detached reference, no copy). Anything that is not exactly
  binary, and every dtype that cannot be packed, is stored this way.
- ``"bitpack"``: 1 bit per element. Payload: ``(ceil(numel / 8),)`` uint8; element ``8*i + j``
  (in row-major order) is bit ``j`` (least significant first) of byte ``i``.
- ``"index"``: positions of the ones, 16 bits each. The flat tensor is cut into blocks of
  65,536 elements; payload ``(n_ones,)`` int16 holds ``position_in_block - 32768`` (an exact
  bijection of 0..65535 onto the int16 range), plus, when ``numel > 65536``, a
  ``(n_blocks,)`` int32 count of ones per block. Cost ``2 * n_ones + 4 * n_blocks`` bytes. The
  design's int32 fallback for rows of 65,536 elements or more is never needed: blocking keeps
  every index at 16 bits, so index lists beat bit-packing up to a density of almost 1/16.

``"auto"`` (the default) stores non-binary tensors dense and binary ones with whichever of
``bitpack`` / ``index`` takes fewer bytes (bit-pack on ties).

"Exactly binary" is bitwise: every element is ``0`` or ``1`` and, for floating dtypes, has a
clear sign bit. ``-0.0`` compares equal to ``0`` but cannot survive 1 bit, so a tensor holding
it is not binary and ``auto`` stores it dense. Round trips keep dtype, shape, device and every
bit of every value; they do not keep strides (unpacked tensors are contiguous) or
``requires_grad``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import Tensor

from spikeckpt.errors import ConfigError, NotBinaryError
from spikeckpt.storage import scan_jit
from spikeckpt.storage.base import tensor_nbytes

__all__ = [
    "BLOCK",
    "CODECS",
    "Packed",
    "binary_mask",
    "bitpack",
    "bitunpack",
    "count_binary",
    "dtype_size",
    "is_binary",
    "merged",
    "not_binary_message",
    "pack",
    "packable_dtype",
    "require_binary",
    "scan_binary",
    "shape_numel",
    "unpack",
]

CODECS = ("auto", "dense", "bitpack", "index")
BLOCK = 65536
"""Elements per index-list block: positions inside a block fit 16 bits."""

# Integer dtype of the same size, to compare floats bit for bit.
_BITS_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
_INTEGER = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_PREFIX = 256  # elements checked first, to reject non-binary tensors cheaply
_ONE_BITS: dict[torch.dtype, int] = {}
_SHIFTS: dict[torch.device, Tensor] = {}
_TABLES: dict[torch.device, Tensor] = {}
NUMPY_DTYPES = frozenset({torch.bool, torch.float16, torch.float32, torch.float64, *_INTEGER})
"""dtypes whose CPU tensors NumPy views as they are (bfloat16 and complex have no such view)."""


@dataclass(frozen=True)
class Packed:
    """A tensor in coded form.

    Attributes:
        codec: ``"dense"``, ``"bitpack"`` or ``"index"``.
        shape: shape of the original tensor.
        dtype: dtype of the original tensor.
        device: device of the original tensor (``unpack`` returns it there by default).
        payload: the stored tensors (see the module docstring for each codec's layout).
    """

    codec: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    payload: tuple[Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the payload (what this takes in memory or on disk, metadata aside)."""
        return sum(tensor_nbytes(p) for p in self.payload)

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return shape_numel(self.shape)

    @property
    def dense_nbytes(self) -> int:
        """Bytes the original tensor takes dense."""
        return self.numel * dtype_size(self.dtype)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Packed:
        """Move the payload to ``device`` (``self.device``, where it unpacks to, is kept)."""
        device = torch.device(device)
        if all(p.device == device for p in self.payload):
            return self
        payload = tuple(p.to(device, non_blocking=non_blocking) for p in self.payload)
        return self.with_payload(payload)

    def with_payload(self, payload: tuple[Tensor, ...]) -> Packed:
        """The same description with another payload (same shapes and dtypes)."""
        return Packed(self.codec, self.shape, self.dtype, self.device, tuple(payload))


def packable_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can be bit-packed (bool, integer and real floating dtypes)."""
    return dtype == torch.bool or dtype in _BITS_VIEW or dtype in _INTEGER


def is_binary(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` is exactly ``0`` or ``1`` (bitwise; ``-0.0`` is not).

    Always ``False`` for dtypes that cannot be packed (complex, quantized, ...) and for sparse
    tensors; ``True`` for empty tensors of packable dtypes.
    """
    return scan_binary(tensor) is not None


def binary_mask(tensor: Tensor) -> tuple[Tensor, int] | None:
    """``(flat bool mask of the ones, count of ones)`` if ``tensor`` is exactly binary, else
    None: one pass that [`pack`][spikeckpt.storage.codecs.pack] can reuse (``pack(tensor, found=...)``)."""
    return scan_binary(tensor)


def require_binary(tensor: Tensor, name: str = "tensor") -> Tensor:
    """Return ``tensor`` if it is exactly binary, else raise ``NotBinaryError`` saying why.

    Args:
        tensor: any shape, any dtype.
        name: how the message calls the tensor (e.g. ``"inputs"``).
    """
    if scan_binary(tensor) is not None:
        return tensor
    raise NotBinaryError(not_binary_message(tensor, name))


_UNSCANNED: object = object()


def pack(tensor: Tensor, codec: str = "auto", *, found: object = _UNSCANNED) -> Packed:
    """Code ``tensor`` (any shape and device) with ``codec``; see the module docstring.

    ``"bitpack"`` and ``"index"`` raise ``NotBinaryError`` on tensors that are not exactly
    binary; ``"auto"`` stores those dense. Runs on the tensor's device, vectorised.
    ``found``: what `binary_mask` returned for this very tensor (saves a pass).
    """
    if codec not in CODECS:
        raise ConfigError(f"unknown codec {codec!r}: use one of {', '.join(map(repr, CODECS))}")
    tensor = tensor.detach()
    if codec == "dense":
        return _dense(tensor)
    if found is _UNSCANNED:
        found = scan_binary(tensor)
    if found is None:
        if codec == "auto":
            return _dense(tensor)
        raise NotBinaryError(not_binary_message(tensor, "tensor", codec=codec))
    mask, n_ones = cast("tuple[Tensor, int]", found)  # scan_binary's or binary_mask's
    if codec == "auto":
        codec = (
            "index" if _index_nbytes(mask.numel(), n_ones) < _bitpack_nbytes(mask) else "bitpack"
        )
    payload = (bitpack(mask),) if codec == "bitpack" else _index_encode(mask)
    return Packed(codec, tensor.shape, tensor.dtype, tensor.device, payload)


def unpack(packed: Packed, device: torch.device | str | None = None) -> Tensor:
    """Rebuild the tensor on ``device`` (default: the device it was packed from).

    Returns a new contiguous tensor for ``bitpack`` / ``index``; for ``dense`` the stored tensor
    itself when it is already on ``device`` (do not modify it in place if you reuse ``packed``).
    """
    target = packed.device if device is None else torch.device(device)
    if packed.codec == "dense":
        return packed.payload[0].to(target)
    payload = tuple(p.to(target) for p in packed.payload)
    if packed.codec == "bitpack":
        flat = bitunpack(payload[0], packed.numel, packed.dtype)
    elif packed.codec == "index":
        flat = _index_decode(payload, packed.numel, packed.dtype)
    else:
        raise ConfigError(f"unknown codec {packed.codec!r} in Packed: was it built by pack()?")
    return flat.reshape(packed.shape)


# ------------------------------------------------------------------------------------- helpers


def shape_numel(shape: torch.Size | tuple[int, ...]) -> int:
    """Elements of a tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def _dense(tensor: Tensor) -> Packed:
    return Packed("dense", tensor.shape, tensor.dtype, tensor.device, (tensor,))


def _ones_mask(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """``(is_one, raw)``: bool mask of elements equal to 1 (bitwise) and a tensor whose nonzero
    elements are exactly the non-zero elements of ``tensor`` (bitwise)."""
    if tensor.dtype == torch.bool:
        return tensor, tensor
    view = _BITS_VIEW.get(tensor.dtype)
    if view is None:
        return tensor == 1, tensor
    raw = tensor.view(view)
    return raw == _one_bits(tensor.dtype), raw


def scan_binary(tensor: Tensor) -> tuple[Tensor, int] | None:
    """``(flat bool mask of ones, count of ones)`` if ``tensor`` is exactly binary, else None."""
    if tensor.layout != torch.strided or not packable_dtype(tensor.dtype):
        return None
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return _scan_numpy(tensor)
    return _scan_torch(tensor)


def _scan_torch(tensor: Tensor) -> tuple[Tensor, int] | None:
    if tensor.dtype != torch.bool and tensor.numel() > 16 * _PREFIX and tensor.is_contiguous():
        ones, raw = _ones_mask(tensor.view(-1)[:_PREFIX])
        if not _same_counts(ones, raw)[0]:
            return None
    ones, raw = _ones_mask(tensor)
    same, n_ones = _same_counts(ones, raw)
    return (ones.reshape(-1), n_ones) if same else None


def _same_counts(ones: Tensor, raw: Tensor) -> tuple[bool, int]:
    """``(ones and raw have as many non-zeros, the count of ones)``, read from the device in
    one transfer (each read waits for the device: on CUDA one sync, not two)."""
    if raw is ones:
        return True, int(torch.count_nonzero(ones))
    n_ones, n_raw = torch.stack([torch.count_nonzero(ones), torch.count_nonzero(raw)]).tolist()
    return n_ones == n_raw, n_ones


# CPU tensors are coded with numpy: its calls cost about a microsecond where a torch op costs
# several, which for the small states of a checkpoint is most of the time (a round trip of a
# 34 KB state: 276 us with torch ops, see docs/benchmarks.md section 7). The results are
# bitwise those of the torch code below, which serves every other device (tests compare the
# two). Every tensor that outlives a call is allocated by torch (seen by ``MemoryMeter``); the
# numpy temporaries are bounded (``_UNPACK_BYTES``) and freed at once.
_UNPACK_BYTES = 1 << 17  # packed bytes unpacked per numpy call: temporaries of <= 1 MiB


def _scan_numpy(tensor: Tensor) -> tuple[Tensor, int] | None:
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        return flat, int(np.count_nonzero(flat.numpy()))
    view = _BITS_VIEW.get(flat.dtype)
    raw = (flat.view(view) if view is not None else flat).numpy()
    one = _one_bits(flat.dtype)
    head = raw[:_PREFIX]
    if raw.size > _PREFIX and np.count_nonzero(head == one) != np.count_nonzero(head):
        return None
    mask = torch.empty(raw.size, dtype=torch.bool)
    ones = mask.numpy()
    if scan_jit.ones_masked is not None:  # one pass (three below)
        n_ones, n_raw = scan_jit.ones_masked(raw, one, ones)
        return (mask, int(n_ones)) if n_ones == n_raw else None
    np.equal(raw, one, out=ones)
    n_ones = int(np.count_nonzero(ones))
    if n_ones != np.count_nonzero(raw):
        return None
    return mask, n_ones


def count_binary(tensor: Tensor) -> tuple[int, bool]:
    """``(the count of non-zero elements, whether tensor is exactly binary)``, where the
    caller needs no mask (a train that is counted, not stored): on the CPU one compiled pass
    over its bits, nothing allocated, also where no flat view reads it (a chunk of a
    permuted or batch-first input: read as ``(k, rows, n)`` where it lies, not copied; the
    planner measured that copy as working memory and chose 1.7x shorter layer-wise chunks)."""
    if tensor.device.type == "cpu" and tensor.dtype in NUMPY_DTYPES and tensor.dtype != torch.bool:
        tensor = tensor.detach()
        view = _BITS_VIEW.get(tensor.dtype)
        bits = tensor.view(view) if view is not None else tensor
        counted = None
        flat = _view_as(bits, (-1,))
        if flat is not None and scan_jit.bits_counted is not None:
            counted = scan_jit.bits_counted(flat.numpy(), _one_bits(tensor.dtype))
        elif flat is None and scan_jit.bits_counted_rows is not None:
            rows = _rows_where_they_lie(bits)
            if rows is not None:
                counted = scan_jit.bits_counted_rows(*rows, _one_bits(tensor.dtype))
        if counted is not None:
            n_ones, n_raw = counted
            if n_ones == n_raw:
                return int(n_ones), True
            return int(torch.count_nonzero(tensor)), False  # values: -0.0 is zero
    found = scan_binary(tensor)
    if found is not None:
        return found[1], True
    return int(torch.count_nonzero(tensor)), False


def _rows_where_they_lie(tensor: Tensor) -> tuple[np.ndarray, np.ndarray, int] | None:
    """``(the storage from tensor's first element to its last as a 1-D array, each row's
    start in it, in storage order, the row length)`` for a CPU tensor ``(k, ..., n)`` read as ``(k, rows,
    n)`` rows of contiguous elements, else None."""
    three = _view_as(tensor, (tensor.shape[0], -1, tensor.shape[-1]))
    if three is None or three.stride(-1) != 1 or min(three.stride()) < 0 or not three.numel():
        return None
    k, rows, n = three.shape
    s_k, s_r = three.stride(0), three.stride(1)
    span = (k - 1) * s_k + (rows - 1) * s_r + n
    base = torch.as_strided(three, (span,), (1,)).numpy()
    # in the order they lie (a batch-first input's rows of one sample first): read cold,
    # 2.3x faster than step by step (600 against 260 us for 34 x 32 x 700 on an AMD EPYC)
    outer, inner = (np.arange(k) * s_k, np.arange(rows) * s_r)
    if s_r > s_k:
        outer, inner = inner, outer
    starts = (outer[:, None] + inner[None, :]).reshape(-1)
    return base, starts, n


def merged(tensor: Tensor, start: int, stop: int) -> bool:
    """Whether dims ``start <= d < stop`` of ``tensor`` merge into one without a copy (each
    dim's stride the next one's times its size, dims of size 1 aside), as ``view`` needs:
    told from the strides, not from ``view`` raising (an exception cost 10 us)."""
    dims = zip(tensor.shape[start:stop], tensor.stride()[start:stop], strict=True)
    kept = [(n, s) for n, s in dims if n != 1]
    return all(s == n * t for (_, s), (n, t) in zip(kept, kept[1:], strict=False))


def _view_as(tensor: Tensor, shape: tuple[int, ...]) -> Tensor | None:
    """``tensor`` as a flat ``(-1,)`` or ``(k, -1, n)`` view (``shape``), or None where that
    needs a copy."""
    if tensor.dim() == 0 or not tensor.numel():
        return tensor.reshape(shape) if shape == (-1,) else None
    if shape == (-1,):
        return tensor.view(shape) if merged(tensor, 0, tensor.dim()) else None
    if merged(tensor, 1, tensor.dim() - 1):
        return tensor.view(shape)
    return None


def _one_bits(dtype: torch.dtype) -> int:
    """The value 1 of ``dtype`` as its integer bit pattern (floats) or itself (integers)."""
    one = _ONE_BITS.get(dtype)
    if one is None:
        view = _BITS_VIEW.get(dtype, dtype)
        one = _ONE_BITS[dtype] = int(torch.ones((), dtype=dtype).view(view).item())
    return one


def _bitpack_nbytes(mask: Tensor) -> int:
    return (mask.numel() + 7) // 8


def _index_nbytes(numel: int, n_ones: int) -> int:
    blocks = 0 if numel <= BLOCK else (numel + BLOCK - 1) // BLOCK
    return 2 * n_ones + 4 * blocks


def _shifts(device: torch.device) -> Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return shifts


def _table(device: torch.device) -> Tensor:
    """``(256,)`` int64 whose 8 bytes (memory order) are the 8 bits of the index, LSB first."""
    table = _TABLES.get(device)
    if table is None:
        bytes_ = (torch.arange(256, dtype=torch.uint8).unsqueeze(1) >> torch.arange(8)) & 1
        table = bytes_.to(torch.uint8).contiguous().view(torch.int64).reshape(256)
        table = _TABLES[device] = table.to(device)
    return table


def bitpack(mask: Tensor) -> Tensor:
    """Flat bool ``(n,)`` -> uint8 ``(ceil(n / 8),)``, bit ``j`` of byte ``i`` = element 8i+j."""
    if mask.device.type == "cpu":
        return _bitpack_numpy(mask)
    return _bitpack_torch(mask)


def _bitpack_numpy(mask: Tensor) -> Tensor:
    out = torch.empty((mask.numel() + 7) // 8, dtype=torch.uint8)
    out.numpy()[:] = np.packbits(mask.numpy(), bitorder="little")
    return out


def _bitpack_torch(mask: Tensor) -> Tensor:
    u8 = mask.view(torch.uint8)
    pad = (-u8.numel()) % 8
    if pad:
        u8 = torch.cat([u8, u8.new_zeros(pad)])
    groups = u8.view(-1, 8)
    return (groups << _shifts(groups.device)).sum(dim=1, dtype=torch.uint8)


def bitunpack(packed: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """uint8 ``(ceil(numel / 8),)`` -> ``(numel,)`` of ``dtype`` holding 0 and 1."""
    if packed.device.type == "cpu":
        return _bitunpack_numpy(packed, numel, dtype)
    return _bitunpack_torch(packed, numel, dtype)


def _bitunpack_numpy(packed: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    out = torch.empty(numel, dtype=dtype if dtype in NUMPY_DTYPES else torch.uint8)
    bits, source = out.numpy(), packed.numpy()[: (numel + 7) // 8]
    for start in range(0, source.size, _UNPACK_BYTES):
        first = 8 * start
        count = min(8 * _UNPACK_BYTES, numel - first)
        part = source[start : start + _UNPACK_BYTES]
        bits[first : first + count] = np.unpackbits(part, count=count, bitorder="little")
    return out if out.dtype == dtype else out.to(dtype)


def _bitunpack_torch(packed: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    if sys.byteorder == "little":
        bits = _table(packed.device)[packed.long()].view(torch.uint8)
    else:  # pragma: no cover - big-endian machines
        bits = ((packed.unsqueeze(1) >> _shifts(packed.device)) & 1).reshape(-1)
    bits = bits[:numel]
    return bits.view(torch.bool) if dtype == torch.bool else bits.to(dtype)


def _index_encode(mask: Tensor) -> tuple[Tensor, ...]:
    if mask.device.type == "cpu":
        return _index_encode_numpy(mask)
    return _index_encode_torch(mask)


def _index_encode_numpy(mask: Tensor) -> tuple[Tensor, ...]:
    positions = np.flatnonzero(mask.numpy())  # int64, ascending
    local = torch.empty(positions.size, dtype=torch.int16)
    local.numpy()[:] = (positions & (BLOCK - 1)) - BLOCK // 2
    if mask.numel() <= BLOCK:
        return (local,)
    n_blocks = (mask.numel() + BLOCK - 1) // BLOCK
    counts = torch.empty(n_blocks, dtype=torch.int32)
    counts.numpy()[:] = np.bincount(positions >> 16, minlength=n_blocks)
    return (local, counts)


def _index_encode_torch(mask: Tensor) -> tuple[Tensor, ...]:
    positions = torch.nonzero(mask).reshape(-1)  # int64, ascending
    local = ((positions & (BLOCK - 1)) - BLOCK // 2).to(torch.int16)
    if mask.numel() <= BLOCK:
        return (local,)
    n_blocks = (mask.numel() + BLOCK - 1) // BLOCK
    counts = torch.bincount(positions >> 16, minlength=n_blocks).to(torch.int32)
    return (local, counts)


def _index_decode(payload: tuple[Tensor, ...], numel: int, dtype: torch.dtype) -> Tensor:
    if payload[0].device.type == "cpu":
        return _index_decode_numpy(payload, numel, dtype)
    return _index_decode_torch(payload, numel, dtype)


def _index_decode_numpy(payload: tuple[Tensor, ...], numel: int, dtype: torch.dtype) -> Tensor:
    positions = payload[0].numpy().astype(np.int64) + BLOCK // 2
    if len(payload) > 1:
        counts = payload[1].numpy()
        positions += np.repeat(np.arange(counts.size, dtype=np.int64) * BLOCK, counts)
    out = torch.zeros(numel, dtype=dtype if dtype in NUMPY_DTYPES else torch.uint8)
    out.numpy()[positions] = 1
    return out if out.dtype == dtype else out.to(dtype)


def _index_decode_torch(payload: tuple[Tensor, ...], numel: int, dtype: torch.dtype) -> Tensor:
    local = payload[0]
    positions = local.long() + BLOCK // 2
    if len(payload) > 1:
        counts = payload[1].long()
        starts = torch.arange(counts.numel(), device=local.device, dtype=torch.long) * BLOCK
        positions += torch.repeat_interleave(starts, counts, output_size=local.numel())
    out = torch.zeros(numel, dtype=dtype, device=local.device)
    return out.index_fill_(0, positions, 1)


def not_binary_message(tensor: Tensor, name: str, codec: str | None = None) -> str:
    """The words of a refusal: ``tensor`` (``name``) is not a spike tensor, and what to do."""
    what = f"{name} (shape {tuple(tensor.shape)}, dtype {tensor.dtype})"
    use = f"codec {codec!r} needs" if codec else "spikes must be"
    if tensor.layout != torch.strided:
        return f"{what}: {use} a dense (strided) tensor, not {tensor.layout}; call .to_dense()."
    if not packable_dtype(tensor.dtype):
        return (
            f"{what}: {use} exactly 0 or 1 in a bool, integer or real floating dtype, not "
            f"{tensor.dtype}. Convert it, e.g. (x != 0).float(), or store it dense."
        )
    flat = tensor.detach().reshape(-1)
    ones, raw = _ones_mask(flat)
    bad = torch.nonzero((raw != 0) & ~ones).reshape(-1)
    first = int(bad[0])
    value = flat[first].item()
    shown = "-0.0 (negative zero, which 1 bit cannot keep)" if value == 0 else repr(value)
    fix = (
        "add 0.0 (x + 0.0 turns -0.0 into 0.0)"
        if value == 0
        else "threshold it, e.g. (x > 0).to(x.dtype), or store it dense (codec='dense')"
    )
    return (
        f"{what}: {use} exactly 0 or 1, but {bad.numel()} of {flat.numel()} elements are not; "
        f"the first, at flat index {first}, is {shown}. Fix: {fix}."
    )
