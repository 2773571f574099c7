"""A small DRAM tier must not switch caching off: a chunk that gets no memory room (DRAM full of chunks that
running requests pin) is written through to SSD instead of being rejected, and budgets still hold."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from pcr_rag.cache import (
    CacheConfig,
    CacheManager,
    FaultyBackend,
    ManualClock,
    MemoryBackend,
    SlowBackend,
    Tier,
    namespace_key,
    plan_chunks,
)
from pcr_rag.cache.tiers.chunk_file import chunk_file_bytes

ROOT = namespace_key("write-through", "float32", 4)
CHUNK_BYTES = 2 * 2 * 1 * 4 * 4 * 4  # payload_for(spec) of a full 4-token chunk
FILE_BYTES = chunk_file_bytes(CHUNK_BYTES, 5, 2)


def engine(dram_chunks: int, ssd_chunks: int = 1000, storage=None, **kw) -> CacheManager:
    cfg = CacheConfig(
        chunk_size=4,
        dram_bytes=dram_chunks * CHUNK_BYTES,
        ssd_bytes=ssd_chunks * FILE_BYTES,
        sync_io=kw.pop("sync_io", True),
        **kw,
    )
    return CacheManager(cfg, clock=ManualClock(), storage=storage if storage is not None else MemoryBackend())


@pytest.mark.parametrize("sync_io", [True, False])
def test_chunks_that_get_no_dram_room_land_on_ssd(chunks, make_payload, sync_io):
    eng = engine(dram_chunks=1, sync_io=sync_io)
    head, *rest = chunks.path([[i] * 4 for i in range(6)])
    assert eng.insert(head, make_payload(head))
    eng.flush(timeout=10)
    with eng.acquire([head]):  # a running request pins its matched prefix: the only DRAM slot
        for spec in rest:
            assert eng.insert(spec, make_payload(spec))
            assert eng.tiers_of(spec.key) == {Tier.SSD}
    st = eng.stats()
    assert st.write_through == len(rest) and st.inserts == 1 + len(rest) and st.inserts_rejected == 0
    assert (
        st.bytes_high_water["dram"] <= CHUNK_BYTES and st.bytes_high_water["ssd"] <= st.capacity_bytes["ssd"]
    )
    assert eng.match([s.key for s in [head, *rest]]).num_chunks == 6  # the chain is whole
    for spec in rest:  # byte-exact from SSD, verified
        with eng.open_layer_reader(spec.key) as reader:
            assert reader.tier is Tier.SSD
            for layer in range(2):
                assert torch.equal(reader.read_layer(layer), make_payload(spec)[layer])
    eng.check_invariants()
    eng.close()


def test_repeats_under_a_one_chunk_dram_reuse_what_a_large_dram_reuses():
    """Six requests on fresh documents, then the same six again, each run like the runtime runs it: acquire the
    plan's prefix (held while the request runs), load it into DRAM (the prefetcher's job), insert the rest,
    release. The system prompt's chunk is shared, so with a one-chunk DRAM every request pins the only DRAM
    slot while it inserts its new chunks."""

    def expected(spec) -> torch.Tensor:
        gen = torch.Generator().manual_seed(int.from_bytes(spec.key[:4], "little"))
        return torch.randn(2, 2, 1, spec.num_tokens, 4, generator=gen)

    def run(dram_chunks: int) -> tuple[int, CacheManager]:
        eng = engine(dram_chunks=dram_chunks)
        system = [1, 2, 3, 4]
        docs = [[100 * d + i for i in range(26)] for d in range(6)]  # 7 chunks each, the last one partial
        reused_on_repeat = 0
        for round_ in range(2):
            for d, doc in enumerate(docs):
                plan = plan_chunks(ROOT, [system, doc, [9, d]], 4)
                with eng.acquire(
                    plan, max_chunks=len(plan) - 1
                ) as lease:  # the last chunk is always computed
                    eng.load(list(lease.keys))
                    for spec in plan[: lease.num_chunks]:
                        assert torch.equal(eng.read_layer(spec.key, 1), expected(spec)[1])  # exact reuse
                    for spec in plan[lease.num_chunks :]:
                        assert eng.insert(spec, expected(spec))
                    if round_ == 1:
                        reused_on_repeat += lease.num_tokens
        eng.check_invariants()
        return reused_on_repeat, eng

    large, large_eng = run(dram_chunks=1000)
    small, small_eng = run(dram_chunks=1)
    assert large > 0 and small >= 0.9 * large, (small, large)
    st = small_eng.stats()
    assert st.inserts_rejected == 0 and st.write_through > 0
    assert st.bytes_high_water["dram"] <= CHUNK_BYTES
    assert large_eng.stats().write_through == 0  # a large DRAM never needs it
    small_eng.close()
    large_eng.close()


def test_without_ssd_room_the_insert_is_rejected_and_nothing_exceeds_its_budget(chunks, make_payload):
    eng = engine(dram_chunks=1, ssd_chunks=2)
    specs = chunks.path([[i] * 4 for i in range(5)])
    assert eng.insert(specs[0], make_payload(specs[0]))
    with eng.acquire(specs[:1]):
        results = [eng.insert(s, make_payload(s)) for s in specs[1:]]
    # SSD holds two files: specs[0]'s write-back and specs[1] written through; specs[2] has no room (its parent
    # and the pinned head are not evictable leaves), so the chain stops there
    assert results[0] and not results[1]
    st = eng.stats()
    assert st.inserts_rejected >= 1 and st.bytes_high_water["ssd"] <= 2 * FILE_BYTES
    assert st.bytes_high_water["dram"] <= CHUNK_BYTES
    eng.check_invariants()
    eng.close()


def test_a_failed_write_through_is_a_counted_rejection_that_leaves_nothing(chunks, make_payload):
    storage = FaultyBackend(MemoryBackend())
    eng = engine(dram_chunks=1, storage=storage)
    head, tail = chunks.path([[1] * 4, [2] * 4])
    assert eng.insert(head, make_payload(head))
    storage.write_errno = errno.EIO
    with eng.acquire([head]):
        assert not eng.insert(tail, make_payload(tail))
    st = eng.stats()
    assert (
        tail.key not in eng and st.writes_failed == 1 and st.inserts_rejected == 1 and st.write_through == 0
    )
    assert st.bytes_used["ssd"] == FILE_BYTES  # only head's write-back
    storage.write_errno = None
    with eng.acquire([head]):
        assert eng.insert(tail, make_payload(tail))  # the disk works again
    assert eng.tiers_of(tail.key) == {Tier.SSD}
    eng.check_invariants()
    eng.close()


@pytest.mark.timeout(60)
def test_racing_write_throughs_of_one_chain_store_each_chunk_once(make_payload, chunks):
    storage = SlowBackend(MemoryBackend(), latency_s=0.002)
    eng = engine(dram_chunks=1, storage=storage, sync_io=False)
    head, *rest = chunks.path([[i] * 4 for i in range(8)])
    assert eng.insert(head, make_payload(head))
    eng.flush(timeout=10)
    lease = eng.acquire([head])
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait(timeout=10)
            for spec in rest:
                eng.insert(
                    spec, make_payload(spec)
                )  # a racing thread may find the parent still being written
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    lease.release()
    eng.flush(timeout=10)
    st = eng.stats()
    assert st.inserts == len(eng) and st.write_through == len(eng) - 1  # every stored chunk stored once
    assert st.chunks["ssd"] == len(eng) and st.bytes_high_water["dram"] <= CHUNK_BYTES
    eng.check_invariants()
    eng.close()
