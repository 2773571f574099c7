"""Blob storage under the storage tiers: the ``StorageBackend`` protocol (``base``), the real local directory
(``local_dir``: O_DIRECT, atomic writes, a lock file, in a private directory that ``private_dir`` creates, checks
and walks without following links), an in-memory store (``memory``) and wrappers for tests and benchmarks
(``wrappers``: slow, faulty, counting)."""

from pcr_rag.cache.storage.aligned import aligned_scratch
from pcr_rag.cache.storage.base import BlobReader, DeferredHead, StorageBackend
from pcr_rag.cache.storage.local_dir import LocalDirBackend
from pcr_rag.cache.storage.memory import MemoryBackend
from pcr_rag.cache.storage.wrappers import CountingBackend, FaultyBackend, IOCounts, SlowBackend

__all__ = [
    "BlobReader",
    "CountingBackend",
    "DeferredHead",
    "FaultyBackend",
    "IOCounts",
    "LocalDirBackend",
    "MemoryBackend",
    "SlowBackend",
    "StorageBackend",
    "aligned_scratch",
]
