"""``RemoteClient``: every call to the remote store goes through here: the circuit breaker, timing, counters and
the measured network speed the load-or-recompute decision uses.

- A call the breaker refuses raises ``RemoteUnavailableError`` at once (counted in ``skipped``), without touching
  the store. A failed call counts in ``errors`` and towards opening the breaker (a timed-out one opens it at
  once: so a hung store costs one caller one timeout per back-off); a call that returns (a value or a miss)
  closes it.
- ``rtt_s``: exponentially weighted mean latency of lookups (small values); ``read_bytes_per_s``: of whole-value
  reads (bytes / seconds). Both None until measured.
- ``counters()``: a snapshot with op latency percentiles over the last ``LATENCY_WINDOW`` calls (seconds), and a
  sharded store's per-node counters (``ClusterStore.node_counters``).
- A sharded store (``ClusterStore``) keeps a breaker per node: a call that only failed on some nodes (their keys
  come back as misses) succeeds, and one whose nodes all failed or were skipped raises
  ``RemoteNodeUnavailableError``, counted in ``errors`` (``skipped`` when every node was skipped) but never towards
  this tier-wide breaker: the store reached its slot map and its per-node breakers decide, so one dead shard does
  not switch the tier off. The tier-wide breaker opens only when the cluster cannot be reached at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

from pcr_rag.cache.errors import RemoteNodeUnavailableError, RemoteTimeoutError, RemoteUnavailableError
from pcr_rag.cache.tiers.breaker import BreakerState, CircuitBreaker
from pcr_rag.cache.tiers.remote_store import RemoteStore

__all__ = ["COUNTERS", "RemoteClient"]

log = logging.getLogger(__name__)

T = TypeVar("T")
LATENCY_WINDOW = 2048
_EWMA = 0.2  # weight of the newest sample in the speed estimates

#: Counters of a remote tier (all since start): lookups (round trips) and the chunks they found / missed; reads
#: (``hits``: values read and verified); errors and calls skipped by the open breaker; values that failed
#: verification (deleted from the store): damaged (``corrupt``) or rejected as forged (``forged``: a MAC failed, or
#: the authenticated header contradicts the reader's root, chunk plan or KV layout); bytes; writes done / already there (``SET NX``) / dropped (queue full or
#: breaker open) / failed; chunks recomputed because that was cheaper than loading them.
COUNTERS = (
    "lookups", "lookup_found", "misses", "hits", "errors", "skipped", "corrupt", "forged", "bytes_read", "bytes_written",
    "writes", "writes_existing", "writes_dropped", "writes_failed", "recompute_chosen",
)


class RemoteClient:
    """Wraps a ``RemoteStore`` with a breaker and measurements (see the module docstring). Thread-safe."""

    def __init__(self, store: RemoteStore, breaker: CircuitBreaker,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.store = store
        self.breaker = breaker
        self._timer = timer
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._latency: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.rtt_s: float | None = None
        self.read_bytes_per_s: float | None = None
        self._was_down = False

    # ------------------------------------------------------------------ counting
    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def available(self) -> bool:
        """Whether the breaker would let a call through now."""
        return self.breaker.available()

    def _run(self, fn: Callable[[], T]) -> tuple[T, float]:
        if not self.breaker.allow():
            self.count("skipped")
            raise RemoteUnavailableError(
                f"remote store {self.store.describe()} skipped: circuit breaker open after errors (retried after "
                f"{self.breaker.backoff_s:g} s)")
        t0 = self._timer()
        try:
            result = fn()
        except RemoteNodeUnavailableError as exc:  # one shard: the store's own breaker for it decided
            self.breaker.success()
            with self._lock:
                self._counts["skipped" if exc.skipped else "errors"] += 1
                self._latency.append(self._timer() - t0)
            raise
        except RemoteUnavailableError as exc:
            if isinstance(exc, RemoteTimeoutError):
                self.breaker.trip()  # one caller paid the whole timeout: skip the store for the back-off
            else:
                self.breaker.failure()
            with self._lock:
                self._counts["errors"] += 1
                self._latency.append(self._timer() - t0)
                first = not self._was_down
                self._was_down = True
            if first:
                log.warning("remote tier %s failing (%s): requests use the local tiers; failures are counted in "
                            "stats().remote_io", self.store.describe(), exc)
            raise
        elapsed = self._timer() - t0
        self.breaker.success()
        with self._lock:
            self._latency.append(elapsed)
            if self._was_down:
                self._was_down = False
                log.info("remote tier %s answers again", self.store.describe())
        return result, elapsed

    @staticmethod
    def _ewma(old: float | None, new: float) -> float:
        return new if old is None else (1 - _EWMA) * old + _EWMA * new

    # ------------------------------------------------------------------ calls
    def probe(self, names: Sequence[str], nbytes: int) -> list[bytes | None]:
        result, elapsed = self._run(lambda: self.store.probe(names, nbytes))
        with self._lock:
            self._counts["lookups"] += 1
            self.rtt_s = self._ewma(self.rtt_s, elapsed)
        return result

    def get_many(self, names: Sequence[str], max_bytes: int | None = None) -> list[bytes | None]:
        """Whole values, or with ``max_bytes`` at most that many bytes of each (`RemoteStore.get_many`)."""
        if max_bytes is None:
            result, elapsed = self._run(lambda: self.store.get_many(names))
        else:
            result, elapsed = self._run(lambda: self.store.get_many(names, max_bytes))
        nbytes = sum(len(v) for v in result if v is not None)
        with self._lock:
            self._counts["bytes_read"] += nbytes
            if nbytes and elapsed > 0:
                self.read_bytes_per_s = self._ewma(self.read_bytes_per_s, nbytes / elapsed)
        return result

    def set_nx(self, name: str, value: bytes, ttl_s: float) -> bool:
        written, _ = self._run(lambda: self.store.set_nx(name, value, ttl_s))
        with self._lock:
            if written:
                self._counts["writes"] += 1
                self._counts["bytes_written"] += len(value)
            else:
                self._counts["writes_existing"] += 1
        return written

    # ------------------------------------------------------------------ metadata (root manifests)
    def scan(self, prefix: str, limit: int, max_calls: int) -> tuple[list[str], bool]:
        """`RemoteStore.scan`, through the breaker (counted only when it fails)."""
        result, _ = self._run(lambda: self.store.scan(prefix, limit, max_calls))
        return result

    def read_meta(self, names: Sequence[str], max_bytes: int) -> list[bytes | None]:
        """Small values other than chunks (at most ``max_bytes`` of each): through the breaker, but neither counted
        as chunk reads nor taken as a sample of the read speed the load-or-recompute decision uses."""
        result, _ = self._run(lambda: self.store.get_many(names, max_bytes))
        return result

    def write_meta(self, name: str, value: bytes, ttl_s: float) -> bool:
        """``SET NX`` of a small value other than a chunk (not counted in ``writes`` / ``bytes_written``)."""
        written, _ = self._run(lambda: self.store.set_nx(name, value, ttl_s))
        return written

    def delete(self, name: str) -> None:
        """Best effort (a bad value is deleted so no replica reads it again); failures are only counted."""
        try:
            self._run(lambda: self.store.delete(name))
        except RemoteUnavailableError:
            pass

    # ------------------------------------------------------------------ estimates and stats
    def observe(self, *, rtt_s: float | None = None, read_bytes_per_s: float | None = None) -> None:
        """Take speeds measured elsewhere (a simulated link, a previous run) as the current estimates."""
        with self._lock:
            if rtt_s is not None:
                self.rtt_s = rtt_s
            if read_bytes_per_s is not None:
                self.read_bytes_per_s = read_bytes_per_s

    def load_seconds(self, nbytes: int) -> float | None:
        """Estimated seconds to read ``nbytes`` in one batch (a round trip + transfer); None until measured."""
        with self._lock:
            if self.read_bytes_per_s is None:
                return None
            return (self.rtt_s or 0.0) + nbytes / self.read_bytes_per_s

    def counters(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counts)
            lat = sorted(self._latency)
            rtt, bw = self.rtt_s, self.read_bytes_per_s
        out["breaker_open"] = int(self.breaker.state is not BreakerState.CLOSED)
        out["breaker_trips"] = self.breaker.trips
        out["rtt_s"] = rtt if rtt is not None else 0.0
        out["read_bytes_per_s"] = bw if bw is not None else 0.0
        out["latency_s"] = _summary(lat)  # type: ignore[assignment]
        node_counters = getattr(self.store, "node_counters", None)
        if node_counters is not None:
            out.update(node_counters())
        return out

    def close(self) -> None:
        self.store.close()


def _summary(sorted_values: list[float]) -> dict[str, float]:
    if not sorted_values:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0}
    n = len(sorted_values)

    def q(p: float) -> float:
        return sorted_values[min(n - 1, int(round(p / 100 * (n - 1))))]

    return {"mean": sum(sorted_values) / n, "p50": q(50), "p95": q(95), "p99": q(99)}
