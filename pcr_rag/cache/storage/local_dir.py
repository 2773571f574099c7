"""``LocalDirBackend``: the real storage of the SSD tier, blobs as files in a local directory.

- Atomic writes: a temp file (``.<name>.<pid>.<seq>.tmp``), optional fdatasync, then rename; a crash leaves at
  most a temp file, removed at the next start (``remove_temp_files``).
- O_DIRECT reads and writes where the filesystem supports it; else buffered I/O followed by
  ``posix_fadvise(DONTNEED)``, so the page cache neither inflates the DRAM budget nor flatters read throughput.
- A deferred head (the chunk header, whose checksums are computed while the payload is written) is produced on a
  helper thread while the caller's thread is blocked in the payload write.
- An ``fcntl.flock`` lock file (``.lock``) lets one engine at a time use the directory.
- A private directory (``private_dir``): created ``0700`` with ``0600`` files whatever the umask, refused at start
  when another user owns it or others can write to it (``UnsafeCacheDirError``), tightened when others can only
  read it. Every file is reached through directory file descriptors with ``O_NOFOLLOW``: a planted symbolic link
  (chunk file, subdirectory, lock file) fails with ``OSError`` instead of being read or written through.
- With ``fsync``, the file is fdatasynced before its rename and the directory fsynced after it (and after creating
  a subdirectory), so a completed write survives power loss. Deletes are not fsynced: a deleted file that comes
  back after a crash is still a verified chunk, which recovery indexes or drops like any other.
"""

from __future__ import annotations

import errno as errno_mod
import fcntl
import logging
import os
import socket
import stat
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pcr_rag.cache.errors import CacheDirLockedError
from pcr_rag.cache.storage.aligned import BLOCK, aligned_scratch, is_aligned
from pcr_rag.cache.storage.base import Buffer, DeferredHead, check_name
from pcr_rag.cache.storage.private_dir import FILE_MODE, open_private_root, secure_tree, walk_to

__all__ = ["LocalDirBackend"]

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
TMP_SUFFIX = ".tmp"
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# portable where it costs nothing (see pcr_rag.platform_support: the engine itself runs on Linux only)
_fdatasync = getattr(os, "fdatasync", os.fsync)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


