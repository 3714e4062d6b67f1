"""Host tier: checkpoints packed in CPU memory; pinned buffers and a side stream on CUDA."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from spikeckpt.storage.base import Ledger, StoreBase, tensor_nbytes
from spikeckpt.storage.codecs import Packed, pack, unpack
from spikeckpt.storage.freelist import ALIGN, BestFit, round_capacity

__all__ = ["HostStore"]


class _PinnedPool:
    """Pinned CPU byte buffers, allocated once and reused (best fit, at most ~2x the request)."""

    def __init__(self) -> None:
        self._free: BestFit[Tensor] = BestFit()
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> Tensor:
        """A pinned uint8 buffer of at least ``nbytes``."""
        found = self._free.take(nbytes)
        if found is not None:
            return found[1]
        capacity = round_capacity(nbytes)
        self.allocated_bytes += capacity
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: Tensor) -> None:
        """Return ``buf`` for reuse."""
        self._free.give(buf.numel(), buf)

    def clear(self) -> None:
        self._free.clear()
        self.allocated_bytes = 0


@dataclass
class _HostItem:
    packs: list[Packed]  # payloads on the CPU
    nbytes: int
    buffer: Tensor | None = None  # pinned buffer holding the payloads (CUDA only)
    event: torch.cuda.Event | None = None  # device -> host copy done


class HostStore(StoreBase):
    """Packs each tensor (``pack``, auto codec) and keeps the payload in CPU memory.

    On CUDA, payloads go to pinned buffers taken from a pool (allocated once, reused after
    ``drop``) through copies on a side stream ordered with events, so they overlap compute;
    ``prefetch`` starts the copy back and ``get`` waits for it. On the CPU the host tier is the
    same memory as the device: it still packs, and ``get`` of a dense tensor returns the stored
    copy (do not modify it in place). On CUDA the copy out of a tensor given to ``put`` may still
    run after ``put`` returns: do not modify those tensors in place afterwards either.

    Args:
        device: where ``get`` returns tensors (where the step runs).
        ledger: counts bytes under ``"host"``.
        pin_memory: use pinned buffers and the side stream; default: when ``device`` is CUDA.
            Ignored (False) for non-CUDA devices.
    """

    kind = "host"

    def __init__(
        self, device: torch.device | str, ledger: Ledger, pin_memory: bool | None = None
    ) -> None:
        self.device = torch.device(device)
        self.ledger = ledger
        is_cuda = self.device.type == "cuda"
        if is_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin_memory = is_cuda if pin_memory is None else (bool(pin_memory) and is_cuda)
        self._stream = torch.cuda.Stream(self.device) if self.pin_memory else None
        self._pool = _PinnedPool() if self.pin_memory else None
        self._items: dict[int, _HostItem] = {}
        self._ready: dict[int, tuple[list[Packed], torch.cuda.Event | None]] = {}

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory allocated by this store (0 without pinning)."""
        return self._pool.allocated_bytes if self._pool is not None else 0

    def put(self, key: int, tensors: Sequence[Tensor]) -> None:
        """Pack ``tensors`` and copy the payloads to CPU memory (asynchronously on CUDA)."""
        self._check_open()
        self.drop(key)
        packs = [pack(t) for t in tensors]
        nbytes = sum(p.nbytes for p in packs)
        if self._stream is not None:
            item = self._put_pinned(packs, nbytes)
        else:
            item = _HostItem([_to_host(p) for p in packs], nbytes)
        self._items[key] = item
        self.ledger.add(self.kind, nbytes)
        self.ledger.moved(self.kind, written=nbytes)

    def _put_pinned(self, packs: list[Packed], nbytes: int) -> _HostItem:
        assert self._stream is not None and self._pool is not None
        offsets, total = _layout(packs)
        buffer = self._pool.take(total)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        host_packs = []
        with torch.cuda.stream(self._stream):
            for p, offs in zip(packs, offsets, strict=True):
                views = []
                for src, off in zip(p.payload, offs, strict=True):
                    dst = _view(buffer, off, src)
                    if src.device.type == "cuda":
                        dst.copy_(src, non_blocking=True)
                        src.record_stream(self._stream)
                    else:
                        dst.copy_(src)
                    views.append(dst)
                host_packs.append(p.with_payload(tuple(views)))
            event = torch.cuda.Event()
            event.record(self._stream)
        return _HostItem(host_packs, nbytes, buffer=buffer, event=event)

    def get(self, key: int) -> list[Tensor]:
        """Unpack ``key`` on the device, waiting for its prefetch if one was started."""
        self._check_open()
        item = self._items.get(key)
        if item is None:
            raise self._unknown_key(key, list(self._items))
        ready = self._ready.pop(key, None)
        if ready is None:
            ready = self._fetch(item)
        packs, event = ready
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for p in packs:
                for t in p.payload:
                    t.record_stream(current)
        self.ledger.moved(self.kind, read=item.nbytes)
        return [unpack(p, self.device) for p in packs]

    def _fetch(self, item: _HostItem) -> tuple[list[Packed], torch.cuda.Event | None]:
        if self._stream is None:
            return [p.to(self.device) for p in item.packs], None
        with torch.cuda.stream(self._stream):
            packs = [p.to(self.device, non_blocking=True) for p in item.packs]
            event = torch.cuda.Event()
            event.record(self._stream)
        return packs, event

    def prefetch(self, key: int) -> None:
        """On CUDA, start copying ``key`` back to the device on the side stream."""
        self._check_open()
        item = self._items.get(key)
        if item is None:
            raise self._unknown_key(key, list(self._items))
        if self._stream is not None and key not in self._ready:
            self._ready[key] = self._fetch(item)

    def drop(self, key: int) -> None:
        """Forget ``key``; its pinned buffer goes back to the pool (no-op when absent)."""
        self._ready.pop(key, None)
        item = self._items.pop(key, None)
        if item is None:
            return
        self.ledger.remove(self.kind, item.nbytes)
        if item.buffer is not None and self._pool is not None:
            # Later copies into the buffer run on the same side stream, after this item's.
            self._pool.give(item.buffer)

    def close(self) -> None:
        """Forget everything and free the pinned buffers. Idempotent."""
        for key in list(self._items):
            self.drop(key)
        self._ready.clear()
        if self._stream is not None and not self._closed:
            self._stream.synchronize()
        if self._pool is not None:
            self._pool.clear()
        self._closed = True

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items


def _to_host(packed: Packed) -> Packed:
    """A copy of ``packed`` whose payload lives in (unpinned) CPU memory, sharing nothing."""
    payload = []
    for t in packed.payload:
        if t.device.type == "cpu" and packed.codec == "dense":
            t = t.clone()  # packed codecs already made new tensors
        payload.append(t.to("cpu"))
    return packed.with_payload(tuple(payload))


def _layout(packs: list[Packed]) -> tuple[list[list[int]], int]:
    """Byte offsets (aligned) of every payload tensor in one buffer, and the buffer size."""
    offsets, total = [], 0
    for p in packs:
        offs = []
        for t in p.payload:
            offs.append(total)
            total += -(-tensor_nbytes(t) // ALIGN) * ALIGN
        offsets.append(offs)
    return offsets, max(total, 1)


def _view(buffer: Tensor, offset: int, like: Tensor) -> Tensor:
    """A contiguous tensor shaped and typed like ``like`` inside ``buffer`` at ``offset``."""
    nbytes = tensor_nbytes(like)
    return buffer[offset : offset + nbytes].view(like.dtype).view(like.shape)
