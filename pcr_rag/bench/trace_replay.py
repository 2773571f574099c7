"""``pcr-rag bench --trace FILE``: replay a trace file (`pcr_rag.bench.trace_file`) through the bench's systems and
report what each reached next to the trace's reuse bounds (`pcr_rag.bench.trace_bounds`).

The replay is an ordinary bench run (`pcr_rag.bench.serving.BenchRunner`) whose traces come from the file instead
of the corpus: one measured trace (the file's first ``--requests`` requests, lengths times ``length_scale``), its
arrivals the file's timestamps divided by ``speed`` (the run's single rate is the replay's mean request rate, so
the report's rate column reads req/s), no repeats, no saturation, no window sweep, every system starting from an
empty cache after ``warmup_requests`` warm-up requests shaped like the first request but made of their own ids (they
warm kernels and the shared head; the bounds count them as served before the trace). Cached systems serve the
documents in trace order (cache-aware order is a bound here, not a replayed system). Requests whose prompt and
output do not fit the model's context are dropped (counted in the report).

After the run, the TTFT bound: a raw transformers forward over a resident cache (`pcr_rag.bench.limit`'s
measurement) timed at a few (context, new tokens) points taken from the trace's longest prompt and fitted
(`RawForwardFit`), then applied to each request's tokens to compute under each bound.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from pcr_rag.bench.config import SYSTEM_PROMPT, BenchConfig, BenchError
from pcr_rag.bench.limit import _raw_suffix_forward
from pcr_rag.bench.serving import BenchRunner
from pcr_rag.bench.systems import parse_systems
from pcr_rag.bench.trace_bounds import (
    HEAD,
    LaidOut,
    LayoutPlanner,
    RawForwardFit,
    RequestLayout,
    TraceBounds,
    bounds_section,
    compute_bounds,
    request_layout,
)
from pcr_rag.bench.trace_file import SyntheticText, Trace, TraceRequest, TraceSegment
from pcr_rag.bench.traces import BenchTraces
from pcr_rag.bench.workload import Request
from pcr_rag.prompt import PromptBuilder
from pcr_rag.rag.corpus import CorpusDocument

log = logging.getLogger(__name__)

__all__ = ["TRACE_SYSTEMS", "TraceReplay", "build_replay", "measure_raw_forward", "output_tokens", "replay_rate",
           "run_trace_bench", "trace_config"]

#: The systems a trace replay runs unless ``--systems`` says otherwise.
TRACE_SYSTEMS: tuple[str, ...] = ("no-reuse", "pcr")
#: Warm-up requests of a replay unless ``--warmup`` says otherwise.
TRACE_WARMUP = 2
#: Timed tries per point of the raw-forward fit (the median is kept).
_FIT_REPS = 2


@dataclass(frozen=True)
class TraceReplay:
    """A trace ready to replay: the bench's ``traces``, the replayed ``trace`` (after dropping what does not fit),
    its ``bounds``, the replay's mean ``rate`` (req/s; inf: all at once) and ``info`` for the report."""

    trace: Trace
    traces: BenchTraces
    bounds: TraceBounds
    rate: float
    info: dict[str, Any]


def output_tokens(request: TraceRequest, default: int) -> int:
    """The output tokens a replayed request asks for: the trace's ``output_length`` (at least 1: a request
    generates its first token), else ``default`` (``--max-new-tokens``). A cap, as in the trace's service: the
    model's end of sequence can stop it sooner."""
    return max(1, request.output_length) if request.output_length is not None else default


def trace_config(cfg: BenchConfig, trace: Trace, *, speed: float = 1.0, systems_given: bool = False,
                 warmup_given: bool = False) -> BenchConfig:
    """``cfg`` for replaying ``trace`` (cut and scaled already) at ``speed``: one measured trace at the replay's
    mean rate (`replay_rate`), no repeats, saturation, sweep or limit ratio; `TRACE_SYSTEMS` and `TRACE_WARMUP`
    unless ``--systems`` / ``--warmup`` were given. Raises `BenchError` for what a replay cannot do."""
    if cfg.quick or cfg.standard or cfg.retrieval:
        raise BenchError("--trace replays a file: it does not combine with --quick, --standard or --retrieval")
    if cfg.order != "relevance" or any(s.order == "cache-aware" for s in parse_systems(list(cfg.systems))):
        raise BenchError("--trace serves documents in trace order; the cache-aware order is reported as a bound, "
                         "not replayed (drop --order / @cache-aware)")
    if not speed > 0:
        raise BenchError(f"--trace-speed must be > 0 ('inf' = all at once), got {speed}")
    return replace(cfg, systems=cfg.systems if systems_given else TRACE_SYSTEMS, repeats=1, saturation=(),
                   windows=(), limit_ratio=False, num_requests=len(trace.requests),
                   rates=(replay_rate(trace, speed),),
                   warmup_requests=cfg.warmup_requests if warmup_given else TRACE_WARMUP)