def _drop_cached(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to drop ``fd``'s pages from the page cache, where it can (``posix_fadvise``)."""
    if _DONTNEED is not None:
        os.posix_fadvise(fd, offset, length, _DONTNEED)
# O_NONBLOCK: opening a FIFO planted as a chunk file must not hang (no effect on regular files)
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _helper_pool() -> ThreadPoolExecutor:
    """Threads that compute deferred heads (checksums) while the caller's thread is blocked in a write."""
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pcr-ssd-head")
        return _helper


def _split(name: str) -> tuple[list[str], str]:
    """A checked blob name as (its directory components, its file name)."""
    check_name(name)
    *dirs, leaf = name.split("/")
    return dirs, leaf


def _open_regular(leaf: str, flags: int, dir_fd: int, mode: int = FILE_MODE) -> int:
    """``os.open`` of ``leaf`` in ``dir_fd`` (never through a link); raises OSError unless it is a regular file."""
    fd = os.open(leaf, flags, mode, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno_mod.ENXIO, "not a regular file", leaf)  # not EINVAL: no O_DIRECT retry
    return fd


def _is_link(name: str, dir_fd: int) -> bool:
    return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)


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

    def __init__(self, dir_fd: int, leaf: str, drop_page_cache: bool, direct: bool) -> None:
        self._direct = False
        if direct and _O_DIRECT:
            try:
                self._fd = _open_regular(leaf, _OPEN_READ | _O_DIRECT, dir_fd)
                self._direct = True
            except OSError as exc:
                if exc.errno != errno_mod.EINVAL:
                    raise
                self._fd = _open_regular(leaf, _OPEN_READ, dir_fd)
        else:
            self._fd = _open_regular(leaf, _OPEN_READ, dir_fd)
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
        if offset % BLOCK == 0 and is_aligned(view):
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
        if self._direct and not all(v.nbytes % BLOCK == 0 and is_aligned(v) for v in views):
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
                _drop_cached(self._fd, 0, 0)
        finally:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> _FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalDirBackend:
    """Blobs as files under ``root`` (created when missing). See the module docstring for the guarantees.

    Construction is the start check: it raises ``UnsafeCacheDirError`` for a directory that is not private, and
    holds the directory open (every path is resolved from that descriptor) until the backend is collected."""

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
        self._counter = 0
        self._counter_lock = threading.Lock()
        fd = open_private_root(self.root)
        try:
            secure_tree(fd, self.root)
        except BaseException:
            os.close(fd)
            raise
        self._root_fd = fd
        weakref.finalize(self, os.close, fd)

    def describe(self) -> str:
        return f"directory {self.root}"

    def write_atomic(self, name: str, parts: Sequence[Buffer], head: DeferredHead | None = None) -> int:
        dirs, leaf = _split(name)
        with walk_to(self._root_fd, dirs, create=True, fsync=self.fsync) as dir_fd:
            return self._write_in(dir_fd, leaf, parts, head)

    def _write_in(self, dir_fd: int, leaf: str, parts: Sequence[Buffer], head: DeferredHead | None) -> int:
        """``write_atomic`` of ``leaf`` in the open directory ``dir_fd``."""
        with self._counter_lock:
            self._counter += 1
            seq = self._counter
        tmp = f".{leaf}.{os.getpid()}.{seq}{TMP_SUFFIX}"
        views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
        head_n = 0 if head is None else head.nbytes
        total = head_n + sum(v.nbytes for v in views)
        direct = self.direct_io and head_n % BLOCK == 0
        fd = self._open_tmp(dir_fd, tmp, direct)
        if fd < 0:
            direct = False
            fd = self._open_tmp(dir_fd, tmp, False)
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
                    hfd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                    try:
                        self._write_buffered(hfd, [head_view], 0)
                        if self.fsync:
                            _fdatasync(hfd)
                        if self.drop_page_cache:
                            _drop_cached(hfd, 0, head_n)
                    finally:
                        os.close(hfd)
                else:
                    self._write_buffered(fd, [head_view], 0)
            if self.fsync:
                _fdatasync(fd)
            if self.drop_page_cache and not direct:
                _drop_cached(fd, 0, 0)
        except BaseException:
            if pending is not None:
                pending.cancel()
                try:
                    pending.result()
                except BaseException:
                    pass
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        os.close(fd)
        try:
            os.replace(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # replaces a planted link, not its target
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        if self.fsync:
            os.fsync(dir_fd)  # the rename itself survives power loss
        return total

    def _open_tmp(self, dir_fd: int, tmp: str, direct: bool) -> int:
        """A new temp file ``tmp`` in ``dir_fd``, mode 0600 whatever the umask; -1 when O_DIRECT is refused."""
        if not direct:
            fd = os.open(tmp, _OPEN_NEW, FILE_MODE, dir_fd=dir_fd)
        else:
            try:
                fd = os.open(tmp, _OPEN_NEW | _O_DIRECT, FILE_MODE, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno != errno_mod.EINVAL:
                    raise
                log.info("%s does not support O_DIRECT; using buffered I/O with page-cache drops", self.root)
                self.direct_io = False
                return -1
        try:
            os.fchmod(fd, FILE_MODE)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=dir_fd)
            raise
        return fd

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
            if fill % BLOCK == 0 and v.nbytes % BLOCK == 0 and is_aligned(v):
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
        dirs, leaf = _split(name)
        with walk_to(self._root_fd, dirs, create=False, fsync=False) as dir_fd:
            return _FileReader(dir_fd, leaf, self.drop_page_cache, self.direct_io)

    def delete(self, name: str) -> bool:
        """Unlink blob ``name`` (a link planted there is removed, its target untouched); False when absent, also
        when a component of its directory is a link (nothing is reached through it)."""
        dirs, leaf = _split(name)
        try:
            with walk_to(self._root_fd, dirs, create=False, fsync=False) as dir_fd:
                os.unlink(leaf, dir_fd=dir_fd)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in (errno_mod.ENOTDIR, errno_mod.ELOOP):
                return False
            raise

    def _walk(self) -> Iterator[tuple[str, list[str], int]]:
        """(directory relative to the root, "" for the root; its file names; its descriptor) for the root and its
        subdirectories, skipping reserved ("." names) and linked subdirectories."""
        for dirpath, dirnames, filenames, dir_fd in os.fwalk(".", dir_fd=self._root_fd):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and not _is_link(d, dir_fd)]
            yield os.path.normpath(dirpath).removeprefix("."), filenames, dir_fd

    def names(self) -> Iterator[str]:
        for rel, filenames, _ in self._walk():
            for fname in filenames:
                if not fname.startswith("."):
                    yield f"{rel}/{fname}" if rel else fname

    def remove_temp_files(self) -> int:
        """Delete leftovers of writes interrupted by a crash; returns how many."""
        removed = 0
        for _, filenames, dir_fd in self._walk():
            for fname in filenames:
                if fname.startswith(".") and fname.endswith(TMP_SUFFIX):
                    try:
                        os.unlink(fname, dir_fd=dir_fd)
                        removed += 1
                    except OSError:
                        pass
        return removed

    def lock(self) -> None:
        if self._lock_fd >= 0:
            return
        fd = _open_regular(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                           self._root_fd)
        try:
            os.fchmod(fd, FILE_MODE)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown process"
            finally:
                os.close(fd)
            raise CacheDirLockedError(
                f"cache directory {self.root} is in use by another cache engine ({holder}); close that engine "
                f"(CacheManager.close()) or give this one a different cache_dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
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
