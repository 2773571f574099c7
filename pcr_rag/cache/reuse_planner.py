"""Load or recompute: the one decision, for every tier, of which cached chunks a request reads and which it computes.

Inputs, all measured:
- ``ReadSpeed`` per tier: seconds to read ``n`` bytes (a per-read latency plus bytes over bandwidth), a decayed
  least-squares line fed by the loader's own timed reads (``record_read``). The remote tier's speed is the remote
  client's (its round trip from lookups, its bandwidth from whole-value reads: the tier's own timed calls).
  A memory tier that was never measured counts as free; a storage tier that was never measured is probed (one
  timed layer read, ``CacheManager`` does it before planning) so the first request is not the one that pays, and
  probed again when its last timed read is older than ``REPROBE_S`` (a tier the planner skips is read by nobody,
  and a disk that got faster must be seen).
- ``ComputeSpeed``: the runtime's prefill steps (``record_compute(tokens, seconds, start)``), a decayed fit of a
  step's seconds on its tokens and on tokens x mean position (attention grows with the position), so the
  recompute cost of a chunk depends on where it sits.

The cost model is what the runner does (``runtime/runner.py``), in this order:
1. remote chunks are fetched whole, in one batch, before the step (one round trip + bytes / bandwidth), and
   chunks whose prefetch is in flight are waited for (counted as a whole read from their tier: conservative, the
   prefetch may be nearly done);
2. the other chunks are copied layer by layer while the first step computes: layer i of the step waits only for
   layer i of every loaded chunk. With ``L`` layers, ``R`` seconds to read one layer of them all and ``C1`` the
   first step's compute, that step ends after ``max(L*R + C1/L, R + C1)``; the later steps add their compute.
   On a CPU with every chunk in memory the copies run on the compute thread instead (serial: ``L*R + C1``);
3. the rest of the prompt is computed (at least its last token, whose logits are the first token's).

``plan`` chooses the reuse that minimises the time to the last prefill layer. It returns a cut (reuse the leading
chunks, compute the rest) because the runner computes one contiguous tail. That is the optimum whenever every
chunk after the first skipped one is at least as slow to read as it is to compute. It is not a cut in general:
a chunk's KV does not depend on how its prefix was obtained, so a fast chunk behind a slow one (a DRAM chunk
after an SSD chunk on a throttled disk, or blended documents of issue 48 in any order) could still be loaded
while the slow one is recomputed; ``plan`` takes segments (tier, tokens, bytes each) rather than a bare prefix so
that such a planner can share this cost model. Ties go to loading (less compute), and so does any plan that is
not at least ``MIN_GAIN`` faster than loading every cached chunk: the estimates are noisy on a busy host, and a
request should not flip between loading and computing on noise.

``measured`` is the default. ``always-load`` mode reuses every chunk a tier can serve (the remote tier ends the
reuse while its breaker is open): the behaviour before this module, kept so that a benchmark can compare both in
one run, and so that tests of a tier's own mechanics on a tiny model (where computing beats any read) can load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pcr_rag.cache.config import PLANNER_MODES
from pcr_rag.cache.tiers.base import TIER_ORDER, Tier

__all__ = ["MIN_GAIN", "REPROBE_S", "ComputeSpeed", "ReadSpeed", "ReusePlan", "ReusePlanner", "Segment"]

log = logging.getLogger(__name__)

_MEMORY = (Tier.DEVICE, Tier.DRAM)
_READ_DECAY = 0.98  # weight of older read samples per new one (one sample per layer read: a few chunks' worth)
_COMPUTE_DECAY = 0.95  # weight of older prefill-step samples per new one
#: Seconds after a storage tier's last timed read when it is probed again (one layer read per period at most).
REPROBE_S = 30.0
#: A plan that skips cached chunks must be estimated at least this fraction faster than loading them all, so
#: that estimation noise (a busy host, a cold page cache) does not flip a request between loading and computing.
MIN_GAIN = 0.1


@dataclass(frozen=True)
class Segment:
    """One cached chunk a request could reuse: its key, the tier it would be read from, its tokens and bytes, its
    layer count, and whether a prefetch of it is in flight (the request would wait for that instead)."""

    key: bytes
    tier: Tier
    tokens: int
    nbytes: int
    layers: int = 1
    in_flight: bool = False


@dataclass(frozen=True)
class ReusePlan:
    """``reuse``: leading segments to load (the rest are computed); ``seconds``: the estimated time to the last
    prefill layer under this plan (None when a speed is not measured yet and everything is loaded);
    ``skipped``: the tiers of the cached segments that are recomputed instead of loaded, in order."""

    reuse: int
    seconds: float | None
    skipped: tuple[Tier, ...] = ()


class _DecayedLine:
    """A decayed least-squares line y = a + b x (a >= 0, b > 0); the ratio of the decayed sums (a = 0) until
    samples of different x have been seen."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.sums = [0.0] * 5  # 1, x, y, x^2, x y
        self.a = 0.0
        self.b: float | None = None

    def add(self, x: float, y: float) -> None:
        s = self.sums
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = self.decay * s[i] + v
        n, sx, sy, sxx, sxy = s
        spread = n * sxx - sx * sx
        slope = (n * sxy - sx * sy) / spread if spread > 1e-9 * n * sxx else -1.0
        intercept = (sy - slope * sx) / n if slope > 0 else -1.0
        if slope > 0 and intercept >= 0:
            self.a, self.b = intercept, slope
        elif self.b is None or spread <= 1e-9 * n * sxx:
            self.a, self.b = 0.0, sy / sx  # one size of sample so far: the plain ratio


