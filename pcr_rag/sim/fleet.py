"""The fleet at scale: N replicas (each its own real `CacheManager` on the virtual clock) behind a router, sharing
one remote tier, on a Zipf workload over many documents (`pcr-rag simulate --fleet`).

What is real: every replica is a `Simulator` (the cache engine, the runtime's prefetch plan and admission, the
executor model: `pcr_rag.sim.simulator`); their remote tiers are one in-process ``memory://`` store whose values
are sealed with `SIM_SECRET`, so a chunk one replica computes is found, verified and loaded by another exactly as
the engine does it. Payloads are metadata-only (`VirtualPayload`): no KV bytes exist, only their sizes.

What is modelled:

- **Time line.** All replicas run on one virtual time line: arrivals are routed when they happen (the router sees
  the replicas' loads then) and every replica's events interleave in time order, so a chunk written at ``t`` is
  in the store for any lookup after ``t`` (the write-through is synchronous here: no write queue delay).
- **Workload** (`FleetWorkload`): a request retrieves ``top_k`` distinct documents drawn from a Zipf law over
  ``num_documents`` ids (rank 1 the most popular), Poisson arrivals. Documents are ids only: a document's length
  and chunk keys derive from its id by hashing (`FleetTraceBuilder`), so no token list exists; the keys chain as
  `plan_chunks` chains them (system prompt, then each document keyed by everything before it, then a question of
  its own), so only requests with the same first document share KV past the system prompt.
- **Routing** (`ROUTINGS`): ``round-robin``; ``least-loaded`` (fewest requests waiting or running, ties to the
  next in turn); ``affinity`` (consistent hashing of the request's leading document on a ring of
  `RING_POINTS` points per replica; the hashed key is `pcr_rag.client.routing.routing_key` of the first document id, the
  header a real client sends); ``bounded-affinity`` (the same ring, but a replica already holding more than
  ``(1 + eps)`` times the mean load, counting the new request, passes it to the next replica on the ring: bounded-load
  consistent hashing, HAProxy's ``hash-balance-factor``).
- **Remote tier** (`REMOTE_MODES`): ``off``; ``single`` (one store node); ``cluster`` (``shards`` nodes, a chunk
  on the shard its key hashes to). Each node serves reads one after another at ``shard_bytes_per_s`` (default:
  the link's bandwidth), so replicas reading at once queue at a node; a request's remote chunks are fetched from
  their shards in parallel and arrive after ``rtt + max(slowest shard's queue + its bytes / shard bandwidth, all
  bytes / the link's bandwidth)`` (`StoreModel`). Each read's speed feeds the replica's estimate as a real client's
  reads do, so a replica facing a busy store recomputes instead of queueing (`Fleet`). Writes (write-through of every chunk new to a replica) are
  counted as network bytes but take no read bandwidth (another direction of the link).

Reported per configuration (`FleetResult`): the share of prompt tokens served by each tier (device, DRAM, SSD,
remote) and recomputed, mean and P99 TTFT, network bytes read and written, the store's memory (the KV bytes of
every distinct chunk written to it; its capacity is unbounded here), and how evenly requests spread.
"""

from __future__ import annotations

import abc
import bisect
import hashlib
import heapq
import logging
import math
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from pcr_rag.cache import namespace_key
from pcr_rag.cache.keys import ChunkSpec
from pcr_rag.cache.tiers.remote_store import MemoryRemoteStore
from pcr_rag.client.routing import routing_key
from pcr_rag.sim.experiment import Scenario, SimSettings
from pcr_rag.sim.profiles import Profile
from pcr_rag.sim.remote_link import RemoteLink
from pcr_rag.sim.simulator import SimConfig, SimResult, Simulator
from pcr_rag.sim.systems import SimSystem, get_system
from pcr_rag.sim.trace import SimRequest

log = logging.getLogger(__name__)

__all__ = [
    "REMOTE_MODES", "ROUTINGS", "Affinity", "Fleet", "FleetConfigError", "FleetResult", "FleetSpec",
    "FleetTraceBuilder", "FleetWorkload", "LeastLoaded", "Pinned", "RoundRobin", "Router", "StoreModel",
    "compare_two_replicas", "fleet_two_replicas", "make_router", "replica_capacity_rps", "run_fleet",
]

