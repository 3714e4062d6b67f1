"""Disk tier: checkpoints packed into one file in a private temporary folder.

Every checkpoint of a store goes into the store's one file, ``<folder>/checkpoints.bin``, at
an offset of its own; a dropped checkpoint's region is reused by a later one (best fit), so
the file grows to about the most bytes held at once and no file is created, renamed or
deleted per checkpoint. Checkpoints of up to ``background_bytes`` are written and read on the
calling thread (one ``pwritev`` / ``preadv`` into the page cache: microseconds); larger ones
by one background I/O thread, so that the steps after a ``put`` or a ``prefetch`` overlap them.

Folders are removed by ``close``, by garbage collection, at interpreter exit and on SIGINT
(``KeyboardInterrupt`` unwinds). **SIGTERM** (what ``kill``, ``timeout`` and job schedulers
send) ends a Python process at once by default, running none of those; so while a disk store
is live, a SIGTERM handler is installed (from the main thread only; the one found is restored
when the last store closes, if it is still ours). On SIGTERM it:

- calls the handler that was there before, if it is a Python function (e.g. Lightning's, which
  lets training stop gracefully), and does nothing else: the process goes on or unwinds, and
  the stores close as usual. Deleting the folders first would break a run that goes on;
- otherwise (the default action), removes the folders of this process's live stores, restores
  the default action and sends SIGTERM again, so the process still ends "killed by SIGTERM"
  (exit status -15 / 143).

Not covered: stores created while SIGTERM is ignored or handled outside Python, stores opened
only from non-main threads before any from the main thread, and SIGKILL.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from types import FrameType
from typing import Any

import torch
from torch import Tensor

from spikeckpt.errors import StorageError
from spikeckpt.storage.base import Ledger, StoreBase
from spikeckpt.storage.codecs import NUMPY_DTYPES, Packed, pack, unpack
from spikeckpt.storage.freelist import BestFit, round_capacity
from spikeckpt.units import format_bytes

__all__ = ["BACKGROUND_BYTES", "FILE_NAME", "DiskStore"]

FILE_NAME = "checkpoints.bin"
"""The one file of a store's folder that holds its checkpoints."""

BACKGROUND_BYTES = 1 << 20
"""Default ``background_bytes``: checkpoints larger than this (bytes in the file) are written
and read by the I/O thread, smaller ones on the calling thread. Put, get and drop of a state,
CPU time on one core of the development VM (``pwritev`` / ``preadv`` through the page cache):
16 KiB 159 us on the calling thread against 266 us through the thread, 264 KiB 225 against
385 us, 1 MiB 1.54 against 1.87 ms. The thread pays only when a core is free to overlap the
I/O with compute and the I/O takes longer than the hand-off (0.1-0.2 ms): from a few hundred
KiB on."""

Layout = list[tuple[torch.dtype, torch.Size]]


@dataclass
class _DiskItem:
    packs: list[Packed]  # metadata only: payload=()
    payload_counts: list[int]
    nbytes: int  # payload bytes (what the ledger counts)
    offset: int  # where the checkpoint starts in the file
    capacity: int  # bytes of the file region it holds (>= size)
    size: int  # bytes written at offset
    layout: Layout | None  # raw bytes: each payload's dtype and shape; None: torch.save bytes
    background: bool  # written and read by the I/O thread


