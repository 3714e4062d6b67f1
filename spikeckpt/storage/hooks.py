"""Pack the binary tensors autograd saves for backward (spikes), through saved-tensor hooks.

A ``Linear`` layer fed with spikes saves its input ``(B, N)`` for the weight gradient: 32 bits
per element dense, 1 bit bit-packed (or less as an index list). Inside
``packed_saved_tensors()`` every saved tensor that is floating or bool, contiguous, has at least
``min_numel`` elements and is exactly binary is stored with ``pack`` and rebuilt on use; the
rebuilt tensor is bitwise equal, so gradients are unchanged.

Saved-tensor hooks registered *inside* a function run by ``torch.utils.checkpoint`` disable its
recomputation (it then keeps every saved tensor): enter this context around the whole taped
segment instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from spikeckpt.storage.base import tensor_nbytes
from spikeckpt.storage.codecs import Packed, pack, unpack

__all__ = ["SavedStats", "SavedTensors", "packed_saved_tensors"]

_Saved = Tensor | Packed


@dataclass
class SavedStats:
    """What passed through the hooks. Bytes are element bytes (numel * element size).

    Attributes:
        saved_bytes: bytes of every tensor saved for backward, dense (what autograd would hold;
            parameters and tensors shared with other nodes are counted each time they are saved).
        stored_bytes: bytes held after packing (packed payloads plus the tensors kept as is).
        saved_count: number of tensors saved.
        packed_count: number of them that were packed.
    """

    saved_bytes: int = 0
    stored_bytes: int = 0
    saved_count: int = 0
    packed_count: int = 0

    @property
    def spared_bytes(self) -> int:
        """``saved_bytes - stored_bytes``: what packing spared."""
        return self.saved_bytes - self.stored_bytes


class SavedTensors:
    """The one saved-tensor hook pair: counts what autograd saves inside it and, with ``pack``,
    keeps the exactly-binary tensors packed (a context manager; the engine's tape counter and
    `packed_saved_tensors` are this).

    With ``pack``, every saved tensor that is exactly binary (floating or bool, contiguous, at
    least ``min_numel`` elements) is kept bit-packed or as an index list
    ([`pack`][spikeckpt.storage.codecs.pack]) and counted at its packed size; it is rebuilt
    bitwise on use. Other tensors are kept as detached aliases: no copy; returning the tensor
    itself would tie a saved output to its own graph node in a reference cycle that only the
    garbage collector breaks. Tensors whose storage is one of ``exclude``'s (parameters: a
    weight that ``matmul`` saves costs no extra memory) are kept as they are and left out of
    `bytes`.

    Attributes:
        bytes: bytes held for backward so far, ``exclude``'s storages left out.
        stats: every saved tensor's dense and stored bytes (`SavedStats`).
    """

    def __init__(
        self, exclude: Iterable[Tensor] = (), *, pack: bool = False, min_numel: int = 1024
    ) -> None:
        self.bytes = 0
        self.stats = SavedStats()
        self._exclude = {p for p in (_storage_ptr(t) for t in exclude) if p is not None}
        self._pack_binary = pack
        self._min_numel = min_numel
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    # never compiled by itself: around a graph break in a compiled step (a full backward
    # hook) dynamo took it for a frame of its own and recompiled it as the byte count grew,
    # up to its recompile limit (16 graphs, a 6-line warning naming this function)
    @torch.compiler.disable
    def _pack(self, tensor: Tensor) -> _Saved:
        nbytes = tensor_nbytes(tensor)
        stats = self.stats
        stats.saved_count += 1
        stats.saved_bytes += nbytes
        ptr = _storage_ptr(tensor) if self._exclude else None
        if ptr is not None and ptr in self._exclude:
            stats.stored_bytes += nbytes
            return tensor.detach()
        if self._pack_binary and _candidate(tensor, self._min_numel):
            packed = pack(tensor)
            if packed.codec != "dense":
                stats.packed_count += 1
                stats.stored_bytes += packed.nbytes
                self.bytes += packed.nbytes
                return packed
        stats.stored_bytes += nbytes
        self.bytes += nbytes
        return tensor.detach()

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


@contextmanager
def packed_saved_tensors(min_numel: int = 1024) -> Iterator[SavedStats]:
    """Context manager: pack exactly-binary tensors saved for backward; yields `SavedStats`.

    Args:
        min_numel: smaller tensors are kept as they are (packing them spares too little).

    The hooks stay attached to the graph built inside the block: backward may run after the
    block ends. Non-contiguous tensors are kept as they are, so that the tensors autograd gets
    back have the strides it saved (and kernels compute bit for bit the same).
    """
    with SavedTensors(pack=True, min_numel=min_numel) as hooks:
        yield hooks.stats


@torch.compiler.disable
def _unpack(saved: _Saved) -> Tensor:
    return unpack(saved) if isinstance(saved, Packed) else saved


def _storage_ptr(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested, meta...
        return None


def _candidate(tensor: Tensor, min_numel: int) -> bool:
    return (
        (tensor.is_floating_point() or tensor.dtype == torch.bool)
        and tensor.layout == torch.strided
        and tensor.numel() >= min_numel
        and tensor.is_contiguous()
    )
