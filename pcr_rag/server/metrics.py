"""Prometheus metrics of a served engine, named as vLLM users chart them, under the ``pcr:`` prefix.

Two sources, one registry per app (never the process-global one, so several apps can live in one process):

- **Per request** (observed by the server when a request finishes): histograms ``pcr:time_to_first_token_seconds``,
  ``pcr:inter_token_latency_seconds``, ``pcr:e2e_request_latency_seconds``, ``pcr:request_queue_time_seconds``,
  ``pcr:request_prefill_time_seconds``, ``pcr:request_prompt_tokens``, ``pcr:request_generation_tokens``; counters
  ``pcr:request_success_total{finished_reason}``, ``pcr:generation_tokens_total`` and
  ``pcr:api_errors_total{status}`` (rejected requests).
- **Engine state** (read from `PCREngine.stats()` at scrape time, so they are exact and cost nothing per token):
  gauges ``pcr:num_requests_running`` / ``pcr:num_requests_waiting``, ``pcr:prefill_tokens_per_second``,
  ``pcr:decode_step_seconds`` and ``pcr:prefill_layers_per_step`` (the ITL budget's reading),
  ``pcr:cache_usage_bytes{tier}``,
  ``pcr:cache_capacity_bytes{tier}``, ``pcr:cache_chunks{tier}``, ``pcr:cache_pinned_chunks``,
  ``pcr:cache_read_bytes_per_second{tier}`` (the load-or-recompute planner's read-speed estimates),
  ``pcr:announcements_pending``, ``pcr:remote_roots_of_other_identity`` (namespace roots of another model, plan or
  kernel identity whose manifests the shared store held at start); counters ``pcr:prompt_tokens_total``,
  ``pcr:prompt_tokens_by_source_total{source=computed|blended|device|dram|ssd|remote}`` (the sources sum to the
  prompt tokens), ``pcr:prefix_cache_queries_total`` and
  ``pcr:prefix_cache_hits_total`` (tokens, as vLLM counts them), ``pcr:cache_evictions_total{tier}``,
  ``pcr:chunks_recomputed_instead_of_loaded_total{tier}``,
  ``pcr:cache_load_failures_total``, ``pcr:cache_failures_recomputed_total``,
  ``pcr:cache_quota_refusals_total{tier}``, ``pcr:remote_values_forged_total``, ``pcr:prefetch_loads_total``,
  ``pcr:prefetch_hit_chunks_total``, ``pcr:prefetch_cycles_total``, ``pcr:announcements_total``,
  ``pcr:announcements_claimed_total``, ``pcr:announcements_expired_total``, ``pcr:requests_failed_total``,
  ``pcr:requests_cancelled_total``; the garbage collector's ``pcr:gc_collections_total{generation}``,
  ``pcr:gc_pause_seconds_total{generation}``, ``pcr:gc_max_pause_seconds{generation}`` and
  ``pcr:gc_frozen_objects`` (process-wide, `runtime.gc_pauses`).
- **Blend mode** (`pcr_rag.sched.blend`, opt-in and approximate): counters ``pcr:blended_tokens_total`` (prompt
  tokens placed from documents' position-independent KV) and ``pcr:blended_requests_total`` (requests served in
  blend mode); from the blend gate's snapshot (`pcr_rag.sched.blend_gate`, ``EngineStats.blend``), counters
  ``pcr:blend_verified_requests_total``, ``pcr:blend_greedy_verified_requests_total``,
  ``pcr:blend_identical_answers_total``, ``pcr:blend_fallbacks_total``, ``pcr:blend_shadow_requests_total``,
  ``pcr:blend_shadow_prompt_tokens_total``, ``pcr:blend_shadow_seconds_total``, and gauges
  ``pcr:blend_verify_fraction``, ``pcr:blend_namespaces_exact`` (namespaces whose gate tripped, served exactly
  now), ``pcr:blend_pending_shadows``, ``pcr:blend_token_agreement_mean`` and ``pcr:blend_first_token_kl_median``
  (nats; these two are left out until a verification gives them a value). A gate key the engine does not report is
  left out, never exported as a made-up zero.

Every series carries a ``model_name`` label, as vLLM's do. The process collector adds
``process_resident_memory_bytes`` and friends (the load test reads the server's RSS there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pcr_rag.metrics import TIERS
from pcr_rag.request import GenerationResult

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "pcr:"

# seconds; vLLM's TTFT / ITL / request-latency bucket edges (CPU serving adds the slower end)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0)
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class ServerMetrics:
    """The app's registry: per-request histograms/counters plus a collector over ``stats()`` (an engine's
    `PCREngine.stats`). ``render()`` is the ``/metrics`` body."""

    def __init__(self, model_name: str, stats: Callable[[], object]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (submission to first token).",
                         _TTFT_BUCKETS).labels(model_name)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive generated tokens.",
                        _ITL_BUCKETS).labels(model_name)
        self.e2e = hist("e2e_request_latency_seconds", "Submission to last token.", _LATENCY_BUCKETS).labels(
            model_name)
        self.queue = hist("request_queue_time_seconds", "Time waiting for a KV row.", _LATENCY_BUCKETS).labels(
            model_name)
        self.prefill = hist("request_prefill_time_seconds", "Admission to first token (prefix load + prefill).",
                            _LATENCY_BUCKETS).labels(model_name)
        self.prefill_compute = hist("request_prefill_compute_time_seconds",
                                    "The request's own prefill steps within its prefill time (the rest: other "
                                    "requests' decode and prefill steps run between them).",
                                    _LATENCY_BUCKETS).labels(model_name)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS).labels(
            model_name)
        self.generation_tokens = hist("request_generation_tokens", "Generated tokens per request.",
                                      _TOKEN_BUCKETS).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._generated = Counter(PREFIX + "generation_tokens", "Generated tokens.", labels,
                                  registry=self.registry).labels(model_name)
        self._api_errors = Counter(PREFIX + "api_errors", "Requests rejected with an error status.",
                                   ["model_name", "status"], registry=self.registry)
        self.registry.register(_EngineCollector(model_name, stats))
        ProcessCollector(registry=self.registry)

    def observe(self, result: GenerationResult) -> None:
        """Record one finished request (every histogram and counter above)."""
        m = result.metrics
        self.ttft.observe(m.ttft_s)
        for gap in m.itl_s:
            self.itl.observe(gap)
        self.e2e.observe(m.e2e_s)
        self.queue.observe(m.queue_s)
        self.prefill.observe(m.prefill_s)
        self.prefill_compute.observe(m.prefill_compute_s)
        self.prompt_tokens.observe(m.prompt_tokens)
        self.generation_tokens.observe(len(result.token_ids))
        self._generated.inc(len(result.token_ids))
        self._success.labels(self.model_name, result.finish_reason).inc()

    def count_error(self, status: int) -> None:
        self._api_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return _generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine counters and gauges, read from one ``stats()`` snapshot per scrape."""

    def __init__(self, model_name: str, stats: Callable[[], object]) -> None:
        self.model_name = model_name
        self.stats = stats

    def describe(self) -> list[Metric]:  # no samples: the registry must not call stats() at registration
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        req, cache, pf = s.requests, s.cache, s.prefetch
        m = self.model_name

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([m], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([m], value)
            return c

        def by_tier(family: GaugeMetricFamily | CounterMetricFamily, values: dict[str, int]):
            for tier in TIERS:
                family.add_metric([m, tier], values.get(tier, 0))
            return family

        yield gauge("num_requests_running", "Requests holding a KV row (prefilling or decoding).", s.running)
        yield gauge("num_requests_waiting", "Requests waiting for a KV row.", s.queue_depth)
        yield gauge("prefill_tokens_per_second", "Measured prefill speed (the cache-aware schedule's aging rate).",
                    s.prefill_tokens_per_s)
        budget = s.step_budget
        if budget.get("decode_step_ms") is not None:
            yield gauge("decode_step_seconds", "Median of the recent decode forwards (the ITL budget's unit).",
                        budget["decode_step_ms"] / 1e3)
        yield gauge("prefill_layers_per_step", "Prefill layers an engine step runs while rows decode (the ITL "
                    "budget's last cap; every layer when nothing decodes).", budget.get("layers_per_step", 0))
        yield counter("prompt_tokens", "Prompt tokens of finished requests.", req["prompt_tokens"])
        by_source = CounterMetricFamily(PREFIX + "prompt_tokens_by_source",
                                        "Prompt tokens of finished requests by where their KV came from: computed, "
                                        "blended (placed by blend mode, approximate), or reused exactly from the "
                                        "device, dram, ssd or remote tier.",
                                        labels=["model_name", "source"])
        by_source.add_metric([m, "computed"], req["computed_tokens"])
        by_source.add_metric([m, "blended"], req.get("blended_tokens", 0))
        for tier in TIERS:
            by_source.add_metric([m, tier], req["reused_by_tier"].get(tier, 0))
        yield by_source
        yield counter("blended_tokens", "Prompt tokens of finished requests placed by blend mode from documents' "
                      "position-independent KV (approximate).", req.get("blended_tokens", 0))
        yield counter("blended_requests", "Finished requests served in blend mode.", req.get("blended_requests", 0))
        yield from _blend_gate(getattr(s, "blend", None) or {}, gauge, counter)
        hits = sum(cache.hit_tokens.values())
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", hits + cache.miss_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield by_tier(GaugeMetricFamily(PREFIX + "cache_usage_bytes", "KV bytes held per tier.",
                                        labels=["model_name", "tier"]), cache.bytes_used)
        yield by_tier(GaugeMetricFamily(PREFIX + "cache_capacity_bytes", "KV byte budget per tier (0: tier off).",
                                        labels=["model_name", "tier"]), cache.capacity_bytes)
        yield by_tier(GaugeMetricFamily(PREFIX + "cache_chunks", "Chunks held per tier.",
                                        labels=["model_name", "tier"]), cache.chunks)
        yield by_tier(CounterMetricFamily(PREFIX + "cache_evictions", "Chunks evicted per tier.",
                                          labels=["model_name", "tier"]), cache.evictions)
        yield by_tier(CounterMetricFamily(PREFIX + "chunks_recomputed_instead_of_loaded",
                                          "Cached chunks recomputed because loading them was estimated slower (the "
                                          "load-or-recompute planner), per tier.", labels=["model_name", "tier"]),
                      cache.recomputed_instead_of_loaded)
        speeds = cache.planner.get("read_bytes_per_s", {})
        if speeds:
            yield by_tier(GaugeMetricFamily(PREFIX + "cache_read_bytes_per_second",
                                            "The planner's read-speed estimate per tier (0: not measured yet; the "
                                            "remote tier's is its client's).", labels=["model_name", "tier"]),
                          {**speeds, "remote": cache.remote_io.get("read_bytes_per_s", 0)})
        yield gauge("cache_pinned_chunks", "Chunks pinned now by running requests and loads (0 when idle).",
                    cache.pinned_chunks)
        yield counter("cache_load_failures", "Cached chunks that failed to load (recomputed).", cache.load_failures)
        yield by_tier(CounterMetricFamily(PREFIX + "cache_quota_refusals", "Chunks not cached in a tier because "
                                          "their tenant was at its per-tenant quota there with none of its own "
                                          "chunks evictable.", labels=["model_name", "tier"]),
                      cache.quota_refusals)
        yield counter("cache_failures_recomputed", "Times a prefill recomputed cached KV after a cache or store failure "
                      "(a load, checksum, MAC or timeout failing during the lease) instead of failing.",
                      req.get("recomputed_after_error", 0))
        yield counter("remote_values_forged", "Remote values rejected as forged (MAC, root, plan or layout), deleted.",
                      cache.remote_io.get("forged", 0))
        yield gauge("remote_roots_of_other_identity", "Namespace roots of another model, plan or kernel identity "
                    "whose manifests the remote store held at start (their chunks are never served here).",
                    cache.remote_io.get("roots_of_other_identity", 0))
        yield counter("prefetch_loads", "SSD -> DRAM loads started by the prefetcher.", pf["loads_started"])
        yield counter("prefetch_hit_chunks", "Chunks on SSD at entry and in memory when their request ran.",
                      pf["prefetch_hit_chunks"])
        yield counter("prefetch_cycles", "Prefetcher planning cycles.", pf["cycles"])
        yield counter("announcements", "Retrievals announced (POST /v1/pcr/announce).", pf["announced"])
        yield counter("announcements_claimed", "Announcements claimed by their request.", pf["claimed"])
        yield counter("announcements_expired", "Announcements that expired unclaimed.", pf["expired"])
        yield gauge("announcements_pending", "Announcements waiting for their request.",
                    pf["pending_announcements"])
        if s.gc:  # process-wide: the garbage collector's pauses stop every thread
            for key, name, doc, family_of in (
                    ("collections", "gc_collections", "Garbage collections of the process, per generation.",
                     CounterMetricFamily),
                    ("pause_s", "gc_pause_seconds", "Seconds the garbage collector stopped every thread.",
                     CounterMetricFamily),
                    ("max_pause_s", "gc_max_pause_seconds", "Longest garbage-collector pause.", GaugeMetricFamily)):
                family = family_of(PREFIX + name, doc, labels=["model_name", "generation"])
                for gen, value in s.gc[key].items():
                    family.add_metric([m, gen], value)
                yield family
            yield gauge("gc_frozen_objects", "Objects the collector no longer scans (EngineConfig.freeze_gc).",
                        s.gc["frozen_objects"])
        yield counter("requests_failed", "Requests that failed with an error.", req["requests_failed"])
        yield counter("requests_cancelled", "Requests cancelled (client gone, timeout, shutdown).",
                      req["requests_cancelled"])