class DiskStore(StoreBase):
    """Writes packed tensors into one file in a private temporary folder.

    ``put`` packs on the calling thread and writes the bytes into a free region of the file
    (on the calling thread, or for checkpoints over ``background_bytes`` on the I/O thread);
    ``prefetch`` starts reading a background checkpoint; ``get`` reads (or waits for the read)
    and unpacks on the device; ``drop`` frees the checkpoint's region for a later ``put``.
    ``close`` (also run when the store is garbage collected or at interpreter exit) stops the
    thread and deletes the folder. A write or read that fails (full disk, unwritable folder)
    raises ``StorageError`` from that call, or for background ones from the next ``put`` /
    ``get`` / ``prefetch``; the store then deletes its folder and is closed.

    Dense CPU tensors of background checkpoints are written without a copy: do not modify them
    in place after ``put``.

    Args:
        device: where ``get`` returns tensors.
        ledger: counts bytes under ``"disk"``.
        directory: folder in which to make the store's own ``spikeckpt-*`` folder (created if
            missing); default: the system temporary folder (``tempfile.gettempdir()``).
        background_bytes: checkpoints of more bytes than this go through the I/O thread
            (default [`BACKGROUND_BYTES`][spikeckpt.storage.disk.BACKGROUND_BYTES]; 0: all of them).

    Attributes:
        directory: the store's own folder (``str``); it is deleted by ``close``.
        path: the file in it that holds the checkpoints.
    """

    kind = "disk"

    def __init__(
        self,
        device: torch.device | str,
        ledger: Ledger,
        directory: str | os.PathLike[str] | None = None,
        background_bytes: int = BACKGROUND_BYTES,
    ) -> None:
        if not hasattr(os, "pwrite"):  # pragma: no cover - not POSIX
            raise StorageError(
                "spikeckpt disk tier: this platform has no os.pwrite / os.pread (POSIX); use "
                "storage='host'."
            )
        self.device = torch.device(device)
        self.ledger = ledger
        self.background_bytes = int(background_bytes)
        parent = None if directory is None else os.fspath(directory)
        name = f"spikeckpt-disk-{uuid.uuid4().hex[:8]}"
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        # Between creating the folder and registering its cleanup a Ctrl-C or SIGTERM would
        # leak it: both signals wait until the folder is owned by the finalizer.
        with _signals_deferred():
            try:
                if parent is not None:
                    os.makedirs(parent, exist_ok=True)
                self.directory: str = tempfile.mkdtemp(prefix="spikeckpt-", dir=parent)
            except OSError as exc:
                self._worker.shutdown(wait=False)
                where = parent if parent is not None else tempfile.gettempdir()
                raise _storage_error(exc, where, 0, "create a checkpoint folder in") from exc
            self.path = os.path.join(self.directory, FILE_NAME)
            # the file is opened after the finalizer owns the folder; it closes what is here
            fds: list[int] = []
            self._finalizer = weakref.finalize(
                self, _cleanup, self._worker, fds, self.directory, name
            )
            _register_live(name, self.directory)
            try:
                fds.append(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            except OSError as exc:
                self._finalizer()
                raise _storage_error(exc, self.directory, 0, "create a checkpoint file in") from exc
        self._fd = fds[0]
        self._items: dict[int, _DiskItem] = {}
        # Free regions of the file and its end: taken on this thread, given back from either
        # (a region still being written or read is given back by the I/O thread after it).
        self._regions: BestFit[int] = BestFit()
        self._end = 0
        # Writes still running (a finished one removes itself) and writes that failed: both
        # updated from the I/O thread under ``_lock``, so checking for errors costs O(1), not
        # a scan of every write so far (which made long sequences quadratic).
        self._writes: dict[int, Future[None]] = {}
        self._failed: list[Future[None]] = []
        self._lock = threading.Lock()
        self._reads: dict[int, Future[list[Tensor]]] = {}
        self._error: StorageError | None = None

    def put(self, key: int, tensors: Sequence[Tensor]) -> None:
        """Pack ``tensors`` and write them into a free region of the file."""
        self._check_usable()
        self.drop(key)
        packs = [pack(t).to("cpu") for t in tensors]
        payload = [t for p in packs for t in p.payload]
        nbytes = sum(p.nbytes for p in packs)
        layout = _raw_layout(payload)
        views = [_raw_bytes(t) for t in payload] if layout is not None else [_saved(payload)]
        size = sum(len(v) for v in views)
        offset, capacity = self._take_region(size)
        item = _DiskItem(
            [p.with_payload(()) for p in packs],
            [len(p.payload) for p in packs],
            nbytes,
            offset,
            capacity,
            size,
            layout,
            size > self.background_bytes,
        )
        if item.background:
            write = self._worker.submit(_write, self._fd, views, offset, size, self.directory)
            with self._lock:
                self._writes[key] = write
            write.add_done_callback(partial(_settle, self._writes, self._failed, self._lock, key))
        else:
            try:
                _write(self._fd, views, offset, size, self.directory)
            except StorageError as exc:
                self._fail(exc)
                raise
        self._items[key] = item
        self.ledger.add(self.kind, nbytes)
        self.ledger.moved(self.kind, written=nbytes)

    def get(self, key: int) -> list[Tensor]:
        """Read ``key`` (or wait for its write and prefetch) and unpack it on the device."""
        self._check_usable()
        item = self._items.get(key)
        if item is None:
            raise self._unknown_key(key, list(self._items))
        try:
            if item.background:
                payload = self._wait_for_read(key, item)
            else:
                payload = _read(self._fd, item.layout, item.offset, item.size, self.directory)
        except StorageError as exc:
            self._fail(exc)
            raise
        self.ledger.moved(self.kind, read=item.nbytes)
        out, start = [], 0
        for meta, count in zip(item.packs, item.payload_counts, strict=True):
            part = tuple(payload[start : start + count])
            start += count
            tensor = unpack(meta.with_payload(part), self.device)
            if item.background and meta.codec == "dense" and tensor is part[0]:
                tensor = tensor.clone()  # allocate on this thread (visible to MemoryMeter)
            out.append(tensor)
        return out

    def _wait_for_read(self, key: int, item: _DiskItem) -> list[Tensor]:
        future = self._reads.pop(key, None)
        if future is None:
            future = self._submit_read(item)
        with self._lock:
            write = self._writes.get(key)
        if write is not None:
            write.result()
        return future.result()

    def prefetch(self, key: int) -> None:
        """Start reading ``key`` on the I/O thread if it is a background checkpoint (after its
        write); ``get`` waits for it. Smaller checkpoints are read by ``get`` itself."""
        self._check_usable()
        item = self._items.get(key)
        if item is None:
            raise self._unknown_key(key, list(self._items))
        if item.background and key not in self._reads:
            self._reads[key] = self._submit_read(item)

    def _submit_read(self, item: _DiskItem) -> Future[list[Tensor]]:
        return self._worker.submit(
            _read, self._fd, item.layout, item.offset, item.size, self.directory
        )

    def drop(self, key: int) -> None:
        """Forget ``key``; its region of the file is reused by a later ``put``."""
        item = self._items.pop(key, None)
        if item is None:
            return
        self.ledger.remove(self.kind, item.nbytes)
        read = self._reads.pop(key, None)
        if read is not None:
            read.cancel()
        with self._lock:
            write = self._writes.pop(key, None)
        if self._closed:
            return
        busy = any(f is not None and not f.done() for f in (read, write))
        if busy:  # the I/O thread gives the region back once it is done with it (FIFO)
            self._worker.submit(self._give_region, item.offset, item.capacity)
        else:
            self._give_region(item.offset, item.capacity)

    def _take_region(self, size: int) -> tuple[int, int]:
        """``(offset, capacity)`` of a free region of the file for ``size`` bytes."""
        with self._lock:
            found = self._regions.take(size)
            if found is not None:
                capacity, offset = found
                return offset, capacity
            capacity = round_capacity(size)
            offset, self._end = self._end, self._end + capacity
        return offset, capacity

    def _give_region(self, offset: int, capacity: int) -> None:
        with self._lock:
            self._regions.give(capacity, offset)

    def close(self) -> None:
        """Stop the thread (pending work is cancelled or waited for) and delete the folder.

        Idempotent; never raises.
        """
        for item in self._items.values():
            self.ledger.remove(self.kind, item.nbytes)
        self._items.clear()
        self._reads.clear()
        with self._lock:
            self._writes.clear()
        self._closed = True
        self._finalizer()

    def flush(self) -> None:
        """Wait until every background write submitted so far is done; raise their errors."""
        self._check_usable()
        self._worker.submit(lambda: None).result()
        self._check_usable()

    def file_bytes(self) -> int:
        """Size of the checkpoint file now (bytes; 0 once the store is closed)."""
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    # -- errors

    def _check_usable(self) -> None:
        if self._error is None and self._failed:
            self._remember(self._failed[0])
        if self._error is not None:
            if not self._closed:
                self.close()
            raise self._error
        self._check_open()

    def _remember(self, write: Future[None]) -> None:
        exc = write.exception()
        if self._error is None:
            self._error = (
                exc if isinstance(exc, StorageError) else StorageError(f"disk tier: {exc}")
            )

    def _fail(self, exc: StorageError) -> None:
        if self._error is None:
            self._error = exc
        self.close()


def _settle(
    writes: dict[int, Future[None]],
    failed: list[Future[None]],
    lock: threading.Lock,
    key: int,
    write: Future[None],
) -> None:
    """Done-callback of a write: forget it when it succeeded, remember it when it failed."""
    with lock:
        if not write.cancelled() and write.exception() is not None:
            failed.append(write)
        elif writes.get(key) is write:
            del writes[key]


def _cleanup(
    worker: ThreadPoolExecutor, fds: list[int], directory: str, thread_prefix: str
) -> None:
    """Stop ``worker`` (cancel what has not started), close the file, delete ``directory``.

    A Ctrl-C (``KeyboardInterrupt``) arriving meanwhile (while it waits for a write in
    progress, or inside ``rmtree``) does not stop it half-way: the finalizer runs once, so an
    interrupted cleanup would leave the folder behind. It finishes, then re-raises it."""
    interrupt: KeyboardInterrupt | None = None
    in_worker = threading.current_thread().name.startswith(thread_prefix)
    try:
        worker.shutdown(wait=not in_worker, cancel_futures=True)
    except KeyboardInterrupt as exc:  # the write in progress ends on the closed file
        interrupt = exc
        worker.shutdown(wait=False, cancel_futures=True)
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())
    for _ in range(3):
        try:
            shutil.rmtree(directory, ignore_errors=True)
            break
        except KeyboardInterrupt as exc:
            interrupt = interrupt or exc
    _unregister_live(thread_prefix)
    if interrupt is not None:
        raise interrupt


