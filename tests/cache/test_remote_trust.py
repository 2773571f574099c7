"""Authenticated, bounded remote values (and sealed SSD files): what someone who can write to the shared store (or
the cache directory) but does not hold the replicas' secret can no longer do.

The attacks: values rewritten with constant KV and recomputed xxh3 checksums (the live probe that made a fresh
replica reuse forged KV and answer differently), a MAC-valid value moved to another key, a value made under
another namespace root, headers whose token count / partial flag / tokens digest contradict the reader's chunk
plan, a dtype or shape other than the engine's KV layout, a header claiming a huge size (DRAM room), and tampered
ciphertext. Each is rejected, deleted, counted in ``remote_io["forged"]``, and the request recomputes: its answer
is the cache-off answer bit for bit.
"""

from __future__ import annotations

import logging
import struct
import uuid

import pytest
import torch
import xxhash

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache import CacheConfig, CacheManager, CorruptChunkError, ManualClock, MemoryBackend, Tier
from pcr_rag.cache.config import KVLayout, RemoteConfig
from pcr_rag.cache.seal import ForgedChunkError
from pcr_rag.cache.tiers.base import ChunkRecord
from pcr_rag.cache.tiers.chunk_file import (
    ChunkMeta,
    announced_header_len,
    byte_view,
    chunk_name,
    decode_header,
    encode_header,
)
from pcr_rag.cache.tiers.remote import open_remote_tier
from pcr_rag.cache.tiers.remote_store import MemoryRemoteStore
from pcr_rag.cache.tiers.remote_value import Expected, value_name
from pcr_rag.errors import ConfigError
from pcr_rag.server.metrics import ServerMetrics
from pcr_rag.testing import tiny_model

from .conftest import Chunks
from .test_remote_tier import LAYOUT, SECRET, fill, remote_config

NS = "pcr-rag"



def engine(store_name: str, **remote) -> CacheManager:
    cfg = CacheConfig(chunk_size=4, dram_bytes=1 << 20, sync_io=True,
                      remote=remote_config(f"memory://{store_name}", **remote))
    return CacheManager(cfg, clock=ManualClock())


def record(spec, payload, digest: bytes | None = None) -> ChunkRecord:
    return ChunkRecord(spec.key, spec.parent, spec.start == 0, spec.num_tokens, spec.partial, digest,
                       int(payload.nbytes), int(payload.shape[0]))


# ---------------------------------------------------------------------------------------------- the attacker
def forge(raw: bytes, *, keep_seal: bool) -> bytes:
    """The live probe's rewrite: constant KV of the header's dtype and shape, xxh3 checksums recomputed, the header
    checksum recomputed. ``keep_seal``: leave every other header byte (the seal too) as it was; otherwise write a
    fresh unsealed header (what an attacker without the secret can produce)."""
    h = decode_header(raw)
    const = torch.full(h.shape, 0.25, dtype=h.dtype)
    data = byte_view(const)
    lb = data.nbytes // h.shape[0]
    sums = [xxhash.xxh3_64_intdigest(data[i * lb : (i + 1) * lb]) for i in range(h.shape[0])]
    if keep_seal:
        head = bytearray(raw[: h.data_offset])
        struct.pack_into(f"<{len(sums)}Q", head, len(h.core), *sums)
        hlen = announced_header_len(raw)
        struct.pack_into("<Q", head, hlen - 8, xxhash.xxh3_64_intdigest(bytes(head[: hlen - 8])))
        return bytes(head) + data.tobytes()
    return encode_header(h.meta, const, sums) + data.tobytes()


def chunk_values(store: MemoryRemoteStore) -> dict[str, bytes]:
    """The store's chunk values (not the root manifests, ``<namespace>:root:<root hex>``)."""
    return {name: raw for name, raw in store.values.items() if ":root:" not in name}


def forge_store(store: MemoryRemoteStore, *, keep_seal: bool = False) -> int:
    chunks = chunk_values(store)
    for name, raw in chunks.items():
        store.values[name] = forge(raw, keep_seal=keep_seal)
    return len(chunks)


# ---------------------------------------------------------------------------------------------- engine level
DOCS = ["The rivers of the world are studied by many scientists, who measure and map them each year. " * 4,
        "Glaciers move slowly down mountain valleys and carve the rock beneath them over thousands of years. " * 4]
QUESTION = "What do scientists measure?"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2, dtype=torch.float32)


