"""The blob-store boundary of the storage tiers: ``StorageBackend`` (named blobs written atomically, read by byte
range) and ``BlobReader``. Tests and the simulator inject their own backend; see ``local_dir``, ``memory`` and
``wrappers`` for the implementations.

Names are relative POSIX paths without ``..``; names starting with ``.`` are reserved for the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "BlobReader",
    "Buffer",
    "DeferredHead",
    "StorageBackend",
    "check_name",
    "resolve_parts",
    "total_bytes",
]

Buffer = bytes | bytearray | memoryview


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


def resolve_parts(parts: Sequence[Buffer], head: DeferredHead | None) -> list[Buffer]:
    """``head`` (produced now) followed by ``parts``: what a backend without overlap writes."""
    return list(parts) if head is None else [head.resolve(), *parts]


def check_name(name: str) -> None:
    """Raise ValueError for a blob name that is absolute, empty, climbs out (``..``) or uses a reserved part."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        raise ValueError(f"invalid blob name {name!r}")


def total_bytes(parts: Sequence[Buffer], head: DeferredHead | None = None) -> int:
    """Bytes a write of ``head`` + ``parts`` stores."""
    return sum(memoryview(p).nbytes for p in parts) + (0 if head is None else head.nbytes)
