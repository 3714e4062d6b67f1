"""Disk tier: checkpoints packed into files in a private temporary folder, one I/O thread.

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
from typing import Any, BinaryIO

import torch
from torch import Tensor

from spikeckpt.errors import StorageError
from spikeckpt.storage.base import Ledger, StoreBase
from spikeckpt.storage.codecs import Packed, pack, unpack
from spikeckpt.units import format_bytes

__all__ = ["DiskStore"]


@dataclass
class _DiskItem:
    packs: list[Packed]  # metadata only: payload=()
    payload_counts: list[int]
    nbytes: int
    path: str
    layout: list[tuple[torch.dtype, torch.Size]] | None  # raw files: each payload's dtype, shape


class DiskStore(StoreBase):
    """Writes packed tensors to files in a private temporary folder with one background thread.

    ``put`` packs on the calling thread and returns; the write runs in the background.
    ``prefetch`` reads ahead in the background; ``get`` waits for the read and unpacks on the
    device; ``drop`` forgets the checkpoint: its file is renamed ``.spare-<n>`` and a later
    ``put`` overwrites it (the folder never holds more files than the most checkpoints held
    at once). ``close`` (also run when the store is garbage collected
    or at interpreter exit) stops the thread and deletes the folder. A write or read that fails
    (full disk, unwritable folder) raises ``StorageError`` on the next ``put``/``get``/
    ``prefetch``; the store then deletes its files and is closed.

    Dense CPU tensors are written without a copy: do not modify them in place after ``put``.

    Args:
        device: where ``get`` returns tensors.
        ledger: counts bytes under ``"disk"``.
        directory: folder in which to make the store's own ``spikeckpt-*`` folder (created if
            missing); default: the system temporary folder (``tempfile.gettempdir()``).

    Attributes:
        directory: the store's own folder (``str``); it is deleted by ``close``.
    """

    kind = "disk"

    def __init__(
        self,
        device: torch.device | str,
        ledger: Ledger,
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.ledger = ledger
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
            self._finalizer = weakref.finalize(self, _cleanup, self._worker, self.directory, name)
            _register_live(name, self.directory)
        self._items: dict[int, _DiskItem] = {}
        # Writes still running (a finished one removes itself) and writes that failed: both
        # updated from the I/O thread under ``_lock``, so checking for errors costs O(1), not
        # a scan of every write so far (which made long sequences quadratic).
        self._writes: dict[int, Future[None]] = {}
        self._failed: list[Future[None]] = []
        self._lock = threading.Lock()
        self._reads: dict[int, Future[list[Tensor]]] = {}
        self._error: StorageError | None = None
        # Files of dropped checkpoints, renamed ``.spare-<n>`` by the I/O thread (the future),
        # for later puts to overwrite: creating and deleting a file cost far more than writing
        # a state's bytes into one (hundreds of microseconds of CPU, and a delete can hold the
        # I/O thread for milliseconds).
        self._spares: list[tuple[str, Future[bool]]] = []
        self._spare_names = 0

    def put(self, key: int, tensors: Sequence[Tensor]) -> None:
        """Pack ``tensors`` and write them to ``<directory>/<key>.pt`` in the background.

        The file exists (possibly still empty) when ``put`` returns.
        """
        self._check_usable()
        self.drop(key)
        packs = [pack(t).to("cpu") for t in tensors]
        payload = [t for p in packs for t in p.payload]
        nbytes = sum(p.nbytes for p in packs)
        path = os.path.join(self.directory, f"{key}.pt")
        layout = _raw_layout(payload)
        item = _DiskItem(
            [p.with_payload(()) for p in packs],
            [len(p.payload) for p in packs],
            nbytes,
            path,
            layout,
        )
        try:  # the file exists when put returns (written in the background)
            if not self._reuse_spare(path):
                open(path, "wb").close()
        except OSError as exc:
            self._fail(_storage_error(exc, self.directory, nbytes, "create a checkpoint file in"))
            raise self._error from exc  # type: ignore[misc]
        write = self._worker.submit(
            _write, path, payload, nbytes, self.directory, layout is not None
        )
        with self._lock:
            self._writes[key] = write
        write.add_done_callback(partial(_settle, self._writes, self._failed, self._lock, key))
        self._items[key] = item
        self.ledger.add(self.kind, nbytes)
        self.ledger.moved(self.kind, written=nbytes)

    def get(self, key: int) -> list[Tensor]:
        """Wait for ``key``'s write and read (or prefetch), and unpack it on the device."""
        self._check_usable()
        item = self._items.get(key)
        if item is None:
            raise self._unknown_key(key, list(self._items))
        future = self._reads.pop(key, None)
        if future is None:
            future = self._submit_read(item)
        try:
            with self._lock:
                write = self._writes.get(key)
            if write is not None:
                write.result()
            payload = future.result()
        except StorageError as exc:
            self._fail(exc)
            raise
        self.ledger.moved(self.kind, read=item.nbytes)
        out, start = [], 0
        for meta, count in zip(item.packs, item.payload_counts, strict=True):
            part = tuple(payload[start : start + count])
            start += count
            tensor = unpack(meta.with_payload(part), self.device)
            if meta.codec == "dense" and tensor is part[0]:
                tensor = tensor.clone()  # allocate on this thread (visible to MemoryMeter)
            out.append(tensor)
        return out

    def prefetch(self, key: int) -> None:
        """Start reading ``key`` in the background (after its write); ``get`` waits for it."""
        self._check_usable()
        item = self._items.get(key)
        if item is None:
            raise self._unknown_key(key, list(self._items))
        if key not in self._reads:
            self._reads[key] = self._submit_read(item)

    def _submit_read(self, item: _DiskItem) -> Future[list[Tensor]]:
        if item.layout is not None:
            return self._worker.submit(_read_raw, item.path, item.layout, self.directory)
        return self._worker.submit(_read, item.path, item.nbytes, self.directory)

    def drop(self, key: int) -> None:
        """Forget ``key`` and delete its file (in the background, after its write)."""
        item = self._items.pop(key, None)
        if item is None:
            return
        self.ledger.remove(self.kind, item.nbytes)
        read = self._reads.pop(key, None)
        if read is not None:
            read.cancel()
        with self._lock:
            self._writes.pop(key, None)
        if not self._closed:
            spare = os.path.join(self.directory, f".spare-{self._spare_names}")
            self._spare_names += 1
            self._spares.append((spare, self._worker.submit(_retire, item.path, spare)))

    def _reuse_spare(self, path: str) -> bool:
        """Rename the oldest spare file already retired to ``path``; False if there is none."""
        while self._spares and self._spares[0][1].done():
            spare, retired = self._spares.pop(0)
            if retired.cancelled() or retired.exception() is not None or not retired.result():
                continue
            try:
                os.replace(spare, path)
            except OSError:
                continue
            return True
        return False

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
        """Wait until every write and delete submitted so far is done; raise their errors."""
        self._check_usable()
        self._worker.submit(lambda: None).result()
        self._check_usable()

    def files(self) -> list[str]:
        """Paths of the checkpoint files now in the store's folder (for tests and debugging;
        without the spare files of dropped checkpoints, kept for reuse until ``close``)."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        return sorted(os.path.join(self.directory, f) for f in names if not f.startswith("."))

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


def _cleanup(worker: ThreadPoolExecutor, directory: str, thread_prefix: str) -> None:
    """Stop ``worker`` (cancel what has not started) and delete ``directory``."""
    in_worker = threading.current_thread().name.startswith(thread_prefix)
    worker.shutdown(wait=not in_worker, cancel_futures=True)
    shutil.rmtree(directory, ignore_errors=True)
    _unregister_live(thread_prefix)


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
    """Install :func:`_on_sigterm` (main thread only) unless it is there or SIGTERM is ignored
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