def _warmup(first: TraceRequest, n: int) -> list[TraceRequest]:
    """``n`` requests shaped like ``first`` whose segments are their own (ids no trace request has)."""
    return [replace(first, segments=tuple(replace(s, id=f"~warmup-{w}/{s.id}") for s in first.segments))
            for w in range(n)]


def _doc_key(segment: TraceSegment | tuple[str, str, int]) -> str:
    kind, sid, tokens = segment.identity if isinstance(segment, TraceSegment) else segment
    return f"{kind}/{sid}#{tokens}"


def build_replay(trace: Trace, cfg: BenchConfig, tokenizer: Any, kv_bytes_per_token: int, *, speed: float = 1.0,
                 context_tokens: int | None = None) -> TraceReplay:
    """Synthetic text for every segment, the engine layouts, the bounds and the bench traces of ``trace`` (already
    cut to the requests to replay and scaled); requests longer than ``context_tokens`` minus the output are
    dropped."""
    text = SyntheticText(tokenizer)
    planner = LayoutPlanner(PromptBuilder(tokenizer), SYSTEM_PROMPT, cfg.chunk_size)

    def layouts(r: TraceRequest) -> tuple[RequestLayout, RequestLayout]:
        return request_layout(r, text.text, moved=False), request_layout(r, text.text, moved=True)

    kept: list[TraceRequest] = []
    pairs: list[tuple[RequestLayout, RequestLayout]] = []
    dropped = 0
    for r in trace.requests:
        pair = layouts(r)
        n = planner.lay_out(pair[0]).num_tokens
        if context_tokens is not None and n + output_tokens(r, cfg.max_new_tokens) > context_tokens:
            dropped += 1
            continue
        kept.append(r)
        pairs.append(pair)
    if not kept:
        raise BenchError(f"no request of {trace.source} fits the model's context of {context_tokens} tokens with "
                         f"{cfg.max_new_tokens} output tokens; replay with --trace-length-scale below 1")
    replayed = replace(trace, requests=tuple(kept))
    warm_requests = _warmup(kept[0], cfg.warmup_requests)  # shaped like a request that fits
    warm = [layouts(r) for r in warm_requests]
    bounds = compute_bounds(warm, pairs, planner, cache_aware=trace.position_independent)
    # stored for 1 req/s like every bench trace: the runner's with_rate(unit, rate) gives back the scaled arrivals
    arrivals = replayed.arrivals_s(speed)
    rate = cfg.rates[0] if cfg.rates else replay_rate(trace, speed)
    unit = [a * rate for a in arrivals] if math.isfinite(rate) else [0.0] * len(arrivals)
    span = arrivals[-1] if arrivals else 0.0

    def bench_request(i: int, r: TraceRequest, arrival: float) -> Request:
        q = r.question
        return Request(i, arrival, tuple(_doc_key(s) for s in r.segments if s.kind != "question"),
                       text.text(q) if q is not None else "", max_new_tokens=output_tokens(r, cfg.max_new_tokens))

    requests = [bench_request(i, r, a) for i, (r, a) in enumerate(zip(kept, unit, strict=True))]
    warmup = [bench_request(i, r, 0.0) for i, r in enumerate(warm_requests)]
    passages = {_doc_key(s): CorpusDocument(_doc_key(s), s.id, text.text(s))
                for r in [*kept, *warm_requests] for s in r.segments if s.kind != "question"}
    doc_tokens: dict[str, int] = {}
    system_tokens = suffix = 0
    for laid, r in zip(bounds.served, kept, strict=True):
        body = [s for s in r.segments if s.kind != "question"]
        system_tokens = max(system_tokens, len(laid.segments[0]))
        for s, seg in zip(body, laid.segments[1:1 + len(body)], strict=False):
            doc_tokens[_doc_key(s)] = len(seg)
        suffix += sum(len(seg) for seg in laid.segments[1 + len(body):])
    prompt = bounds.prefix.prompt
    synthetic = text.stats()
    info: dict[str, Any] = {
        "file": trace.source, "format": trace.format, "requests": len(kept), "dropped_too_long": dropped,
        "warmup_requests": len(warmup), "speed": speed,
        "mean_rate_rps": float(f"{rate:.4g}") if math.isfinite(rate) else "inf",
        "span_s": round(span, 3), "prompt_tokens_mean": round(statistics.mean(prompt), 1),
        "trace_tokens_mean": round(statistics.mean(r.trace_tokens for r in kept), 1),
        "segments": sum(len(r.segments) for r in kept),
        "distinct_segments": len({s.identity for r in kept for s in r.segments}),
        "volatile_tokens_mean": statistics.mean(sum(s.tokens for s in r.segments if s.volatile) for r in kept),
        "output_length_mean": (round(statistics.mean(r.output_length for r in kept if r.output_length is not None), 1)
                               if any(r.output_length is not None for r in kept) else None),
        "synthetic_text": synthetic.as_dict(), "layout_checks": planner.checked,
        "unclean_layouts": bounds.unclean,
    }
    blend_tokens = _blend_store_tokens(bounds.served, tokenizer) if _has_blend(cfg) else 0
    info["blend_store_tokens"] = blend_tokens
    ws_bytes = (bounds.stored_tokens + blend_tokens) * kv_bytes_per_token
    ws_info = {"bytes": ws_bytes, "prefix_tokens": bounds.stored_tokens, "requests": len(kept) + len(warmup),
               "passages": len({s.identity for r in kept for s in r.segments if s.kind == "passage"}),
               "mean_prompt_tokens": info["prompt_tokens_mean"], "reuse_upper_bound": bounds.prefix.fraction,
               "trace": {k: v for k, v in info.items() if not isinstance(v, dict)}}
    traces = BenchTraces(passages, warmup, {(0, 0): requests}, doc_tokens, system_tokens, suffix, ws_bytes, ws_info)
    return TraceReplay(replayed, traces, bounds, rate, info)


