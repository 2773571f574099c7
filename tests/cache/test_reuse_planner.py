"""The load-or-recompute planner (`pcr_rag.cache.reuse_planner`): its cost model on injected speeds, its estimates,
and the cache engine's use of it (cut, counters, stats, cold-start probe, log line) on a virtual clock."""

from __future__ import annotations

import logging

import pytest

from pcr_rag.cache import CacheConfig, CacheManager, ManualClock, MemoryBackend, SlowBackend, Tier
from pcr_rag.cache.reuse_planner import REPROBE_S, ComputeSpeed, ReadSpeed, ReusePlanner, Segment

MB = 1_000_000
LAYERS = 30
CHUNK_BYTES = 4_718_592  # a 256-token SmolLM2-135M chunk: 30 layers x 2 x 3 heads x 256 x 64 x 2 bytes (bf16)


def ssd_chunks(n: int, tier: Tier = Tier.SSD, **kw) -> list[Segment]:
    return [Segment(bytes([i]), tier, 256, CHUNK_BYTES, LAYERS, **kw) for i in range(n)]


def planner(s_per_token: float = 0.5e-3, step_tokens: int | None = 256, **kw) -> ReusePlanner:
    p = ReusePlanner(**kw)
    p.configure(step_tokens=step_tokens, layerwise=True)
    p.compute.observe(s_per_token)
    return p


def test_a_disk_slower_than_compute_is_recomputed_and_a_fast_one_loaded():
    # 256 tokens compute in 102 ms; at 20 MB/s a chunk reads in 236 ms (more than the first step it could hide
    # behind), at 200 MB/s in 24 ms
    slow, fast = planner(0.4e-3), planner(0.4e-3)
    slow.observe_read(Tier.SSD, 20 * MB)
    fast.observe_read(Tier.SSD, 200 * MB)
    segs = ssd_chunks(4)
    assert slow.plan(segs, 4 * 256 + 40).reuse == 0
    assert slow.plan(segs, 4 * 256 + 40).skipped == (Tier.SSD,) * 4
    assert fast.plan(segs, 4 * 256 + 40).reuse == 4


def test_ssd_reads_overlap_the_compute_layer_by_layer():
    # reading a chunk takes a little longer than computing it, but the reads run beside the compute of the rest
    # of the prompt (here in one step): loading the front that arrives in time beats computing everything
    p = planner(s_per_token=1e-3, step_tokens=None)  # 256 ms per chunk
    p.observe_read(Tier.SSD, CHUNK_BYTES / 0.6)  # 600 ms per chunk read
    segs = ssd_chunks(4)
    plan = p.plan(segs, 8 * 256)  # 4 more chunks to compute after the cached ones: room to hide the reads
    assert plan.reuse == 2  # 1.2 s of reads behind 1.5 s of compute; a third chunk would arrive last
    assert plan.seconds < p.plan(segs[: plan.reuse], 8 * 256).seconds + 1e-9  # the cut is what it costs
    alone = p.plan(segs, 4 * 256)  # nothing else to compute: the reads cannot hide, recompute
    assert alone.reuse < plan.reuse
    p.configure(step_tokens=256, layerwise=True)  # only the first step overlaps: little to hide behind
    assert p.plan(segs, 8 * 256).reuse == 0
    p.configure(step_tokens=None, layerwise=False)  # the load ends before the compute starts: nothing hides
    assert p.plan(segs, 8 * 256).reuse == 0


def test_memory_chunks_before_a_slow_disk_are_kept():
    p = planner(0.4e-3)
    p.observe_read(Tier.SSD, 20 * MB)
    segs = ssd_chunks(2, Tier.DRAM) + ssd_chunks(2)
    plan = p.plan(segs, 4 * 256 + 10)
    assert plan.reuse == 2 and plan.skipped == (Tier.SSD, Tier.SSD)


def test_dram_to_device_on_a_gpu_host_follows_injected_speeds():
    """DRAM -> device copies overlap the compute on a copy stream (``memory_copies_overlap``): a slow bus (or a
    fast GPU) can make recomputing cheaper; an unmeasured memory tier is loaded."""
    gpu = planner(s_per_token=2e-6, memory_copies_overlap=True)  # 0.5 ms to compute a chunk
    segs = ssd_chunks(3, Tier.DRAM)
    assert gpu.plan(segs, 3 * 256 + 5).reuse == 3  # unmeasured: load
    gpu.observe_read(Tier.DRAM, 50_000 * MB)  # 0.09 ms per chunk over PCIe 5
    assert gpu.plan(segs, 3 * 256 + 5).reuse == 3
    gpu.observe_read(Tier.DRAM, 1_000 * MB)  # a contended 1 GB/s link: 4.7 ms per chunk
    plan = gpu.plan(segs, 3 * 256 + 5)
    assert plan.reuse == 0 and plan.skipped == (Tier.DRAM,) * 3


