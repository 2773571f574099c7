"""The cache engine's parts on their own: the tier contract (every tier), the residency index (no threads, no
I/O), write-back, verified reads, and the counting storage wrapper."""

from __future__ import annotations

import errno

import pytest
import torch

from pcr_rag.cache import (
    CorruptChunkError,
    CountingBackend,
    FaultyBackend,
    LocalDirBackend,
    ManualClock,
    MemoryBackend,
    Tier,
    VirtualPayload,
)
from pcr_rag.cache.config import RemoteConfig
from pcr_rag.cache.loader import Loader
from pcr_rag.cache.lock import CacheLock
from pcr_rag.cache.node import WriteBackState
from pcr_rag.cache.policy import make_policy
from pcr_rag.cache.residency import Evictability, ResidencyIndex, Room
from pcr_rag.cache.stats import CacheStats
from pcr_rag.cache.tiers import KVTier, MemoryTier, SsdTier, TierKind, open_remote_tier
from pcr_rag.cache.tiers.base import ChunkRecord, TierRecovery
from pcr_rag.cache.tiers.chunk_file import ChunkMeta, chunk_file_bytes, chunk_name
from pcr_rag.cache.tiers.ssd_store import SSDStore
from pcr_rag.cache.writeback import WriteBack

CHUNK_BYTES = 2 * 2 * 1 * 4 * 4 * 4  # payload_for(spec) of a full 4-token chunk
FILE_BYTES = chunk_file_bytes(CHUNK_BYTES, 5, 2)


def record(spec, payload, virtual: bool = False) -> ChunkRecord:
    return ChunkRecord(
        key=spec.key,
        parent_key=spec.parent,
        parent_is_root=spec.start == 0,
        num_tokens=spec.num_tokens,
        partial=spec.partial,
        tokens_digest=None,
        nbytes=int(payload.nbytes),
        num_layers=int(payload.shape[0]) if isinstance(payload, torch.Tensor) else payload.num_layers,
        virtual=virtual,
    )


def memory_tier(tmp_path) -> KVTier:
    return MemoryTier(Tier.DRAM, 1 << 20)


def ssd_tier_in_memory(tmp_path) -> KVTier:
    return SsdTier(SSDStore(MemoryBackend()), 1 << 20)


def ssd_tier_on_disk(tmp_path) -> KVTier:
    return SsdTier(SSDStore(LocalDirBackend(tmp_path)), 1 << 20)


def remote_tier_in_memory(tmp_path) -> KVTier:
    return open_remote_tier(RemoteConfig(f"memory://contract-{tmp_path.name}", capacity_bytes=1 << 20,
                                         secret="contract-test-secret"))


