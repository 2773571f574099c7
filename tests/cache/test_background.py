"""Background cache threads lower their own priority, and only their own."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from pcr_rag.cache.background import BACKGROUND_NICE, lower_this_thread_priority


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are a Linux feature")
def test_lowers_the_calling_thread_only():
    seen: dict[str, int] = {}

    def worker() -> None:
        assert lower_this_thread_priority()
        seen["worker"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == max(before, BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_writeback_thread_runs_at_background_priority(tmp_path):
    from pcr_rag.cache import CacheConfig, CacheManager

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice values are a Linux feature")
    before = set(threading.enumerate())
    engine = CacheManager(CacheConfig(cache_dir=tmp_path, dram_bytes=1 << 20, ssd_bytes=1 << 22))
    try:
        writer = next(t for t in threading.enumerate() if t.name == "pcr-cache-writeback" and t not in before)
        for _ in range(200):  # the thread sets it as its first action
            if os.getpriority(os.PRIO_PROCESS, writer.native_id) >= BACKGROUND_NICE:
                break
            threading.Event().wait(0.01)
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) >= BACKGROUND_NICE
    finally:
        engine.close()