def replica(tiny, tmp_path, name: str, url: str | None, **kw) -> PCREngine:
    model, tok = tiny
    kw.setdefault("ssd_capacity", 0)
    cfg = EngineConfig(cache_dir=tmp_path / name, chunk_size=16, dram_capacity="64MiB", max_new_tokens=6,
                       device="cpu", dtype="float32", prefetch=False, remote_url=url, **kw)
    return PCREngine(model=model, tokenizer=tok, config=cfg)


def answer(eng: PCREngine):
    return eng.generate(QUESTION, DOCS)


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and torch.equal(a.first_token_logits, b.first_token_logits)


@pytest.mark.parametrize("keep_seal", [False, True])
def test_forged_values_change_an_insecure_replica_but_are_rejected_under_a_secret(tiny, tmp_path, keep_seal):
    """The reviewer's live probe, end to end. Insecure (checksums only, the code before this fix): the forged KV is
    reused and the answer changes, nothing counted. With a secret: every value is counted forged and deleted,
    nothing is reused, and the answer is the cache-off answer bit for bit."""
    with replica(tiny, tmp_path, "off", None, enable_cache=False) as off:
        ref = answer(off)
    for secure in (False, True):
        name = f"forge-{uuid.uuid4().hex[:8]}"
        trust = {"remote_secret": SECRET} if secure else {"remote_insecure": True}
        try:
            with replica(tiny, tmp_path, f"w{secure}", f"memory://{name}", **trust) as writer:
                assert same(answer(writer), ref)
                writer.flush(timeout=30)
            forged = forge_store(MemoryRemoteStore.named(name), keep_seal=keep_seal and secure)
            assert forged >= 4
            with replica(tiny, tmp_path, f"r{secure}", f"memory://{name}", **trust) as fresh:
                got = answer(fresh)
                io = fresh.stats().cache.remote_io
                scraped = ServerMetrics("tiny", fresh.stats).render().decode()  # what /metrics serves
            if not secure:
                assert got.metrics.reused_by_tier["remote"] > 0 and not same(got, ref)  # the attack works
                assert io["forged"] == 0 and io["corrupt"] == 0
            else:
                assert got.metrics.reused_by_tier["remote"] == 0 and same(got, ref)
                assert io["forged"] >= 1 and io["hits"] == 0
                assert f'pcr:remote_values_forged_total{{model_name="tiny"}} {float(io["forged"])}' in scraped
                left = chunk_values(MemoryRemoteStore.named(name))
                assert all(not _is_forged(raw) for raw in left.values())  # forged ones deleted, fresh ones sealed
        finally:
            MemoryRemoteStore.forget(name)


def _is_forged(raw: bytes) -> bool:
    h = decode_header(raw)
    return not h.sealed or torch.all(torch.frombuffer(bytearray(raw[h.data_offset :]), dtype=torch.float32) == 0.25)


def test_every_forged_value_is_counted_and_deleted(store_name, chunks, make_payload):
    specs = chunks.path([[1] * 4, [2] * 4, [3] * 4])
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name) as a, engine(store_name) as b:
        fill(a, specs, make_payload)
        assert forge_store(store) == 3
        assert b.acquire(specs).num_chunks == 0  # one lookup reads (and rejects) the whole chain
        assert b.stats().remote_io["forged"] == 3 and not store.values  # every value deleted
        assert b.stats().remote_io["lookup_found"] == 0 and len(b) == 0


# ---------------------------------------------------------------------------------------------- splices and roots
def test_a_mac_valid_value_moved_to_another_key_is_rejected(store_name, chunks, make_payload):
    a_spec, b_spec = chunks.child(None, [1] * 4), chunks.child(None, [2] * 4)
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name) as a, engine(store_name) as b:
        fill(a, [a_spec], make_payload)
        raw = store.values[value_name(NS, a_spec.key)]
        store.values[value_name(NS, b_spec.key)] = raw  # moved as it is: its header names a_spec
        assert b.acquire([b_spec]).num_chunks == 0 and b.stats().remote_io["forged"] == 1
        moved = bytearray(raw)  # moved with the key field rewritten and the header checksum recomputed
        at = decode_header(raw).core.index(a_spec.key)
        moved[at : at + 16] = b_spec.key
        hlen = announced_header_len(raw)
        struct.pack_into("<Q", moved, hlen - 8, xxhash.xxh3_64_intdigest(bytes(moved[: hlen - 8])))
        store.values[value_name(NS, b_spec.key)] = bytes(moved)
        assert b.acquire([b_spec]).num_chunks == 0 and b.stats().remote_io["forged"] == 2
        assert value_name(NS, b_spec.key) not in store.values


