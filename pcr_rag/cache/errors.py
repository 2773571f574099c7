"""Exceptions of the cache engine; each message says what happened and what to do."""

from __future__ import annotations

from pcr_rag.errors import ConfigError

__all__ = [
    "CacheError",
    "CacheClosedError",
    "CacheDirLockedError",
    "ChunkNotFoundError",
    "CorruptChunkError",
    "RemoteError",
    "RemoteMissError",
    "RemoteNodeUnavailableError",
    "RemoteTimeoutError",
    "RemoteUnavailableError",
    "UnsafeCacheDirError",
]


class CacheError(Exception):
    """Base class of cache-engine errors."""


class CacheDirLockedError(CacheError):
    """Another engine (this or another process) holds the SSD cache directory's lock."""


class UnsafeCacheDirError(CacheError, ConfigError):
    """The SSD cache directory (or something in it) belongs to another user or others can write to it: whoever
    can write there can plant chunks that are served as KV, whoever can read there reads every tenant's KV. Raised
    when the engine starts, before anything is read; the message names the path and the command that fixes it
    (``chmod 700`` / ``chown``). Also a ``ConfigError``: ``cache_dir`` is unusable as configured."""


class CorruptChunkError(CacheError):
    """A chunk read from SSD failed verification. The chunk has been dropped from the cache: recompute it."""


class ChunkNotFoundError(CacheError, KeyError):
    """The chunk is not (or no longer) in any tier of the cache: recompute it."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "chunk not in cache"


class CacheClosedError(CacheError):
    """The engine was closed; create a new CacheManager."""


class RemoteError(OSError):
    """A remote-tier operation did not return a usable value. An ``OSError``, so the engine handles it as any
    failed storage read: a miss, the chunk is recomputed. Never raised into a request."""


class RemoteMissError(RemoteError):
    """The remote store no longer holds the value (it evicted or expired it): a miss, recompute the chunk."""


class RemoteUnavailableError(RemoteError):
    """The remote store could not be reached, refused the operation, or its circuit breaker is open (the tier is
    skipped for a back-off period): the request runs on the local tiers."""


class RemoteTimeoutError(RemoteUnavailableError, TimeoutError):
    """A remote operation ran past its timeout (``remote_timeout_s`` / ``remote_connect_timeout_s``)."""


class RemoteNodeUnavailableError(RemoteUnavailableError):
    """One node (shard) of a clustered remote store failed, or its own circuit breaker is open (``skipped``): the
    chunks in its hash slots are misses until it answers again or the cluster fails over to its replica; the other
    shards still serve, so the tier as a whole stays on."""

    def __init__(self, message: str, *, skipped: bool = False) -> None:
        super().__init__(message)
        self.skipped = skipped