ROUTINGS = ("round-robin", "least-loaded", "affinity", "bounded-affinity")
REMOTE_MODES = ("off", "single", "cluster")
RING_POINTS = 64  # points per replica on the consistent-hash ring
TIERS = ("device", "dram", "ssd", "remote")
SPEED_EWMA = 0.2  # weight of a read's speed in the replica's estimate (the remote client's own weight)
_PERSON = b"pcr-sim-fleet"


class FleetConfigError(ValueError):
    """A fleet simulation's settings are out of range; the message names the setting and what it accepts."""


# ----------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class FleetWorkload:
    """A RAG workload over many documents (tokens; requests). Document lengths are uniform in
    ``[doc_tokens / 2, 3 * doc_tokens / 2]``, drawn from the id's hash."""

    num_documents: int = 100_000
    zipf: float = 1.0
    top_k: int = 3
    doc_tokens: int = 300
    system_tokens: int = 40
    question_tokens: int = 30
    output_tokens: int = 32
    chunk_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "num_documents": self.num_documents >= 1, "zipf": self.zipf >= 0.0,
            "top_k": 1 <= self.top_k <= self.num_documents, "doc_tokens": self.doc_tokens >= 2,
            "system_tokens": self.system_tokens >= 0, "question_tokens": self.question_tokens >= 1,
            "output_tokens": self.output_tokens >= 1, "chunk_size": self.chunk_size >= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise FleetConfigError(f"workload setting(s) out of range: {', '.join(f'{k}={getattr(self, k)!r}' for k in bad)}"
                                   " (documents >= 1, zipf >= 0, 1 <= top_k <= documents, doc_tokens >= 2, "
                                   "question/output tokens >= 1, chunk size >= 1)")


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.digest()


class FleetTraceBuilder:
    """Requests of a `FleetWorkload` as chunk plans, without token lists: a chunk's key hashes its parent key, the
    segment's label (document id, ``system`` or the request's question) and its index in the segment, so equal
    prefixes give equal keys and different ones differ, as `plan_chunks` keys do. The first document's chunks
    (whose parent is always the system prompt's last chunk) are memoised per document id."""

    def __init__(self, workload: FleetWorkload, model: str) -> None:
        self.wl = workload
        self.root = namespace_key(model, "float16", workload.chunk_size)
        self._first: dict[int, tuple[ChunkSpec, ...]] = {}
        self._system = tuple(self._segment(self.root, b"\x00system", workload.system_tokens, 0, 0))
        ranks = np.arange(1, workload.num_documents + 1, dtype=np.float64)
        weights = ranks ** -workload.zipf
        self._cdf = np.cumsum(weights / weights.sum())

    def doc_tokens(self, doc: int) -> int:
        """The length of document ``doc`` (tokens), from its id's hash."""
        u = int.from_bytes(_digest(b"len", str(self.wl.seed).encode(), str(doc).encode())[:8], "little") / 2**64
        return max(1, int(self.wl.doc_tokens * (0.5 + u)))

    def _segment(self, parent: bytes, label: bytes, n: int, offset: int, seg: int) -> list[ChunkSpec]:
        out: list[ChunkSpec] = []
        cs = self.wl.chunk_size
        for i, lo in enumerate(range(0, n, cs)):
            hi = min(lo + cs, n)
            key = _digest(parent, label, i.to_bytes(4, "little"))
            out.append(ChunkSpec(key, parent, offset + lo, offset + hi, seg, (hi - lo) < cs))
            parent = key
        return out

    def plan(self, docs: Sequence[int], rid: int) -> tuple[ChunkSpec, ...]:
        """The chunk plan of ``[system][docs...][question of request rid]``."""
        specs = list(self._system)
        parent = specs[-1].key if specs else self.root
        offset = specs[-1].end if specs else 0
        seg = 1 if specs else 0
        for j, doc in enumerate(docs):
            n = self.doc_tokens(doc)
            if j == 0:
                got = self._first.get(doc)
                if got is None:
                    got = self._first[doc] = tuple(self._segment(parent, f"doc-{doc}".encode(), n, offset, seg))
            else:
                got = tuple(self._segment(parent, f"doc-{doc}".encode(), n, offset, seg))
            specs.extend(got)
            parent, offset, seg = got[-1].key, got[-1].end, seg + 1
        specs.extend(self._segment(parent, b"\x00question" + rid.to_bytes(8, "little"), self.wl.question_tokens,
                                   offset, seg))
        return tuple(specs)

    def draw_documents(self, rng: np.random.Generator) -> list[int]:
        """``top_k`` distinct document ids (ranks from 0, 0 the most popular), in retrieval order."""
        out: list[int] = []
        while len(out) < self.wl.top_k:
            doc = int(np.searchsorted(self._cdf, rng.random(), side="right"))
            doc = min(doc, self.wl.num_documents - 1)
            if doc not in out:
                out.append(doc)
        return out

    def requests(self, n: int, rate: float, *, seed: int, first_rid: int = 0) -> list[SimRequest]:
        """``n`` requests with Poisson arrivals at ``rate`` req/s (inf: all at t=0), request ids from
        ``first_rid``."""
        rng = np.random.default_rng([self.wl.seed, seed, 17])
        gaps = np.zeros(n) if math.isinf(rate) else rng.exponential(1.0 / rate, size=n)
        t = np.cumsum(gaps)
        out = []
        for i in range(n):
            docs = self.draw_documents(rng)
            rid = first_rid + i
            out.append(SimRequest(rid, float(t[i]), self.plan(docs, rid), self.wl.output_tokens,
                                  tuple(f"doc-{d}" for d in docs)))
        return out