def test_a_prefetch_in_flight_is_waited_for_before_the_step():
    p = planner(s_per_token=1e-3, step_tokens=None)
    p.observe_read(Tier.SSD, CHUNK_BYTES / 0.5)
    overlapped = p.plan(ssd_chunks(2), 8 * 256)
    waited = p.plan(ssd_chunks(2, in_flight=True), 8 * 256)
    assert overlapped.reuse == 2 and waited.reuse == 0  # a wait does not overlap: 1 s to save 512 ms


def test_a_skip_must_be_clearly_faster_than_loading():
    """Within ``MIN_GAIN`` of loading every chunk, the plan loads: noise must not flip a request."""
    p = planner(s_per_token=1e-3, step_tokens=None)
    p.observe_read(Tier.SSD, CHUNK_BYTES / 0.3)  # waiting 600 ms to save 512 ms: computing is ~4% faster
    assert p.plan(ssd_chunks(2, in_flight=True), 8 * 256).reuse == 2
    p.observe_read(Tier.SSD, CHUNK_BYTES / 0.4)  # 800 ms to save 512 ms: ~12% faster, past the margin
    assert p.plan(ssd_chunks(2, in_flight=True), 8 * 256).reuse == 0


def test_unmeasured_speeds_load_and_always_load_loads():
    p = ReusePlanner()
    segs = ssd_chunks(3)
    assert p.plan(segs).reuse == 3 and p.plan(segs).seconds is None  # no compute speed yet
    p.compute.observe(1e-3)
    assert p.plan(segs).reuse == 3  # the SSD is not measured yet (the engine probes it first)
    p.observe_read(Tier.SSD, 1 * MB)
    assert p.plan(segs).reuse == 0
    p.mode = "always-load"
    assert p.plan(segs).reuse == 3


def test_remote_chunks_are_fetched_in_one_batch_before_the_step():
    estimates: list[int] = []

    def remote_seconds(nbytes: int) -> float:
        estimates.append(nbytes)
        return 1e-3 + nbytes / (100 * MB)

    p = planner(s_per_token=1e-6, remote_seconds=remote_seconds)
    p.observe_read(Tier.SSD, 1e12)
    segs = ssd_chunks(1) + ssd_chunks(2, Tier.REMOTE)
    assert p.plan(segs, 3 * 256).reuse == 1  # 47 ms to fetch, 0.3 ms to compute
    assert estimates == [CHUNK_BYTES, 2 * CHUNK_BYTES]  # one batch: the remote bytes up to each cut together
    assert p.plan(segs, 3 * 256, remote_available=False).reuse == 1
    p.mode = "always-load"
    assert p.plan(segs, 3 * 256).reuse == 3
    assert p.plan(segs, 3 * 256, remote_available=False).reuse == 1  # the breaker is open: no remote load


def test_later_positions_cost_more_to_recompute():
    """A chunk deep in the prompt attends to more positions: the fit recovers the position term, and a chunk
    that is not worth loading at the front is worth it at the back."""
    c = ComputeSpeed()
    for start, n in ((0, 256), (256, 256), (512, 128), (1024, 256), (0, 64), (2048, 32), (300, 1)):
        c.record(n, 0.01 + n * 4e-4 + n * (start + (n - 1) / 2) * 2e-7, start)
    assert c.fixed_s == pytest.approx(0.01) and c.s_per_token == pytest.approx(4e-4)
    assert c.position_s == pytest.approx(2e-7)
    assert c.seconds(2048, 2304) > 2 * c.seconds(0, 256, fixed=False)


def test_read_speed_separates_latency_from_bandwidth():
    r = ReadSpeed()
    assert not r.measured and r.seconds(100) is None
    r.record(1000, 0.01 + 1000 / MB)
    assert r.seconds(1000) == pytest.approx(0.011)  # one size: the plain ratio
    for n in (2000, 500, 8000, 1000):
        r.record(n, 0.01 + n / MB)
    assert r.latency_s == pytest.approx(0.01) and r.bytes_per_s == pytest.approx(MB)
    with pytest.raises(ValueError):
        r.observe(0)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="load_planner"):
        ReusePlanner("sometimes")
    with pytest.raises(ValueError, match="load_planner"):
        CacheConfig(load_planner="sometimes")


