"""The garbage collector's pauses: counted per generation, and frozen start-up objects while an engine serves."""

from __future__ import annotations

import gc
import weakref

import pytest

from pcr_rag import ConfigError, EngineConfig, PCREngine
from pcr_rag.sched import gc_pauses
from pcr_rag.sched.gc_pauses import GCPauses
from pcr_rag.testing import tiny_model


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_pauses_are_counted_and_timed_per_generation():
    clock = FakeClock()
    p = GCPauses(clock)
    for gen, seconds in ((0, 0.001), (0, 0.003), (2, 0.2)):
        p.callback("start", {"generation": gen})
        clock.now += seconds
        p.callback("stop", {"generation": gen})
    p.callback("stop", {"generation": 1})  # a stop without its start (installed mid-collection): ignored
    snap = p.snapshot()
    assert snap["collections"] == {"0": 2, "1": 0, "2": 1}
    assert snap["pause_s"]["0"] == pytest.approx(0.004) and snap["pause_s"]["2"] == pytest.approx(0.2)
    assert snap["max_pause_s"] == {"0": pytest.approx(0.003), "1": 0.0, "2": pytest.approx(0.2)}
    assert snap["frozen_objects"] == gc.get_freeze_count()


def test_install_hooks_the_collector_once():
    p = GCPauses()
    try:
        p.install()
        p.install()
        assert gc.callbacks.count(p.callback) == 1
        gc.collect()
        assert p.collections[2] >= 1 and p.max_pause_s[2] > 0
    finally:
        gc.callbacks.remove(p.callback)


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_hold_freezes_what_is_alive_and_release_lets_it_be_collected():
    if gc_pauses.held():
        pytest.skip("another engine in this process holds the freeze")
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a reference cycle: only the cyclic collector frees it
    watch = weakref.ref(a)
    freeze = gc_pauses.hold()
    try:
        # (frozen objects freed by their reference count leave the permanent generation: the count only falls)
        assert freeze.frozen_objects >= gc.get_freeze_count() > 0 and freeze.seconds >= 0
        del a, b
        gc.collect()
        assert watch() is not None  # frozen: full collections skip it
    finally:
        gc_pauses.release()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert watch() is None  # unfrozen: collected
    with pytest.raises(RuntimeError, match="without a matching hold"):
        gc_pauses.release()


def test_engine_freezes_after_start_and_unfreezes_on_close(tmp_path):
    if gc_pauses.held():
        pytest.skip("another engine in this process holds the freeze")
    with pytest.raises(ConfigError, match="freeze_gc must be True or False"):
        EngineConfig(freeze_gc="yes")
    model, tok = tiny_model("llama", num_layers=2)
    with PCREngine(model=model, tokenizer=tok, config=EngineConfig(cache_dir=tmp_path / "off")) as plain:
        assert gc_pauses.held() == 0 and plain.stats().gc["frozen_objects"] == 0
    engine = PCREngine(model=model, tokenizer=tok,
                       config=EngineConfig(cache_dir=tmp_path / "kv", freeze_gc=True, max_new_tokens=3))
    try:
        assert gc_pauses.held() == 1
        stats = engine.stats().gc
        assert stats["frozen_objects"] > 0 and gc.get_freeze_count() > 0
        assert stats["collections"]["2"] >= 1  # the start-up collection, counted
        out = engine.generate("Which star?", documents=["Alpha centauri is close. " * 4])
        assert len(out.token_ids) == 3
    finally:
        engine.close()
    assert gc_pauses.held() == 0 and gc.get_freeze_count() == 0
    engine.close()  # idempotent: releases once
    assert gc_pauses.held() == 0