# -------------------------------------------------------------------------------- SIGTERM


#: Live stores of this process: name -> (pid that made it, folder). Read by the handler
#: without a lock (a signal handler must not wait for a lock its own thread may hold).
@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back (this thread) inside; they are delivered on leaving."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:  # pragma: no cover - not POSIX
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = mask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, previous)


_LIVE: dict[str, tuple[int, str]] = {}
_LIVE_LOCK = threading.Lock()
#: The SIGTERM handler found when ours was installed (restored when the last store closes).
_PREVIOUS: list[Any] = [None]
_IN_HANDLER = [False]
#: Set by the handler before it removes folders: the I/O threads then write no new files.
_TERMINATING = threading.Event()


def _register_live(name: str, directory: str) -> None:
    with _LIVE_LOCK:
        _LIVE[name] = (os.getpid(), directory)
    _install_sigterm_handler()


def _unregister_live(name: str) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(name, None)
        empty = not _LIVE
    if empty:
        _restore_sigterm_handler()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install_sigterm_handler() -> None:
    """Install `_on_sigterm` (main thread only) unless it is there or SIGTERM is ignored
    or handled outside Python (then there is nothing to chain to, or nothing to fix)."""
    if not _in_main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm or current is None or current == signal.SIG_IGN:
        return
    _PREVIOUS[0] = current
    signal.signal(signal.SIGTERM, _on_sigterm)


