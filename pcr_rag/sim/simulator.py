"""Discrete-event simulation of serving a request trace, with the real cache engine and prefetch decisions.

What is real: the :class:`~pcr_rag.cache.CacheManager` (prefix tree, tiers, eviction policies, look-ahead
protection, write-back) running on a virtual clock with metadata-only payloads and synchronous I/O, the
runtime's :func:`~pcr_rag.sched.prefetcher.plan_prefetch`, and its admission policy
(:func:`~pcr_rag.sched.admission.queue_order`, ``rank``). What is modelled: the time of compute and transfers
(:mod:`pcr_rag.sim.costmodel`) and the order of events. The simulator mirrors the runtime's request path
(``pcr_rag/sched/runner.py``): ``acquire(keys, max_chunks=len(plan) - 1)`` (the last chunk is always computed),
chunks on SSD are read on demand layer by layer and copied back to DRAM afterwards, every computed chunk is inserted,
the lease is released when the prefill ends.

Scheduling: the waiting queue is admitted in the system's ``schedule`` order, computed by the runtime's own
functions - ``fcfs`` (arrival) or ``cache-aware`` (least uncached work first, aged at the profile's prefill speed;
a waiting request's work leaves out the chunks of the prefill in flight, and requests sharing uncached documents
rank as a group) - and the look-ahead window follows that order. Three executors (``SimConfig.executor``):

- ``serial``: one request at a time, prefill then decode (the runtime with ``max_active=1``);
- ``prefill-first``: a vLLM-like engine: prefill-first, running requests decode together one token per step,
  admission bounded by the device KV pool (tokens);
- ``engine-steps``: the runtime's own executor (`pcr_rag.sched.batch`): ``max_batch`` rows, held from admission
  to the last token; each engine step is one decode step over every decoding row, then one prefill step of one
  admitted request, chosen by the runtime's `prefill_candidates` and ``rank`` (a prefill waits for chunks another
  one is computing and lends it its place); while rows decode, only the prefill layers the runtime's own
  `StepBudget` allows run (fed with the modelled step times), so a prefill step spans several engine steps; a
  prefill leases its cached prefix when it begins and inserts each chunk when the step computing it ends; the
  look-ahead window starts with the admitted prefills that have not begun. With one row it is the serial executor,
  step for step.

Resources: one compute stream; the SSD as one FIFO read channel shared by prefetches and on-demand reads; DRAM ->
SSD write-back on a separate write channel (background; it never delays a read, its busy time is reported).
Times are seconds of virtual time, sizes bytes / tokens.

Remote tier (``SimConfig.remote``: a `RemoteLink`, and ``remote_store``: the name of an in-process store that
replicas simulated one after the other share): the engine's remote tier runs for real on that store (lookups,
write-through of metadata-only values, the load-or-recompute decision with the link's speeds and the profile's
compute speed); a request fetches its remote chunks whole before its prefill starts, as the runtime does (one
round trip + bytes / bandwidth), then uses them like DRAM hits. Remote chunks are not prefetched here.

Blend mode (a system with ``blend``, `pcr_rag.sched.blend`), as the runtime's `PrefillTask._begin_blend` runs it:
after the exact prefix match, the spans are `blend_spans` of the request's documents (`SimRequest.documents`):
each later document is placed after its first ``ceil(blend_recompute * n)`` tokens, everything else is computed,
the last token always. The first document right after the exact match (starting at or after its end) whose
position-independent chain is not wholly cached (any tier) is not placed: it is computed in context, exactly, and
its chunks extend the exact index. A document whose chain ``[anchor][document]`` is wholly in memory (DRAM, or the
device) is leased and placed: its placed tokens load host -> device layer by layer in the first step, like the
exact prefix's DRAM chunks. Any other document is first prefilled in isolation (its chain's cached chunks loaded
from their tiers, SSD reads on the same channel as any on-demand read, the rest computed behind them in the
runtime's steps, whose budget is the request's prompt length; the computed chunks inserted and SSD/remote ones kept
in DRAM, as the isolated `PrefillTask` does), one after the other before the request's own steps; its KV is then
on the device. The anchor is thus computed once per cache (while it stays cached) and each new document once, in
isolation. Placing rotates the placed keys in the first step (`CostModel.place_s`). The compute spans run as the
runtime's steps (`blend_steps`): a step takes up to the step budget of tokens across the compute spans in one
forward (a "scattered" step, `PrefillTask._blend_step`), and costs its tokens plus each span's attention over every
earlier position, placed ones included. Nothing computed after the first placed position is inserted into the
exact index (`_Prefill.exact_until`), offloaded, or named in the prefill's outlook. A document whose cached chunks
the cache's load-or-recompute planner declines to load is computed in place instead, as in the runtime. The
prefetch window holds a blend request's documents' chains after its own, as the runtime's does
(`pcr_rag.sched.lookahead.build_window`). The blend gate is not modelled (it is off unless ``blend_verify`` > 0).
A request's counts are the runtime's: ``blended_tokens`` are the placed tokens whose position-independent KV was
cached before the request (a document computed in isolation by the request and placed counts as computed), and
``computed_tokens`` is prompt - exact reuse - blended. ``placed_tokens`` counts every placed token and
``isolated_tokens`` what the isolated prefills computed (anchor included), so a request's forwards computed
``prompt - exact - placed + isolated`` tokens.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pcr_rag.cache import (
    CacheConfig,
    CacheManager,
    CacheStats,
    ChunkSpec,
    ManualClock,
    MemoryBackend,
    RemoteConfig,
    Tier,
    VirtualPayload,
)
from pcr_rag.cache.config import KVLayout
from pcr_rag.model.forward import ATTENTION_BLOCK
from pcr_rag.sched.admission import PrefillOutlook, prefill_candidates, queue_order, rank
from pcr_rag.sched.blend import BlendDocument, blend_spans
from pcr_rag.sched.prefetcher import plan_prefetch
from pcr_rag.sched.runner import prefill_step_sizes
from pcr_rag.sched.step_budget import StepBudget
from pcr_rag.sim.costmodel import CostModel, PrefillWork, attention_pairs
from pcr_rag.sim.profiles import Profile
from pcr_rag.sim.remote_link import RemoteLink
from pcr_rag.sim.systems import SimSystem, engine_default
from pcr_rag.sim.trace import SimDocument, SimRequest

log = logging.getLogger(__name__)

#: The simulated replicas' shared secret: their store is in-process (``memory://``), so the secret guards against
#: nothing there, but values are sealed and checked exactly as a real replica's are.
SIM_SECRET = "pcr-rag-simulator-shared-secret"


def _virtual_layout(num_layers: int, kv_bytes_per_token: int) -> KVLayout:
    """A KV layout whose chunk sizes are the simulated model's (``kv_bytes_per_token`` per token over
    ``num_layers``): the simulator's chunks are metadata-only, so only their sizes are checked."""
    per_layer, rest = divmod(kv_bytes_per_token, 2 * num_layers)
    if rest or per_layer < 1:
        raise ValueError(f"kv_bytes_per_token {kv_bytes_per_token} is not K and V over {num_layers} layers")
    return KVLayout(num_layers, 1, per_layer, torch.uint8)