class ReadSpeed:
    """Seconds to read ``nbytes`` from one tier: ``latency_s + nbytes * s_per_byte`` (decayed fit, see
    ``_DecayedLine``); None until a read was timed or a speed observed."""

    def __init__(self) -> None:
        self._line = _DecayedLine(_READ_DECAY)

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._line.add(float(nbytes), seconds)

    def observe(self, bytes_per_s: float, latency_s: float = 0.0) -> None:
        """Take a speed measured elsewhere (a benchmark, a test, a previous run) as the estimate."""
        if not bytes_per_s > 0 or latency_s < 0:
            raise ValueError(f"a read speed needs bytes_per_s > 0 and latency_s >= 0, got {bytes_per_s}, {latency_s}")
        self._line = _DecayedLine(_READ_DECAY)
        self._line.a, self._line.b = latency_s, 1.0 / bytes_per_s

    @property
    def measured(self) -> bool:
        return self._line.b is not None

    def seconds(self, nbytes: float, reads: int = 1) -> float | None:
        b = self._line.b
        return None if b is None else reads * self._line.a + nbytes * b

    @property
    def bytes_per_s(self) -> float:
        """The bandwidth part of the estimate (0 while unmeasured)."""
        b = self._line.b
        return 1.0 / b if b else 0.0

    @property
    def latency_s(self) -> float:
        return self._line.a


class ComputeSpeed:
    """Seconds of a prefill step over positions [start, end): ``fixed + per_token x n + per_token_position x n x
    mid`` (n = end - start, mid its mean position): a decayed least-squares fit of the runtime's steps. Until
    steps at different positions were seen, the position term is 0 (the line of seconds on tokens, or the mean
    seconds per token until steps of different sizes were seen); a fit that would make a term negative keeps the
    simpler model."""

    def __init__(self) -> None:
        self._line = _DecayedLine(_COMPUTE_DECAY)
        self._sums = [0.0] * 9  # decayed sums of 1, n, m, y, nn, nm, ny, mm, my with m = n x mid
        self.position_s: float = 0.0  # seconds per token per position of the 3-term fit (0: not fitted)
        self.fixed_s: float = 0.0
        self.token_s: float | None = None

    def record(self, tokens: int, seconds: float, start: int = 0) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._line.add(float(tokens), seconds)
        n, m = float(tokens), tokens * (start + (tokens - 1) / 2.0)
        s = self._sums
        for i, v in enumerate((1.0, n, m, seconds, n * n, n * m, n * seconds, m * m, m * seconds)):
            s[i] = _COMPUTE_DECAY * s[i] + v
        fit = _solve3(s)
        if fit is not None and fit[0] >= 0 and fit[1] > 0 and fit[2] >= 0:
            self.fixed_s, self.token_s, self.position_s = fit
        else:
            self.fixed_s, self.token_s, self.position_s = self._line.a, self._line.b, 0.0

    def observe(self, s_per_token: float, fixed_s: float = 0.0, position_s: float = 0.0) -> None:
        """Take a speed measured elsewhere as the estimate (tests, the simulator's profile)."""
        self.fixed_s, self.token_s, self.position_s = fixed_s, s_per_token, position_s
        self._line = _DecayedLine(_COMPUTE_DECAY)
        self._line.a, self._line.b = fixed_s, s_per_token

    @property
    def s_per_token(self) -> float | None:
        return self.token_s

    def seconds(self, start: int, end: int, *, fixed: bool = True) -> float | None:
        """Compute seconds of positions [start, end) in one step (0 for an empty range)."""
        if self.token_s is None:
            return None
        n = end - start
        if n <= 0:
            return 0.0
        mid = start + (n - 1) / 2.0
        return (self.fixed_s if fixed else 0.0) + n * self.token_s + n * mid * self.position_s