def test_a_value_sealed_under_another_root_is_rejected_and_no_value_stores_its_root(store_name, make_payload):
    mine, theirs = Chunks(), Chunks(root=b"\x07" * 16)
    spec = mine.child(None, [1] * 4)
    payload = make_payload(spec)
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name) as a:
        fill(a, [spec], make_payload)
        assert mine.root not in store.values[value_name(NS, spec.key)]  # the first chunk's parent: never written
    store.values.clear()
    tier = open_remote_tier(remote_config(f"memory://{store_name}"))
    tier.store(record(spec, payload), payload, theirs.root)  # a secret holder sealing it under the wrong root
    assert theirs.root not in store.values[value_name(NS, spec.key)]
    with engine(store_name) as b:
        assert b.acquire([spec]).num_chunks == 0 and b.stats().remote_io["forged"] == 1
        assert value_name(NS, spec.key) not in store.values


# ---------------------------------------------------------------------------------------------- the chunk plan
def test_headers_contradicting_the_plan_are_rejected(store_name, chunks, make_payload):
    """Values a secret holder sealed (a buggy or hostile replica) whose token count or partial flag differs from
    the reader's own plan, or whose tokens digest differs from the one the reader knows."""
    full = chunks.child(None, [1] * 4)
    store = MemoryRemoteStore.named(store_name)
    tier = open_remote_tier(remote_config(f"memory://{store_name}"))
    with engine(store_name) as b:
        for lie in ({"num_tokens": 3}, {"partial": True}):
            rec = record(full, make_payload(full))._replace(**lie)
            payload = make_payload(full)[:, :, :, : rec.num_tokens].contiguous()
            store.values[value_name(NS, full.key)] = tier.codec.encode(rec._replace(nbytes=payload.nbytes), payload,
                                                                       chunks.root)
            assert b.acquire([full]).num_chunks == 0
        assert b.stats().remote_io["forged"] == 2
    partial = chunks.child(None, [5, 6])
    payload = make_payload(partial)
    tier.store(record(partial, payload, digest=b"\x01" * 16), payload, chunks.root)
    exp = Expected(partial.key, chunks.root, None, partial.num_tokens, True, b"\x02" * 16)
    assert tier.probe([exp]) == [None] and tier.client.counters()["forged"] == 1
    tier.store(record(full, make_payload(full), digest=b"\x01" * 16), make_payload(full), chunks.root)
    assert tier.probe([Expected(full.key, chunks.root, None, 4, False)]) == [None]  # a full chunk has no digest
    assert tier.client.counters()["forged"] == 2


def test_a_dtype_or_shape_other_than_the_kv_layout_is_rejected_not_converted(store_name, chunks, make_payload):
    specs = chunks.path([[1] * 4, [2] * 4])
    store = MemoryRemoteStore.named(store_name)
    tier = open_remote_tier(remote_config(f"memory://{store_name}"))
    with engine(store_name) as a, engine(store_name) as b:
        fill(a, specs, make_payload)
        good = store.values[value_name(NS, specs[0].key)]
        half = make_payload(specs[0]).to(torch.float16)  # same tokens, another dtype
        store.values[value_name(NS, specs[0].key)] = tier.codec.encode(
            record(specs[0], half), half, chunks.root)
        assert b.acquire(specs).num_chunks == 0 and b.stats().remote_io["forged"] == 1  # lookup: rejected
        store.values[value_name(NS, specs[0].key)] = good
        assert b.acquire(specs).num_chunks == 2  # learned from good values
        wide = torch.randn(2, 2, 2, 4, 4)  # two KV heads instead of one
        store.values[value_name(NS, specs[1].key)] = tier.codec.encode(record(specs[1], wide), wide, chunks.root)
        with pytest.raises(CorruptChunkError, match="recompute"):
            b.read_layer(specs[1].key, 0)  # read: rejected, never copied into a buffer of the right layout
        assert b.stats().remote_io["forged"] == 2 and specs[1].key not in b