def _restore_sigterm_handler() -> None:
    """Put back the handler found at install time, if ours is still the one installed."""
    if not _in_main_thread() or signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        return
    previous = _PREVIOUS[0]
    signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    _PREVIOUS[0] = None


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM: chain a Python handler, or remove live folders and die by SIGTERM."""
    if _IN_HANDLER[0]:  # a chained handler called us back (e.g. it wrapped ours)
        return
    _IN_HANDLER[0] = True
    try:
        previous = _PREVIOUS[0]
        if callable(previous):
            previous(signum, frame)
            return
        _remove_live_folders()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        _IN_HANDLER[0] = False


def _remove_live_folders(attempts: int = 100) -> None:
    """Delete this process's live store folders, retrying while an I/O thread finishes a file."""
    _TERMINATING.set()
    pid = os.getpid()
    for _ in range(attempts):
        try:
            folders = [folder for owner, folder in list(_LIVE.values()) if owner == pid]
        except RuntimeError:  # changed size while copying: try again
            continue
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        if not any(os.path.exists(folder) for folder in folders):
            return
        time.sleep(0.01)


# ---------------------------------------------------------------------------------- file I/O

_IOV_MAX = 512  # buffers per pwritev / preadv call (POSIX guarantees at least 16; Linux 1024)


def _write(fd: int, views: list[memoryview], offset: int, size: int, directory: str) -> None:
    """Write ``views`` one after the other at ``offset``; errors become ``StorageError``."""
    if _TERMINATING.is_set():
        return  # the process is being terminated: its folders are being removed
    try:
        _write_at(fd, views, offset)
    except OSError as exc:
        raise _storage_error(exc, directory, size, "write a checkpoint file in") from exc