# -------------------------------------------------------------------------------------------------- routing
class Router(abc.ABC):
    """Picks the replica of each arriving request; ``loads()`` gives every replica's requests waiting or running."""

    def __init__(self, replicas: int) -> None:
        self.n = replicas

    @abc.abstractmethod
    def pick(self, req: SimRequest, loads: Callable[[], list[int]]) -> int:
        """The replica (0 .. replicas - 1) that serves ``req``."""


class RoundRobin(Router):
    def __init__(self, replicas: int) -> None:
        super().__init__(replicas)
        self._next = 0

    def pick(self, req: SimRequest, loads: Callable[[], list[int]]) -> int:
        i = self._next
        self._next = (i + 1) % self.n
        return i


class LeastLoaded(Router):
    """Fewest requests in the replica; ties go to the first one at or after a rotating start."""

    def __init__(self, replicas: int) -> None:
        super().__init__(replicas)
        self._start = 0

    def pick(self, req: SimRequest, loads: Callable[[], list[int]]) -> int:
        ls = loads()
        best = min(ls)
        n = self.n
        for j in range(n):
            i = (self._start + j) % n
            if ls[i] == best:
                self._start = (i + 1) % n
                return i
        raise AssertionError("unreachable: min() is one of the loads")


class Affinity(Router):
    """Consistent hashing of the leading document's routing key (`pcr_rag.client.routing.routing_key`) on a ring of
    `RING_POINTS` points per replica. With ``eps`` (bounded load): a replica whose load would exceed
    ``ceil((1 + eps) * (total load + 1) / replicas)`` with this request passes it on along the ring."""

    def __init__(self, replicas: int, eps: float | None = None) -> None:
        super().__init__(replicas)
        self.eps = eps
        points = sorted((int.from_bytes(_digest(b"ring", f"replica-{r}".encode(), p.to_bytes(4, "little"))[:8],
                                        "little"), r)
                        for r in range(replicas) for p in range(RING_POINTS))
        self._hashes = [h for h, _ in points]
        self._owners = [r for _, r in points]
        self._key_cache: dict[str, int] = {}

    def _start(self, req: SimRequest) -> int:
        doc = req.doc_ids[0] if req.doc_ids else ""
        h = self._key_cache.get(doc)
        if h is None:
            h = self._key_cache[doc] = int(routing_key([doc]), 16) if doc else 0
        return bisect.bisect_left(self._hashes, h) % len(self._hashes)

    def pick(self, req: SimRequest, loads: Callable[[], list[int]]) -> int:
        at = self._start(req)
        if self.eps is None:
            return self._owners[at]
        ls = loads()
        bound = math.ceil((1.0 + self.eps) * (sum(ls) + 1) / self.n)
        seen: set[int] = set()
        for j in range(len(self._owners)):
            r = self._owners[(at + j) % len(self._owners)]
            if r in seen:
                continue
            if ls[r] + 1 <= bound:
                return r
            seen.add(r)
            if len(seen) == self.n:
                break
        return self._owners[at]  # unreachable with eps >= 0: some replica is at or below the mean


