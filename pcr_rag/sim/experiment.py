"""Simulation experiments, shaped like ``pcr-rag bench`` runs: warm-up, then every rate in order on one engine
per system; the prefetch-window sweep; the hit-ratio study against Belady; the speed check. Results are the bench's
report records (`pcr_rag.bench.report`).

The workload is the bench's (`pcr_rag.bench.workload.make_requests`, the same defaults): Zipf-popular topics of
``top_k`` passages, Poisson/gamma arrivals, one warm-up trace and one trace per rate slot (seeds as the bench
draws them), tier capacities as fractions of the working set of all traces. Passages are synthetic token lists
of seeded lengths unless real token counts are given. Rates are given in requests/s or as load factors of the
no-reuse system's capacity on the same traces (:func:`no_reuse_capacity_rps`), fixed before any cached system runs.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pcr_rag.bench.report import RequestSample, RunRecord
from pcr_rag.bench.workload import Request, make_requests, tier_capacities, working_set
from pcr_rag.cache import CacheStats, namespace_key
from pcr_rag.sim.belady import HitResult, TraceChunk, belady_hits_per_request
from pcr_rag.sim.profiles import Profile
from pcr_rag.sim.simulator import ENGINE_DEFAULT_ITL_BUDGET, SimConfig, SimResult, Simulator
from pcr_rag.sim.systems import SimSystem, get_system
from pcr_rag.sim.trace import SimRequest, TraceBuilder, lognormal_lengths, synthetic_tokens

log = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]


@dataclass(frozen=True)
class SimWorkload:
    """A simulated RAG workload; defaults are ``pcr-rag bench``'s (tokens, requests). ``doc_lengths`` overrides
    the synthetic passage lengths (e.g. token counts of a real corpus); its keys are then the passage ids."""

    num_requests: int = 1000
    warmup_requests: int = 16
    num_passages: int = 256
    passage_tokens: int = 300
    passage_sigma: float = 0.3
    top_k: int = 3
    num_topics: int | None = 64
    zipf: float = 1.0
    system_tokens: int = 40
    question_tokens: int = 30
    output_tokens: int = 32
    burstiness: float = 1.0
    seed: int = 0
    chunk_size: int = 256
    dram_fraction: float = 0.25
    ssd_fraction: float = 1.0
    doc_lengths: Mapping[str, int] | None = None

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("doc_lengths")
        if self.doc_lengths is not None:
            d["num_passages"] = len(self.doc_lengths)
            d["passage_tokens"] = statistics.fmean(self.doc_lengths.values())
            d["passage_sigma"] = None
        return d


@dataclass
class Scenario:
    """Everything one comparison replays: a warm-up trace (served all at once, not measured) and one trace per
    rate slot (arrival times for 1 req/s), with the tier capacities (bytes) every system gets."""

    warmup: list[SimRequest]
    traces: list[list[SimRequest]]
    dram_bytes: int
    ssd_bytes: int
    working_set_bytes: int
    reuse_upper_bound: float
    info: dict[str, Any] = field(default_factory=dict)

    def all_requests(self) -> list[SimRequest]:
        return [*self.warmup, *(r for t in self.traces for r in t)]


def at_rate(requests: Sequence[SimRequest], rate: float) -> list[SimRequest]:
    """The same requests with arrival times for ``rate`` req/s (``inf``: all at t=0)."""
    if math.isinf(rate):
        return [replace(r, arrival_s=0.0) for r in requests]
    return [replace(r, arrival_s=r.arrival_s / rate) for r in requests]


def build_scenario(workload: SimWorkload, profile: Profile, num_slots: int) -> Scenario:
    """Synthetic passages + the bench's request generator: a warm-up trace and ``num_slots`` measured traces."""
    wl = workload
    if wl.doc_lengths is not None:
        lengths = {str(k): int(v) for k, v in wl.doc_lengths.items()}
    else:
        names = [f"passage-{i:05d}" for i in range(wl.num_passages)]
        lengths = lognormal_lengths(names, mean_tokens=wl.passage_tokens, sigma=wl.passage_sigma, seed=wl.seed)
    ids = list(lengths)

    def gen(seed: int, n: int) -> list[Request]:
        return make_requests(ids, num_requests=n, top_k=wl.top_k, zipf_exponent=wl.zipf, rate=1.0,
                             burstiness=wl.burstiness, seed=seed, popularity_seed=wl.seed, num_topics=wl.num_topics)

    warm = gen(wl.seed * 1000 + 999, wl.warmup_requests) if wl.warmup_requests else []
    units = [gen(wl.seed * 1000 + i, wl.num_requests) for i in range(num_slots)]
    root = namespace_key(profile.model, "float16", wl.chunk_size)
    system = synthetic_tokens("\x00system", wl.system_tokens, seed=wl.seed) if wl.system_tokens else ()
    builder = TraceBuilder(root, wl.chunk_size, lambda d: synthetic_tokens(d, lengths[d], seed=wl.seed),
                           system_tokens=system, question_tokens=wl.question_tokens, seed=wl.seed)

    def sim(reqs: list[Request]) -> list[SimRequest]:
        return [builder.request(r.request_id, r.arrival_s, r.doc_ids, wl.output_tokens) for r in reqs]

    everything = warm + [r for u in units for r in u]
    ws = working_set(everything, lengths, bytes_per_token=profile.kv_bytes_per_token,
                     system_tokens=wl.system_tokens, suffix_tokens=wl.question_tokens * len(everything))
    dram, ssd = tier_capacities(ws.bytes, dram_fraction=wl.dram_fraction, ssd_fraction=wl.ssd_fraction,
                                min_bytes=wl.chunk_size * profile.kv_bytes_per_token)
    return Scenario(sim(warm), [sim(u) for u in units], dram, ssd, ws.bytes, ws.reuse_upper_bound,
                    {"workload": wl.describe(), "unique_passages": ws.unique_docs})


