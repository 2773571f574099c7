"""``SsdTier``: the SSD tier, chunk files (``chunk_file`` format, ``SSDStore``) in a local directory or any
``StorageBackend``.

A copy costs ``chunk_file_bytes`` (header padded to 4096 + payload padded to 4096); its header records the tenant
its bytes are charged to (``ChunkRecord.tenant``), so recovery charges it again. Writes are atomic and leave
nothing behind on failure; every read is verified (``CorruptChunkError`` otherwise). The directory survives
restarts: ``recover`` lists the valid chunks, oldest write first, after deleting bad files, and counts them per
namespace root (``census``; `pcr_rag.cache.roots`). The engine names its roots (``note_root``): a root's manifest
is written with the first chunk stored under it (at once when chunks of it are on disk already). With
``CacheConfig.ssd_secret`` the files are sealed and encrypted (``SSDStore``). The backend's lock
(a lock file for a directory) is held from ``open_ssd_tier`` until ``close``.
"""

from __future__ import annotations

import logging
import threading

import torch

from pcr_rag.cache.config import CacheConfig
from pcr_rag.cache.errors import CacheDirLockedError
from pcr_rag.cache.payload import Payload, VirtualPayload
from pcr_rag.cache.roots import RootManifest, RootUsage, usage_by_root
from pcr_rag.cache.seal import Sealer
from pcr_rag.cache.storage import LocalDirBackend, StorageBackend
from pcr_rag.cache.tiers.base import (
    UNATTRIBUTED,
    ChunkRecord,
    ChunkRef,
    LayerSource,
    PayloadLayers,
    Tier,
    TierKind,
    TierRecovery,
)
from pcr_rag.cache.tiers.chunk_file import NO_DIGEST, ChunkMeta, chunk_file_bytes
from pcr_rag.cache.tiers.ssd_store import SSDStore

__all__ = ["SsdTier", "open_ssd_tier"]

log = logging.getLogger(__name__)


def _virtual(chunk: ChunkRef) -> VirtualPayload:
    return VirtualPayload(chunk.nbytes, chunk.num_layers)


class SsdTier:
    """Chunk files on ``store``'s backend, within ``capacity_bytes``. Metadata-only chunks keep no file."""

    tier = Tier.SSD
    kind = TierKind.STORAGE
    shared = False

    def __init__(self, store: SSDStore, capacity_bytes: int) -> None:
        self.files = store
        self.capacity_bytes = int(capacity_bytes)
        self.census: dict[bytes | None, RootUsage] = {}  # per root (None: orphans), what `recover` found
        self.manifests: frozenset[bytes] = frozenset()  # roots whose manifest `recover` found
        self._pending: dict[bytes, RootManifest] = {}  # manifests to write with their root's first chunk
        self._noted: set[bytes] = set()
        self._roots_lock = threading.Lock()

    def charge(self, chunk: ChunkRef) -> int:
        return chunk_file_bytes(chunk.nbytes, 5, chunk.num_layers, self.files.sealer is not None, owned=True)

    def place(self, payload: Payload) -> Payload:
        return payload  # the write makes its own contiguous CPU view

    def store(self, chunk: ChunkRef, payload: Payload) -> None:
        if chunk.virtual:
            return
        if not isinstance(payload, torch.Tensor):
            raise TypeError(
                f"chunk {chunk.key.hex()} is not metadata-only but its payload is {type(payload).__name__}"
            )
        if chunk.parent_is_root and self._pending:
            self._write_manifest(chunk.parent_key)
        self.files.write(ChunkMeta.of(chunk, with_owner=True), payload)  # recovery charges the same tenant

    def note_root(self, manifest: RootManifest) -> None:
        """Have ``manifest`` stored for its root: with the first chunk stored under the root, or now when chunks of
        the root are on disk and it has no manifest (a cache written before manifests). Once per root; a failed
        write is logged and leaves the root of unknown origin (nothing else depends on it)."""
        root = manifest.root
        with self._roots_lock:
            if root in self._noted:
                return
            self._noted.add(root)
            if root in self.manifests:
                return
            self._pending[root] = manifest
        if root in self.census:
            self._write_manifest(root)

    def _write_manifest(self, root: bytes) -> None:
        with self._roots_lock:
            manifest = self._pending.pop(root, None)
        if manifest is None:
            return
        try:
            self.files.write_manifest(manifest)
        except OSError as exc:
            log.warning("could not write the manifest of cache root %s: %s", root.hex(), exc)

    def get(self, chunk: ChunkRef) -> Payload | None:
        return None  # a file must be read (and verified) before use

    def read(self, chunk: ChunkRef) -> Payload:
        return _virtual(chunk) if chunk.virtual else self.files.read(chunk.key)

    def read_layer(self, chunk: ChunkRef, layer: int) -> torch.Tensor | VirtualPayload:
        return _virtual(chunk)[layer] if chunk.virtual else self.files.read_layer(chunk.key, layer)

    def open_layers(self, chunk: ChunkRef) -> LayerSource:
        return PayloadLayers(_virtual(chunk)) if chunk.virtual else self.files.open_layers(chunk.key)

    def drop(self, chunk: ChunkRef) -> None:
        if not chunk.virtual:
            self.files.delete(chunk.key)

    def holds(self, chunk: ChunkRef) -> bool:
        return chunk.key in self.files

    def recover(self) -> TierRecovery:
        report = self.files.recover()
        self.census = usage_by_root(
            (h.meta.key, h.meta.parent, h.meta.parent_is_root, h.file_bytes, h.written_at) for h in report.headers)
        self.manifests = report.manifests
        chunks = tuple(
            ChunkRecord(
                key=h.meta.key,
                parent_key=h.meta.parent,
                parent_is_root=h.meta.parent_is_root,
                num_tokens=h.meta.num_tokens,
                partial=h.meta.partial,
                tokens_digest=h.meta.digest if h.meta.digest != NO_DIGEST else None,
                nbytes=h.payload_nbytes,
                num_layers=h.shape[0],
                charged_bytes=h.file_bytes,
                tenant=h.meta.owner or UNATTRIBUTED,
            )
            for h in report.headers
        )
        return TierRecovery(chunks, report.corrupt)

    def describe(self) -> str:
        return self.files.backend.describe()

    def close(self) -> None:
        self.files.backend.unlock()


def open_ssd_tier(config: CacheConfig, storage: StorageBackend | None) -> SsdTier | None:
    """The SSD tier ``config`` asks for, its backend locked; None (logged) when it is off or unusable. Raises
    ``CacheDirLockedError`` when another engine holds the directory."""
    if int(config.ssd_bytes) <= 0:
        if storage is not None or config.cache_dir is not None:
            log.warning("ssd_bytes is 0: the SSD tier is disabled and the storage/cache_dir is not used")
        return None
    if storage is None and config.cache_dir is None:
        log.warning("ssd_bytes > 0 but neither cache_dir nor a storage backend was given: SSD tier disabled")
        return None
    try:
        backend = storage or LocalDirBackend(
            config.cache_dir, fsync=config.fsync, drop_page_cache=config.drop_page_cache
        )
        backend.lock()
    except CacheDirLockedError:
        raise
    except OSError as exc:
        log.error("SSD tier disabled: cannot use %s (%s); serving from DRAM only", config.cache_dir, exc)
        return None
    sealer = Sealer(config.ssd_secret, "ssd", encrypt=True) if config.ssd_secret is not None else None
    return SsdTier(SSDStore(backend, pin_memory=config.pin_dram, sealer=sealer), int(config.ssd_bytes))