def _has_blend(cfg: BenchConfig) -> bool:
    """True when a system of ``cfg`` serves in blend mode (it keeps documents' position-independent KV too)."""
    return any(s.overrides.get("reuse") == "blend" for s in parse_systems(list(cfg.systems)))


def _blend_store_tokens(served: Sequence[LaidOut], tokenizer: Any) -> int:
    """Tokens a blend engine's position-independent store holds after ``served``: every distinct document segment
    (the segments between the head and the question) behind the engine's anchor (its default RAG head), each
    ``[anchor][document]`` counted whole (an upper bound: chunks of the anchor are shared)."""
    seg = PromptBuilder(tokenizer).build_rag("?", ["Document."])
    first = seg.document_segments[0] if seg.document_segments else 1
    anchor = sum(len(s) for s in seg.segments[:first])
    docs = {s for laid in served for s, ident in zip(laid.segments, laid.identities, strict=True)
            if ident is not None and ident != HEAD and ident != laid.identities[-1]}
    return sum(anchor + len(d) for d in docs)


def _fit_points(prompt_len: int) -> list[tuple[int, int]]:
    """(prefix, new) points spanning a prompt of ``prompt_len`` tokens: short and full forwards from (almost) no
    context, a short suffix after a long context, half after half."""
    small = max(1, min(64, prompt_len // 8))
    half = max(1, prompt_len // 2)
    pts = [(1, small), (1, max(small, prompt_len - 1)), (max(1, prompt_len - small), small),
           (half, max(1, prompt_len - half))]
    return list(dict.fromkeys(pts))


def measure_raw_forward(loaded: Any, token_ids: list[int], *, reps: int = _FIT_REPS) -> RawForwardFit:
    """Time raw forwards of slices of ``token_ids`` (the longest replayed prompt) over a resident cache
    (`pcr_rag.bench.limit`'s measurement; one untimed try first) and fit `RawForwardFit`."""
    n = len(token_ids)
    if n < 4:
        raise BenchError(f"the raw-forward fit needs a prompt of at least 4 tokens, got {n}")
    points = _fit_points(n)
    if len(points) < 3:
        points = [(1, 1), (1, n - 1), (n // 2, n - n // 2)]
    _raw_suffix_forward(loaded.model, token_ids[:1], token_ids[1:], loaded.device)  # warm kernels, untimed
    measured = []
    for p, k in points:
        times = [_raw_suffix_forward(loaded.model, token_ids[:p], token_ids[p:p + k], loaded.device)
                 for _ in range(reps)]
        measured.append((p, k, statistics.median(times)))
    return RawForwardFit.fit(measured)


def replay_rate(trace: Trace, speed: float) -> float:
    """The replay's mean request rate (req/s): requests after the first over the span of the scaled arrivals (inf:
    all at once)."""
    arrivals = trace.arrivals_s(speed)
    span = arrivals[-1] if arrivals else 0.0
    return (len(arrivals) - 1) / span if span > 0 else math.inf


def run_trace_bench(cfg: BenchConfig, trace: Trace, *, speed: float = 1.0, model: Any = None, tokenizer: Any = None,
                    progress: bool = True, ttft_bound: bool = True) -> dict[str, Any]:
    """Replay ``trace`` (cut and scaled already; ``cfg`` from `trace_config` for the same trace and speed) and
    return the bench report with its ``bounds`` section (`pcr_rag.bench.trace_bounds.bounds_section`)."""
    built: dict[str, TraceReplay] = {}

    def traces_builder(config: BenchConfig, loaded: Any) -> BenchTraces:
        replay = build_replay(trace, config, loaded.tokenizer, loaded.kv.bytes_per_token, speed=speed,
                              context_tokens=loaded.context_window)
        built["replay"] = replay
        return replay.traces

    runner = BenchRunner(cfg, model=model, tokenizer=tokenizer, progress=progress, traces_builder=traces_builder)
    report = runner.run()
    replay = built["replay"]
    fit = None
    notes: list[str] = []
    if ttft_bound:
        longest = max(replay.bounds.served, key=lambda laid: laid.num_tokens)
        before = torch.get_num_threads()
        torch.set_num_threads(runner.threads)  # the run's own compute threads
        try:
            fit = measure_raw_forward(runner.loaded, longest.token_ids)
        finally:
            torch.set_num_threads(before)
    else:
        notes.append("TTFT bounds not measured (--no-limit-ratio)")
    notes += _notes(replay)
    report["bounds"] = bounds_section(replay.bounds, report["runs"], fit=fit, info=replay.info, notes=notes)
    report["notes"] = list(report.get("notes") or []) + [f"trace replay: {n}" for n in notes]
    return report


def _notes(replay: TraceReplay) -> list[str]:
    info, b = replay.info, replay.bounds
    syn = info["synthetic_text"]
    notes = [
        f"synthetic text: {syn['exact']} of {syn['segments']} segment texts tokenize to exactly their trace length "
        f"alone (largest error {syn['max_abs_error']} tokens); in the engine's layout a request holds "
        f"{info['prompt_tokens_mean']:.0f} prompt tokens on average against {info['trace_tokens_mean']:.0f} in the "
        "trace (the head, separators and the question's template; counted exactly from the engine's own layout)",
        f"arrivals: the trace's timestamps divided by {info['speed']} (mean rate {info['mean_rate_rps']} req/s over "
        f"{info['span_s']:.1f} s); "
        + (f"each request generates its trace's output length at most (mean {info['output_length_mean']:.0f} "
           "tokens; the model's end of sequence can stop it sooner)" if info.get("output_length_mean") is not None
           else "every request generates --max-new-tokens tokens at most"),
    ]
    if info.get("blend_store_tokens"):
        notes.append(f"blend: the tiers are sized for the position-independent store too ({info['blend_store_tokens']} "
                     "tokens: every distinct document segment behind the engine's anchor), the same for every "
                     "system; pcr-blend's reuse counts placed tokens only when an earlier request left their KV "
                     "(pcr_rag.bench.blend_ledger)")
    if info["dropped_too_long"]:
        notes.append(f"{info['dropped_too_long']} requests did not fit the model's context and were dropped")
    if replay.trace.format == "mooncake":
        notes.append("block-hash trace (Mooncake): its ids chain by prefix, so a seen block always follows the prefix "
                     "it was seen after; the position-independent bound cannot exceed the prefix bound here, and "
                     "the trace cannot show position-independent reuse (no passages: no cache-aware bound)")
    elif not b.moved_differs:
        notes.append("the trace has no volatile system part before its passages: the moved layout is the served one")
    if b.unclean:
        notes.append(f"{b.unclean} layouts could not be cut at every segment; their segments count only inside an "
                     "exact prefix")
    return notes

