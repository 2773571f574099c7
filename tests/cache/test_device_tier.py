"""The optional device tier (fastest, above DRAM). Its bookkeeping is exercised on the CPU through a config that
forces the tier on; the real CUDA path runs only where a GPU is present."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pcr_rag.cache import CacheConfig, CacheManager, MemoryBackend, Tier

CHUNK = 2 * 2 * 1 * 4 * 4 * 4  # bytes of payload_for(spec) with 4 tokens


@dataclass
class ForcedDeviceConfig(CacheConfig):
    """A device tier on the CPU: same accounting and policy as on a GPU, without a GPU."""

    @property
    def has_device_tier(self) -> bool:
        return int(self.device_bytes) > 0


def test_device_tier_is_off_on_cpu():
    eng = CacheManager(CacheConfig(device="cpu", device_bytes=10**6))
    assert eng.tiers == (Tier.DRAM,) and eng.stats().capacity_bytes["device"] == 0


def test_device_tier_holds_the_hottest_chunks_and_demotes_to_dram(chunks, make_payload):
    cfg = ForcedDeviceConfig(chunk_size=4, device_bytes=2 * CHUNK, dram_bytes=4 * CHUNK, ssd_bytes=1 << 20, sync_io=True)
    eng = CacheManager(cfg, storage=MemoryBackend())
    assert eng.tiers == (Tier.DEVICE, Tier.DRAM, Tier.SSD)
    specs = [chunks.child(None, [i] * 4) for i in range(3)]
    for s in specs:
        assert eng.insert(s, make_payload(s))
    st = eng.stats()
    assert st.chunks == {"device": 2, "dram": 3, "ssd": 3, "remote": 0}
    assert st.evictions["device"] == 1 and st.demotions["device"] == 1
    assert eng.tiers_of(specs[0].key) == {Tier.DRAM, Tier.SSD}
    assert eng.match([specs[2].key]).tiers == (Tier.DEVICE,)
    with eng.acquire([specs[2].key]) as lease:
        assert lease.tiers == (Tier.DEVICE,)
        assert torch.equal(eng.get_payload(specs[2].key), make_payload(specs[2]))
        assert torch.equal(eng.read_layer(specs[2].key, 0), make_payload(specs[2])[0])
    assert st.bytes_high_water["device"] <= 2 * CHUNK
    eng.check_invariants()


def test_device_only_chunk_is_written_back_from_the_device_copy(chunks, make_payload):
    cfg = ForcedDeviceConfig(chunk_size=4, device_bytes=4 * CHUNK, dram_bytes=CHUNK // 2, ssd_bytes=1 << 20, sync_io=True)
    eng = CacheManager(cfg, storage=MemoryBackend())
    spec = chunks.child(None, [1, 2, 3, 4])
    assert eng.insert(spec, make_payload(spec))  # DRAM too small: device copy only
    assert eng.tiers_of(spec.key) == {Tier.DEVICE, Tier.SSD}
    eng.evict(Tier.DEVICE, 1)
    assert eng.tiers_of(spec.key) == {Tier.SSD}
    eng.check_invariants()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_tier_and_pinned_dram(chunks, make_payload):
    cfg = CacheConfig(chunk_size=4, device="cuda", device_bytes=4 * CHUNK, dram_bytes=8 * CHUNK, sync_io=True)
    eng = CacheManager(cfg)
    spec = chunks.child(None, [1, 2, 3, 4])
    payload = make_payload(spec)
    assert eng.insert(spec, payload.cuda())
    dev = eng.get_payload(spec.key)
    assert dev.is_cuda and torch.equal(dev.cpu(), payload)
    eng.evict(Tier.DEVICE, 1)
    host = eng.get_payload(spec.key)
    assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host, payload)
    eng.check_invariants()