def test_dram_room_comes_from_the_local_size_not_the_header(store_name, chunks, make_payload):
    """An insecure tier (no MAC to stop it) and a header claiming a huge shape: nothing is reserved or evicted
    for it. Before, the node took the header's size and its load evicted all of DRAM to make room."""
    specs = chunks.path([[1] * 4, [2] * 4])
    others = Chunks(root=b"\x05" * 16).path([[9] * 4, [8] * 4, [7] * 4])
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name, secret=None, insecure=True) as a, \
            engine(store_name, secret=None, insecure=True) as b:
        fill(a, specs, make_payload)
        fill(b, others, make_payload)
        raw = store.values[value_name(NS, specs[0].key)]
        h = decode_header(raw)
        huge = torch.empty((2, 2, 1, 4, 4 * 4096), dtype=torch.float32)  # header only: its claim, not its bytes
        meta = ChunkMeta(h.meta.key, h.meta.parent, True, 4, False, h.meta.digest)
        store.values[value_name(NS, specs[0].key)] = encode_header(meta, huge, [0, 0]) + raw[h.data_offset :]
        used = b.stats().bytes_used["dram"]
        with b.acquire(specs) as lease:
            assert lease.num_chunks == 0
            b.load([s.key for s in specs])
        st = b.stats()
        assert st.remote_io["forged"] == 1 and st.evictions["dram"] == 0 and st.bytes_used["dram"] == used
        assert all(b.get_payload(s.key) is not None for s in others)


# ---------------------------------------------------------------------------------------------- start-up rules
def test_a_remote_tier_without_a_secret_refuses_to_start(tmp_path, monkeypatch):
    monkeypatch.delenv("PCR_RAG_REMOTE_SECRET", raising=False)
    with pytest.raises(ConfigError, match="PCR_RAG_REMOTE_SECRET"):
        EngineConfig(cache_dir=tmp_path, remote_url="redis://store:6379/0")
    with pytest.raises(ConfigError, match="at least 16"):
        EngineConfig(cache_dir=tmp_path, remote_url="redis://store:6379/0", remote_secret="short")
    with pytest.raises(ConfigError, match="ssd_encrypt needs a secret"):
        EngineConfig(cache_dir=tmp_path, ssd_encrypt=True)
    with pytest.raises(ConfigError, match="encryption needs a secret"):
        EngineConfig(cache_dir=tmp_path, remote_url="redis://s:1/0", remote_insecure=True, remote_encrypt=True)
    with pytest.raises(ValueError, match="remote_insecure"):
        RemoteConfig("memory://x")
    monkeypatch.setenv("PCR_RAG_REMOTE_SECRET", SECRET)
    cfg = EngineConfig(cache_dir=tmp_path, remote_url="redis://store:6379/0")
    assert cfg.remote_config.secret == SECRET and SECRET not in repr(cfg) and SECRET not in repr(cfg.remote_config)


def test_insecure_mode_logs_one_warning(store_name, caplog):
    with caplog.at_level(logging.WARNING, logger="pcr_rag.cache.tiers.remote"), \
            engine(store_name, secret=None, insecure=True):
        pass
    assert sum("without a secret" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pcr_rag.cache.tiers.remote"), engine(store_name):
        pass
    assert not caplog.records


# ---------------------------------------------------------------------------------------------- encryption
def _plaintext_pieces(payload: torch.Tensor) -> list[bytes]:
    data = bytes(byte_view(payload.contiguous()))
    return [data[i : i + 32] for i in range(0, len(data), 64)]


def test_encrypted_values_round_trip_hold_no_plaintext_and_reject_tampering(store_name, chunks, make_payload):
    specs = chunks.path([[1] * 4, [2] * 4])
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name, encrypt=True) as a, engine(store_name, encrypt=True) as b:
        fill(a, specs, make_payload)
        for s in specs:
            raw = store.values[value_name(NS, s.key)]
            assert decode_header(raw).encrypted
            assert not any(piece in raw for piece in _plaintext_pieces(make_payload(s)))
        assert b.acquire(specs).num_chunks == 2 and b.load([s.key for s in specs]) == 2
        assert all(torch.equal(b.get_payload(s.key), make_payload(s)) for s in specs)
    with engine(store_name, encrypt=True) as c:
        name = value_name(NS, specs[1].key)
        raw = bytearray(store.values[name])
        raw[-1] ^= 0x01  # one ciphertext bit of the last layer
        store.values[name] = bytes(raw)
        assert c.acquire(specs).num_chunks == 2  # the header is intact
        with c.open_layer_reader(specs[1].key) as reader:
            assert torch.equal(reader.read_layer(0), make_payload(specs[1])[0])
            with pytest.raises(CorruptChunkError, match="recompute"):
                reader.read_layer(1)
        assert c.stats().remote_io["forged"] == 1 and name not in store.values


def test_a_replica_without_encryption_reads_encrypted_values_with_the_same_secret(store_name, chunks, make_payload):
    specs = chunks.path([[1] * 4])
    with engine(store_name, encrypt=True) as a, engine(store_name) as b:
        fill(a, specs, make_payload)
        assert b.acquire(specs).num_chunks == 1 and b.load([specs[0].key]) == 1
        assert torch.equal(b.get_payload(specs[0].key), make_payload(specs[0]))