def _write_at(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Write all of ``views`` at ``offset`` of ``fd`` or raise the ``OSError`` (a seam for
    tests that simulate a full disk)."""
    pending = [v for v in views if len(v)]
    start = 0
    while start < len(pending):
        batch = pending[start : start + _IOV_MAX]
        wrote = _pwritev(fd, batch, offset)
        if wrote <= 0:
            raise OSError(errno.ENOSPC, "short write: no space left on device")
        offset += wrote
        start = _advance(pending, start, wrote)


def _read(fd: int, layout: Layout | None, offset: int, size: int, directory: str) -> list[Tensor]:
    """Read a checkpoint written by `_write` (any thread); errors become ``StorageError``.

    Raw checkpoints are read straight into new tensors of ``layout``'s dtypes and shapes.
    """
    try:
        if layout is None:
            data = bytearray(size)
            _read_at(fd, [memoryview(data)], offset)
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        out = [torch.empty(shape, dtype=dtype) for dtype, shape in layout]
        _read_at(fd, [_raw_bytes(t) for t in out], offset)
        return out
    except (OSError, RuntimeError) as exc:
        raise _storage_error(exc, directory, size, "read a checkpoint file from") from exc


def _read_at(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Fill all of ``views`` from ``offset`` of ``fd``; ``OSError`` if the file ends first."""
    pending = [v for v in views if len(v)]
    start = 0
    while start < len(pending):
        got = _preadv(fd, pending[start : start + _IOV_MAX], offset)
        if got <= 0:
            raise OSError(errno.EIO, "the checkpoint file is shorter than its checkpoints")
        offset += got
        start = _advance(pending, start, got)


def _advance(pending: list[memoryview], start: int, done: int) -> int:
    """Skip ``done`` bytes of ``pending[start:]`` (cutting a buffer done in part); the new
    start."""
    while done and start < len(pending):
        n = len(pending[start])
        if done < n:
            pending[start] = pending[start][done:]
            return start
        done -= n
        start += 1
    return start


def _pwritev(fd: int, views: list[memoryview], offset: int) -> int:
    if hasattr(os, "pwritev"):
        return os.pwritev(fd, views, offset)
    return os.pwrite(fd, views[0], offset)  # pragma: no cover - no pwritev (e.g. old macOS)


def _preadv(fd: int, views: list[memoryview], offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, views, offset)
    data = os.pread(fd, len(views[0]), offset)  # pragma: no cover - no preadv
    views[0][: len(data)] = data  # pragma: no cover
    return len(data)  # pragma: no cover


def _raw_layout(payload: Sequence[Tensor]) -> Layout | None:
    """Each payload tensor's (dtype, shape) when all can be written as raw bytes, else None."""
    for t in payload:
        if t.layout != torch.strided or t.is_quantized or t.device.type != "cpu":
            return None
    return [(t.dtype, t.shape) for t in payload]


def _raw_bytes(t: Tensor) -> memoryview:
    """The bytes of ``t``'s elements in row-major order (a view when ``t`` is contiguous)."""
    if t.dtype in NUMPY_DTYPES and t.dim() and t.is_contiguous() and not t.is_neg():
        return memoryview(t.detach().numpy()).cast("B")  # type: ignore[arg-type]  # numpy's stub: ndarray.__buffer__ only for Python >= 3.12
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy's stub: ndarray.__buffer__ only for Python >= 3.12


def _saved(payload: list[Tensor]) -> memoryview:
    """``torch.save`` bytes of payloads that cannot be written raw (sparse, quantized)."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getbuffer()


_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EACCES: "the folder is not writable (permission denied)",
    errno.EPERM: "the folder is not writable (operation not permitted)",
    errno.EROFS: "the file system is read-only",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.ENOENT: "the file or folder does not exist (was it deleted?)",
}


def _storage_error(exc: BaseException, directory: str, nbytes: int, action: str) -> StorageError:
    """A ``StorageError`` that names the folder, the bytes needed and the fixes."""
    code = getattr(exc, "errno", None)
    try:
        free_bytes: int | None = shutil.disk_usage(directory).free
    except OSError:
        free_bytes = None
    if code in _REASONS:
        reason = _REASONS[code]
    elif free_bytes is not None and free_bytes < nbytes:
        reason = "the disk is probably full"
    else:
        reason = "the operation failed"
    free = f" {format_bytes(free_bytes)} are free there." if free_bytes is not None else ""
    need = f" (needed: {format_bytes(nbytes)}, {nbytes} bytes)" if nbytes else ""
    message = (
        f"spikeckpt disk tier: could not {action} {directory!r}{need}: {reason} ({exc}).{free} "
        "Fix: pass directory= a writable folder on a disk with room for the checkpoints, or "
        "use storage='host' to keep them in RAM."
    )
    return StorageError(code, message) if code is not None else StorageError(message)