class Pinned(Router):
    """Each request to the replica ``assign(request)`` names (experiments with a fixed placement)."""

    def __init__(self, replicas: int, assign: Callable[[SimRequest], int]) -> None:
        super().__init__(replicas)
        self.assign = assign

    def pick(self, req: SimRequest, loads: Callable[[], list[int]]) -> int:
        return self.assign(req)


def make_router(name: str, replicas: int, eps: float = 0.25) -> Router:
    """A router by name (`ROUTINGS`); ``eps``: bounded-affinity's load bound."""
    if name == "round-robin":
        return RoundRobin(replicas)
    if name == "least-loaded":
        return LeastLoaded(replicas)
    if name == "affinity":
        return Affinity(replicas)
    if name == "bounded-affinity":
        return Affinity(replicas, eps)
    raise FleetConfigError(f"unknown routing {name!r}; known: {', '.join(ROUTINGS)}")


# ---------------------------------------------------------------------------------------------- the store
class StoreModel:
    """The shared store's read path (module docstring): ``shards`` nodes, each a FIFO read channel at
    ``shard_bytes_per_s``; a chunk lives on the shard its key hashes to."""

    def __init__(self, link: RemoteLink, shards: int = 1, shard_bytes_per_s: float | None = None) -> None:
        if shards < 1:
            raise FleetConfigError(f"shards must be >= 1, got {shards}")
        self.link = link
        self.shards = shards
        self.shard_bytes_per_s = link.bytes_per_s if shard_bytes_per_s is None else float(shard_bytes_per_s)
        if not self.shard_bytes_per_s > 0:
            raise FleetConfigError(f"shard bandwidth must be > 0 bytes/s, got {shard_bytes_per_s}")
        self.free_s = [0.0] * shards  # when each node's read channel is free
        self.queued_s = 0.0  # total seconds reads waited for a busy node

    def shard_of(self, key: bytes) -> int:
        return int.from_bytes(key[:4], "little") % self.shards

    def fetch_s(self, now: float, chunks: Sequence[tuple[bytes, int]]) -> float:
        """Seconds from ``now`` until the chunks ``[(key, bytes)]`` have arrived (0 for none)."""
        if not chunks:
            return 0.0
        per: dict[int, int] = {}
        for key, nbytes in chunks:
            s = self.shard_of(key)
            per[s] = per.get(s, 0) + nbytes
        done = now
        for s, nbytes in per.items():
            start = max(now, self.free_s[s])
            self.queued_s += start - now
            end = start + nbytes / self.shard_bytes_per_s
            self.free_s[s] = end
            done = max(done, end)
        total = sum(per.values())
        return self.link.rtt_s + max(done - now, total / self.link.bytes_per_s)


