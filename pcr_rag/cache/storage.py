"""Storage backends of the SSD tier: named blobs written atomically and read by byte range.

``StorageBackend`` is the injectable I/O boundary (tests and the simulator swap it):
- ``LocalDirBackend``: files in a directory; atomic writes (temp file, optional fdatasync, rename); O_DIRECT reads and
  writes where the filesystem supports it (else buffered I/O followed by ``posix_fadvise(DONTNEED)``), so the page
  cache neither inflates the DRAM budget nor flatters read throughput; an ``fcntl.flock`` lock file so one engine
  at a time uses the directory.
- ``MemoryBackend``: a dict, for fast deterministic tests.
- ``SlowBackend``: wraps another backend with injectable per-operation latency and bandwidth (seconds, bytes/s).
- ``FaultyBackend``: wraps another backend and fails writes with an errno (e.g. ENOSPC), or emulates a small
  disk that fills up.
Names are relative POSIX paths without ``..``; names starting with ``.`` are reserved for the backend.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import fcntl
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from pcr_rag.cache.errors import CacheDirLockedError

__all__ = [
    "BlobReader",
    "DeferredHead",
    "FaultyBackend",
    "LocalDirBackend",
    "MemoryBackend",
    "SlowBackend",
    "StorageBackend",
    "aligned_scratch",
]

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

LOCK_NAME = ".lock"
TMP_SUFFIX = ".tmp"


@runtime_checkable
class BlobReader(Protocol):
    size: int

    def read_at(self, offset: int, length: int) -> bytes: ...

    def readinto_at(self, offset: int, buf: memoryview) -> int: ...

    def readv_at(self, offset: int, bufs: list[memoryview]) -> int:
        """Fill ``bufs`` back to back from ``offset`` (one I/O where possible); returns bytes read."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class StorageBackend(Protocol):
    def write_atomic(self, name: str, parts: Sequence[Buffer], head: DeferredHead | None = None) -> int:
        """Write ``head`` (if any) then the concatenation of ``parts`` as blob ``name``; readers see the old blob
        or the whole new one, never a prefix. Returns bytes written; raises OSError (e.g. ENOSPC) and leaves
        nothing behind."""
        ...

    def open(self, name: str) -> BlobReader:
        """Open blob ``name`` for reading; raises FileNotFoundError."""
        ...

    def delete(self, name: str) -> bool: ...

    def names(self) -> Iterator[str]:
        """Names of all stored blobs (no temp files, no reserved names)."""
        ...

    def lock(self) -> None:
        """Take exclusive use of the store; raise CacheDirLockedError when another user holds it."""
        ...

    def unlock(self) -> None: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class DeferredHead:
    """The first ``nbytes`` of a blob, produced by ``produce()`` while the rest is being written (a header whose
    checksums are computed as the payload goes to disk). ``produce`` must return exactly ``nbytes`` bytes."""

    nbytes: int
    produce: Callable[[], Buffer]

    def resolve(self) -> memoryview:
        data = memoryview(self.produce()).cast("B")
        if data.nbytes != self.nbytes:
            raise ValueError(f"deferred head produced {data.nbytes} bytes, {self.nbytes} were announced")
        return data


def _resolve_parts(parts: Sequence[Buffer], head: DeferredHead | None) -> list[Buffer]:
    return list(parts) if head is None else [head.resolve(), *parts]


def _check_name(name: str) -> None:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        raise ValueError(f"invalid blob name {name!r}")