@dataclass
class SimSettings:
    """How the systems run: the executor (`Simulator`'s module docstring; None: serial for ``max_batch`` 1, else
    prefill-first), its rows or batch, its ITL budget (engine-steps) and the prefill step mode. Under
    ``engine-steps`` a system's own ``max_active`` / ``itl_budget_steps`` (`SimSystem.executor_overrides`) replace
    ``max_batch`` / ``itl_budget_steps``; an outside baseline runs serially with one-shot prefill whatever the
    run's executor."""

    max_batch: int = 1
    prefill_steps: str | None = None
    executor: str | None = None
    itl_budget_steps: float | None = ENGINE_DEFAULT_ITL_BUDGET

    def config(self, profile: Profile, system: SimSystem, scenario: Scenario, *, record_trace: bool = False,
               chunk_size: int = 256, ssd_bytes: int | None = None) -> SimConfig:
        own = dict(system.executor_overrides)
        executor = own.get("executor", self.executor)
        rows, budget = self.max_batch, self.itl_budget_steps
        if executor == "engine-steps":
            rows, budget = int(own.get("max_active", rows)), own.get("itl_budget_steps", budget)
        elif executor == "serial":  # one request at a time, whatever rows the system would have
            rows = 1
        steps = own.get("prefill_steps", self.prefill_steps)
        pool = max(1, int(profile.device_kv_bytes // profile.kv_bytes_per_token)) if rows > 1 else None
        return SimConfig(
            profile=profile, system=system, chunk_size=chunk_size, dram_bytes=scenario.dram_bytes,
            ssd_bytes=scenario.ssd_bytes if ssd_bytes is None else ssd_bytes,
            device_cache_bytes=int(profile.device_kv_bytes), max_batch=rows, kv_pool_tokens=pool,
            prefill_steps=steps, record_trace=record_trace, executor=executor,
            itl_budget_steps=budget,
        )


def no_reuse_capacity_rps(profile: Profile, scenario: Scenario, settings: SimSettings, chunk_size: int = 256
                          ) -> float:
    """The no-reuse system's throughput (req/s) with every request of the scenario queued at t=0: with the
    serial executor exactly ``1 / mean(prefill + decode)``, the bench's "capacity"; with batched decode
    (``engine-steps``, ``prefill-first``) it includes the batching gain at full load - none where every answer
    ends before the next cold prefill does, as with the bench's 8-token answers on a CPU."""
    sim = Simulator(settings.config(profile, get_system("no-reuse"), scenario, chunk_size=chunk_size))
    reqs = at_rate(scenario.all_requests(), math.inf)
    reqs = [replace(r, rid=i) for i, r in enumerate(reqs)]
    res = sim.run(reqs)
    sim.close()
    if res.duration_s <= 0:
        raise ValueError("the scenario has no work: cannot derive a capacity")
    return len(res.outcomes) / res.duration_s


def to_run_record(result: SimResult, system: SimSystem, rate: float, extra: Mapping[str, Any]) -> RunRecord:
    """A simulation result as the bench's report record (same keys as ``pcr-rag bench --json``)."""
    samples = [
        RequestSample(key=(0, o.rid), arrival_s=o.arrival_s,
                      ttft_s=o.ttft_s, e2e_s=o.e2e_s, queue_s=o.queue_s, itl_s=tuple(o.itl_s),
                      prompt_tokens=o.prompt_tokens, computed_tokens=o.computed_tokens,
                      reused_by_tier=dict(o.reused), output_tokens=o.output_tokens,
                      prefetch_hit_chunks=o.prefetch_hit_chunks, prefill_s=o.first_token_s - o.start_s,
                      prefill_compute_s=o.prefill_s, load_wait_s=o.stall_s)
        for o in result.outcomes
    ]
    c = result.counters
    dur = result.duration_s
    outs = result.outcomes
    ex = dict(extra)
    ex.update(
        prefetch_window=system.window if system.uses_window else 0,
        eviction=system.policy,
        layerwise=system.overlap,
        prefetch=system.prefetch,
        ssd_tier=system.ssd,
        prefetch_issued=int(c["prefetch_issued"]),
        prefetch_loads_chunks=int(c["prefetch_loaded"]),
        max_queue_depth=int(c["max_queue"]),
        compute_utilisation=c["compute_busy_s"] / dur if dur > 0 else None,
        ssd_read_utilisation=c["ssd_read_busy_s"] / dur if dur > 0 else None,
        ssd_write_utilisation=c["ssd_write_busy_s"] / dur if dur > 0 else None,
        stall_s_mean=statistics.fmean(o.stall_s for o in outs) if outs else 0.0,
        prefill_s_mean=statistics.fmean(o.prefill_s for o in outs) if outs else 0.0,
        sim_wall_s=result.wall_s,
        engine=_engine_summary(result.cache_stats),
    )
    return RunRecord(
        system=system.name, rate=rate, samples=samples, duration_s=dur,
        prefetch_hits=sum(o.prefetch_hit_chunks for o in outs),
        bytes={"ssd_read": int(c["ssd_read_bytes"]), "ssd_write": int(c["ssd_write_bytes"]),
               "host_to_device": int(c["h2d_bytes"]), "device_to_host": int(c["d2h_bytes"])},
        extra=ex,
    )


def _engine_summary(stats: CacheStats | None) -> dict[str, Any]:
    """The cache counters a report keeps per run (empty for a system without a cache)."""
    if stats is None:
        return {}
    keep = ("evictions", "demotions", "loads", "prefetch_loads", "inserts", "inserts_rejected", "writes_done",
            "writes_skipped", "bytes_high_water", "capacity_bytes", "nodes")
    return {k: getattr(stats, k) for k in keep}


def run_system(profile: Profile, system: SimSystem, scenario: Scenario, rates: Sequence[float],
               settings: SimSettings, *, slots: Sequence[int] | None = None, chunk_size: int = 256,
               extra: Callable[[float], Mapping[str, Any]] | None = None, history: bool = True) -> list[RunRecord]:
    """One system, one engine: the warm-up trace all at once, then the trace of each rate slot in order, like a
    bench engine. ``slots``: the slots to report (default all); with ``history`` the slots before them are served
    too (unreported), so every system meets each measured trace with the same cache history; without it only the
    given slots run after the warm-up (what the bench does for its window variants)."""
    sim = Simulator(settings.config(profile, system, scenario, chunk_size=chunk_size))
    keep = set(range(len(rates)) if slots is None else slots)
    out: list[RunRecord] = []
    try:
        if scenario.warmup:
            sim.run(at_rate(scenario.warmup, math.inf))
        order = range(max(keep) + 1 if keep else 0) if history else sorted(keep)
        for i in order:
            res = sim.run(at_rate(scenario.traces[i], rates[i]))
            if i in keep:
                out.append(to_run_record(res, system, rates[i], extra(rates[i]) if extra else {}))
    finally:
        sim.close()
    return out


def sweep(profile: Profile, scenario: Scenario, systems: Sequence[SimSystem], rates: Sequence[float],
          settings: SimSettings, *, slots: Sequence[int] | None = None, chunk_size: int = 256,
          extra: Callable[[float], Mapping[str, Any]] | None = None,
          progress: ProgressFn | None = None) -> list[RunRecord]:
    """Every system over the scenario (see :func:`run_system`)."""
    out: list[RunRecord] = []
    for system in systems:
        t0 = time.perf_counter()
        recs = run_system(profile, system, scenario, rates, settings, slots=slots, chunk_size=chunk_size,
                          extra=extra)
        out += recs
        if progress is not None:
            means = ", ".join(
                f"{statistics.fmean(s.ttft_s for s in r.samples) * 1e3:.0f} ms" for r in recs if r.samples)
            progress(f"{system.name:>16s}: mean TTFT per rate {means} ({time.perf_counter() - t0:.1f} s)")
    return out


@dataclass
class HitStudy:
    """Token hit ratios on one trace and one cache size: online policies (the real engine) vs Belady."""

    rate: float
    capacity_bytes: int
    window: int
    results: list[HitResult] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rate": self.rate, "capacity_bytes": self.capacity_bytes, "window": self.window,
                               "policies": [r.as_dict() for r in self.results]}
        by = {r.policy: r for r in self.results}
        b = by.get("belady")
        if b is not None and b.hit_tokens:
            out["fraction_of_belady"] = {p: r.hit_tokens / b.hit_tokens for p, r in by.items() if p != "belady"}
        return out


def hit_ratio_study(profile: Profile, scenario: Scenario, slot: int, rate: float, settings: SimSettings, *,
                    window: int = 6, chunk_size: int = 256, capacity_bytes: int | None = None) -> HitStudy:
    """One DRAM tier (default: the scenario's DRAM capacity; no SSD, so every policy sees the same single-tier
    cache) serving the warm-up and one measured trace: plain LRU and look-ahead LRU (window ``window``,
    protection only) on the real engine, and Belady (MIN with bypass) offline on the executed chunk trace with the
    same capacity. The last chunk of a request is never reusable (the runtime always computes it) and counts as a
    miss for all three. Hits are counted over the measured trace only (the warm-up fills the cache)."""
    cap = scenario.dram_bytes if capacity_bytes is None else capacity_bytes
    sc = replace(scenario, dram_bytes=cap)
    study = HitStudy(rate, cap, window)
    base = SimSystem("hit-study", ssd=False, overlap=False, prefetch=False, window=window)
    executed: list[list[tuple[bytes, int, int]]] = []
    n_warm = 0
    for name, lookahead in (("lru", False), ("lookahead-lru", True)):
        sim = Simulator(settings.config(profile, replace(base, name=f"dram-{name}", lookahead=lookahead), sc,
                                        record_trace=True, chunk_size=chunk_size, ssd_bytes=0))
        warm = sim.run(at_rate(sc.warmup, math.inf)) if sc.warmup else None
        before = sim.engine.stats().hit_chunks["dram"]
        res = sim.run(at_rate(sc.traces[slot], rate))
        sim.close()
        hit = sum(sum(o.reused.values()) for o in res.outcomes)
        tot = sum(o.prompt_tokens for o in res.outcomes)
        hit_chunks = res.cache_stats.hit_chunks["dram"] - before
        study.results.append(HitResult(name, hit, tot, hit_chunks, sum(len(t) for t in res.trace or [])))
        executed = [*(warm.trace or [] if warm else []), *(res.trace or [])]
        n_warm = len(warm.trace or []) if warm else 0
    # Belady sees the same history (warm-up, then the measured trace); hits are counted on the measured part
    cacheable = [[TraceChunk(k, b, t) for k, b, t in req[:-1]] for req in executed]
    per = belady_hits_per_request(cacheable, cap)[n_warm:]
    measured = executed[n_warm:]
    study.results.append(HitResult(
        "belady",
        sum(h for h, _ in per),
        sum(t for req in measured for _, _, t in req),
        sum(c for _, c in per),
        sum(len(req) for req in measured),
    ))
    return study


def speed_check(profile: Profile, workload: SimWorkload, settings: SimSettings, num_requests: int,
                system: str = "pcr", load_factor: float = 0.7) -> dict[str, Any]:
    """Wall time to build and simulate ``num_requests`` requests of one system, one trace (seconds)."""
    t0 = time.perf_counter()
    sc = build_scenario(replace(workload, num_requests=num_requests, warmup_requests=0), profile, 1)
    t1 = time.perf_counter()
    cap = no_reuse_capacity_rps(profile, sc, settings, workload.chunk_size)
    t2 = time.perf_counter()
    rate = load_factor * cap
    recs = run_system(profile, get_system(system), sc, [rate], settings, chunk_size=workload.chunk_size)
    t3 = time.perf_counter()
    return {"system": system, "num_requests": num_requests, "rate": rate, "build_s": t1 - t0,
            "no_reuse_capacity_s": t2 - t1, "simulate_s": t3 - t2, "total_s": t3 - t0,
            "requests_per_s": num_requests / (t3 - t2),
            "mean_ttft_s": statistics.fmean(s.ttft_s for s in recs[0].samples)}


def workload_from_args(args: Any) -> SimWorkload:
    """The `SimWorkload` of ``pcr-rag simulate``'s parsed arguments (an ``argparse.Namespace``)."""
    return SimWorkload(
        num_requests=args.requests,
        warmup_requests=SimWorkload.warmup_requests if args.warmup is None else args.warmup,
        num_passages=args.passages,
        passage_tokens=args.passage_tokens, top_k=args.top_k, num_topics=args.topics or None, zipf=args.zipf,
        system_tokens=args.system_tokens, question_tokens=args.question_tokens, output_tokens=args.max_new_tokens,
        burstiness=args.burstiness, seed=args.seed, chunk_size=args.chunk_size, dram_fraction=args.dram_fraction,
        ssd_fraction=args.ssd_fraction,
    )