# ---------------------------------------------------------------------------------------------- the fleet
class Fleet:
    """``replicas`` simulators of one configuration on one time line, sharing ``store`` when ``remote`` is set
    (see the module docstring). Serve traces with :meth:`serve`, then :meth:`close`."""

    def __init__(self, config: SimConfig, replicas: int, *, remote: RemoteLink | None = None,
                 store: StoreModel | None = None) -> None:
        if replicas < 1:
            raise FleetConfigError(f"replicas must be >= 1, got {replicas}")
        self.store_name = f"sim-fleet-{uuid.uuid4().hex}"
        cfg = replace(config, remote=remote, remote_store=self.store_name)
        self.sims = [Simulator(cfg) for _ in range(replicas)]
        self.store = store if remote is not None else None
        if self.store is not None:
            for sim in self.sims:
                sim.remote_fetch = self._fetcher(sim)

    def _fetcher(self, sim: Simulator) -> Callable[[float, list[tuple[bytes, int]]], float]:
        """``sim``'s remote reads through the store model; each read's transfer speed (its bytes over its time
        less the round trip, queueing at a node included) feeds the replica's speed estimate as the real client's
        reads do (an exponential average, weight `SPEED_EWMA`), so its load-or-recompute decision sees a busy
        store. On an idle store the speed read is the link's, so the estimate does not move."""
        store = self.store
        assert store is not None
        client = sim.engine.remote.client if sim.engine is not None and sim.engine.remote is not None else None

        def fetch(now: float, chunks: list[tuple[bytes, int]]) -> float:
            seconds = store.fetch_s(now, chunks)
            transfer = seconds - store.link.rtt_s
            if client is not None and transfer > 0:
                speed = sum(b for _, b in chunks) / transfer
                old = client.read_bytes_per_s
                client.observe(read_bytes_per_s=speed if old is None else (1 - SPEED_EWMA) * old + SPEED_EWMA * speed)
            return seconds

        return fetch

    def loads(self) -> list[int]:
        return [s.load() for s in self.sims]

    def serve(self, requests: Sequence[SimRequest], router: Router) -> tuple[list[SimResult], list[int]]:
        """Serve one trace (arrival times from its start, which is when every replica has finished the previous
        one): each request goes where ``router`` picks when it arrives. Returns each replica's result and each
        request's replica (in arrival order)."""
        wall0 = time.perf_counter()
        sims = self.sims
        offset = max(s.trace_end_s for s in sims)
        for s in sims:
            s.open_trace(offset)
        reqs = sorted(requests, key=lambda r: (r.arrival_s, r.rid))
        placed: list[list[SimRequest]] = [[] for _ in sims]
        where: list[int] = []
        heap: list[tuple[float, int]] = []
        def touch(i: int) -> None:
            t = sims[i].next_event_s()
            if t != math.inf:
                heapq.heappush(heap, (t, i))

        n = len(reqs)
        k = 0
        while True:
            t_arr = offset + reqs[k].arrival_s if k < n else math.inf
            while heap and heap[0][0] != sims[heap[0][1]].next_event_s():
                heapq.heappop(heap)  # stale: that replica's next event moved
            t_ev = heap[0][0] if heap else math.inf
            if t_arr == math.inf and t_ev == math.inf:
                break
            if t_arr <= t_ev:
                req = reqs[k]
                k += 1
                nxt = offset + reqs[k].arrival_s if k < n else math.inf
                i = router.pick(req, self.loads)
                if not 0 <= i < len(sims):
                    raise FleetConfigError(f"router picked replica {i} of {len(sims)}")
                placed[i].append(req)
                where.append(i)
                sims[i].arrive(req, t_arr, nxt)
                touch(i)
                continue
            _, i = heapq.heappop(heap)
            sims[i].set_next_arrival(t_arr)
            sims[i].step_event()
            touch(i)
        return [s.close_trace(p, offset, wall0) for s, p in zip(sims, placed, strict=True)], where

    def store_bytes(self) -> int:
        """KV bytes of the distinct chunks written to the store (0 without a remote tier)."""
        if self.store is None:
            return 0
        seen: dict[bytes, int] = {}
        for s in self.sims:
            seen.update(s.remote_offered)
        return sum(seen.values())

    def close(self) -> None:
        for s in self.sims:
            s.close()
        MemoryRemoteStore.forget(self.store_name)


# ----------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class FleetSpec:
    """One fleet configuration: replicas, routing, remote tier (``off``, ``single``, ``cluster``), link, shards,
    the load bound of bounded-affinity."""

    replicas: int
    routing: str
    remote: str
    link: RemoteLink
    shards: int = 8
    eps: float = 0.25
    shard_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise FleetConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.routing not in ROUTINGS:
            raise FleetConfigError(f"unknown routing {self.routing!r}; known: {', '.join(ROUTINGS)}")
        if self.remote not in REMOTE_MODES:
            raise FleetConfigError(f"unknown remote tier {self.remote!r}; known: {', '.join(REMOTE_MODES)}")
        if self.shards < 1 or self.eps < 0:
            raise FleetConfigError(f"need shards >= 1 and eps >= 0, got shards={self.shards}, eps={self.eps}")

    @property
    def label(self) -> str:
        remote = {"off": "off", "single": "single", "cluster": f"cluster x{self.shards}"}[self.remote]
        return f"{self.replicas} x {self.routing}, remote {remote}" + ("" if self.remote == "off" else
                                                                        f" over {self.link.name}")


