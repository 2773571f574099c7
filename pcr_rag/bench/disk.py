"""Disk helpers for honest measurements: evict files from the page cache, count the bytes a storage backend moves.

Benchmarks that read "from SSD" must not read from the page cache, so before each try the files are evicted
(``posix_fadvise(DONTNEED)``, after an fsync: dirty pages cannot be dropped). Eviction is best effort by design:
where the OS cannot do it, the measurement still runs (and reads faster than a disk would).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pcr_rag.cache import StorageBackend
from pcr_rag.cache.storage import _DelegatingBackend  # the storage wrappers' base (delegates every call)

__all__ = ["CountingBackend", "drop_page_cache", "evict_from_page_cache"]


def evict_from_page_cache(fd: int) -> bool:
    """``posix_fadvise(DONTNEED)`` on an open file; False where the OS has no such call or refuses it."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        return False
    return True


def drop_page_cache(path: str | Path) -> int:
    """Evict ``path`` (a file, or every file below a directory) from the page cache, fsync first. Returns the
    files evicted; silently skips what it cannot open or evict."""
    p = Path(path)
    files = [p] if p.is_file() else [Path(root, name) for root, _dirs, names in os.walk(p) for name in names]
    evicted = 0
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            evicted += evict_from_page_cache(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
    return evicted


class _CountingReader:
    """Wraps the storage's blob reader (``read_at``/``readinto_at``/``readv_at``) and adds the bytes it reads to
    its backend's counter."""

    def __init__(self, inner: Any, backend: CountingBackend) -> None:
        self._inner = inner
        self._backend = backend
        self.size = inner.size

    def read_at(self, offset: int, length: int) -> bytes:
        data = self._inner.read_at(offset, length)
        self._backend.add_read(len(data))
        return data

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        n = self._inner.readinto_at(offset, buf)
        self._backend.add_read(n)
        return n

    def readv_at(self, offset: int, bufs: list[memoryview]) -> int:
        n = self._inner.readv_at(offset, bufs)
        self._backend.add_read(n)
        return n

    def close(self) -> None:
        self._inner.close()


class CountingBackend(_DelegatingBackend):
    """Wraps a `StorageBackend` and counts the bytes actually read from and written to it (thread-safe)."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    def add_read(self, n: int) -> None:
        with self._lock:
            self.bytes_read += int(n)

    def write_atomic(self, name: str, parts: Sequence[Any], head: Any = None) -> int:
        n = self.inner.write_atomic(name, parts, head)
        with self._lock:
            self.bytes_written += int(n)
        return n

    def open(self, name: str) -> _CountingReader:
        return _CountingReader(self.inner.open(name), self)

    def describe(self) -> str:
        return f"counting({self.inner.describe()})"

    def snapshot(self) -> tuple[int, int]:
        """``(bytes_read, bytes_written)`` so far."""
        with self._lock:
            return self.bytes_read, self.bytes_written
