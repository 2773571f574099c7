"""The cyclic garbage collector's pauses: measured, and kept short while engines serve.

A full (generation 2) collection scans every object the collector tracks, holding the GIL throughout, so every
engine thread stops while it runs. With a model, its tokenizer, torch and transformers loaded that is hundreds of
thousands of objects, so one request's TTFT or one inter-token gap of every running request grows by a whole
collection's pause (see docs/measurements-history.md#figures-moved-from-code-comments).

- `hold()` (an engine with ``EngineConfig(freeze_gc=True)`` finished starting): collect, then `gc.freeze()`, which
  moves every object alive now (the model, the tokenizer, imported modules) to the permanent generation that
  collections never scan, so a full collection then scans only what was allocated since. vLLM freezes after its
  warm-up too, and
  SGLang offers the same as an API (with a warning when a collection is slow).
- `release()` (that engine closed): `gc.unfreeze()`. Frozen objects are never collected, so a closed engine's
  reference cycles (its threads, its KV arena) are freed only once nothing is frozen; the next `hold()` freezes
  what the open engines still use. Between the two, open engines run unfrozen, as without `hold()`.
- `GCPauses` counts and times every collection of the process (``gc.callbacks``): `snapshot()` is what
  `PCREngine.stats().gc` and ``/metrics`` report.

The collector is the process's, shared with the application that embeds an engine, so freezing is opt-in in
`EngineConfig` and on in the processes pcr-rag owns (``pcr-rag serve``, ``demo``, ``bench``). While something is
frozen, objects alive at the freeze that later become cyclic garbage wait for `release()`; nothing else changes.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Freeze", "GCPauses", "held", "hold", "pauses", "release"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_holders = 0


@dataclass(frozen=True)
class Freeze:
    """What one `hold()` did: seconds it took (the collection first), objects in the permanent generation after."""

    seconds: float
    frozen_objects: int


class GCPauses:
    """Counts and durations of the process's garbage collections, per generation (seconds). Install once with
    `install()`; the callback runs inside each collection, with the GIL held, so it needs no lock of its own."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self._clock = clock
        self._started: float | None = None
        self.collections = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.max_pause_s = [0.0, 0.0, 0.0]
        self._installed = False

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        """The ``gc.callbacks`` hook: ``phase`` "start" or "stop", ``info["generation"]`` 0-2."""
        if phase == "start":
            self._started = self._clock()
            return
        if self._started is None:
            return
        gen = min(int(info.get("generation", 2)), 2)
        pause = self._clock() - self._started
        self._started = None
        self.collections[gen] += 1
        self.pause_s[gen] += pause
        self.max_pause_s[gen] = max(self.max_pause_s[gen], pause)

    def install(self) -> None:
        with _lock:
            if not self._installed:
                gc.callbacks.append(self.callback)
                self._installed = True

    def snapshot(self) -> dict[str, Any]:
        """Collections, total and longest pause (seconds) per generation "0"-"2" since `install()`, and the
        objects frozen now (process-wide figures)."""
        return {
            "collections": {str(g): self.collections[g] for g in range(3)},
            "pause_s": {str(g): self.pause_s[g] for g in range(3)},
            "max_pause_s": {str(g): self.max_pause_s[g] for g in range(3)},
            "frozen_objects": gc.get_freeze_count(),
        }


pauses = GCPauses()


def hold() -> Freeze:
    """An engine finished starting: collect, then freeze everything alive (see the module docstring)."""
    global _holders
    pauses.install()
    with _lock:
        _holders += 1
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        out = Freeze(time.perf_counter() - started, gc.get_freeze_count())
    log.info("garbage collector: %d objects frozen in %.0f ms (full collections now skip them)",
             out.frozen_objects, out.seconds * 1e3)
    return out


def held() -> int:
    """Engines holding the freeze now."""
    return _holders


def release() -> None:
    """An engine that called `hold()` closed: unfreeze, so what it leaves behind can be collected."""
    global _holders
    with _lock:
        if _holders <= 0:
            raise RuntimeError("gc_pauses.release() without a matching hold()")
        _holders -= 1
        gc.unfreeze()