@dataclass(frozen=True)
class FleetResult:
    """A configuration's measured requests (after the warm-up): tier shares of prompt tokens, TTFT (seconds),
    network bytes (read from / written to the store, over the whole run), store memory (bytes), spread
    (the busiest replica's measured requests over the mean), the seconds reads waited for a busy store node
    (``store_queue_s``, whole run) and the wall time the simulation took."""

    spec: FleetSpec
    requests: int
    rate_rps: float
    tier_share: dict[str, float]
    mean_ttft_s: float
    p99_ttft_s: float
    network_read_bytes: float
    network_write_bytes: float
    store_bytes: int
    spread: float
    store_queue_s: float
    wall_s: float

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["spec"] = {**asdict(self.spec), "link": self.spec.link.name, "label": self.spec.label}
        return d


def _percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[int(q * (len(s) - 1))] if s else math.nan


def replica_config(profile: Profile, system: SimSystem, settings: SimSettings, *, dram_bytes: int,
                   ssd_bytes: int, chunk_size: int) -> SimConfig:
    """A replica's `SimConfig`: the settings' executor and rows, the given tier capacities (bytes)."""
    caps = Scenario([], [], int(dram_bytes), int(ssd_bytes), 0, 0.0)
    return settings.config(profile, system, caps, chunk_size=chunk_size)


def replica_capacity_rps(profile: Profile, builder: FleetTraceBuilder, settings: SimSettings, *,
                         sample: int = 300) -> float:
    """One replica's no-reuse throughput (req/s) on ``sample`` requests of the workload queued at t=0 (as
    `pcr_rag.sim.experiment.no_reuse_capacity_rps`)."""
    cfg = replica_config(profile, get_system("no-reuse"), settings, dram_bytes=0, ssd_bytes=0,
                         chunk_size=builder.wl.chunk_size)
    sim = Simulator(cfg)
    try:
        res = sim.run(builder.requests(sample, math.inf, seed=99))
    finally:
        sim.close()
    if res.duration_s <= 0:
        raise FleetConfigError("the workload has no work: cannot derive a capacity")
    return len(res.outcomes) / res.duration_s


def run_fleet(profile: Profile, spec: FleetSpec, builder: FleetTraceBuilder, settings: SimSettings, *,
              rate_per_replica: float, requests_per_replica: int, warmup_fraction: float = 0.5,
              dram_bytes: int, ssd_bytes: int, system: str = "pcr", seed: int = 0) -> FleetResult:
    """One configuration: ``requests_per_replica * replicas`` Poisson requests at ``rate_per_replica * replicas``
    req/s, served continuously; the first ``warmup_fraction`` of them fill the caches and are not measured."""
    if not 0.0 <= warmup_fraction < 1.0:
        raise FleetConfigError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")
    wall0 = time.perf_counter()
    n = spec.replicas
    total = requests_per_replica * n
    rate = rate_per_replica * n
    trace = builder.requests(total, rate, seed=seed)
    warm = int(total * warmup_fraction)
    cfg = replica_config(profile, get_system(system), settings, dram_bytes=dram_bytes, ssd_bytes=ssd_bytes,
                         chunk_size=builder.wl.chunk_size)
    remote = None if spec.remote == "off" else spec.link
    store = None if remote is None else StoreModel(spec.link, spec.shards if spec.remote == "cluster" else 1,
                                                    spec.shard_bytes_per_s)
    fleet = Fleet(cfg, n, remote=remote, store=store)
    try:
        results, where = fleet.serve(trace, make_router(spec.routing, n, spec.eps))
        store_bytes = fleet.store_bytes()
    finally:
        fleet.close()
    outs = [o for res in results for o in res.outcomes if o.rid >= warm]
    prompt = sum(o.prompt_tokens for o in outs)
    reused = {t: sum(o.reused.get(t, 0) for o in outs) for t in TIERS}
    share = {t: reused[t] / prompt if prompt else 0.0 for t in TIERS}
    share["recompute"] = 1.0 - sum(share.values()) if prompt else 0.0
    ttft = [o.ttft_s for o in outs]
    counts = [0] * n
    for rid, i in enumerate(where):  # trace rids are 0..total-1 in arrival order
        if rid >= warm:
            counts[i] += 1
    mean_count = statistics.fmean(counts) if counts else 0.0
    return FleetResult(
        spec=spec, requests=len(outs), rate_rps=rate, tier_share=share,
        mean_ttft_s=statistics.fmean(ttft) if ttft else math.nan, p99_ttft_s=_percentile(ttft, 0.99),
        network_read_bytes=sum(r.counters["remote_read_bytes"] for r in results),
        network_write_bytes=sum(r.counters["remote_write_bytes"] for r in results),
        store_bytes=store_bytes, spread=max(counts) / mean_count if mean_count else math.nan,
        store_queue_s=store.queued_s if store is not None else 0.0, wall_s=time.perf_counter() - wall0,
    )


