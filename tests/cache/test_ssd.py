"""SSD store: byte-exact round trips, corruption detection, restart recovery, the directory lock, full disks."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pcr_rag.cache import (
    CacheConfig,
    CacheDirLockedError,
    CacheManager,
    CorruptChunkError,
    FaultyBackend,
    LocalDirBackend,
    MemoryBackend,
    Tier,
)
from pcr_rag.cache.tiers.chunk_file import ChunkMeta, chunk_file_bytes, chunk_name, decode_header
from pcr_rag.cache.tiers.ssd_store import SSDStore

REPO = Path(__file__).resolve().parents[2]


def cfg(tmp_path: Path, **kw) -> CacheConfig:
    base = dict(chunk_size=4, dram_bytes=1 << 20, ssd_bytes=1 << 22, cache_dir=tmp_path / "kv", sync_io=True)
    base.update(kw)
    return CacheConfig(**base)


def fill(eng: CacheManager, specs, make_payload) -> None:
    for s in specs:
        assert eng.insert(s, make_payload(s), tokens=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_store_round_trip_is_byte_exact(tmp_path, chunks, dtype):
    store = SSDStore(LocalDirBackend(tmp_path))
    spec = chunks.child(None, [1, 2, 3])
    payload = (torch.randn(3, 2, 2, 3, 8) * 50).to(dtype)
    meta = ChunkMeta(spec.key, spec.parent, True, 3, True, b"\x01" * 16)
    size = store.write(meta, payload)
    assert size == chunk_file_bytes(payload.nbytes, 5, 3) == (tmp_path / chunk_name(spec.key)).stat().st_size
    back = store.read(spec.key)
    assert back.dtype == dtype and back.shape == payload.shape
    assert back.view(torch.uint8).equal(payload.view(torch.uint8))
    for layer in range(3):
        assert store.read_layer(spec.key, layer).view(torch.uint8).equal(payload[layer].view(torch.uint8))
    header = store.read_header(spec.key)
    assert header.meta == meta and header.data_offset % 4096 == 0


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("shape", [(2, 2, 2, 256, 8), (3, 2, 1, 5, 8)])  # 4096-multiple payload / ragged one
def test_store_io_paths_are_byte_exact(tmp_path, chunks, direct_io, shape):
    """O_DIRECT (zero-copy when aligned, bounce buffers otherwise) and buffered I/O; fresh and caller buffers."""
    store = SSDStore(LocalDirBackend(tmp_path, direct_io=direct_io))
    spec = chunks.child(None, [1] * shape[3])
    payload = torch.randn(shape).to(torch.bfloat16)
    store.write(ChunkMeta(spec.key, spec.parent, True, shape[3], False, b"\x00" * 16), payload)
    assert store.read(spec.key).view(torch.uint8).equal(payload.view(torch.uint8))
    out = torch.empty(shape, dtype=torch.bfloat16)
    assert store.read(spec.key, out=out) is out and out.view(torch.uint8).equal(payload.view(torch.uint8))
    assert store.read_layer(spec.key, shape[0] - 1).equal(payload[-1])
    with pytest.raises(ValueError):
        store.read(spec.key, out=torch.empty(3, dtype=torch.bfloat16))
    reopened = SSDStore(LocalDirBackend(tmp_path, direct_io=direct_io))
    report = reopened.recover()
    assert [h.meta.key for h in report.headers] == [spec.key] and report.corrupt == 0
    assert reopened.read(spec.key).view(torch.uint8).equal(payload.view(torch.uint8))


def test_engine_round_trip_through_restart_is_byte_exact(tmp_path, chunks, make_payload):
    path = chunks.path([[1, 2, 3, 4], [5, 6, 7, 8], [9]])
    with CacheManager(cfg(tmp_path)) as eng:
        fill(eng, path, make_payload)
    with CacheManager(cfg(tmp_path)) as eng:
        assert eng.stats().recovered_chunks == 3
        assert eng.load([s.key for s in path]) == 3
        for s in path:
            assert torch.equal(eng.get_payload(s.key), make_payload(s))


def corrupt(path: Path, kind: str, donor: Path) -> None:
    raw = bytearray(path.read_bytes())
    if kind == "truncate":
        path.write_bytes(raw[: len(raw) - 10])
    elif kind == "flip_payload":
        header = decode_header(bytes(raw[:4096]))
        raw[header.data_offset + header.payload_nbytes - 3] ^= 0x40  # inside the last layer's bytes
        path.write_bytes(raw)
    elif kind == "flip_header":
        raw[60] ^= 0x01
        path.write_bytes(raw)
    elif kind == "wrong_key":
        shutil.copyfile(donor, path)  # a valid chunk file, but for another key
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncate", "flip_payload", "flip_header", "wrong_key"])
@pytest.mark.parametrize("phase", ["live", "restart"])
def test_corrupt_chunk_is_detected_dropped_and_a_miss(tmp_path, chunks, make_payload, kind, phase):
    a, b = chunks.path([[1, 2, 3, 4], [5, 6, 7, 8]])
    other = chunks.child(None, [9, 9, 9, 9])
    eng = CacheManager(cfg(tmp_path, dram_bytes=4 * 64))  # DRAM holds one chunk: the rest lives on SSD
    fill(eng, [a, b, other], make_payload)
    assert eng.tiers_of(b.key) == {Tier.SSD}
    victim = tmp_path / "kv" / chunk_name(b.key)
    corrupt(victim, kind, tmp_path / "kv" / chunk_name(a.key))
    if phase == "restart":
        eng.close()
        eng = CacheManager(cfg(tmp_path, dram_bytes=4 * 64))
    if b.key in eng:  # header intact: detected on the verified read
        assert eng.load([b.key]) == 0
    assert b.key not in eng and not victim.exists()
    st = eng.stats()
    assert st.corrupt_chunks_dropped == 1
    with eng.acquire([a, b]) as lease:
        assert lease.keys == (a.key,)  # the bad chunk is a miss, its parent still hits
    assert torch.equal(eng.read_layer(a.key, 0), make_payload(a)[0])
    eng.check_invariants()
    eng.close()


def test_read_layer_verifies_only_the_layer_it_reads(tmp_path, chunks, make_payload):
    a = chunks.child(None, [1, 2, 3, 4])
    x = chunks.child(None, [7, 7, 7, 7])
    eng = CacheManager(cfg(tmp_path, dram_bytes=4 * 64))
    fill(eng, [a, x], make_payload)
    assert eng.tiers_of(a.key) == {Tier.SSD}
    path = tmp_path / "kv" / chunk_name(a.key)
    raw = bytearray(path.read_bytes())
    header = decode_header(bytes(raw[:4096]))
    raw[header.data_offset + header.payload_nbytes - 1] ^= 0xFF  # last payload byte = layer 1
    path.write_bytes(raw)
    assert torch.equal(eng.read_layer(a.key, 0), make_payload(a)[0])
    with pytest.raises(CorruptChunkError, match="recompute"):
        eng.read_layer(a.key, 1)
    assert a.key not in eng and eng.stats().corrupt_chunks_dropped == 1
    eng.close()


def test_restart_rebuilds_index_tree_and_lru_order(tmp_path, chunks, make_payload):
    trunk = chunks.path([[1, 1, 1, 1], [2, 2, 2, 2]])
    branch = chunks.child(trunk[0], [3, 3, 3, 3])
    tail = chunks.child(branch, [4, 4])
    lone = chunks.child(None, [5, 5, 5, 5])
    order = [*trunk, branch, tail, lone]
    with CacheManager(cfg(tmp_path)) as eng:
        for s in order:
            assert eng.insert(s, make_payload(s), tokens=chunks.tokens[s.key])
        leaves_before = set(eng.leaf_keys())
    (tmp_path / "kv" / "ab").mkdir(exist_ok=True)
    (tmp_path / "kv" / "ab" / ".stale.kv.123.1.tmp").write_bytes(b"half a write")
    with CacheManager(cfg(tmp_path)) as eng:
        st = eng.stats()
        assert st.recovered_chunks == 5 and st.nodes == 5 and st.chunks["ssd"] == 5 and st.chunks["dram"] == 0
        assert st.bytes_used["ssd"] == sum(chunk_file_bytes(make_payload(s).nbytes, 5, 2) for s in order)
        assert set(eng.leaf_keys()) == leaves_before == {trunk[1].key, tail.key, lone.key}
        assert eng.leaf_keys(Tier.SSD) == [trunk[1].key, tail.key, lone.key]  # oldest write first
        m = eng.match([trunk[0].key, branch.key, tail.key])
        assert m.num_chunks == 3 and m.num_tokens == 10 and set(m.tiers) == {Tier.SSD}
        eng.check_invariants()
        # the partial chunk's token digest survived the restart: a full sibling still supersedes it
        full = chunks.child(branch, [4, 4, 4, 4])
        assert eng.insert(full, make_payload(full), tokens=[4, 4, 4, 4])
        assert tail.key not in eng and eng.stats().superseded == 1
    assert not (tmp_path / "kv" / "ab" / ".stale.kv.123.1.tmp").exists()


def test_restart_drops_orphans_and_trims_to_a_smaller_budget(tmp_path, chunks, make_payload):
    path = chunks.path([[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]])
    others = [chunks.child(None, [i] * 4) for i in range(10, 14)]
    with CacheManager(cfg(tmp_path)) as eng:
        fill(eng, path + others, make_payload)
    os.unlink(tmp_path / "kv" / chunk_name(path[0].key))
    one = chunk_file_bytes(make_payload(others[0]).nbytes, 5, 2)
    with CacheManager(cfg(tmp_path, ssd_bytes=3 * one)) as eng:
        st = eng.stats()
        assert st.orphans_dropped == 2  # path[1] and path[2] lost their parent
        assert path[1].key not in eng and not (tmp_path / "kv" / chunk_name(path[2].key)).exists()
        assert st.chunks["ssd"] == 3 and st.bytes_used["ssd"] <= 3 * one
        assert set(eng.leaf_keys()) == {o.key for o in others[1:]}  # the oldest write was trimmed
        eng.check_invariants()


def test_second_engine_on_the_same_dir_gets_a_clear_error(tmp_path):
    first = CacheManager(cfg(tmp_path))
    with pytest.raises(CacheDirLockedError) as info:
        CacheManager(cfg(tmp_path))
    msg = str(info.value)
    assert str((tmp_path / "kv").resolve()) in msg and f"pid {os.getpid()}" in msg and "cache_dir" in msg
    code = (
        "import sys\n"
        "from pcr_rag.cache import CacheConfig, CacheManager, CacheDirLockedError\n"
        "try:\n"
        f"    CacheManager(CacheConfig(ssd_bytes=1 << 20, cache_dir={str(tmp_path / 'kv')!r}))\n"
        "except CacheDirLockedError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "in use by another cache engine" in proc.stdout
    first.close()
    CacheManager(cfg(tmp_path)).close()  # free again after close


def test_memory_backend_is_exclusive_too():
    storage = MemoryBackend()
    eng = CacheManager(CacheConfig(ssd_bytes=1 << 20), storage=storage)
    with pytest.raises(CacheDirLockedError):
        CacheManager(CacheConfig(ssd_bytes=1 << 20), storage=storage)
    eng.close()


def test_full_disk_keeps_requests_working(chunks, make_payload, caplog):
    one = chunk_file_bytes(make_payload(chunks.child(None, [0] * 4)).nbytes, 5, 2)
    storage = FaultyBackend(MemoryBackend(), disk_bytes=2 * one)  # the disk fills after two chunks
    eng = CacheManager(CacheConfig(chunk_size=4, dram_bytes=3 * 256, ssd_bytes=100 * one, sync_io=True), storage=storage)
    specs = [chunks.child(None, [i] * 4) for i in range(8)]
    with caplog.at_level(logging.ERROR, logger="pcr_rag.cache.manager"):
        for s in specs:
            assert eng.insert(s, make_payload(s))
            with eng.acquire([s]) as lease:  # requests keep hitting
                assert lease.num_chunks == 1
                assert torch.equal(eng.get_payload(s.key), make_payload(s))
    st = eng.stats()
    assert st.writes_done == 2 and st.writes_failed == 6 and storage.write_failures == 6
    assert len([r for r in caplog.records if "write-back failed" in r.getMessage()]) == 1  # logged once
    assert st.chunks["ssd"] == 2 and st.chunks["dram"] == 3 and st.bytes_used["dram"] <= 3 * 256
    # the disk is freed: write-back works again
    storage.disk_bytes = None
    late = chunks.child(None, [99] * 4)
    assert eng.insert(late, make_payload(late))
    assert eng.tiers_of(late.key) == {Tier.DRAM, Tier.SSD}
    eng.check_invariants()
    eng.close()


def test_write_errors_of_any_kind_are_counted_not_raised(chunks, make_payload):
    storage = FaultyBackend(MemoryBackend(), write_errno=errno.EACCES)
    eng = CacheManager(CacheConfig(chunk_size=4, ssd_bytes=1 << 20, sync_io=False), storage=storage)
    specs = [chunks.child(None, [i] * 4) for i in range(5)]
    for s in specs:
        assert eng.insert(s, make_payload(s))
    eng.flush(timeout=10)
    assert eng.stats().writes_failed == 5 and eng.stats().chunks["ssd"] == 0
    assert eng.match([specs[0].key]).num_chunks == 1
    eng.close()


def test_unusable_cache_dir_disables_the_ssd_tier(tmp_path, chunks, make_payload, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with caplog.at_level(logging.ERROR):
        eng = CacheManager(cfg(tmp_path, cache_dir=blocker / "kv"))
    assert not eng.ssd_enabled and eng.tiers == (Tier.DRAM,)
    assert any("SSD tier disabled" in r.getMessage() for r in caplog.records)
    spec = chunks.child(None, [1, 2, 3, 4])
    assert eng.insert(spec, make_payload(spec))
    assert eng.match([spec.key]).num_chunks == 1
    eng.close()


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("shape", [(2, 2, 2, 256, 8), (3, 2, 1, 5, 8)])  # 4096-multiple payload / ragged one
def test_page_locked_reads_lock_the_payload_alone(tmp_path, chunks, fake_pinned, direct_io, shape):
    """On a GPU host a chunk read for the DRAM tier is page-locked and that tier keeps it: the buffer must hold the
    payload alone, with no header and no alignment slack, because the host allocator rounds the request up to a
    power of two (a 32 MiB chunk read with its header would lock 64 MiB)."""
    store = SSDStore(LocalDirBackend(tmp_path, direct_io=direct_io), pin_memory=True)
    spec = chunks.child(None, [1] * shape[3])
    payload = torch.randn(shape).to(torch.bfloat16)
    store.write(ChunkMeta(spec.key, spec.parent, True, shape[3], False, b"\x00" * 16), payload)
    fake_pinned.clear()
    assert store.read(spec.key).view(torch.uint8).equal(payload.view(torch.uint8))
    padded = -(-payload.nbytes // 4096) * 4096
    assert fake_pinned == [padded], "one page-locked buffer, of the payload's padded size"
    reopened = SSDStore(LocalDirBackend(tmp_path, direct_io=direct_io), pin_memory=True)  # no index: step by step
    reopened.recover()
    fake_pinned.clear()
    assert reopened.read(spec.key).view(torch.uint8).equal(payload.view(torch.uint8))
    assert fake_pinned == [padded]