def _solve3(s: Sequence[float]) -> tuple[float, float, float] | None:
    """Least squares of y on (1, n, m) from the decayed sums (Cramer's rule on the normal equations); None when
    the system is (nearly) singular."""
    c, n, m, y, nn, nm, ny, mm, my = s
    a = ((c, n, m), (n, nn, nm), (m, nm, mm))
    rhs = (y, ny, my)

    def det(x: Sequence[Sequence[float]]) -> float:
        return (x[0][0] * (x[1][1] * x[2][2] - x[1][2] * x[2][1]) - x[0][1] * (x[1][0] * x[2][2] - x[1][2] * x[2][0])
                + x[0][2] * (x[1][0] * x[2][1] - x[1][1] * x[2][0]))

    d = det(a)
    scale = c * nn * mm
    if scale <= 0 or abs(d) <= 1e-9 * scale:
        return None
    out = []
    for col in range(3):
        x = [list(row) for row in a]
        for r in range(3):
            x[r][col] = rhs[r]
        out.append(det(x) / d)
    return out[0], out[1], out[2]


class ReusePlanner:
    """The load-or-recompute decision for one cache engine (see the module docstring). Thread-safe.

    ``remote_seconds(nbytes)``: the remote tier's estimate of one batched read (None: unmeasured), or None
    without a remote tier. ``memory_copies_overlap``: memory-tier copies run beside the compute (a CUDA copy
    stream) rather than on the compute thread."""

    def __init__(self, mode: str = "measured", *, remote_seconds: Callable[[int], float | None] | None = None,
                 memory_copies_overlap: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        if mode not in PLANNER_MODES:
            raise ValueError(f"unknown load_planner {mode!r}; choose one of {PLANNER_MODES}")
        self.mode = mode
        self.remote_seconds = remote_seconds
        self.memory_copies_overlap = memory_copies_overlap
        self.step_tokens: int | None = None  # the runtime's prefill step (None: one step per prompt)
        self.layerwise = True  # loads overlap the first step layer by layer (False: they finish before it)
        self.reads: dict[Tier, ReadSpeed] = {t: ReadSpeed() for t in TIER_ORDER if t is not Tier.REMOTE}
        self.compute = ComputeSpeed()
        self.recomputed: dict[str, int] = {t.value: 0 for t in TIER_ORDER}
        self._clock = clock
        self._read_at: dict[Tier, float] = {}  # clock time of each tier's last timed read
        self._lock = threading.Lock()

    def configure(self, *, step_tokens: int | None, layerwise: bool) -> None:
        """How the runtime runs a prefill: steps of ``step_tokens`` tokens, loads overlapping the first step
        layer by layer (``layerwise``) or finishing before it."""
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1 or None, got {step_tokens}")
        self.step_tokens = step_tokens
        self.layerwise = layerwise

    # ------------------------------------------------------------------ measurements
    def record_read(self, tier: Tier, nbytes: int, seconds: float) -> None:
        """A timed read of ``nbytes`` from ``tier`` (the loader's reads; ignored for the remote tier, whose client
        measures itself)."""
        speed = self.reads.get(tier)
        if speed is not None:
            with self._lock:
                speed.record(nbytes, seconds)
                self._read_at[tier] = self._clock()

    def record_compute(self, tokens: int, seconds: float, start: int = 0) -> None:
        """A measured prefill step: ``tokens`` positions from ``start`` computed in ``seconds``."""
        with self._lock:
            self.compute.record(tokens, seconds, start)

    def observe_read(self, tier: Tier, bytes_per_s: float, latency_s: float = 0.0) -> None:
        """Take a read speed of ``tier`` measured elsewhere (a benchmark, a test, a previous run) as the estimate,
        as fresh as a timed read (the loader's next reads refine it)."""
        with self._lock:
            self.reads[tier].observe(bytes_per_s, latency_s)
            self._read_at[tier] = self._clock()

    def measured(self, tier: Tier) -> bool:
        speed = self.reads.get(tier)
        return speed is None or speed.measured

    def needs_probe(self, tier: Tier) -> bool:
        """``tier``'s speed is unknown, or its last timed read is older than ``REPROBE_S`` (measured mode only)."""
        if self.mode != "measured" or tier not in self.reads:
            return False
        at = self._read_at.get(tier)
        return not self.reads[tier].measured or at is None or self._clock() - at > REPROBE_S

    # ------------------------------------------------------------------ the decision
    def plan(self, segments: Sequence[Segment], prompt_tokens: int | None = None, *,
             remote_available: bool = True) -> ReusePlan:
        """The reuse for a request whose cached chunks are ``segments`` (positions from 0, in order) and whose
        prompt has ``prompt_tokens`` tokens (None: the segments' tokens). ``remote_available`` False (the remote
        tier's breaker is open): the reuse ends before the first remote chunk, whatever the speeds."""
        n = len(segments)
        limit = n
        if not remote_available:
            limit = next((i for i, s in enumerate(segments) if s.tier is Tier.REMOTE), n)
        if self.mode == "always-load" or limit == 0:
            return ReusePlan(limit, None, tuple(s.tier for s in segments[limit:]))
        with self._lock:
            best = self._best(segments[:limit], prompt_tokens)
        if best is None:
            return ReusePlan(limit, None, tuple(s.tier for s in segments[limit:]))
        cut, seconds = best
        return ReusePlan(cut, seconds, tuple(s.tier for s in segments[cut:]))

    def _best(self, segs: Sequence[Segment], prompt_tokens: int | None) -> tuple[int, float] | None:
        """(cut, seconds) minimising the time to the last prefill layer; None when a speed it needs is unknown
        (lock held)."""
        compute = self.compute
        if compute.token_s is None:
            return None
        positions = [0]
        for s in segs:
            positions.append(positions[-1] + s.tokens)
        total = max(prompt_tokens if prompt_tokens is not None else positions[-1], positions[-1])
        step = self.step_tokens or total
        layers = max(1, max(s.layers for s in segs))
        # per cut k: serial seconds before the step, per-layer async read seconds, memory copy seconds
        before = layer_async = memory_serial = 0.0
        remote_bytes, remote_s = 0, 0.0
        async_sources = False
        best_cut, best_s = 0, self._finish(0, total, step, layers, 0.0, 0.0, 0.0)
        seconds = best_s
        for k, s in enumerate(segs, start=1):
            if s.tier is Tier.REMOTE:
                remote_bytes += s.nbytes
                estimate = self.remote_seconds(remote_bytes) if self.remote_seconds is not None else None
                if estimate is None:
                    return None  # the network is not measured yet: load (the load measures it)
                remote_s = estimate
            elif s.in_flight:
                wait = self.reads[s.tier].seconds(s.nbytes)
                if wait is None:
                    return None
                before += wait
            elif s.tier in _MEMORY:
                copy = self.reads[s.tier].seconds(s.nbytes / layers) or 0.0  # unmeasured memory: free
                if self.memory_copies_overlap:
                    layer_async += copy
                    async_sources = True
                else:
                    memory_serial += copy * layers
            else:
                read = self.reads[s.tier].seconds(s.nbytes / layers)
                if read is None:
                    return None  # unprobed storage: load (the read measures it)
                layer_async += read
                async_sources = True
            serial = before + remote_s
            if async_sources:  # the loader thread copies the memory chunks too
                per_layer, mem = layer_async + memory_serial / layers, 0.0
            else:
                per_layer, mem = 0.0, memory_serial
            seconds = self._finish(positions[k], total, step, layers, serial, per_layer, mem)
            if seconds <= best_s:
                best_cut, best_s = k, seconds
        if best_cut < len(segs) and best_s > (1.0 - MIN_GAIN) * seconds:
            return len(segs), seconds  # the skip is not clearly faster: load everything (less compute)
        return best_cut, best_s

    def _finish(self, start: int, total: int, step: int, layers: int, serial: float, per_layer: float,
                memory: float) -> float:
        """Seconds to the last prefill layer when positions [start, total) are computed (at least the last one)
        after ``serial`` seconds, while ``per_layer`` seconds per layer load beside the first step and ``memory``
        seconds of copies run on the compute thread."""
        start = min(start, total - 1) if total > 0 else 0
        first_end = min(total, start + step)
        compute = self.compute
        c1 = compute.seconds(start, first_end) or 0.0
        rest = compute.seconds(first_end, total, fixed=False) or 0.0
        steps_after = max(0, -(-(total - first_end) // step))
        rest += steps_after * compute.fixed_s
        if per_layer > 0 and not self.layerwise:
            first = layers * per_layer + c1
        elif per_layer > 0:
            first = max(layers * per_layer + c1 / layers, per_layer + c1)
        else:
            first = c1
        return serial + memory + first + rest

    # ------------------------------------------------------------------ counting and stats
    def count(self, plan: ReusePlan) -> None:
        """Count a request's decision: its cached chunks recomputed instead of loaded, by tier."""
        if plan.skipped:
            with self._lock:
                for tier in plan.skipped:
                    self.recomputed[tier.value] += 1

    def snapshot(self) -> dict[str, object]:
        """The estimates: ``read_bytes_per_s`` / ``read_latency_s`` per tier (0: unmeasured; the remote tier's are
        its client's, in ``remote_io``), ``compute_s_per_token`` (0: unmeasured), ``compute_s_per_token_position``
        and the mode."""
        with self._lock:
            return {
                "mode": self.mode,
                "read_bytes_per_s": {t.value: s.bytes_per_s for t, s in self.reads.items()},
                "read_latency_s": {t.value: s.latency_s for t, s in self.reads.items()},
                "compute_s_per_token": self.compute.token_s or 0.0,
                "compute_s_per_token_position": self.compute.position_s,
            }