def _write(path: str, payload: list[Tensor], nbytes: int, directory: str, raw: bool) -> None:
    """Save ``payload`` to ``path`` (worker thread); errors become ``StorageError``.

    ``raw``: the payload's bytes one after the other (each aligned to ``_RAW_ALIGN``), read
    back by :func:`_read_raw` with the dtypes and shapes kept in memory (:func:`_serialize`); else ``torch.save``.
    """
    if _TERMINATING.is_set():
        return  # the process is being terminated: its folders are being removed
    writer = None
    try:
        # no O_TRUNC: the file may be a spare one (overwritten, then cut to the new size)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        with open(fd, "wb", buffering=0) as f:
            writer = _WholeWriter(f)
            if raw:
                _serialize(payload, writer)
            else:
                _serialize_torch(payload, writer)
            f.truncate()
    except (OSError, RuntimeError) as exc:
        _remove(path)
        # torch.save reports a failed write as a RuntimeError: recover the OSError behind it.
        cause = writer.error if writer is not None and writer.error is not None else exc
        raise _storage_error(cause, directory, nbytes, "write a checkpoint file in") from exc


class _WholeWriter:
    """File wrapper whose ``write`` writes everything or raises the ``OSError`` (a raw file's
    short write on a full disk would otherwise reach torch.save as an opaque RuntimeError)."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                wrote = self._raw.write(view[done:])
                if not wrote:
                    raise OSError(errno.ENOSPC, "short write: no space left on device")
                done += wrote
        except OSError as exc:
            self.error = exc
            raise
        return done

    def flush(self) -> None:
        self._raw.flush()


def _serialize_torch(payload: list[Tensor], file: BinaryIO) -> None:
    """Write ``payload`` with ``torch.save`` (payloads that cannot be written raw)."""
    torch.save(payload, file)


# Raw checkpoint files: torch.save / torch.load of a few small tensors cost about 1-2 ms each
# (zip container, pickling) on the I/O thread, which on a busy or single core is time taken
# from the compute; a raw write or read of the same bytes costs tens of microseconds.
_RAW_ALIGN = 64


def _raw_layout(payload: Sequence[Tensor]) -> list[tuple[torch.dtype, torch.Size]] | None:
    """Each payload tensor's (dtype, shape) when all can be written as raw bytes, else None."""
    for t in payload:
        if t.layout != torch.strided or t.is_quantized or t.device.type != "cpu":
            return None
    return [(t.dtype, t.shape) for t in payload]