_PREFILL_DONE, _EXEC_READY, _PREFETCH_DONE = range(3)  # event kinds
EXECUTORS = ("serial", "prefill-first", "engine-steps")
ENGINE_DEFAULT_MAX_ACTIVE: int = engine_default("max_active")  # rows of the engine-steps executor
ENGINE_DEFAULT_ITL_BUDGET: float | None = engine_default("itl_budget_steps")
PREFILL_FIRST_DEFAULT_BATCH = 256  # running requests of the vLLM-like executor by default


def default_max_batch(executor: str) -> int:
    """``SimConfig.max_batch`` when none is given: 1 for ``serial``, the engine's ``max_active`` rows for
    ``engine-steps``, `PREFILL_FIRST_DEFAULT_BATCH` for ``prefill-first``."""
    return {"serial": 1, "engine-steps": ENGINE_DEFAULT_MAX_ACTIVE}.get(executor, PREFILL_FIRST_DEFAULT_BATCH)


def engine_steps(spans: Sequence[tuple[int, int]], budget: int, block: int) -> list[tuple[tuple[int, int], ...]]:
    """The forward steps `PrefillTask` runs over a prefill's compute spans (``[start, end)``, ordered, non-empty,
    disjoint), each as the pieces of spans it computes, when no error intervenes: while more spans follow the
    current one and fewer than ``budget`` of its tokens are left, one scattered step takes the rest of it and the
    next tokens of the following spans, ``budget`` tokens in all (`PrefillTask._blend_step`; the placed KV between
    them is not computed); otherwise a contiguous step of at most ``budget`` tokens cut at a multiple of ``block``
    (`prefill_step_sizes`). One span (exact mode): the runtime's contiguous steps. The pieces cover the spans
    exactly, in order."""
    budget = max(1, budget)
    rest = list(spans)
    if not rest:
        return []
    pos, span_end = rest.pop(0)
    steps: list[tuple[tuple[int, int], ...]] = []
    while True:
        if rest and span_end - pos < budget:
            pieces = [(pos, span_end)]
            left = budget - (span_end - pos)
            while rest and left > 0:
                lo, hi = rest.pop(0)
                take = min(left, hi - lo)
                pieces.append((lo, lo + take))
                left -= take
                if take < hi - lo:
                    rest.insert(0, (lo + take, hi))
            steps.append(tuple(pieces))
        else:
            end = pos + prefill_step_sizes(pos, span_end, budget, block)[0]
            steps.append(((pos, end),))
            if end < span_end:
                pos = end
                continue
        if not rest:
            return steps
        pos, span_end = rest.pop(0)


class SimulationError(RuntimeError):
    """The simulation cannot proceed (e.g. an engine call failed); the message names the request and time."""


@dataclass(frozen=True)
class SimConfig:
    """One simulated serving set-up.

    Capacities in bytes: ``dram_bytes``/``ssd_bytes`` for the host cache tiers, ``device_cache_bytes`` for a
    ``device_cache`` system's prefix cache: like vLLM's, it holds whatever part of the device KV pool the running
    requests do not use (it is trimmed, LRU first, whenever they need more). ``max_batch``: the rows of the
    ``engine-steps`` executor, the running requests of ``prefill-first``; 1 for ``serial``.
    ``kv_pool_tokens`` bounds the tokens of running requests when batching (None: unbounded).
    ``prefill_steps``: "single" (one forward over the new tokens), "engine" (the runtime's steps of
    ``prefill_chunk_tokens`` cut at its attention blocks: `pcr_rag.sched.runner.prefill_step_sizes`) or
    "per_chunk" (one per plan chunk: the runtime before its prefill was split-invariant).
    ``record_trace`` keeps the executed chunk trace (for Belady). ``executor``: see the module
    docstring; None = ``serial`` for ``max_batch`` 1, else ``prefill-first``. ``itl_budget_steps``: the
    ``engine-steps`` executor's ITL budget in decode steps (the runtime's `EngineConfig.itl_budget_steps`; None:
    prefill steps always run whole).
    """

    profile: Profile
    system: SimSystem
    chunk_size: int = 256
    dram_bytes: int = 0
    ssd_bytes: int = 0
    device_cache_bytes: int = 0
    max_batch: int = 1
    kv_pool_tokens: int | None = None
    prefill_steps: str | None = None
    record_trace: bool = False
    remote: RemoteLink | None = None
    remote_store: str = ""
    executor: str | None = None
    itl_budget_steps: float | None = ENGINE_DEFAULT_ITL_BUDGET

    def __post_init__(self) -> None:
        if self.executor not in (None, *EXECUTORS):
            raise ValueError(f"executor must be one of {list(EXECUTORS)} or None, got {self.executor!r}")
        if self.max_batch < 1 or (self.executor == "serial" and self.max_batch != 1):
            raise ValueError(f"max_batch {self.max_batch} does not fit executor {self.executor!r} (>= 1; 1 for "
                             f"serial)")

    @property
    def steps_mode(self) -> str:
        return self.prefill_steps or self.profile.prefill_steps

    @property
    def executor_kind(self) -> str:
        """The executor modelled (see the module docstring)."""
        return self.executor or ("serial" if self.max_batch == 1 else "prefill-first")


@dataclass
class RequestOutcome:
    """What one simulated request cost (seconds of virtual time; tokens)."""

    rid: int
    arrival_s: float
    start_s: float = math.nan
    first_token_s: float = math.nan
    done_s: float = math.nan
    prompt_tokens: int = 0
    computed_tokens: int = 0
    reused: dict[str, int] = field(default_factory=lambda: {"device": 0, "dram": 0, "ssd": 0, "remote": 0})
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    prefetch_hit_chunks: int = 0
    prefill_s: float = 0.0
    stall_s: float = 0.0
    blended_tokens: int = 0  # blend mode: placed from position-independent KV cached before the request
    placed_tokens: int = 0  # blend mode: every placed token (blended, and those of documents computed in isolation)
    isolated_tokens: int = 0  # computed by blend mode's isolated prefills of documents (anchor included)
    forward_steps: int = 0  # forward steps of its prefill (blend mode's isolated prefills included)

    @property
    def exact_tokens(self) -> int:
        """Prompt tokens reused exactly (the prefix match, every tier)."""
        return sum(self.reused.values())

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        return self.start_s - self.arrival_s