# The blend gate's snapshot keys (`pcr_rag.sched.blend_gate.BlendGate.snapshot`) -> (metric name, help, counter?)
_BLEND_GATE: tuple[tuple[str, str, str, bool], ...] = (
    ("verify_fraction", "blend_verify_fraction", "Fraction of blended requests also run exactly as shadow requests "
     "(EngineConfig.blend_verify).", False),
    ("verified", "blend_verified_requests", "Blended requests compared with their exact shadow.", True),
    ("greedy_verified", "blend_greedy_verified_requests", "Verified blended requests whose tokens are reproducible "
     "(greedy or seeded), so their answers could be compared.", True),
    ("identical", "blend_identical_answers", "Reproducible verified blended requests whose answer was identical to "
     "the exact one.", True),
    ("fallbacks", "blend_fallbacks", "Times a namespace's blend gate tripped and it fell back to exact reuse.", True),
    ("namespaces_exact", "blend_namespaces_exact", "Namespaces whose blend gate tripped: their blend requests are "
     "served exactly until the engine restarts.", False),
    ("shadow_requests", "blend_shadow_requests", "Exact shadow requests run to verify blended ones.", True),
    ("shadow_prompt_tokens", "blend_shadow_prompt_tokens", "Prompt tokens of the exact shadow requests.", True),
    ("shadow_seconds", "blend_shadow_seconds", "Wall seconds the exact shadow requests took, submission to last "
     "token.", True),
    ("pending_shadows", "blend_pending_shadows", "Shadow requests waiting for an idle engine.", False),
    ("token_agreement_mean", "blend_token_agreement_mean", "Mean share of the exact answer's tokens a verified "
     "blended answer matched position by position (reproducible requests).", False),
    ("first_token_kl_median", "blend_first_token_kl_median", "Median KL(exact || blend) of the first token's "
     "distribution over verified blended requests, in nats.", False),
)


def _blend_gate(gate: Mapping[str, Any], gauge: Callable[[str, str, float], Metric],
                counter: Callable[[str, str, float], Metric]) -> Iterator[Metric]:
    """The blend gate's series from its snapshot ``gate``: a key it lacks, or whose value is None or not finite (a
    mean or median before any verification), is left out, so no series ever carries a made-up value or NaN."""
    for key, name, doc, monotonic in _BLEND_GATE:
        value = gate.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        yield (counter if monotonic else gauge)(name, doc, value)
