"""``MemoryBackend``: blobs in a dict, for fast deterministic tests and the simulator."""

from __future__ import annotations

import errno as errno_mod
import threading
from collections.abc import Iterator, Sequence

from pcr_rag.cache.errors import CacheDirLockedError
from pcr_rag.cache.storage.base import Buffer, DeferredHead, check_name, resolve_parts

__all__ = ["MemoryBackend"]


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
        check_name(name)
        data = b"".join(bytes(memoryview(p).cast("B")) for p in resolve_parts(parts, head))
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
