"""Concurrency: many threads matching / inserting / loading / evicting at once on the asynchronous engine.
No deadlock (every join has a timeout, so a deadlock fails instead of hanging), no budget overrun, no torn or
wrong payload, and every invariant holds once the threads are done."""

from __future__ import annotations

import faulthandler
import random
import sys
import threading

import pytest
import torch

from pcr_rag.cache import (
    CacheConfig,
    CacheManager,
    LocalDirBackend,
    MemoryBackend,
    SlowBackend,
    Tier,
    namespace_key,
    plan_chunks,
)
from pcr_rag.cache.tiers.chunk_file import chunk_file_bytes

ROOT = namespace_key("conc", "float32", 4)
CHUNK_BYTES = 2 * 2 * 1 * 4 * 4 * 4  # 2 layers x kv x 1 head x 4 tokens x 4 dims x float32


def expected(spec) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(spec.key[:4], "little"))
    return torch.randn(2, 2, 1, spec.num_tokens, 4, generator=gen)


def join_all(threads: list[threading.Thread], timeout: float) -> None:
    for t in threads:
        t.join(timeout)
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        pytest.fail(f"threads still running after {timeout} s (deadlock?): {alive}")


def run_workload(eng: CacheManager, *, threads: int, iterations: int, seed: int) -> list[BaseException]:
    docs = [[d * 100 + i for i in range(10)] for d in range(8)]  # 3 chunks each (4 + 4 + 2 partial)
    errors: list[BaseException] = []
    capacity = eng.stats().capacity_bytes
    stop = threading.Event()

    def worker(wid: int) -> None:
        rng = random.Random(seed * 1000 + wid)
        try:
            for _ in range(iterations):
                picked = rng.sample(docs, 2)
                plan = plan_chunks(ROOT, [[1, 2, 3], *picked, [rng.randrange(3)]], 4)
                lease = eng.acquire(plan)
                try:
                    for spec in plan[: lease.num_chunks]:  # pinned: readable from some tier, byte-exact
                        layer = eng.read_layer(spec.key, 1)
                        assert torch.equal(layer, expected(spec)[1]), "wrong payload served"
                    for spec in plan[lease.num_chunks :]:
                        if not eng.insert(spec, expected(spec), tokens=None):
                            break
                    op = rng.random()
                    keys = [s.key for s in plan]
                    if op < 0.2:
                        eng.load_async(keys).result(timeout=20)
                    elif op < 0.35:
                        eng.load(keys)
                    elif op < 0.45:
                        eng.evict(rng.choice([Tier.DRAM, Tier.SSD]), rng.randrange(1, 4 * CHUNK_BYTES))
                    elif op < 0.6:
                        eng.set_lookahead(keys)
                    else:
                        eng.match(keys)
                finally:
                    lease.release()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def monitor() -> None:
        while not stop.is_set():
            st = eng.stats()
            for tier in ("dram", "ssd"):
                if st.bytes_used[tier] > capacity[tier]:
                    errors.append(AssertionError(f"{tier} over budget: {st.bytes_used[tier]} > {capacity[tier]}"))
            stop.wait(0.002)

    workers = [threading.Thread(target=worker, args=(i,), name=f"worker-{i}") for i in range(threads)]
    mon = threading.Thread(target=monitor, name="monitor")
    mon.start()
    for t in workers:
        t.start()
    join_all(workers, timeout=45)
    stop.set()
    join_all([mon], timeout=5)
    return errors


def check_final(eng: CacheManager) -> None:
    eng.flush(timeout=20)
    eng.check_invariants()
    st = eng.stats()
    for tier in ("dram", "ssd"):
        assert st.bytes_high_water[tier] <= st.capacity_bytes[tier]
    assert st.writeback_queue_depth == 0 and st.pinned_chunks == 0
    assert st.lookups > 0 and sum(st.hit_chunks.values()) > 0


@pytest.mark.timeout(90)
def test_many_threads_memory_store_with_slow_disk():
    storage = SlowBackend(MemoryBackend(), latency_s=0.0005)
    cfg = CacheConfig(
        chunk_size=4,
        dram_bytes=10 * CHUNK_BYTES,
        ssd_bytes=25 * chunk_file_bytes(CHUNK_BYTES, 5, 2),
        writeback_wait_s=5.0,
    )
    eng = CacheManager(cfg, storage=storage)
    errors = run_workload(eng, threads=8, iterations=60, seed=1)
    assert not errors, errors[:3]
    check_final(eng)
    st = eng.stats()
    assert st.evictions["dram"] > 0 and st.writes_done > 0 and st.loads > 0
    eng.close()


@pytest.mark.timeout(90)
def test_many_threads_on_a_real_directory(tmp_path):
    cfg = CacheConfig(
        chunk_size=4,
        dram_bytes=8 * CHUNK_BYTES,
        ssd_bytes=20 * chunk_file_bytes(CHUNK_BYTES, 5, 2),
        cache_dir=tmp_path,
        fsync=False,
        policy="lru",
    )
    eng = CacheManager(cfg, storage=LocalDirBackend(tmp_path, fsync=False))
    errors = run_workload(eng, threads=6, iterations=40, seed=2)
    assert not errors, errors[:3]
    check_final(eng)
    eng.close()
    # what is on disk is consistent: a restarted engine recovers it without corrupt files
    eng = CacheManager(cfg)
    assert eng.stats().corrupt_chunks_dropped == 0
    eng.check_invariants()
    eng.close()


@pytest.mark.timeout(60)
def test_racing_inserts_of_the_same_chain_store_it_once():
    cfg = CacheConfig(chunk_size=4, dram_bytes=100 * CHUNK_BYTES, ssd_bytes=1 << 20)
    eng = CacheManager(cfg, storage=MemoryBackend())
    plan = plan_chunks(ROOT, [list(range(40))], 4)
    barrier = threading.Barrier(6)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait(timeout=10)
            for spec in plan:
                assert eng.insert(spec, expected(spec))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    join_all(threads, timeout=30)
    assert not errors, errors[:3]
    eng.flush(timeout=10)
    st = eng.stats()
    assert st.inserts == len(plan) and st.chunks["dram"] == len(plan) and st.writes_done == len(plan)
    assert st.bytes_used["dram"] == len(plan) * CHUNK_BYTES
    eng.check_invariants()
    eng.close()


@pytest.mark.timeout(60)
def test_concurrent_loads_of_one_chunk_do_not_race():
    cfg = CacheConfig(chunk_size=4, dram_bytes=2 * CHUNK_BYTES, ssd_bytes=1 << 20)
    eng = CacheManager(cfg, storage=SlowBackend(MemoryBackend(), latency_s=0.01))
    plan = plan_chunks(ROOT, [list(range(16))], 4)
    for spec in plan:
        assert eng.insert(spec, expected(spec))
    eng.flush(timeout=10)
    assert eng.tiers_of(plan[0].key) == {Tier.SSD}
    futures = [eng.load_async([plan[0].key]) for _ in range(5)]
    results = [f.result(timeout=20) for f in futures]
    loaded_sync = eng.load([plan[0].key])
    assert sum(results) + loaded_sync == 1  # exactly one read from SSD
    assert torch.equal(eng.get_payload(plan[0].key), expected(plan[0]))
    eng.check_invariants()
    eng.close()