def _raw_bytes(t: Tensor) -> memoryview:
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


def _serialize(payload: list[Tensor], file: Any) -> None:
    """Write the payload's bytes to an open binary file, each tensor padded to ``_RAW_ALIGN``
    bytes (a seam for tests that simulate a full disk)."""
    for t in payload:
        data = _raw_bytes(t)
        if len(data):
            file.write(data)
        pad = -len(data) % _RAW_ALIGN
        if pad:
            file.write(bytes(pad))


def _read_raw(
    path: str, layout: list[tuple[torch.dtype, torch.Size]], directory: str
) -> list[Tensor]:
    """Read a file written by :func:`_serialize` (worker thread)."""
    sizes = [_numel(shape) * _itemsize(dtype) for dtype, shape in layout]
    total = sum(n + (-n % _RAW_ALIGN) for n in sizes)
    buf = torch.empty(total, dtype=torch.uint8)
    try:
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buf.numpy()) if total else memoryview(b"")
            done = 0
            while done < total:
                got = f.readinto(view[done:])
                if not got:
                    raise OSError(errno.EIO, f"checkpoint file {path!r} is truncated")
                done += got
    except OSError as exc:
        raise _storage_error(exc, directory, total, "read a checkpoint file from") from exc
    out, offset = [], 0
    for (dtype, shape), n in zip(layout, sizes, strict=True):
        part = buf[offset : offset + n]
        out.append(part.view(dtype).view(shape) if dtype != torch.uint8 else part.view(shape))
        offset += n + (-n % _RAW_ALIGN)
    return out


def _numel(shape: torch.Size) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _read(path: str, nbytes: int, directory: str) -> list[Tensor]:
    """Load the payload list from ``path`` (worker thread)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise _storage_error(exc, directory, nbytes, "read a checkpoint file from") from exc


def _retire(path: str, spare: str) -> bool:
    """Rename a dropped checkpoint's file to ``spare`` (I/O thread); False if that failed."""
    if _TERMINATING.is_set():
        return False
    try:
        os.replace(path, spare)
    except OSError:
        _remove(path)
        return False
    return True


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


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
    err = StorageError(code, message) if code is not None else StorageError(message)
    err.directory = directory  # type: ignore[attr-defined]
    err.needed_bytes = nbytes  # type: ignore[attr-defined]
    return err