# ---------------------------------------------------------------------------------------------------------- engine
def slow_ssd_engine(bandwidth: float, **kw) -> tuple[CacheManager, ManualClock]:
    """An engine whose SSD reads take ``nbytes / bandwidth`` seconds of a virtual clock (no real waiting)."""
    clock = ManualClock()
    storage = SlowBackend(MemoryBackend(), bandwidth_bytes_per_s=bandwidth, sleep=clock.advance)
    kw.setdefault("load_planner", "measured")
    cfg = CacheConfig(chunk_size=4, dram_bytes=1 << 20, ssd_bytes=1 << 20, sync_io=True, **kw)
    return CacheManager(cfg, clock=clock, storage=storage), clock


def on_ssd_only(eng: CacheManager, specs, make_payload) -> None:
    for s in specs:
        assert eng.insert(s, make_payload(s))
    eng.flush()
    eng.evict(Tier.DRAM, 1 << 20)
    assert all(eng.tiers_of(s.key) == {Tier.SSD} for s in specs)


def test_engine_probes_a_cold_ssd_then_recomputes_what_it_reads_too_slowly(chunks, make_payload, caplog):
    specs = chunks.path([[1] * 4, [2] * 4, [3] * 4])
    eng, clock = slow_ssd_engine(bandwidth=1000.0)  # 1 kB/s: a 128-byte chunk reads in 128 ms
    with eng:
        on_ssd_only(eng, specs, make_payload)
        eng.record_compute(4, 4e-4)  # 0.1 ms per token
        assert not eng.planner.measured(Tier.SSD)
        with caplog.at_level(logging.DEBUG, logger="pcr_rag.cache.manager"):
            lease = eng.acquire(specs, prompt_tokens=14)
        assert eng.planner.measured(Tier.SSD)  # the probe timed one layer read before the decision
        assert lease.num_chunks == 0
        lease.release()
        st = eng.stats()
        assert st.recomputed_instead_of_loaded == {"device": 0, "dram": 0, "ssd": 3, "remote": 0}
        assert 0 < st.planner["read_bytes_per_s"]["ssd"] <= 1000.0  # a layer's bytes over its read's seconds
        assert st.planner["compute_s_per_token"] == pytest.approx(1e-4)
        assert st.miss_chunks == 3
        assert [r.message for r in caplog.records if "reuse plan" in r.message] == [
            "reuse plan: 0 of 3 cached chunks loaded, recomputing 3 ssd (estimated 0.0014 s to the last prefill layer)"]
        assert eng.reuse_limit([s.key for s in specs], 14) == 0
        assert eng.stats().recomputed_instead_of_loaded["ssd"] == 3  # reuse_limit (the prefetcher) counts nothing
        probes = eng.stats().planner["read_bytes_per_s"]["ssd"]
        read_at = clock.now()
        clock.advance(REPROBE_S / 2)
        assert not eng.planner.needs_probe(Tier.SSD)  # fresh: no read
        eng.acquire(specs, prompt_tokens=14).release()
        assert clock.now() == read_at + REPROBE_S / 2
        clock.advance(REPROBE_S)
        assert eng.planner.needs_probe(Tier.SSD)  # stale: nobody read the skipped disk; probed again
        eng.acquire(specs, prompt_tokens=14).release()
        assert clock.now() > read_at + REPROBE_S * 1.5 and not eng.planner.needs_probe(Tier.SSD)
        assert probes > 0


def test_engine_loads_from_a_fast_ssd_and_always_load_ignores_speeds(chunks, make_payload, caplog):
    specs = chunks.path([[1] * 4, [2] * 4])
    fast, _ = slow_ssd_engine(bandwidth=1e12)
    always, _ = slow_ssd_engine(bandwidth=1000.0, load_planner="always-load")
    for eng in (fast, always):
        with eng:
            on_ssd_only(eng, specs, make_payload)
            eng.record_compute(4, 4e-4)
            with caplog.at_level(logging.DEBUG, logger="pcr_rag.cache.manager"), \
                    eng.acquire(specs, prompt_tokens=10) as lease:
                assert lease.num_chunks == 2
            assert sum(eng.stats().recomputed_instead_of_loaded.values()) == 0
    assert not always.planner.measured(Tier.SSD)  # always-load does not probe
    assert not [r for r in caplog.records if "reuse plan" in r.message]