@dataclass
class SimResult:
    """One trace served: per-request outcomes, the makespan (virtual seconds) and the wall time it took to
    simulate, the cache engine's counters after the trace (None for a system without a cache), the simulator's
    own counters (bytes, busy seconds, prefetch issue/skip counts), and the executed chunk trace when recorded."""

    system: str
    outcomes: list[RequestOutcome]
    duration_s: float
    wall_s: float
    cache_stats: CacheStats | None
    counters: dict[str, float]
    trace: list[list[tuple[bytes, int, int]]] | None = None


@dataclass
class _Running:
    out: RequestOutcome
    remaining: int  # decode steps left
    context: int  # tokens in its KV now
    last_token_s: float
    reserved: int  # tokens reserved in the KV pool


@dataclass
class _Prefill:
    """One request's prefill once begun: its lease, its modelled forward steps and how far they got."""

    req: SimRequest
    lease: Any
    ssd_read: list[int]  # plan indices read from SSD (or fetched remotely): copied to DRAM at the end
    steps: list[int]  # tokens of each forward step still to run, in order
    step_s: list[float]  # their modelled seconds
    position: int  # tokens [0, position) are in the request's KV
    stored: int  # plan chunks [0, stored) are cached (matched or inserted)
    ends: list[int] = field(default_factory=list)  # the position each step of ``steps`` ends at, in order
    layers_done: int = 0  # layers of steps[0] already run (engine-steps: a step paused by the ITL budget)
    began_s: float = math.inf  # when it began (`_begin`; the schedule's aging)
    served_s: float = 0.0  # modelled seconds of its steps run so far (the schedule's aging)
    exact_until: int | None = None  # blend: plan chunks ending after this position are never inserted
    blend_leases: list[Any] = field(default_factory=list)  # blend: documents' chains pinned until placed


@dataclass
class _BlendPrep:
    """Blend mode's part of one prefill (`Simulator._blend_prep`): the compute spans ``[start, end)`` after the
    exact prefix, the placed tokens (``placed``: all of them; ``blended``: those whose position-independent KV was
    cached before the request; by where their KV comes from, ``memory``: leased DRAM chains, loaded host -> device,
    the rest already on the device), the isolated prefills' seconds, tokens and forward steps, the position from
    which nothing is inserted, and the leases of the placed chains."""

    computes: list[tuple[int, int]]
    placed: int
    blended: int
    memory: int
    exact_until: int
    prelude_s: float
    isolated_tokens: int
    isolated_steps: int
    leases: list[Any]


@dataclass
class _Row:
    """A row of the ``engine-steps`` executor: a request waiting to begin its prefill (both None), prefilling,
    or decoding."""

    req: SimRequest
    prefill: _Prefill | None = None
    decode: _Running | None = None


