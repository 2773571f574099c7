"""The remote tier on its own and inside the cache engine, over the in-process store (``memory://``): shared
reuse between engines, verification, misses, namespaces, the circuit breaker, load-or-recompute and the bounded
write queue. Deterministic: ``sync_io`` engines and a ``ManualClock`` (the real-server tests are in
tests/remote/)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from pcr_rag.cache import CacheConfig, CacheManager, CorruptChunkError, ManualClock, Tier, VirtualPayload
from pcr_rag.cache.config import KVLayout, RemoteConfig
from pcr_rag.cache.errors import RemoteMissError, RemoteUnavailableError
from pcr_rag.cache.tiers.breaker import BreakerState, CircuitBreaker
from pcr_rag.cache.tiers.remote import open_remote_tier
from pcr_rag.cache.tiers.remote_store import MemoryRemoteStore
from pcr_rag.cache.tiers.remote_value import PROBE_BYTES, Expected, value_name

from .conftest import Chunks

SECRET = "unit-test-remote-secret"  # the replicas' shared secret in these tests
LAYOUT = KVLayout(2, 1, 4, torch.float32)  # the layout of conftest's payload_for


def remote_config(url: str, **kw) -> RemoteConfig:
    """A remote tier config with the tests' secret and KV layout."""
    kw.setdefault("secret", SECRET)
    kw.setdefault("kv_layout", LAYOUT)
    return RemoteConfig(url, **kw)



def engine(store_name: str, clock: ManualClock | None = None, namespace: str = "pcr-rag", **remote) -> CacheManager:
    remote.setdefault("breaker_backoff_s", 5.0)
    cfg = CacheConfig(chunk_size=4, dram_bytes=1 << 20, sync_io=True,
                      remote=remote_config(f"memory://{store_name}", namespace=namespace, **remote))
    return CacheManager(cfg, clock=clock or ManualClock())


def fill(eng: CacheManager, specs, make_payload) -> None:
    for s in specs:
        assert eng.insert(s, make_payload(s))


def test_a_second_engine_reuses_what_the_first_wrote(store_name, chunks, make_payload):
    specs = chunks.path([[1] * 4, [2] * 4, [3] * 4])
    with engine(store_name) as a, engine(store_name) as b:
        fill(a, specs, make_payload)
        assert a.stats().remote_io["writes"] == 3 and a.tiers_of(specs[2].key) == {Tier.DRAM, Tier.REMOTE}
        with b.acquire(specs) as lease:  # B has nothing locally: one lookup finds all three
            assert lease.tiers == (Tier.REMOTE,) * 3
        assert b.load([s.key for s in specs]) == 3
        for s in specs:
            assert torch.equal(b.get_payload(s.key), make_payload(s))
        st = b.stats()
        assert st.remote_io["lookups"] == 1 and st.remote_io["lookup_found"] == 3 and st.remote_io["hits"] == 3
        assert st.hit_chunks["remote"] == 3 and st.remote_io["bytes_read"] > 3 * make_payload(specs[0]).nbytes
        b.check_invariants()


def test_a_bad_value_is_dropped_deleted_and_recomputed(store_name, chunks, make_payload):
    specs = chunks.path([[1] * 4, [2] * 4])
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name) as a, engine(store_name) as b:
        fill(a, specs, make_payload)
        name = value_name("pcr-rag", specs[1].key)
        raw = bytearray(store.values[name])
        raw[-1] ^= 0xFF  # last payload byte: the last layer
        store.values[name] = bytes(raw)
        assert b.acquire(specs).num_chunks == 2  # the header is intact: the lookup matches it
        with pytest.raises(CorruptChunkError, match="recompute"), b.open_layer_reader(specs[1].key) as r:
            r.read_layer(0)  # layer 0 verifies
            r.read_layer(1)
        assert name not in store.values and specs[1].key not in b  # deleted for every replica, dropped here
        assert b.stats().remote_io["forged"] == 1 and b.stats().corrupt_chunks_dropped == 1  # its MAC fails
        assert b.insert(specs[1], make_payload(specs[1]))  # recomputed and written again
        assert name in store.values


def test_an_evicted_value_is_a_miss(store_name, chunks, make_payload):
    specs = chunks.path([[1] * 4, [2] * 4])
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name) as a, engine(store_name) as b:
        fill(a, specs, make_payload)
        b.acquire(specs).release()
        store.delete(value_name("pcr-rag", specs[0].key))  # the store evicted it after the lookup
        assert b.load([specs[0].key]) == 0 and specs[0].key not in b and specs[1].key not in b
        st = b.stats()
        assert st.load_failures == 1 and st.remote_io["misses"] == 1 and st.corrupt_chunks_dropped == 0
        b.check_invariants()