# --------------------------------------------------------------------------------------------- validation
def fleet_two_replicas(profile: Profile, scenario: Scenario, settings: SimSettings, links: Sequence[RemoteLink], *,
                       rate: float, slot: int = 0, chunk_size: int = 256) -> dict[str, Any]:
    """The two-replica experiment (`pcr_rag.sim.replicas.two_replica_experiment`) run through the fleet's code
    path: one `Fleet` of two replicas per link, a single store node of that link, requests placed as the
    experiment places them (replica 0 serves the warm-up and the measured trace, then replica 1 serves the
    measured trace cold) - the fleet's time line, routing hook, store model and counters, on the experiment's
    workload. Returns the experiment's dict layout, so the two compare figure by figure (`compare_two_replicas`)."""
    from pcr_rag.sim.experiment import at_rate
    from pcr_rag.sim.replicas import replica_summary

    base = settings.config(profile, get_system("pcr"), scenario, chunk_size=chunk_size)
    trace = at_rate(scenario.traces[slot], rate)
    warmup = at_rate(scenario.warmup, math.inf)
    to = [Pinned(2, lambda _r: 0), Pinned(2, lambda _r: 1)]
    fleet = Fleet(base, 2)
    try:
        off = replica_summary(fleet.serve(trace, to[1])[0][1])
    finally:
        fleet.close()
    out: dict[str, Any] = {"profile": profile.name, "rate": rate, "requests": len(trace), "cold_no_remote": off,
                           "links": {}}
    for link in links:
        fleet = Fleet(base, 2, remote=link, store=StoreModel(link, 1))
        try:
            if warmup:
                fleet.serve(warmup, to[0])
            fleet.serve(trace, to[0])
            cold = replica_summary(fleet.serve(trace, to[1])[0][1])
        finally:
            fleet.close()
        cold["ttft_over_no_remote"] = cold["mean_ttft_s"] / off["mean_ttft_s"] if off["mean_ttft_s"] else math.nan
        out["links"][link.name] = {"bytes_per_s": link.bytes_per_s, "rtt_s": link.rtt_s, "cold_with_remote": cold}
    return out


def compare_two_replicas(reference: dict[str, Any], fleet: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """``(figure, experiment, fleet, relative error)`` for every mean TTFT and remote-token figure of the two
    results (the no-remote replica's, then each link's cold replica's); the error is 0 where both are 0."""
    rows = []

    def add(name: str, a: float, b: float) -> None:
        err = 0.0 if a == b else (b - a) / a if a else math.inf
        rows.append((name, float(a), float(b), err))

    add("cold, no remote: mean TTFT (s)", reference["cold_no_remote"]["mean_ttft_s"],
        fleet["cold_no_remote"]["mean_ttft_s"])
    for name, ref in reference["links"].items():
        a, b = ref["cold_with_remote"], fleet["links"][name]["cold_with_remote"]
        add(f"{name}: mean TTFT (s)", a["mean_ttft_s"], b["mean_ttft_s"])
        add(f"{name}: remote tokens", a["reused_tokens"]["remote"], b["reused_tokens"]["remote"])
        add(f"{name}: reuse ratio", a["reuse_ratio"], b["reuse_ratio"])
    return rows