def ssd_engine(backend: MemoryBackend, secret: str | None = SECRET) -> CacheManager:
    cfg = CacheConfig(chunk_size=4, dram_bytes=1 << 20, ssd_bytes=1 << 20, sync_io=True, ssd_secret=secret)
    return CacheManager(cfg, clock=ManualClock(), storage=backend)


def test_encrypted_ssd_files_hold_no_plaintext_and_a_tampered_file_is_recomputed(chunks, make_payload):
    specs = chunks.path([[1] * 4, [2] * 4])
    backend = MemoryBackend()
    with ssd_engine(backend) as eng:
        fill(eng, specs, make_payload)
        eng.flush()
        for s in specs:
            raw = backend.open(chunk_name(s.key)).read_at(0, 1 << 20)
            assert decode_header(raw).encrypted
            assert not any(piece in raw for piece in _plaintext_pieces(make_payload(s)))
        eng.evict(Tier.DRAM, 1 << 20)
        assert torch.equal(eng.read_layer(specs[1].key, 1), make_payload(specs[1])[1])  # one layer, decrypted
        assert eng.load([s.key for s in specs]) == 2
        assert all(torch.equal(eng.get_payload(s.key), make_payload(s)) for s in specs)
    with ssd_engine(backend) as again:  # restart: the sealed headers verify, the chunks are found
        assert again.acquire(specs).num_chunks == 2
        raw = bytearray(backend.open(chunk_name(specs[1].key)).read_at(0, 1 << 20))
        h = decode_header(bytes(raw))
        raw[h.data_offset + 3] ^= 0x10
        backend.write_atomic(chunk_name(specs[1].key), [bytes(raw)])
        assert again.load([specs[1].key]) == 0 and specs[1].key not in again  # rejected, dropped
        assert again.stats().corrupt_chunks_dropped == 1
        assert again.insert(specs[1], make_payload(specs[1]))  # recomputed
        again.flush()
        again.evict(Tier.DRAM, 1 << 20)
        assert again.load([specs[1].key]) == 1 and torch.equal(again.get_payload(specs[1].key),
                                                                make_payload(specs[1]))


def test_ssd_files_written_without_the_secret_are_dropped_at_start_up(chunks, make_payload):
    specs = chunks.path([[1] * 4])
    backend = MemoryBackend()
    with ssd_engine(backend, secret=None) as plain:
        fill(plain, specs, make_payload)
        plain.flush()
    with ssd_engine(backend) as sealed:  # an unsealed file could be anyone's: forged
        assert specs[0].key not in sealed and sealed.stats().corrupt_chunks_dropped == 1
    with pytest.raises(ForgedChunkError):
        from pcr_rag.cache.tiers.chunk_file import verify_seal

        verify_seal(decode_header(encode_header(ChunkMeta.of(record(specs[0], make_payload(specs[0]))),
                                                make_payload(specs[0]), [0, 0])), _sealer(), b"")


def _sealer():
    from pcr_rag.cache.seal import Sealer

    return Sealer(SECRET, "ssd", encrypt=True)


def test_layout_of_the_tests_matches_their_payloads(chunks, make_payload):
    spec = chunks.child(None, [1] * 4)
    assert LAYOUT.nbytes(4) == make_payload(spec).nbytes and LAYOUT.shape(4) == tuple(make_payload(spec).shape)
    assert KVLayout(30, 3, 64, torch.bfloat16).nbytes(256) == 5_898_240  # SmolLM2-135M's 256-token chunk


def test_an_engine_with_ssd_encrypt_writes_sealed_files_and_reuses_them_exactly(tiny, tmp_path):
    with replica(tiny, tmp_path, "off", None, enable_cache=False) as off:
        ref = answer(off)
    kw = {"ssd_capacity": "64MiB", "ssd_encrypt": True, "remote_secret": SECRET,
          "load_planner": "always-load"}  # the SSD path itself: on a tiny model recomputing beats reading, which the planner would choose
    with replica(tiny, tmp_path, "ssd", None, **kw) as first:
        assert same(answer(first), ref)
        first.flush(timeout=30)
    files = list((tmp_path / "ssd").rglob("*.kv"))
    assert files and all(decode_header(p.read_bytes()).encrypted for p in files)
    with replica(tiny, tmp_path, "ssd", None, **kw) as again:  # restarted: the chunks come from the SSD
        got = answer(again)
        assert got.metrics.reused_by_tier["ssd"] > 0 and same(got, ref)
