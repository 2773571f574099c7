"""Exceptions of the cache engine; each message says what happened and what to do."""

from __future__ import annotations

__all__ = [
    "CacheError",
    "CacheClosedError",
    "CacheDirLockedError",
    "ChunkNotFoundError",
    "CorruptChunkError",
]


class CacheError(Exception):
    """Base class of cache-engine errors."""


class CacheDirLockedError(CacheError):
    """Another engine (this or another process) holds the SSD cache directory's lock."""


class CorruptChunkError(CacheError):
    """A chunk read from SSD failed verification. The chunk has been dropped from the cache: recompute it."""


class ChunkNotFoundError(CacheError, KeyError):
    """The chunk is not (or no longer) in any tier of the cache: recompute it."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "chunk not in cache"


class CacheClosedError(CacheError):
    """The engine was closed; create a new CacheEngine."""
