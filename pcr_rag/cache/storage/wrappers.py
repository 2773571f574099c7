"""Backends that wrap another ``StorageBackend``: for tests, the simulator and the benchmarks.

- ``SlowBackend``: adds ``latency_s + nbytes / bandwidth`` seconds (injectable ``sleep``) to every read and write.
- ``FaultyBackend``: fails writes with an errno (e.g. EACCES), or emulates a small disk that fills up (ENOSPC).
- ``CountingBackend``: counts the operations and bytes actually read from and written to the inner backend.
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from pcr_rag.cache.storage.base import BlobReader, Buffer, DeferredHead, StorageBackend, total_bytes

__all__ = ["CountingBackend", "DelegatingBackend", "FaultyBackend", "IOCounts", "SlowBackend"]


class DelegatingBackend:
    """Forwards every call to ``inner``; wrappers override what they change."""

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

    def remove_temp_files(self) -> int:
        remove = getattr(self.inner, "remove_temp_files", None)
        return int(remove()) if callable(remove) else 0

    def lock(self) -> None:
        self.inner.lock()

    def unlock(self) -> None:
        self.inner.unlock()

    def describe(self) -> str:
        return self.inner.describe()


class _ObservedReader:
    """A reader that reports the bytes of each read to ``before(nbytes)`` (called first, with the bytes asked for)
    and ``after(nbytes)`` (with the bytes read)."""

    def __init__(
        self, inner: BlobReader, before: Callable[[int], None], after: Callable[[int], None]
    ) -> None:
        self._inner = inner
        self._before = before
        self._after = after
        self.size = inner.size

    def read_at(self, offset: int, length: int) -> bytes:
        self._before(length)
        data = self._inner.read_at(offset, length)
        self._after(len(data))
        return data

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        self._before(memoryview(buf).nbytes)
        got = self._inner.readinto_at(offset, buf)
        self._after(got)
        return got

    def readv_at(self, offset: int, bufs: list[memoryview]) -> int:
        self._before(sum(memoryview(b).nbytes for b in bufs))
        got = self._inner.readv_at(offset, bufs)
        self._after(got)
        return got

    def close(self) -> None:
        self._inner.close()


def _ignore(nbytes: int) -> None:
    """A reader hook that records nothing."""


class SlowBackend(DelegatingBackend):
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
        self._delay(total_bytes(parts, head))
        return self.inner.write_atomic(name, parts, head)

    def open(self, name: str) -> BlobReader:
        return _ObservedReader(self.inner.open(name), self._delay, _ignore)


class FaultyBackend(DelegatingBackend):
    """Injects failures: every write raises ``OSError(write_errno)`` while ``write_errno`` is set, and with
    ``disk_bytes`` set, a write that would make the stored total exceed it raises ENOSPC (a full disk). While
    ``read_fault`` is set (an exception instance, e.g. ``TimeoutError(...)`` or ``OSError(EIO, ...)``), every read
    of an opened blob raises it (counted in ``read_failures``): a failing or timing-out disk under a load."""

    def __init__(
        self, inner: StorageBackend, *, write_errno: int | None = None, disk_bytes: int | None = None,
        read_fault: BaseException | None = None,
    ):
        super().__init__(inner)
        self.write_errno = write_errno
        self.disk_bytes = disk_bytes
        self.read_fault = read_fault
        self.write_attempts = 0
        self.write_failures = 0
        self.read_failures = 0
        self._sizes: dict[str, int] = {}
        self._mutex = threading.Lock()

    def open(self, name: str) -> BlobReader:
        return _ObservedReader(self.inner.open(name), self._maybe_fail_read, _ignore)

    def _maybe_fail_read(self, nbytes: int) -> None:
        fault = self.read_fault
        if fault is not None:
            with self._mutex:
                self.read_failures += 1
            raise fault

    def write_atomic(self, name: str, parts: Sequence[Buffer], head: DeferredHead | None = None) -> int:
        size = total_bytes(parts, head)
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


@dataclass(frozen=True)
class IOCounts:
    """What a ``CountingBackend`` has seen: operations and bytes (reads count the bytes actually read)."""

    read_ops: int = 0
    bytes_read: int = 0
    write_ops: int = 0
    bytes_written: int = 0
    delete_ops: int = 0


class CountingBackend(DelegatingBackend):
    """Counts the operations and bytes actually read from and written to ``inner`` (thread-safe). A read is one
    ``read_at``/``readinto_at``/``readv_at`` call; opening a blob is not counted. ``snapshot()`` gives
    ``(bytes_read, bytes_written)``; ``counts()`` everything."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(inner)
        self._mutex = threading.Lock()
        self._counts = IOCounts()

    def _add(self, **deltas: int) -> None:
        with self._mutex:
            c = self._counts
            self._counts = IOCounts(**{k: getattr(c, k) + deltas.get(k, 0) for k in vars(c)})

    def _read_done(self, nbytes: int) -> None:
        self._add(read_ops=1, bytes_read=nbytes)

    def write_atomic(self, name: str, parts: Sequence[Buffer], head: DeferredHead | None = None) -> int:
        written = self.inner.write_atomic(name, parts, head)
        self._add(write_ops=1, bytes_written=written)
        return written

    def open(self, name: str) -> BlobReader:
        return _ObservedReader(self.inner.open(name), _ignore, self._read_done)

    def delete(self, name: str) -> bool:
        self._add(delete_ops=1)
        return self.inner.delete(name)

    def describe(self) -> str:
        return f"counting({self.inner.describe()})"

    def counts(self) -> IOCounts:
        with self._mutex:
            return self._counts

    @property
    def bytes_read(self) -> int:
        return self.counts().bytes_read

    @property
    def bytes_written(self) -> int:
        return self.counts().bytes_written

    def snapshot(self) -> tuple[int, int]:
        """``(bytes_read, bytes_written)`` at one instant."""
        c = self.counts()
        return c.bytes_read, c.bytes_written