@pytest.mark.parametrize("make_tier", [memory_tier, ssd_tier_in_memory, ssd_tier_on_disk, remote_tier_in_memory])
def test_every_tier_keeps_the_tier_contract(tmp_path, chunks, make_payload, make_tier):
    """What a new tier (e.g. a remote store) must pass too: exact round trips, charged bytes, drop, recovery,
    metadata-only chunks without bytes."""
    tier = make_tier(tmp_path)
    spec = chunks.child(None, [1, 2, 3, 4])
    payload = make_payload(spec)
    chunk = record(spec, payload)
    assert tier.charge(chunk) >= chunk.nbytes
    assert not tier.holds(chunk)
    tier.store(chunk, tier.place(payload))
    assert tier.holds(chunk)
    assert torch.equal(tier.read(chunk), payload)
    assert torch.equal(tier.read_layer(chunk, 1), payload[1])
    layers = tier.open_layers(chunk)
    assert torch.equal(layers.read_layer(0), payload[0]) and torch.equal(layers.read_layer(1), payload[1])
    layers.close()
    if tier.kind is TierKind.MEMORY:
        assert tier.get(chunk) is not None and tier.recover().chunks == ()
    elif tier.shared:  # a store other engines use: learned by lookups, never scanned at start-up
        assert tier.get(chunk) is None and tier.recover() == TierRecovery()
    else:
        assert tier.get(chunk) is None  # storage copies are read, and verified, before use
        found = tier.recover()
        assert [c.key for c in found.chunks] == [spec.key] and found.corrupt == 0
        assert found.chunks[0].charged_bytes == tier.charge(chunk)
    tier.drop(chunk)
    assert not tier.holds(chunk)
    virtual = record(spec, VirtualPayload(CHUNK_BYTES, 2), virtual=True)
    tier.store(virtual, tier.place(VirtualPayload(CHUNK_BYTES, 2)))
    assert tier.read_layer(virtual, 1) == VirtualPayload(CHUNK_BYTES // 2, 1)
    assert tier.open_layers(virtual).read_layer(0) == VirtualPayload(CHUNK_BYTES // 2, 1)


@pytest.mark.parametrize("make_tier", [ssd_tier_in_memory, ssd_tier_on_disk])
def test_a_storage_tier_verifies_what_it_reads_and_fails_as_a_miss(tmp_path, chunks, make_payload, make_tier):
    tier = make_tier(tmp_path)
    spec = chunks.child(None, [1, 2, 3, 4])
    chunk = record(spec, make_payload(spec))
    tier.store(chunk, make_payload(spec))
    backend = tier.files.backend
    name = chunk_name(spec.key)
    raw = bytearray(backend.open(name).read_at(0, FILE_BYTES))
    raw[4096 + CHUNK_BYTES - 1] ^= 0xFF  # the last payload byte: layer 1
    backend.write_atomic(name, [bytes(raw)])
    assert torch.equal(tier.read_layer(chunk, 0), make_payload(spec)[0])  # layer 0 is intact
    with pytest.raises(CorruptChunkError):
        tier.read(chunk)
    with pytest.raises(CorruptChunkError):
        tier.read_layer(chunk, 1)
    backend.delete(name)
    with pytest.raises(OSError):
        tier.read(chunk)


def index_with(dram_chunks: int, ssd_chunks: int = 0) -> ResidencyIndex:
    tiers: list[KVTier] = [MemoryTier(Tier.DRAM, dram_chunks * CHUNK_BYTES)]
    if ssd_chunks:
        tiers.append(SsdTier(SSDStore(MemoryBackend()), ssd_chunks * FILE_BYTES))
    return ResidencyIndex(tiers, make_policy("lru"), ManualClock(), CacheStats())


def copy_to(index: ResidencyIndex, node, payload, tier: Tier) -> None:
    assert index.make_room(tier, index.tiers[tier].charge(node)) is Room.RESERVED
    index.tiers[tier].store(node, payload)
    index.mark_resident(node, tier)


def put(index: ResidencyIndex, spec, payload, tier: Tier = Tier.DRAM):
    node = index.add_node(record(spec, payload))
    copy_to(index, node, payload, tier)
    return node


def test_residency_makes_room_by_policy_and_never_evicts_pinned_or_pending_copies(chunks, make_payload):
    index = index_with(dram_chunks=2, ssd_chunks=4)
    a, b, c = (chunks.child(None, [i] * 4) for i in range(3))
    na, nb = put(index, a, make_payload(a)), put(index, b, make_payload(b))
    index.pin(na)
    nb.writeback = WriteBackState.QUEUED  # its write to SSD is pending: the DRAM copy is its only copy
    assert index.evictability(na, Tier.DRAM) is Evictability.KEPT
    assert index.evictability(nb, Tier.DRAM) is Evictability.AFTER_WRITEBACK
    assert index.make_room(Tier.DRAM, CHUNK_BYTES) is Room.AFTER_WRITEBACK
    nb.writeback = WriteBackState.FAILED  # the write failed: nothing to wait for, the copy may go
    assert index.evictability(nb, Tier.DRAM) is Evictability.NOW
    assert index.make_room(Tier.DRAM, CHUNK_BYTES) is Room.RESERVED
    assert b.key not in index.tree and index.stats.evictions["dram"] == 1
    index.release(Tier.DRAM, CHUNK_BYTES)
    nc = put(index, c, make_payload(c))
    assert index.make_room(Tier.DRAM, 3 * CHUNK_BYTES) is Room.NO_ROOM  # larger than the tier
    index.unpin([na])
    assert index.pinned == 0
    index.check(quiet=True)
    assert index.evict(Tier.DRAM, 10**9) == 2 * CHUNK_BYTES and len(index.tree) == 0
    assert nc.removed


def test_residency_demotes_to_a_slower_copy_and_drops_a_bad_copy_with_its_subtree(chunks, make_payload):
    index = index_with(dram_chunks=2, ssd_chunks=4)
    a, b = chunks.path([[1] * 4, [2] * 4])
    na = put(index, a, make_payload(a))
    copy_to(index, na, make_payload(a), Tier.SSD)
    nb = put(index, b, make_payload(b))
    assert index.evict(Tier.DRAM, CHUNK_BYTES) == CHUNK_BYTES  # b is DRAM's only leaf: dropped, a stays
    assert b.key not in index.tree and index.stats.demotions["dram"] == 0
    nb = put(index, b, make_payload(b))
    index.pin(nb)  # a is interior in DRAM and b pinned: no leaf can go, the fallback demotes a's DRAM copy
    assert index.make_room(Tier.DRAM, CHUNK_BYTES) is Room.RESERVED
    assert na.tiers() == {Tier.SSD} and index.stats.demotions["dram"] == 1
    index.release(Tier.DRAM, CHUNK_BYTES)
    index.unpin([nb])
    index.drop_bad_copy(na, Tier.SSD, CorruptChunkError("test"))  # a in no tier: b goes with it
    assert len(index.tree) == 0 and na.removed and nb.removed and index.stats.corrupt_chunks_dropped == 1
    index.check(quiet=True)


def test_writeback_writes_queued_chunks_and_counts_failures(chunks, make_payload):
    storage = FaultyBackend(MemoryBackend())
    ssd = SsdTier(SSDStore(storage), 4 * FILE_BYTES)
    stats = CacheStats()
    index = ResidencyIndex(
        [MemoryTier(Tier.DRAM, 4 * CHUNK_BYTES), ssd], make_policy("lru"), ManualClock(), stats
    )
    sync = CacheLock()
    wb = WriteBack(sync, index, ssd, stats, inline=True, wait_s=0.0)
    a, b = (chunks.child(None, [i] * 4) for i in range(2))
    with sync.lock:
        na, nb = put(index, a, make_payload(a)), put(index, b, make_payload(b))
        assert wb.enqueue(na) and wb.enqueue(nb)  # inline: the caller writes
    wb.write(na)
    assert na.tiers() == {Tier.DRAM, Tier.SSD} and na.writeback is WriteBackState.NOT_NEEDED
    storage.write_errno = errno.ENOSPC
    wb.write(nb)
    assert nb.tiers() == {Tier.DRAM} and nb.writeback is WriteBackState.FAILED
    assert stats.writes_done == 1 and stats.writes_failed == 1 and index.budgets[Tier.SSD].used == FILE_BYTES
    wb.flush(timeout=1)
    wb.stop()
    index.check(quiet=True)


def test_verified_read_drops_the_bad_copy_and_says_recompute(chunks, make_payload):
    backend = MemoryBackend()
    ssd = SsdTier(SSDStore(backend), 4 * FILE_BYTES)
    stats = CacheStats()
    index = ResidencyIndex(
        [MemoryTier(Tier.DRAM, CHUNK_BYTES), ssd], make_policy("lru"), ManualClock(), stats
    )
    sync = CacheLock()
    loader = Loader(
        sync, index, WriteBack(sync, index, ssd, stats, inline=True, wait_s=0.0), stats, workers=None
    )
    a = chunks.child(None, [1] * 4)
    node = put(index, a, make_payload(a), Tier.SSD)
    assert loader.load([a.key]) == 1 and node.tiers() == {Tier.DRAM, Tier.SSD}
    index.evict(Tier.DRAM, CHUNK_BYTES)
    backend.delete(chunk_name(a.key))  # the file vanished behind the engine's back
    with pytest.raises(CorruptChunkError, match="recompute"):
        loader.read_verified(node, Tier.SSD, lambda: ssd.read(node))
    assert node.removed and stats.corrupt_chunks_dropped == 1
    index.check(quiet=True)


def test_counting_backend_counts_operations_and_bytes(tmp_path, chunks, make_payload):
    counting = CountingBackend(LocalDirBackend(tmp_path))
    store = SSDStore(counting)
    spec = chunks.child(None, [1, 2, 3, 4])
    payload = make_payload(spec)
    size = store.write(ChunkMeta(spec.key, spec.parent, True, 4, False, b"\x00" * 16), payload)
    assert counting.snapshot() == (0, size) and counting.counts().write_ops == 1
    assert torch.equal(store.read(spec.key), payload)
    assert counting.bytes_read == size  # header and payload in one verified read
    assert torch.equal(store.read_layer(spec.key, 1), payload[1])
    c = counting.counts()
    assert (
        c.bytes_read == size + 4096 + payload[1].nbytes and c.read_ops == 3
    )  # whole; header, then one layer
    store.delete(spec.key)
    assert counting.counts().delete_ops == 1 and counting.describe().startswith("counting(")