def test_other_namespaces_and_models_are_never_matched(store_name, make_payload):
    mine, other_model = Chunks(), Chunks(root=b"\x01" * 16)
    specs = mine.path([[1] * 4, [2] * 4])
    with engine(store_name) as a, engine(store_name, namespace="tenant-b") as b, engine(store_name) as c:
        fill(a, specs, make_payload)
        assert b.acquire(specs).num_chunks == 0  # same chunks, another namespace
        assert c.acquire(other_model.path([[1] * 4, [2] * 4])).num_chunks == 0  # same tokens, another model
        assert c.acquire(specs).num_chunks == 2


def test_a_value_under_the_wrong_key_fails_verification(store_name, chunks, make_payload):
    a_spec, b_spec = chunks.child(None, [1] * 4), chunks.child(None, [2] * 4)
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name) as a, engine(store_name) as b:
        fill(a, [a_spec], make_payload)
        store.values[value_name("pcr-rag", b_spec.key)] = store.values[value_name("pcr-rag", a_spec.key)]
        assert b.acquire([b_spec]).num_chunks == 0  # its header names another key: deleted, not matched
        assert value_name("pcr-rag", b_spec.key) not in store.values and b.stats().remote_io["forged"] == 1


def test_the_breaker_skips_a_failing_store_and_tries_again_after_the_backoff(store_name, chunks, make_payload):
    specs = chunks.path([[1] * 4, [2] * 4])
    store = MemoryRemoteStore.named(store_name)
    clock = ManualClock()
    with engine(store_name) as a, engine(store_name, clock, breaker_errors=2, breaker_backoff_s=5.0) as b:
        fill(a, specs, make_payload)
        store.down = True
        for _ in range(4):
            assert b.acquire(specs).num_chunks == 0  # every failure is a miss
        io = b.stats().remote_io
        assert io["errors"] == 2 and io["breaker_open"] == 1 and io["breaker_trips"] == 1
        assert io["lookups"] == 0  # after two errors the store is not called at all
        assert b.insert(specs[0], make_payload(specs[0]))  # local inserts go on; the remote write is dropped
        assert b.stats().remote_io["writes_dropped"] == 1
        store.down = False
        assert b.acquire(specs[1:2]).num_chunks == 0  # still backing off (and the chain needs specs[0])
        clock.advance(5.0)
        assert b.acquire(specs).num_chunks == 2  # one trial lookup succeeds: used again
        assert b.stats().remote_io["breaker_open"] == 0


def test_load_or_recompute_follows_the_measured_speeds(store_name, chunks, make_payload):
    specs = chunks.path([[1] * 4, [2] * 4, [3] * 4])
    with engine(store_name) as a, engine(store_name) as b:
        fill(a, specs, make_payload)
        assert b.acquire(specs).num_chunks == 3  # nothing measured yet: load
        client = b._remote.client  # noqa: SLF001 - set the measured speeds directly
        client.rtt_s, client.read_bytes_per_s = 1e-3, 1e6  # ~1.1 ms to load the first chunk, +0.1 ms per chunk
        b.record_compute(4, 4 * 1e-6)  # recomputing a chunk costs 4 us: never load
        assert b.reuse_limit([s.key for s in specs]) == 0 and b.acquire(specs).num_chunks == 0
        assert b.stats().remote_io["recompute_chosen"] == 3
        b.planner.compute.observe(1e-3)  # 4 ms per chunk: loading all three wins
        assert b.acquire(specs).num_chunks == 3
        b.planner.compute.observe(2e-4)  # 0.8 ms/chunk: the round trip pays off only over several chunks
        assert b.reuse_limit([s.key for s in specs]) == 3  # 2.4 ms saved for 1.3 ms of loading
        assert b.reuse_limit([s.key for s in specs[:1]]) == 0  # 0.8 ms saved for 1.1 ms: recompute


def test_remote_writes_never_block_a_request(store_name, chunks, make_payload):
    class SlowStore(MemoryRemoteStore):
        def __init__(self) -> None:
            super().__init__("slow")
            self.release = threading.Event()

        def set_nx(self, name, value, ttl_s):
            self.release.wait(10)
            return super().set_nx(name, value, ttl_s)

    slow = SlowStore()
    cfg = CacheConfig(chunk_size=4, dram_bytes=1 << 20,
                      remote=remote_config(f"memory://{store_name}", write_queue=2))
    eng = CacheManager(cfg)
    eng._remote.client.store = slow  # noqa: SLF001 - a store whose writes hang until released
    specs = chunks.path([[i] * 4 for i in range(6)])
    for s in specs:
        assert eng.insert(s, make_payload(s))  # returns while the writer is stuck
    assert eng.stats().remote_io["writes_dropped"] >= 3
    slow.release.set()
    eng.flush(timeout=10)
    io = eng.stats().remote_io
    assert io["writes"] + io["writes_dropped"] == 6 and io["write_queue_depth"] == 0
    eng.close()
    eng.check_invariants()