class Simulator:
    """Runs one system over one or more traces (:meth:`run`), then :meth:`close`."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.sys = config.system
        self.cm = CostModel(config.profile)
        self.clock = ManualClock(0.0)
        self.kv_bytes_per_token = config.profile.kv_bytes_per_token
        self.num_layers = config.profile.num_layers
        self.engine = self._make_engine() if self.sys.reuse else None
        self._uses_window = self.engine is not None and self.sys.uses_window
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self.waiting: deque[SimRequest] = deque()  # arrival order; admitted in `_admission_order`
        self._prefilling: frozenset[bytes] = frozenset()  # chunk keys of the prefill in flight
        self._aging = 1024 / self.cm.compute_only_s((1024,))  # the profile's prefill speed, tokens/s
        self._prefill_chunk_tokens = int(engine_default("prefill_chunk_tokens"))  # the "engine" steps' size
        self.running: list[_Running] = []
        self.rows: list[_Row] = []  # engine-steps: requests holding a row, in admission order
        self.budget = StepBudget(self.num_layers, config.itl_budget_steps)
        self.exec_busy = False
        self.ssd_demand_free = 0.0  # on-demand SSD reads (priority) keep the device busy until then
        self.pf_queue: deque[bytes] = deque()  # prefetch reads waiting for the device, in issue order
        self.pf_current: tuple[bytes, float] | None = None  # the prefetch read on the device and its end
        self.ssd_write_free = 0.0
        self.inflight: set[bytes] = set()  # queued or on the device
        self.key_bytes: dict[bytes, int] = {}
        self.outcomes: dict[int, RequestOutcome] = {}
        self.ssd_at_entry: dict[int, frozenset[bytes]] = {}
        self.pool_used = 0
        self.counters: dict[str, float] = dict.fromkeys(
            (
                "prefetch_issued", "prefetch_loaded", "prefetch_wasted", "ssd_read_bytes", "ssd_read_busy_s",
                "ssd_write_bytes", "ssd_write_busy_s", "h2d_bytes", "d2h_bytes", "compute_busy_s", "decode_steps",
                "inserts_rejected", "max_queue", "prefetch_skipped", "remote_read_bytes", "remote_read_s", "remote_write_bytes",
            ),
            0,
        )
        self.trace: list[list[tuple[bytes, int, int]]] | None = [] if config.record_trace else None
        #: How long fetching remote chunks takes: ``(now, [(key, bytes), ...]) -> seconds``; None: the link's
        #: ``fetch_s`` of their bytes. A fleet sets it to its store's model (`pcr_rag.sim.fleet`: a node or the
        #: shards of a cluster, shared by every replica).
        self.remote_fetch: Callable[[float, list[tuple[bytes, int]]], float] | None = None
        #: Chunks this replica offered to the remote tier (key -> bytes; with a remote tier only): every chunk
        #: inserted locally is written through (`CacheManager.insert`).
        self.remote_offered: dict[bytes, int] = {}
        self.remote_tracked = self.engine is not None and self.engine.remote is not None
        self._next_arrival = math.inf
        self._t_end = 0.0

    # ---------------------------------------------------------------------------------------------- set-up
    def _make_engine(self) -> CacheManager:
        cfg, sysm = self.cfg, self.sys
        if sysm.device_cache:
            dram, ssd = int(cfg.device_cache_bytes), 0
        else:
            dram, ssd = int(cfg.dram_bytes), int(cfg.ssd_bytes) if sysm.ssd else 0
        cache_cfg = CacheConfig(
            chunk_size=cfg.chunk_size, dram_bytes=dram, ssd_bytes=ssd, policy=sysm.policy, sync_io=True,
            pin_memory=False, fsync=False, drop_page_cache=False,
        )
        storage = MemoryBackend() if ssd > 0 else None
        link = cfg.remote
        if link is not None and not sysm.device_cache:
            cache_cfg.remote = RemoteConfig(f"memory://{cfg.remote_store}", capacity_bytes=1 << 50, secret=SIM_SECRET,
                                            kv_layout=_virtual_layout(self.num_layers, self.kv_bytes_per_token))
        engine = CacheManager(cache_cfg, clock=self.clock, storage=storage)
        if engine.remote is not None and link is not None:  # the decision sees the link's and the model's speeds
            engine.remote.client.observe(rtt_s=link.rtt_s, read_bytes_per_s=link.bytes_per_s)
            tokens = cfg.chunk_size
            chunk_s = self.cm.compute_only_s((tokens,), cached_tokens=tokens) - cfg.profile.request_overhead_s
            engine.record_compute(tokens, chunk_s)
        return engine

    def _push(self, t: float, kind: int, data: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    # ------------------------------------------------------------------------------------------------- run
    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        """Serve ``requests`` (arrival times relative to this trace's start) to completion and return what each
        cost. May be called again with another trace: the cache keeps its state (like a bench engine that serves
        warm-up and then every rate), and the new trace starts when the previous one has finished."""
        wall0 = time.perf_counter()
        offset = self.open_trace()
        reqs = sorted(requests, key=lambda r: (r.arrival_s, r.rid))
        i = 0
        n = len(reqs)
        while True:
            t_arr = offset + reqs[i].arrival_s if i < n else math.inf
            t_ev = self.next_event_s()
            if t_arr == math.inf and t_ev == math.inf:
                break
            if t_arr <= t_ev:
                i += 1
                self.arrive(reqs[i - 1], t_arr, offset + reqs[i].arrival_s if i < n else math.inf)
                continue
            self.step_event()
        return self.close_trace(reqs, offset, wall0)

    # The pieces of `run`, public so that `pcr_rag.sim.fleet` can interleave several simulators on one time line.
    @property
    def trace_end_s(self) -> float:
        """When the last trace served ended (virtual seconds): a new trace's arrival times count from here."""
        return self._t_end

    def open_trace(self, offset: float | None = None) -> float:
        """Start a trace at ``offset`` (default: the end of the previous one; never before it): counters and
        outcomes reset. Returns the offset."""
        offset = self._t_end if offset is None else max(offset, self._t_end)
        self._t_end = offset
        for k in self.counters:
            self.counters[k] = 0
        if self.trace is not None:
            self.trace = []
        self.outcomes = {}
        return offset

    def next_event_s(self) -> float:
        """The virtual time of the next internal event (inf: none pending)."""
        return self._events[0][0] if self._events else math.inf

    def arrive(self, req: SimRequest, now: float, next_arrival: float) -> None:
        """``req`` arrives at ``now`` (absolute virtual seconds); ``next_arrival``: when the next request may
        arrive (the batched executors stop a decode run there to admit it; inf: no more)."""
        self.clock.set(now)
        self._next_arrival = next_arrival
        self._on_arrival(req, now)

    def set_next_arrival(self, next_arrival: float) -> None:
        """When the next request may arrive (see `arrive`)."""
        self._next_arrival = next_arrival

    def step_event(self) -> None:
        """Handle the next internal event (call only when `next_event_s` is finite)."""
        t, _, kind, data = heapq.heappop(self._events)
        self.clock.set(t)
        if kind == _PREFILL_DONE:
            self._on_prefill_done(data, t)
        elif kind == _EXEC_READY:
            self.exec_busy = False
            self._exec_ready(t, self._next_arrival)
        elif kind == _PREFETCH_DONE:
            self._on_prefetch_done(data, t)

    def load(self) -> int:
        """Requests in this replica now: waiting, prefilling or decoding (what a least-loaded router counts)."""
        busy = 1 if self._prefilling and self.cfg.executor_kind != "engine-steps" else 0
        return len(self.waiting) + len(self.running) + len(self.rows) + busy

    def close_trace(self, reqs: Sequence[SimRequest], offset: float, wall0: float) -> SimResult:
        """The result of the trace opened at ``offset``, once every request of ``reqs`` (its requests, in arrival
        order) is done; ``wall0``: the ``perf_counter`` reading when it started."""
        stats = self.engine.stats() if self.engine is not None else None
        outs = [self.outcomes[r.rid] for r in reqs]
        end = max((o.done_s for o in outs), default=offset)
        self._t_end = max(end, self.clock.now())
        return SimResult(self.sys.name, outs, end - offset, time.perf_counter() - wall0, stats, dict(self.counters),
                         self.trace)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    # -------------------------------------------------------------------------------------------- handlers
    def _on_arrival(self, req: SimRequest, now: float) -> None:
        self.outcomes[req.rid] = RequestOutcome(req.rid, now, prompt_tokens=req.prompt_tokens,
                                                output_tokens=req.output_tokens)
        self.waiting.append(req)
        if len(self.waiting) > self.counters["max_queue"]:
            self.counters["max_queue"] = len(self.waiting)
        if self.engine is not None and self.sys.ssd and self.sys.prefetch:
            m = self.engine.match(req.keys)
            ssd = frozenset(k for k, t in zip(m.keys, m.tiers, strict=False) if t is Tier.SSD)
            if ssd:
                self.ssd_at_entry[req.rid] = ssd
        if not self.exec_busy:
            self._exec_ready(now, self._next_arrival)
        elif len(self.waiting) <= self.sys.window or self.sys.schedule != "fcfs":  # it may rank into the window
            self._refresh_prefetch(now)

    def _exec_ready(self, now: float, next_arrival: float) -> None:
        if self.exec_busy:
            return
        if self.cfg.executor_kind == "engine-steps":
            self._engine_step(now)
            return
        if self.waiting:
            head = self._admission_order(now)[0]
            if self._can_admit(head):
                self.waiting.remove(head)
                self._start_prefill(head, now)
                return
        if self.running:
            self._decode(now, next_arrival)

    def _admission_order(self, now: float) -> list[SimRequest]:
        """The waiting requests in the order the runtime's schedule admits them (see the module docstring)."""
        waiting = list(self.waiting)
        if self.sys.schedule == "fcfs" or len(waiting) < 2:
            return waiting
        order = queue_order(self.sys.schedule, len(waiting), lambda i: self._outlook(waiting[i]), self._prefilling,
                            now, self._aging)
        return [waiting[i] for i in order]

    def _outlook(self, req: SimRequest) -> PrefillOutlook:
        """``req`` as the runtime's waiting queue sees it (`pcr_rag.sched.lookahead.QueueOutlook`): the tokens it would
        compute if admitted now and its plan chunks after the cache's match."""
        match = None if self.engine is None else self.engine.match(req.keys)
        return PrefillOutlook.not_begun(self.outcomes[req.rid].arrival_s, req.prompt_tokens, req.plan, match)

    def _can_admit(self, req: SimRequest) -> bool:
        if len(self.running) >= self.cfg.max_batch:
            return False
        pool = self.cfg.kv_pool_tokens
        if pool is None or not self.running:
            return True
        return self.pool_used + req.prompt_tokens + req.output_tokens <= pool

    # -------------------------------------------------------------------------------------------- prefill
    def _start_prefill(self, req: SimRequest, now: float) -> None:
        """Serial and prefill-first executors: the whole prefill as one event."""
        self.outcomes[req.rid].start_s = now
        self._prefilling = frozenset(req.keys)
        self.pool_used += req.prompt_tokens + req.output_tokens  # its KV slots, until it finishes
        run = self._begin(req, now)
        self.exec_busy = True
        self._push(now + sum(run.step_s), _PREFILL_DONE, run)

    def _begin(self, req: SimRequest, now: float) -> _Prefill:
        """Lease the cached prefix (``acquire(keys, max_chunks=len(plan) - 1)``, as the runtime's `PrefillTask`)
        and model the prefill's forward steps: their tokens and seconds (loads, stalls, remote fetches included)."""
        out = self.outcomes[req.rid]
        plan = req.plan
        kb = self.kv_bytes_per_token
        lease = None
        matched = 0
        tiers: list[Tier] = []
        if self.engine is not None:
            for c in plan:
                if c.key not in self.key_bytes:
                    self.key_bytes[c.key] = c.num_tokens * kb
            lease = self.engine.acquire(req.keys, max_chunks=len(plan) - 1)
            matched = lease.num_chunks
            tiers = list(lease.tiers[:matched])
        if self.trace is not None:
            self.trace.append([(c.key, c.num_tokens * kb, c.num_tokens) for c in plan])
        self._refresh_prefetch(now)  # the window slid past this request
        reused = out.reused
        ssd_tokens = ssd_chunks = 0
        ssd_keys = self.ssd_at_entry.pop(req.rid, frozenset())
        ssd_read: list[int] = []
        remote_tokens = 0
        for idx, (c, tier) in enumerate(zip(plan, tiers, strict=False)):
            if self.sys.device_cache:
                tier = Tier.DEVICE
            reused[tier.value] += c.num_tokens
            if tier is Tier.REMOTE:
                remote_tokens += c.num_tokens
                ssd_read.append(idx)  # kept in DRAM afterwards, like a chunk read from SSD
            elif tier is Tier.SSD:
                ssd_tokens += c.num_tokens
                ssd_chunks += 1
                ssd_read.append(idx)
            elif c.key in ssd_keys:
                out.prefetch_hit_chunks += 1
        cached = plan[matched - 1].end if matched else 0
        blend = None
        if self.engine is not None and self.sys.blend and req.documents:
            blend = self._blend_prep(req, cached, now)
        if blend is None:
            spans = [(cached, req.prompt_tokens)]
            out.computed_tokens = req.prompt_tokens - cached
        else:
            spans = blend.computes
            out.blended_tokens, out.placed_tokens = blend.blended, blend.placed
            out.isolated_tokens = blend.isolated_tokens
            out.computed_tokens = req.prompt_tokens - cached - blend.blended
        pieces = self._step_pieces(plan, spans) or [((cached, cached),)]  # an empty plan: one step of nothing
        steps = tuple(sum(hi - lo for lo, hi in step) for step in pieces)
        starts = [step[0][0] for step in pieces]
        ends = [step[-1][1] for step in pieces]
        if self.engine is None:
            step_s = [self.cm.compute_only_s((n,), cached_tokens=starts[i])
                      - (self.cm.profile.request_overhead_s if i else 0.0) for i, n in enumerate(steps)]
            stall = 0.0
            self.counters["compute_busy_s"] += sum(step_s)
        else:
            prelude = blend.prelude_s if blend is not None else 0.0
            ssd_wait = 0.0
            if ssd_tokens:
                # on-demand reads go before queued prefetches, after the read on the device now (the isolated
                # prefills of blend mode run before the prefix load starts)
                busy_until = max(self.ssd_demand_free, self.pf_current[1] if self.pf_current else 0.0)
                ssd_wait = max(0.0, busy_until - now - prelude)
            exact_until = req.prompt_tokens if blend is None else blend.exact_until
            work = PrefillWork(
                cached_tokens=cached,
                compute_steps=steps,
                device_tokens=reused["device"],
                dram_tokens=reused["dram"] + remote_tokens + (blend.memory if blend is not None else 0),
                ssd_tokens=ssd_tokens,
                ssd_chunks=ssd_chunks,
                ssd_wait_s=ssd_wait,
                promote_tokens=ssd_tokens,
                offload=not self.sys.device_cache,
                step_context=tuple(starts) if blend is not None else (),
                step_offload=tuple(sum(max(0, min(hi, exact_until) - lo) for lo, hi in step) for step in pieces)
                if blend is not None else (),
                placed_tokens=blend.placed if blend is not None else 0,
                step_pairs=tuple(sum(attention_pairs(lo, hi) for lo, hi in step) for step in pieces)
                if blend is not None else (),
            )
            cost = self.cm.prefill(work, overlap=self.sys.overlap)
            step_s, stall = list(cost.step_s), cost.stall_s
            if prelude:
                step_s[0] += prelude
            if remote_tokens and self.cfg.remote is not None:  # fetched whole before the prefill starts
                fetch = self._remote_fetch_s(now, [(plan[i].key, plan[i].num_tokens * kb) for i in ssd_read
                                                   if tiers[i] is Tier.REMOTE], remote_tokens * kb)
                step_s[0] += fetch
                stall += fetch
            if ssd_tokens:
                busy = cost.ssd_read_s
                self.ssd_demand_free = now + prelude + ssd_wait + busy
                self.counters["ssd_read_bytes"] += ssd_tokens * kb
                self.counters["ssd_read_busy_s"] += busy
            self.counters["compute_busy_s"] += cost.compute_s
            self.counters["h2d_bytes"] += (work.dram_tokens - remote_tokens + ssd_tokens) * kb
            if work.offload:
                self.counters["d2h_bytes"] += (sum(work.offload_of(i) for i in range(len(steps))) + ssd_tokens) * kb
        if len(step_s) != len(steps):  # a step of no tokens (an empty plan): one step of everything
            steps, step_s, ends = (sum(steps),), [sum(step_s)], [ends[-1]]
        out.forward_steps = len(steps) + (blend.isolated_steps if blend is not None else 0)
        out.prefill_s = sum(step_s)
        out.stall_s = stall
        if self.sys.device_cache:
            self._trim_device_cache()
        run = _Prefill(req, lease, ssd_read, list(steps), step_s, cached, matched, ends=ends, began_s=now)
        if blend is not None:
            run.exact_until, run.blend_leases = blend.exact_until, blend.leases
        return run

    def _step_pieces(self, plan: Sequence[ChunkSpec], spans: Sequence[tuple[int, int]],
                     budget: int | None = None) -> list[tuple[tuple[int, int], ...]]:
        """The forward steps computing ``spans`` (``[start, end)``, in order; empty ones ignored) in the profile's
        step mode, each as the spans' pieces it computes: ``engine``: the runtime's steps of ``budget`` tokens
        (default ``prefill_chunk_tokens``; `engine_steps`: contiguous ones cut at attention blocks, and blend
        mode's scattered ones across several spans); ``per_chunk``: each span cut at the plan's chunk boundaries,
        one step per piece; ``single``: one forward over every span. No spans: no steps."""
        spans = [(lo, hi) for lo, hi in spans if hi > lo]
        if not spans:
            return []
        mode = self.cfg.steps_mode
        if mode == "engine":
            return engine_steps(spans, budget or self._prefill_chunk_tokens, ATTENTION_BLOCK)
        if mode == "per_chunk":
            return [((max(c.start, lo), min(c.end, hi)),) for lo, hi in spans for c in plan
                    if c.end > lo and c.start < hi]
        return [tuple(spans)]

    def _remote_fetch_s(self, now: float, chunks: list[tuple[bytes, int]], nbytes: int) -> float:
        """Seconds to fetch ``chunks`` (key, bytes) whole from the remote tier (the link's model, or the fleet's
        `remote_fetch`), counted in the remote counters."""
        assert self.cfg.remote is not None
        fetch = self.cfg.remote.fetch_s(nbytes) if self.remote_fetch is None else self.remote_fetch(now, chunks)
        self.counters["remote_read_bytes"] += nbytes
        self.counters["remote_read_s"] += fetch
        return fetch

    # ------------------------------------------------------------------------------------------------ blend
    def _blend_prep(self, req: SimRequest, exact_end: int, now: float) -> _BlendPrep:
        """Blend mode's spans after the exact prefix ending at ``exact_end`` (see the module docstring), with each
        placed document's KV got as the runtime gets it (`PrefillTask._document_kv`): a chain wholly in memory is
        leased; one whose cached chunks the load-or-recompute planner declines to load is computed in place (not
        placed); any other is prefilled in isolation first (`_isolated_prefill`, its seconds summed into
        ``prelude_s``). The first document after the exact match whose chain is not wholly cached is computed in
        context (`PrefillTask._begin_blend`). Placed tokens count as blended where their isolated KV came from the
        cache: all of a leased chain's, and of an isolated prefill's those below the prefix it loaded."""
        docs = req.documents
        bdocs = [BlendDocument(d.start, d.end, b"") for d in docs]
        total, frac = req.prompt_tokens, self.sys.blend_recompute
        wanted = [i for i, d in enumerate(docs) if d.end > exact_end]
        if wanted and docs[wanted[0]].start >= exact_end:
            first = docs[wanted[0]]
            self._note_bytes(first.plan)
            if len(self.engine.match(first.keys).keys) < len(first.plan):
                wanted = wanted[1:]  # seen for the first time right after the exact match: computed in context
        kept: list[int] = []
        leases: list[Any] = []
        memory_docs: set[int] = set()
        cached_upto: dict[int, int] = {}  # per placed document: isolated positions below this came from the cache
        prelude = 0.0
        isolated = steps = 0
        for span in blend_spans(total, exact_end, bdocs, wanted, frac):
            if not span.placed:
                continue
            doc = docs[span.document]
            self._note_bytes(doc.plan)
            n = doc.plan[-1].end
            lease = self.engine.acquire(doc.keys, prompt_tokens=n)
            in_memory = lease.num_chunks == len(doc.plan) and all(
                t in (Tier.DRAM, Tier.DEVICE) for t in lease.tiers[: lease.num_chunks])
            if in_memory:
                leases.append(lease)
                memory_docs.add(span.document)
                cached_upto[span.document] = n
            else:
                declined = lease.num_chunks < len(self.engine.match(doc.keys).keys)
                lease.release()
                if declined:  # the load-or-recompute planner would rather compute it: in place, not placed
                    continue
                seconds, tokens, forwards, loaded = self._isolated_prefill(doc, now + prelude, total)
                prelude += seconds
                isolated += tokens
                steps += forwards
                cached_upto[span.document] = loaded
            kept.append(span.document)
        spans = blend_spans(total, exact_end, bdocs, kept, frac)
        placed = [sp for sp in spans if sp.placed]
        blended = 0
        for sp in placed:
            doc = docs[sp.document]
            lo = doc.anchor_tokens + sp.start - doc.start  # the span's positions in the isolated prompt
            blended += max(0, min(doc.anchor_tokens + sp.end - doc.start, cached_upto[sp.document]) - lo)
        memory = 0 if self.sys.device_cache else sum(sp.end - sp.start for sp in placed if sp.document in memory_docs)
        return _BlendPrep(
            computes=[(sp.start, sp.end) for sp in spans if not sp.placed],
            placed=sum(sp.end - sp.start for sp in placed),
            blended=blended,
            memory=memory,
            exact_until=placed[0].start if placed else total,
            prelude_s=prelude,
            isolated_tokens=isolated,
            isolated_steps=steps,
            leases=leases,
        )

    def _isolated_prefill(self, doc: SimDocument, now: float, budget: int) -> tuple[float, int, int, int]:
        """Prefill ``doc``'s chain ``[anchor][document]`` on its own, starting at ``now`` (the runtime's isolated
        `PrefillTask`, advanced with a budget of ``budget`` tokens, the request's prompt length: its cached chunks
        loaded from their tiers, the rest computed behind them, the last position always; computed chunks inserted,
        SSD- and remote-read ones kept in DRAM). Returns (seconds, tokens computed, forward steps, the position
        below which its KV came from the cache); the request overhead is the request's own, not counted here."""
        plan, kb, p = doc.plan, self.kv_bytes_per_token, self.cm.profile
        n = plan[-1].end
        lease = self.engine.acquire(doc.keys, prompt_tokens=n)
        try:
            m = lease.num_chunks
            memory = ssd_tokens = ssd_chunks = remote_tokens = 0
            read: list[ChunkSpec] = []
            remote: list[tuple[bytes, int]] = []
            for c, tier in zip(plan[:m], lease.tiers[:m], strict=True):
                if self.sys.device_cache or tier is Tier.DEVICE:
                    continue
                if tier is Tier.SSD:
                    ssd_tokens += c.num_tokens
                    ssd_chunks += 1
                    read.append(c)
                elif tier is Tier.REMOTE:
                    remote_tokens += c.num_tokens
                    remote.append((c.key, c.num_tokens * kb))
                    read.append(c)
                else:
                    memory += c.num_tokens
            position = min(plan[m - 1].end, n - 1) if m else 0
            ssd_wait = 0.0
            if ssd_tokens:
                busy_until = max(self.ssd_demand_free, self.pf_current[1] if self.pf_current else 0.0)
                ssd_wait = max(0.0, busy_until - now)
            steps = tuple(hi - lo for step in self._step_pieces(plan, [(position, n)], budget) for lo, hi in step)
            work = PrefillWork(cached_tokens=position, compute_steps=steps, dram_tokens=memory + remote_tokens,
                               ssd_tokens=ssd_tokens, ssd_chunks=ssd_chunks, ssd_wait_s=ssd_wait,
                               promote_tokens=ssd_tokens, offload=not self.sys.device_cache)
            cost = self.cm.prefill(work, overlap=self.sys.overlap)
            seconds = cost.total_s - p.request_overhead_s
            if remote_tokens and self.cfg.remote is not None:
                seconds += self._remote_fetch_s(now, remote, remote_tokens * kb)
            if ssd_tokens:
                self.ssd_demand_free = now + ssd_wait + cost.ssd_read_s
                self.counters["ssd_read_bytes"] += ssd_tokens * kb
                self.counters["ssd_read_busy_s"] += cost.ssd_read_s
            self.counters["compute_busy_s"] += cost.compute_s
            self.counters["h2d_bytes"] += (memory + ssd_tokens) * kb
            if work.offload:
                self.counters["d2h_bytes"] += (n - position + ssd_tokens) * kb
            self._insert_specs(plan[m:], now + seconds)
            for c in read:  # kept in DRAM, as the isolated task's promotion (and remote load) does
                fresh = self.remote_tracked and not self.engine.tiers_of(c.key)
                if self.engine.insert(c, VirtualPayload(c.num_tokens * kb, self.num_layers)) and fresh:
                    self._offered(c.key, c.num_tokens * kb)
        finally:
            lease.release()
        return seconds, n - position, len(steps), position

    def _note_bytes(self, plan: Sequence[ChunkSpec]) -> None:
        for c in plan:
            if c.key not in self.key_bytes:
                self.key_bytes[c.key] = c.num_tokens * self.kv_bytes_per_token

    def _on_prefill_done(self, run: _Prefill, now: float) -> None:
        self._prefilling = frozenset()
        self._end_prefill(run, now)
        req = run.req
        out = self.outcomes[req.rid]
        steps = req.output_tokens - 1
        reserve = req.prompt_tokens + req.output_tokens
        if steps <= 0:
            out.done_s = now
            self.pool_used -= reserve
        else:
            self.running.append(_Running(out, steps, req.prompt_tokens + 1, now, reserve))
        if self.sys.device_cache:
            self._trim_device_cache()
        self.exec_busy = False
        self._exec_ready(now, self._next_arrival)

    def _end_prefill(self, run: _Prefill, now: float) -> None:
        """The prompt is complete (first token at ``now``): insert what is left of the computed chunks, keep a DRAM
        copy of those read from SSD on demand, release the lease - as the runtime does."""
        self.outcomes[run.req.rid].first_token_s = now
        if self.engine is not None:
            self._store_computed(run, run.req.prompt_tokens, now)
            for i in run.ssd_read:
                c = run.req.plan[i]
                fresh = self.remote_tracked and not self.engine.tiers_of(c.key)
                payload = VirtualPayload(c.num_tokens * self.kv_bytes_per_token, self.num_layers)
                if self.engine.insert(c, payload) and fresh:
                    self._offered(c.key, c.num_tokens * self.kv_bytes_per_token)
            run.lease.release()
            for lease in run.blend_leases:
                lease.release()
            run.blend_leases = []
        self._refresh_prefetch(now)

    def _store_computed(self, run: _Prefill, position: int, now: float) -> None:
        """Insert the computed plan chunks that end by ``position`` (and by ``run.exact_until``: blend mode inserts
        nothing computed after a placed document) and are not stored yet."""
        plan = run.req.plan
        limit = position if run.exact_until is None else min(position, run.exact_until)
        upto = run.stored
        while upto < len(plan) and plan[upto].end <= limit:
            upto += 1
        self._insert_specs(plan[run.stored:upto], now)
        run.stored = upto

    def _insert_specs(self, specs: Sequence[ChunkSpec], now: float) -> None:
        """Insert computed chunks (metadata-only payloads); the SSD write-back of their bytes is busy time on the
        write channel from ``now``; chunks new to this replica are offered to the remote tier."""
        kb = self.kv_bytes_per_token
        written = ops = 0
        for c in specs:
            fresh = self.remote_tracked and not self.engine.tiers_of(c.key)
            if self.engine.insert(c, VirtualPayload(c.num_tokens * kb, self.num_layers)):
                written += c.num_tokens * kb
                if fresh:
                    self._offered(c.key, c.num_tokens * kb)
            else:
                self.counters["inserts_rejected"] += 1
            ops += 1
        if self.sys.ssd and written:
            start = max(now, self.ssd_write_free)
            busy = self.cm.ssd_write_s(written, ops=ops)
            self.ssd_write_free = start + busy
            self.counters["ssd_write_bytes"] += written
            self.counters["ssd_write_busy_s"] += busy

    def _offered(self, key: bytes, nbytes: int) -> None:
        """A chunk new to this replica landed locally and went on to the store (its bytes cross the network:
        ``SET NX`` sends the value whether or not another replica stored it first)."""
        self.remote_offered[key] = nbytes
        self.counters["remote_write_bytes"] += nbytes

    def _trim_device_cache(self) -> None:
        """Keep cached prefixes + running requests' KV within the device pool (the cache gives way)."""
        used = self.engine.stats().bytes_used["dram"]
        over = used + self.pool_used * self.kv_bytes_per_token - self.cfg.device_cache_bytes
        if over > 0:
            self.engine.evict(Tier.DRAM, over)

    # -------------------------------------------------------------------------------------------- decode
    def _decode(self, now: float, next_arrival: float) -> None:
        """Decode steps for all running requests until one finishes or (when a new request could be admitted)
        the next arrival; then hand the executor back."""
        cm = self.cm
        run = self.running
        t = now
        admit_possible = len(run) < self.cfg.max_batch
        finished = False
        steps = 0
        while not finished:
            ctx = sum(r.context for r in run)
            dt = cm.decode_step_s(ctx)  # weights read once per step; every sequence's KV read
            t += dt
            steps += 1
            for r in run:
                r.out.itl_s.append(t - r.last_token_s)
                r.last_token_s = t
                r.remaining -= 1
                r.context += 1
                if r.remaining == 0:
                    finished = True
            if admit_possible and t >= next_arrival:
                break
        self.counters["decode_steps"] += steps
        self.counters["compute_busy_s"] += t - now
        still: list[_Running] = []
        for r in run:
            if r.remaining == 0:
                r.out.done_s = t
                self.pool_used -= r.reserved
            else:
                still.append(r)
        self.running = still
        self.exec_busy = True
        self._push(t, _EXEC_READY, None)

    # --------------------------------------------------------------------------------------- engine steps
    def _engine_step(self, now: float) -> None:
        """One step of the runtime's executor (`BatchExecutor.step`): free rows go to the waiting queue's head (in
        the schedule's order), then one decode step over every decoding row, then one prefill step (or the part of
        it the ITL budget allows while rows decode)."""
        while self.waiting and len(self.rows) < self.cfg.max_batch:
            head = self._admission_order(now)[0]
            self.waiting.remove(head)
            self.outcomes[head.rid].start_s = now
            self.pool_used += head.prompt_tokens + head.output_tokens
            self.rows.append(_Row(head))
            self._update_in_flight()
            self._refresh_prefetch(now)  # the window slid past this request
        if not self.rows:
            return
        t = now
        decoding = [r for r in self.rows if r.decode is not None]
        if decoding:
            dt = self.cm.decode_step_s(sum(r.decode.context for r in decoding), rows=len(decoding))
            t += dt
            self.budget.record_decode(dt)
            self.counters["decode_steps"] += 1
            self.counters["compute_busy_s"] += dt  # prefill compute is counted when it begins (`_begin`)
            for row in decoding:
                d = row.decode
                d.out.itl_s.append(t - d.last_token_s)
                d.last_token_s = t
                d.remaining -= 1
                d.context += 1
                if d.remaining == 0:
                    self._release_row(row, t)
        prefilling = [r for r in self.rows if r.decode is None]
        if prefilling:
            t = self._prefill_step(self._next_prefill(prefilling, t), t)
        self.exec_busy = True
        self._push(t, _EXEC_READY, None)

    def _next_prefill(self, prefilling: list[_Row], now: float) -> _Row:
        """The prefill the runtime advances next (`BatchExecutor._next_prefill`): its schedule over
        `prefill_candidates` of the rows' outlooks."""
        outlooks = []
        for row in prefilling:
            run, arrived = row.prefill, self.outcomes[row.req.rid].arrival_s
            if run is None:
                outlooks.append(self._outlook(row.req))
            else:
                limit = row.req.prompt_tokens if run.exact_until is None else run.exact_until
                chunks = {} if self.engine is None else {c.key: c.num_tokens for c in row.req.plan[run.stored:]
                                                         if c.end <= limit}  # blend: none after a placed one
                outlooks.append(PrefillOutlook(arrived, sum(run.steps), chunks, begun=True,
                                               began_s=run.began_s, served_s=run.served_s))
        candidates = prefill_candidates(self.sys.schedule, outlooks)
        runnable = [(row, c) for row, c in zip(prefilling, candidates, strict=True) if c is not None]
        order = rank(self.sys.schedule, [c for _, c in runnable], now, self._aging)
        return runnable[order[0]][0]

    def _prefill_step(self, row: _Row, now: float) -> float:
        """Run the layers of ``row``'s next prefill step that the ITL budget allows; returns when they stop."""
        if row.prefill is None:
            row.prefill = self._begin(row.req, now)
        run = row.prefill
        n = self.num_layers
        layers = min(self.budget.layers(run.steps[0]), n - run.layers_done)
        t = now + run.step_s[0] * layers / n
        run.served_s += t - now
        run.layers_done += layers
        if run.layers_done < n:
            return t
        tokens, seconds = run.steps.pop(0), run.step_s.pop(0)
        self.budget.record_prefill(tokens, seconds)
        run.layers_done = 0
        run.position = run.ends.pop(0)
        if run.steps:
            if self.engine is not None:
                self._store_computed(run, run.position, t)
            return t
        self._end_prefill(run, t)
        req = row.req
        row.prefill = None
        if req.output_tokens <= 1:
            self._release_row(row, t)
        else:
            row.decode = _Running(self.outcomes[req.rid], req.output_tokens - 1, req.prompt_tokens + 1, t,
                                  req.prompt_tokens + req.output_tokens)
        self._update_in_flight()
        if self.sys.device_cache:
            self._trim_device_cache()
        return t

    def _release_row(self, row: _Row, now: float) -> None:
        """``row``'s request is done at ``now``: its row and KV slots are free."""
        self.outcomes[row.req.rid].done_s = now
        self.pool_used -= row.req.prompt_tokens + row.req.output_tokens
        self.rows.remove(row)

    def _update_in_flight(self) -> None:
        """The chunk keys of the admitted prefills' plans (`BatchExecutor.in_flight_keys`): the waiting queue counts
        them as on their way into the cache."""
        self._prefilling = frozenset(k for r in self.rows if r.decode is None for k in r.req.keys)

    # -------------------------------------------------------------------------------------------- prefetch
    def _refresh_prefetch(self, now: float) -> None:
        if not self._uses_window:
            return
        # as the runtime's window (`pcr_rag.sched.lookahead.build_window`): admitted prefills that have not begun, oldest first
        # (`BatchExecutor.waiting_keys`: key chains, cut at the window's size), then the waiting queue in admission
        # order (requests, each with all its chains); a blend request's documents' chains follow its own
        limit = self.sys.window
        window = [c for r in self.rows if r.prefill is None and r.decode is None for c in self._chains(r.req)][:limit]
        if len(window) < limit:
            for req in self._admission_order(now)[: limit - len(window)]:
                window += self._chains(req)
        plan = plan_prefetch(window, self.engine)
        if self.sys.lookahead:
            self.engine.set_lookahead(plan.protect)
        if not self.sys.prefetch:
            return
        for key in plan.load:
            if key not in self.inflight:
                self.inflight.add(key)
                self.pf_queue.append(key)
        if self.pf_current is None:
            self._next_prefetch(now)

    def _chains(self, req: SimRequest) -> list[tuple[bytes, ...]]:
        """The key chains the prefetch window holds for ``req``: its plan's, then (blend mode) each document's
        position-independent chain."""
        if not self.sys.blend:
            return [req.keys]
        for d in req.documents:
            self._note_bytes(d.plan)
        return [req.keys, *(d.keys for d in req.documents)]

    def _next_prefetch(self, now: float) -> None:
        """Put the next queued prefetch read on the SSD (after any on-demand read). A chunk that reached memory
        meanwhile (e.g. its request read it on demand) or left the cache is skipped at no cost, as the engine's
        loader skips it."""
        while self.pf_queue:
            key = self.pf_queue.popleft()
            tiers = self.engine.tiers_of(key)
            if Tier.SSD not in tiers or Tier.DRAM in tiers or Tier.DEVICE in tiers:
                self.inflight.discard(key)
                self.counters["prefetch_skipped"] += 1
                continue
            nbytes = self.key_bytes.get(key, 0)
            start = max(now, self.ssd_demand_free)
            busy = self.cm.ssd_read_s(nbytes)
            self.pf_current = (key, start + busy)
            self.counters["prefetch_issued"] += 1
            self.counters["ssd_read_bytes"] += nbytes
            self.counters["ssd_read_busy_s"] += busy
            self._push(start + busy, _PREFETCH_DONE, key)
            return
        self.pf_current = None

    def _on_prefetch_done(self, key: bytes, now: float) -> None:
        self.inflight.discard(key)
        loaded = self.engine.load_async([key]).result()
        if loaded:
            self.counters["prefetch_loaded"] += loaded
        else:
            self.counters["prefetch_wasted"] += 1
        self.pf_current = None
        self._next_prefetch(now)