def _total(parts: Sequence[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


# --------------------------------------------------------------------------------------------- local dir


BLOCK = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_bounce = threading.local()


_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _helper_pool() -> ThreadPoolExecutor:
    """Threads that compute deferred heads (checksums) while the caller's thread is blocked in a write."""
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pcr-ssd-head")
        return _helper


def aligned_scratch(nbytes: int, slot: str = "bounce") -> memoryview:
    """A thread-local, page-aligned scratch buffer of at least ``nbytes`` (anonymous mmap), reused across calls:
    valid until the same thread asks for the same ``slot`` again (the backends use slot "bounce")."""
    buffers: dict[str, mmap.mmap] | None = getattr(_bounce, "buffers", None)
    if buffers is None:
        buffers = _bounce.buffers = {}
    buf = buffers.get(slot)
    if buf is None or len(buf) < nbytes:
        size = max(nbytes, 1 << 20)
        size = (size + BLOCK - 1) // BLOCK * BLOCK
        buf = buffers[slot] = mmap.mmap(-1, size)
    return memoryview(buf)


def _is_aligned(view: memoryview) -> bool:
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else -1
    return addr >= 0 and addr % BLOCK == 0


def _skip(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """``views`` without their first ``nbytes`` bytes."""
    out = []
    for v in views:
        if nbytes >= v.nbytes:
            nbytes -= v.nbytes
            continue
        out.append(v[nbytes:])
        nbytes = 0
    return out


class _FileReader:
    """pread-based reader. With ``direct`` the file is opened O_DIRECT: aligned requests go straight from the
    disk into the caller's buffer, others through an aligned bounce buffer; the page cache is bypassed."""

    def __init__(self, path: Path, drop_page_cache: bool, direct: bool) -> None:
        self._direct = False
        if direct and _O_DIRECT:
            try:
                self._fd = os.open(path, os.O_RDONLY | _O_DIRECT)
                self._direct = True
            except OSError as exc:
                if exc.errno != errno_mod.EINVAL:
                    raise
                self._fd = os.open(path, os.O_RDONLY)
        else:
            self._fd = os.open(path, os.O_RDONLY)
        self._drop = drop_page_cache
        self.size = os.fstat(self._fd).st_size

    def _pread_into(self, view: memoryview, offset: int) -> int:
        done = 0
        total = view.nbytes
        while done < total:
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def _bounced(self, offset: int, length: int) -> memoryview:
        start = offset // BLOCK * BLOCK
        end = (offset + length + BLOCK - 1) // BLOCK * BLOCK
        scratch = aligned_scratch(end - start)[: end - start]
        got = self._pread_into(scratch, start)
        lo = offset - start
        return scratch[lo : max(lo, min(lo + length, got))]

    def read_at(self, offset: int, length: int) -> bytes:
        if self._direct:
            return bytes(self._bounced(offset, length))
        return os.pread(self._fd, length, offset)

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        view = memoryview(buf).cast("B")
        if not self._direct:
            return self._pread_into(view, offset)
        total = view.nbytes
        if offset % BLOCK == 0 and _is_aligned(view):
            body = total // BLOCK * BLOCK  # the aligned body goes straight into the caller's buffer
            got = self._pread_into(view[:body], offset) if body else 0
            if got < body or body == total:
                return got
            tail = self._bounced(offset + body, total - body)
            view[body : body + tail.nbytes] = tail
            return body + tail.nbytes
        data = self._bounced(offset, total)
        view[: data.nbytes] = data
        return data.nbytes

    def readv_at(self, offset: int, bufs: list[memoryview]) -> int:
        views = [memoryview(b).cast("B") for b in bufs]
        if self._direct and not all(v.nbytes % BLOCK == 0 and _is_aligned(v) for v in views):
            done = 0
            for v in views:  # unaligned pieces go one by one through the bounce path
                got = self.readinto_at(offset + done, v)
                done += got
                if got < v.nbytes:
                    break
            return done
        done = 0
        total = sum(v.nbytes for v in views)
        while done < total:
            n = os.preadv(self._fd, _skip(views, done), offset + done)
            if n == 0:
                break
            done += n
        return done

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            if self._drop and not self._direct:
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> _FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalDirBackend:
    """Blobs as files under ``root`` (created when missing). See the module docstring for the guarantees."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = False,
        drop_page_cache: bool = True,
        direct_io: bool = True,
    ) -> None:
        self.root = Path(root).expanduser().resolve()
        self.fsync = fsync
        self.drop_page_cache = drop_page_cache
        self.direct_io = direct_io and bool(_O_DIRECT)
        self._lock_fd = -1
        self._dirs: set[Path] = set()
        self._counter = 0
        self._counter_lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)

    def describe(self) -> str:
        return f"directory {self.root}"

    def _path(self, name: str) -> Path:
        _check_name(name)
        return self.root / name

    def write_atomic(self, name: str, parts: Sequence[Buffer], head: DeferredHead | None = None) -> int:
        path = self._path(name)
        parent = path.parent
        if parent not in self._dirs:
            parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(parent)
        with self._counter_lock:
            self._counter += 1
            seq = self._counter
        tmp = parent / f".{path.name}.{os.getpid()}.{seq}{TMP_SUFFIX}"
        views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
        head_n = 0 if head is None else head.nbytes
        total = head_n + sum(v.nbytes for v in views)
        direct = self.direct_io and head_n % BLOCK == 0
        fd = self._open_tmp(tmp, direct)
        if fd < 0:
            direct = False
            fd = self._open_tmp(tmp, False)
        # the head is produced on a helper thread while the body is written (the write releases the GIL)
        pending = None if head is None else _helper_pool().submit(head.resolve)
        try:
            if direct:
                self._write_direct(fd, views, head_n, total)
            else:
                self._write_buffered(fd, views, head_n)
            if pending is not None:
                head_view = pending.result()
                pending = None
                if direct:  # a few KiB: through the page cache (no extra device round trip), then dropped
                    hfd = os.open(tmp, os.O_WRONLY)
                    try:
                        self._write_buffered(hfd, [head_view], 0)
                        if self.fsync:
                            os.fdatasync(hfd)
                        if self.drop_page_cache:
                            os.posix_fadvise(hfd, 0, head_n, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(hfd)
                else:
                    self._write_buffered(fd, [head_view], 0)
            if self.fsync:
                os.fdatasync(fd)
            if self.drop_page_cache and not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            if pending is not None:
                pending.cancel()
                try:
                    pending.result()
                except BaseException:
                    pass
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        os.close(fd)
        try:
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return total

    def _open_tmp(self, tmp: Path, direct: bool) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if not direct:
            return os.open(tmp, flags, 0o644)
        try:
            return os.open(tmp, flags | _O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno_mod.EINVAL:
                raise
            log.info("%s does not support O_DIRECT; using buffered I/O with page-cache drops", self.root)
            self.direct_io = False
            return -1

    @staticmethod
    def _write_buffered(fd: int, views: list[memoryview], offset: int) -> None:
        """pwritev ``views`` back to back from ``offset``, resuming after partial writes."""
        views = list(views)
        while views:
            n = os.pwritev(fd, views, offset)
            offset += n
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]

    @staticmethod
    def _write_direct(fd: int, views: list[memoryview], offset: int, total: int) -> None:
        """O_DIRECT write of ``views`` from the block-aligned ``offset``. Block-aligned views (address and length
        multiples of 4096, e.g. a payload the SSD store allocated) go to the disk as they are; everything else is
        packed into an aligned bounce buffer, zero-padded to the block size (the file is truncated back to
        ``total`` afterwards)."""
        body = total - offset
        scratch = aligned_scratch(body + BLOCK)
        iov: list[memoryview] = []
        seg_start = fill = 0  # bytes of scratch in use; [seg_start, fill) not yet in iov
        for v in views:
            if fill % BLOCK == 0 and v.nbytes % BLOCK == 0 and _is_aligned(v):
                if fill > seg_start:
                    iov.append(scratch[seg_start:fill])
                seg_start = fill
                iov.append(v)
            else:
                scratch[fill : fill + v.nbytes] = v
                fill += v.nbytes
        padded = (fill + BLOCK - 1) // BLOCK * BLOCK
        if padded > fill:
            scratch[fill:padded] = bytes(padded - fill)
        if padded > seg_start:
            iov.append(scratch[seg_start:padded])
        written = sum(v.nbytes for v in iov)
        LocalDirBackend._write_buffered(fd, iov, offset)
        if offset + written != total:
            os.ftruncate(fd, total)

    def open(self, name: str) -> _FileReader:
        return _FileReader(self._path(name), self.drop_page_cache, self.direct_io)

    def delete(self, name: str) -> bool:
        try:
            os.unlink(self._path(name))
            return True
        except FileNotFoundError:
            return False

    def names(self) -> Iterator[str]:
        root = self.root
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(root)
            for fname in filenames:
                if fname.startswith("."):
                    continue
                yield fname if rel == Path(".") else (rel / fname).as_posix()

    def remove_temp_files(self) -> int:
        """Delete leftovers of writes interrupted by a crash; returns how many."""
        removed = 0
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for fname in filenames:
                if fname.startswith(".") and fname.endswith(TMP_SUFFIX):
                    try:
                        os.unlink(os.path.join(dirpath, fname))
                        removed += 1
                    except OSError:
                        pass
        return removed

    def lock(self) -> None:
        if self._lock_fd >= 0:
            return
        path = self.root / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown process"
            finally:
                os.close(fd)
            raise CacheDirLockedError(
                f"cache directory {self.root} is in use by another cache engine ({holder}); close that engine "
                f"(CacheEngine.close()) or give this one a different cache_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd < 0:
            return
        try:
            os.ftruncate(self._lock_fd, 0)
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = -1


# --------------------------------------------------------------------------------------------- memory


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self.size = len(data)

    def read_at(self, offset: int, length: int) -> bytes:
        return self._data[offset : offset + length]

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        view = memoryview(buf).cast("B")
        chunk = self._data[offset : offset + view.nbytes]
        view[: len(chunk)] = chunk
        return len(chunk)

    def readv_at(self, offset: int, bufs: list[memoryview]) -> int:
        done = 0
        for b in bufs:
            got = self.readinto_at(offset + done, b)
            done += got
            if got < memoryview(b).nbytes:
                break
        return done

    def close(self) -> None:
        pass


class MemoryBackend:
    """Blobs in a dict (thread-safe). ``lock`` is exclusive per instance, like a directory's lock file."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self._mutex = threading.Lock()
        self._locked = False

    def describe(self) -> str:
        return f"memory store {id(self):#x}"

    def write_atomic(self, name: str, parts: Sequence[Buffer], head: DeferredHead | None = None) -> int:
        _check_name(name)
        data = b"".join(bytes(memoryview(p).cast("B")) for p in _resolve_parts(parts, head))
        with self._mutex:
            self.blobs[name] = data
        return len(data)

    def open(self, name: str) -> _BytesReader:
        with self._mutex:
            data = self.blobs.get(name)
        if data is None:
            raise FileNotFoundError(errno_mod.ENOENT, f"no blob {name!r}")
        return _BytesReader(data)

    def delete(self, name: str) -> bool:
        with self._mutex:
            return self.blobs.pop(name, None) is not None

    def names(self) -> Iterator[str]:
        with self._mutex:
            return iter(list(self.blobs))

    def lock(self) -> None:
        with self._mutex:
            if self._locked:
                raise CacheDirLockedError(
                    f"{self.describe()} is in use by another cache engine; close that engine first"
                )
            self._locked = True

    def unlock(self) -> None:
        with self._mutex:
            self._locked = False


# --------------------------------------------------------------------------------------------- wrappers


class _DelegatingBackend:
    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner

    def write_atomic(self, name: str, parts: Sequence[Buffer], head: DeferredHead | None = None) -> int:
        return self.inner.write_atomic(name, parts, head)

    def open(self, name: str) -> BlobReader:
        return self.inner.open(name)

    def delete(self, name: str) -> bool:
        return self.inner.delete(name)

    def names(self) -> Iterator[str]:
        return self.inner.names()

    def lock(self) -> None:
        self.inner.lock()

    def unlock(self) -> None:
        self.inner.unlock()

    def describe(self) -> str:
        return self.inner.describe()


class _SlowReader:
    def __init__(self, inner: BlobReader, delay: Callable[[int], None]) -> None:
        self._inner = inner
        self._delay = delay
        self.size = inner.size

    def read_at(self, offset: int, length: int) -> bytes:
        self._delay(length)
        return self._inner.read_at(offset, length)

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        self._delay(memoryview(buf).nbytes)
        return self._inner.readinto_at(offset, buf)

    def readv_at(self, offset: int, bufs: list[memoryview]) -> int:
        self._delay(sum(memoryview(b).nbytes for b in bufs))
        return self._inner.readv_at(offset, bufs)

    def close(self) -> None:
        self._inner.close()


class SlowBackend(_DelegatingBackend):
    """Adds ``latency_s + nbytes / bandwidth`` seconds (via the injectable ``sleep``) to every read and write."""

    def __init__(
        self,
        inner: StorageBackend,
        *,
        latency_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(inner)
        self.latency_s = latency_s
        self.bandwidth = bandwidth_bytes_per_s
        self._sleep = sleep

    def _delay(self, nbytes: int) -> None:
        seconds = self.latency_s + (nbytes / self.bandwidth if self.bandwidth else 0.0)
        if seconds > 0:
            self._sleep(seconds)

    def write_atomic(self, name: str, parts: Sequence[Buffer], head: DeferredHead | None = None) -> int:
        self._delay(_total(parts) + (head.nbytes if head is not None else 0))
        return self.inner.write_atomic(name, parts, head)

    def open(self, name: str) -> BlobReader:
        return _SlowReader(self.inner.open(name), self._delay)


class FaultyBackend(_DelegatingBackend):
    """Injects write failures: every write raises ``OSError(write_errno)`` while ``write_errno`` is set, and
    with ``disk_bytes`` set, a write that would make the stored total exceed it raises ENOSPC (a full disk)."""

    def __init__(self, inner: StorageBackend, *, write_errno: int | None = None, disk_bytes: int | None = None):
        super().__init__(inner)
        self.write_errno = write_errno
        self.disk_bytes = disk_bytes
        self.write_attempts = 0
        self.write_failures = 0
        self._sizes: dict[str, int] = {}
        self._mutex = threading.Lock()

    def write_atomic(self, name: str, parts: Sequence[Buffer], head: DeferredHead | None = None) -> int:
        size = _total(parts) + (head.nbytes if head is not None else 0)
        with self._mutex:
            self.write_attempts += 1
            code = self.write_errno
            if code is None and self.disk_bytes is not None:
                used = sum(self._sizes.values()) - self._sizes.get(name, 0)
                if used + size > self.disk_bytes:
                    code = errno_mod.ENOSPC
            if code is not None:
                self.write_failures += 1
                raise OSError(code, os.strerror(code), name)
        written = self.inner.write_atomic(name, parts, head)
        with self._mutex:
            self._sizes[name] = size
        return written

    def delete(self, name: str) -> bool:
        with self._mutex:
            self._sizes.pop(name, None)
        return self.inner.delete(name)