def test_circuit_breaker_states():
    clock = ManualClock()
    br = CircuitBreaker(2, 3.0, clock)
    assert br.allow() and br.state is BreakerState.CLOSED
    br.failure()
    assert br.allow()  # one error: still closed
    br.failure()
    assert br.state is BreakerState.OPEN and not br.allow() and not br.available()
    clock.advance(3.0)
    assert br.available() and br.allow()  # the trial
    assert not br.allow()  # only one trial at a time
    br.failure()
    assert br.state is BreakerState.OPEN and br.trips == 2
    clock.advance(3.0)
    assert br.allow()
    br.success()
    assert br.state is BreakerState.CLOSED and br.allow()
    br.trip()
    assert br.state is BreakerState.OPEN and br.trips == 3


def test_values_carry_their_own_header_and_long_headers_are_read_in_full(chunks):
    spec = chunks.child(None, [1] * 4)
    payload = torch.randn(200, 2, 1, 4, 4)  # 200 layers: the header is longer than one probe
    from pcr_rag.cache.tiers.base import ChunkRecord

    rec = ChunkRecord(spec.key, spec.parent, True, 4, False, None, payload.nbytes, 200)
    tier = open_remote_tier(remote_config(f"memory://long-{uuid.uuid4().hex[:6]}",
                                          kv_layout=KVLayout(200, 1, 4, torch.float32)))
    tier.store(rec, payload)
    found = tier.probe([Expected(spec.key, spec.parent, None)])[0]
    assert found is not None and found.record.num_layers == 200 and found.value_bytes == tier.charge(rec)
    assert torch.equal(tier.read(rec), payload)
    with pytest.raises(CorruptChunkError):
        tier.codec.probe(tier.codec.encode(rec, payload, spec.parent)[:PROBE_BYTES],
                         Expected(spec.key, spec.parent, None))  # truncated header
    virtual = rec._replace(virtual=True, nbytes=LAYOUT.nbytes(4) * 100)  # 200 layers of LAYOUT's tokens
    assert tier.codec.probe(tier.codec.encode(virtual, None, spec.parent),
                            Expected(spec.key, spec.parent, None)).record.virtual
    assert tier.read(virtual) == VirtualPayload(virtual.nbytes, 200)


def test_remote_failures_are_os_errors_the_engine_treats_as_misses(chunks):
    tier = open_remote_tier(remote_config(f"memory://down-{uuid.uuid4().hex[:6]}"))
    tier.client.store.down = True
    spec = chunks.child(None, [1] * 4)
    from pcr_rag.cache.tiers.base import ChunkRecord

    rec = ChunkRecord(spec.key, spec.parent, True, 4, False, None, 128, 2)
    with pytest.raises(RemoteUnavailableError):
        tier.read(rec)
    tier.client.store.down = False
    with pytest.raises(RemoteMissError):
        tier.read(rec)
    assert isinstance(RemoteMissError("x"), OSError)


def test_chunks_loaded_from_the_store_are_kept_on_the_local_ssd(store_name, chunks, make_payload):
    from pcr_rag.cache import MemoryBackend

    specs = chunks.path([[1] * 4, [2] * 4])
    cfg = CacheConfig(chunk_size=4, dram_bytes=1 << 20, ssd_bytes=1 << 20, sync_io=True,
                      remote=remote_config(f"memory://{store_name}"))
    with engine(store_name) as a, CacheManager(cfg, clock=ManualClock(), storage=MemoryBackend()) as b:
        fill(a, specs, make_payload)
        b.acquire(specs).release()
        assert b.load([s.key for s in specs]) == 2
        assert all(b.tiers_of(s.key) == {Tier.DRAM, Tier.SSD, Tier.REMOTE} for s in specs)
        b.evict(Tier.DRAM, 1 << 20)
        assert torch.equal(b.read_layer(specs[1].key, 1), make_payload(specs[1])[1])  # from the local SSD now
        assert b.stats().remote_io["hits"] == 2
        b.check_invariants()


def test_compute_speed_is_the_per_token_slope_not_the_fixed_step_cost(store_name):
    with engine(store_name) as eng:
        eng.record_compute(256, 0.3 + 256 * 0.002)
        assert eng.planner.compute.s_per_token == pytest.approx((0.3 + 0.512) / 256)  # one size: the mean
        for tokens in (1, 1, 30, 256, 1, 12):  # full hits compute one token: mostly the fixed 0.3 s
            eng.record_compute(tokens, 0.3 + tokens * 0.002)
        assert eng.planner.compute.s_per_token == pytest.approx(0.002)
