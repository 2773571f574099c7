"""``pcr-rag simulate --trace FILE``: project a trace replay (`pcr_rag.bench.trace_file`, the file ``pcr-rag bench
--trace`` replays) onto a profile: each system's mean TTFT and the prompt tokens it reused exactly and blended.

The replay is the bench's (`pcr_rag.bench.trace_replay`) as far as the simulator models it: the file's first
requests (lengths scaled), arrivals at the file's timestamps divided by ``speed``, every system starting from an
empty cache after ``warmup`` warm-up requests shaped like the first request but made of their own segment ids
(`pcr_rag.sim.trace.warmup_requests`: they warm the shared head, and in blend mode the anchor), tier capacities as
fractions of the working set (the distinct exact chunks of the warm-up and the replayed requests), documents in
trace order. Prompts are laid out as `pcr_rag.sim.trace.trace_requests` says (the engine's separators are not
modelled).

Reuse is reported as fractions of all replayed prompt tokens, as the runtime counts them: ``exact`` (the prefix
match), ``blended`` (blend mode: placed from documents' position-independent KV cached before the request),
``computed`` (the rest, the runtime's ``computed_tokens``: a document computed in isolation by the request and
placed counts as computed), and ``reused`` (exact + blended). The work the forwards did is reported next to them:
``in context`` (the request's own forward steps: the prompt less the exact prefix and every placed token) and
``in isolation`` (blend mode's isolated prefills of documents not cached, anchor included). Next to them, two
bounds of the same prompts for a cache that never evicts, at chunk granularity: ``prefix`` (the longest prefix of
the chunk chain served before) and ``position_independent`` (that prefix plus every later segment - document or
question - whose identity an earlier request held in any position), each leaving the last token computed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pcr_rag.bench.config import BenchError
from pcr_rag.bench.trace_file import Trace, TraceRequest, read_trace
from pcr_rag.bench.trace_replay import TRACE_WARMUP
from pcr_rag.bench.workload import tier_capacities
from pcr_rag.cache import namespace_key
from pcr_rag.sim.experiment import Scenario, SimSettings, at_rate
from pcr_rag.sim.profiles import Profile, ProfileError, get_profile
from pcr_rag.sim.simulator import SimResult, Simulator, default_max_batch
from pcr_rag.sim.systems import SimSystem, UnknownSystemError, parse_systems
from pcr_rag.sim.trace import (
    SimRequest,
    TraceBuilder,
    segment_doc_id,
    segment_tokens,
    synthetic_tokens,
    trace_requests,
    warmup_requests,
)

__all__ = ["TRACE_SIM_SYSTEMS", "ReplayBounds", "ReplayOptions", "ReplaySummary", "TraceScenario", "blend_variants",
           "build_trace_scenario", "replay_bounds", "replay_table", "replay_trace", "run_trace_cli", "summarize"]

#: The systems ``pcr-rag simulate --trace`` compares unless ``--systems`` says otherwise.
TRACE_SIM_SYSTEMS: tuple[str, ...] = ("no-reuse", "pcr", "pcr-blend")


@dataclass(frozen=True)
class ReplayOptions:
    """How a trace file is replayed (tokens, seconds): ``speed`` divides the trace's gaps (inf: all at once);
    ``warmup`` warm-up requests (the bench's trace default); ``head_tokens``: the engine's head before the first
    document (chat template, system prompt, instruction), the same in every request; ``default_output``: output
    tokens of a request whose trace line has no ``output_length``; tier capacities as fractions of the working
    set, at least one chunk (the bench's defaults)."""

    chunk_size: int = 256
    head_tokens: int = 40
    speed: float = 1.0
    warmup: int = TRACE_WARMUP
    default_output: int = 32
    dram_fraction: float = 0.25
    ssd_fraction: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0 (inf = all at once), got {self.speed}")
        if self.warmup < 0 or self.head_tokens < 0 or self.default_output < 1 or self.chunk_size < 1:
            raise ValueError("warmup and head_tokens must be >= 0, default_output and chunk_size >= 1")


@dataclass
class TraceScenario:
    """A trace ready to simulate: the `Scenario` (warm-up, one measured trace at its own arrival times, tier
    capacities) and, per measured request, the trace request it came from."""

    scenario: Scenario
    sources: list[TraceRequest]
    info: dict[str, Any] = field(default_factory=dict)


def build_trace_scenario(trace: Trace, profile: Profile, options: ReplayOptions) -> TraceScenario:
    """The requests of ``trace`` (cut and scaled already) for ``profile``'s model (see the module docstring)."""
    o = options
    root = namespace_key(profile.model, "float16", o.chunk_size)
    head = synthetic_tokens("\x00system", o.head_tokens, seed=o.seed) if o.head_tokens else ()
    builder = TraceBuilder(root, o.chunk_size, lambda d: segment_tokens(d, seed=o.seed), system_tokens=head,
                           seed=o.seed)
    warm_src = warmup_requests(trace.requests[0], o.warmup) if trace.requests and o.warmup else []
    warm = trace_requests(warm_src, builder, [0.0] * len(warm_src), default_output=o.default_output)
    arrivals = trace.arrivals_s(o.speed)
    reqs = trace_requests(trace, builder, arrivals, default_output=o.default_output, rid_offset=len(warm))
    chunks: dict[bytes, int] = {}
    for r in (*warm, *reqs):
        for c in r.plan:
            chunks[c.key] = c.num_tokens
    ws = sum(chunks.values()) * profile.kv_bytes_per_token
    dram, ssd = tier_capacities(ws, dram_fraction=o.dram_fraction, ssd_fraction=o.ssd_fraction,
                                min_bytes=o.chunk_size * profile.kv_bytes_per_token)
    span = arrivals[-1] if arrivals else 0.0
    info = {"file": trace.source, "format": trace.format, "requests": len(reqs), "warmup_requests": len(warm),
            "speed": o.speed, "span_s": span,
            "mean_rate_rps": (len(reqs) - 1) / span if span > 0 else math.inf,
            "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in reqs) if reqs else 0.0,
            "working_set_bytes": ws, "dram_bytes": dram, "ssd_bytes": ssd, "head_tokens": o.head_tokens,
            "chunk_size": o.chunk_size}
    sc = Scenario(warm, [reqs], dram, ssd, ws, math.nan, info)
    return TraceScenario(sc, list(trace.requests), info)


@dataclass(frozen=True)
class ReplayBounds:
    """Reuse bounds of the measured requests, as fractions of their prompt tokens (see the module docstring)."""

    prefix: float
    position_independent: float

    def as_dict(self) -> dict[str, float]:
        return {"prefix": self.prefix, "position_independent": self.position_independent}


def replay_bounds(ts: TraceScenario, warmup_sources: Sequence[TraceRequest] | None = None) -> ReplayBounds:
    """The prefix and position-independent bounds of ``ts``'s measured requests, walked in arrival order after
    the warm-up (which counts for what is cached, not in the fractions)."""
    sc = ts.scenario
    warm_src = warmup_sources if warmup_sources is not None else (
        warmup_requests(ts.sources[0], len(sc.warmup)) if ts.sources and sc.warmup else [])
    seen_keys: set[bytes] = set()
    seen_ids: set[str] = set()
    total = prefix_sum = pi_sum = 0

    def walk(req: SimRequest, src: TraceRequest, count: bool) -> None:
        nonlocal total, prefix_sum, pi_sum
        matched = 0
        for c in req.plan[:-1]:
            if c.key not in seen_keys:
                break
            matched = c.end
        ids = [segment_doc_id(s) for s in src.segments]
        spans: list[tuple[int, int]] = [(d.start, d.end) for d in req.documents]
        if src.question is not None:
            spans.append((req.prompt_tokens - src.question.tokens, req.prompt_tokens))
        extra = 0
        for doc_id, (lo, hi) in zip(ids, spans, strict=False):
            if doc_id in seen_ids and hi > matched:
                extra += min(hi, req.prompt_tokens - 1) - max(lo, matched)
        if count:
            total += req.prompt_tokens
            prefix_sum += matched
            pi_sum += matched + max(0, extra)
        seen_keys.update(c.key for c in req.plan)
        seen_ids.update(ids)

    for req, src in zip(sc.warmup, warm_src, strict=True):
        walk(req, src, False)
    for req, src in zip(sc.traces[0], ts.sources, strict=True):
        walk(req, src, True)
    return ReplayBounds(prefix_sum / total if total else 0.0, pi_sum / total if total else 0.0)


@dataclass(frozen=True)
class ReplaySummary:
    """One system's replay on one profile: mean TTFT (seconds), token counts (fractions: `fraction`, of all
    prompt tokens) and the forward steps of all its prefills."""

    profile: str
    system: str
    requests: int
    mean_ttft_s: float
    p50_ttft_s: float
    prompt_tokens: int
    exact_tokens: int
    blended_tokens: int
    computed_tokens: int
    isolated_tokens: int
    forward_steps: int
    placed_tokens: int = 0

    def fraction(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def reused_fraction(self) -> float:
        """Exact + blended, over all prompt tokens."""
        return self.fraction(self.exact_tokens + self.blended_tokens)

    @property
    def context_tokens(self) -> int:
        """Tokens the requests' own forward steps computed: the prompts less the exact prefixes and every placed
        token (blend mode's isolated prefills not included)."""
        return self.prompt_tokens - self.exact_tokens - self.placed_tokens

    def as_dict(self) -> dict[str, Any]:
        return {"profile": self.profile, "system": self.system, "requests": self.requests,
                "mean_ttft_s": self.mean_ttft_s, "p50_ttft_s": self.p50_ttft_s, "prompt_tokens": self.prompt_tokens,
                "exact_tokens": self.exact_tokens, "blended_tokens": self.blended_tokens,
                "computed_tokens": self.computed_tokens, "placed_tokens": self.placed_tokens,
                "context_tokens": self.context_tokens, "isolated_tokens": self.isolated_tokens,
                "forward_steps": self.forward_steps, "reused_fraction": self.reused_fraction}


def summarize(profile: str, system: str, result: SimResult) -> ReplaySummary:
    outs = result.outcomes
    ttft = [o.ttft_s for o in outs]
    return ReplaySummary(
        profile=profile, system=system, requests=len(outs),
        mean_ttft_s=statistics.fmean(ttft) if ttft else math.nan,
        p50_ttft_s=statistics.median(ttft) if ttft else math.nan,
        prompt_tokens=sum(o.prompt_tokens for o in outs),
        exact_tokens=sum(o.exact_tokens for o in outs),
        blended_tokens=sum(o.blended_tokens for o in outs),
        computed_tokens=sum(o.computed_tokens for o in outs),
        isolated_tokens=sum(o.isolated_tokens for o in outs),
        forward_steps=sum(o.forward_steps for o in outs),
        placed_tokens=sum(o.placed_tokens for o in outs),
    )


def replay_trace(profile: Profile, ts: TraceScenario, systems: Sequence[SimSystem], settings: SimSettings, *,
                 chunk_size: int = 256) -> list[ReplaySummary]:
    """Each system on its own cache: the warm-up all at once, then the measured requests at their arrivals."""
    out: list[ReplaySummary] = []
    sc = ts.scenario
    for system in systems:
        sim = Simulator(settings.config(profile, system, sc, chunk_size=chunk_size))
        try:
            if sc.warmup:
                sim.run(at_rate(sc.warmup, math.inf))
            res = sim.run(sc.traces[0])
        finally:
            sim.close()
        out.append(summarize(profile.name, system.name, res))
    return out


def blend_variants(systems: Sequence[SimSystem], fractions: Sequence[float]) -> list[SimSystem]:
    """``systems`` with each blend system replaced by one per recompute fraction (named ``NAME@r=F``; none: its
    own fraction); the other systems as given."""
    out: list[SimSystem] = []
    for s in systems:
        if not s.blend:
            out.append(s)
            continue
        out += [replace(s, name=f"{s.name}@r={f:g}", blend_recompute=float(f)) for f in fractions] or [s]
    return out


def replay_table(summaries: Sequence[ReplaySummary], bounds: dict[str, ReplayBounds] | None = None, *,
                 baseline: str = "pcr", cold: str = "no-reuse") -> list[str]:
    """A Markdown table of ``summaries`` (grouped by profile, in order): mean TTFT and its ratio to ``baseline``
    and to ``cold`` on the same profile (blank where that system did not run), then the token fractions (exact +
    blended + computed = 100%; the forwards' tokens in context and in isolation) and the forward steps per request;
    a line of each profile's bounds below when given."""
    lines = ["| profile | system | mean TTFT | p50 TTFT | vs " + baseline + " | vs " + cold + " | exact | blended "
             "| computed | forward tokens: in context | forward tokens: in isolation | forward steps / request |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(s.profile, s.system): s for s in summaries}
    for s in summaries:
        base, nr = by.get((s.profile, baseline)), by.get((s.profile, cold))
        lines.append(
            f"| {s.profile} | {s.system} | {_ms(s.mean_ttft_s)} | {_ms(s.p50_ttft_s)} | "
            f"{_ratio(s.mean_ttft_s, base)} | {_ratio(s.mean_ttft_s, nr)} | {s.fraction(s.exact_tokens):.1%} | "
            f"{s.fraction(s.blended_tokens):.1%} | {s.fraction(s.computed_tokens):.1%} | "
            f"{s.fraction(s.context_tokens):.1%} | {s.fraction(s.isolated_tokens):.1%} | "
            f"{s.forward_steps / s.requests if s.requests else 0:.1f} |")
    for name, b in (bounds or {}).items():
        lines.append("")
        lines.append(f"Bounds on {name} (fractions of prompt tokens, unbounded cache): prefix {b.prefix:.1%}, "
                     f"position-independent {b.position_independent:.1%}.")
    return lines


def _ms(seconds: float) -> str:
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e3:.1f} ms"


def _ratio(value: float, other: ReplaySummary | None) -> str:
    if other is None or not other.mean_ttft_s > 0:
        return "-"
    return f"{value / other.mean_ttft_s:.2f}x"


# ------------------------------------------------------------------------------------------------------------ CLI
def sim_settings(args: argparse.Namespace, profile: Profile) -> SimSettings | None:
    """The run's `SimSettings` from the CLI's ``--executor``, ``--max-batch``, ``--prefill-steps`` and
    ``--itl-budget`` for ``profile`` (the executor's default: engine steps on a host profile, prefill-first on a
    device); None, after one stderr line, when the batch size does not fit the executor."""
    executor = args.executor or ("engine-steps" if profile.device_is_host else "prefill-first")
    max_batch = args.max_batch if args.max_batch is not None else default_max_batch(executor)
    if max_batch < 1 or (executor == "serial" and max_batch != 1):
        print(f"error: --max-batch {max_batch} does not fit --executor {executor}", file=sys.stderr)
        return None
    return SimSettings(max_batch=max_batch, prefill_steps=args.prefill_steps, executor=executor,
                       itl_budget_steps=args.itl_budget)


def run_trace_cli(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    """``pcr-rag simulate --trace FILE``: the replay on each ``--profile`` (comma-separated), one table. Uses
    ``--systems`` (default `TRACE_SIM_SYSTEMS`), ``--blend-recompute``, ``--requests`` (the file's first N),
    ``--trace-speed``, ``--trace-length-scale``, ``--warmup``, ``--system-tokens`` (the head), ``--max-new-tokens``
    (outputs the trace does not give), ``--chunk-size``, ``--dram-fraction``, ``--ssd-fraction``, ``--seed``,
    ``--executor`` / ``--max-batch`` / ``--itl-budget`` / ``--prefill-steps``; writes ``--json`` / ``--markdown``.
    Returns the exit status (2: bad arguments)."""
    try:
        speeds = args.trace_speed or (1.0,)
        if len(speeds) != 1:
            raise ValueError(f"--trace-speed takes one factor, got {len(speeds)}")
        scale = 1.0 if args.trace_length_scale is None else float(args.trace_length_scale)
        if not scale > 0:
            raise ValueError(f"--trace-length-scale must be > 0, got {scale}")
        profiles = [get_profile(name.strip()) for name in str(args.profile).split(",") if name.strip()]
        if not profiles:
            raise ValueError("--profile names no profile")
        systems = blend_variants(parse_systems(args.systems or ",".join(TRACE_SIM_SYSTEMS)),
                                 tuple(args.blend_recompute or ()))
        options = ReplayOptions(chunk_size=args.chunk_size, head_tokens=args.system_tokens, speed=speeds[0],
                                warmup=TRACE_WARMUP if args.warmup is None else args.warmup,
                                default_output=args.max_new_tokens, dram_fraction=args.dram_fraction,
                                ssd_fraction=args.ssd_fraction, seed=args.seed)
        trace = read_trace(args.trace).head(args.requests).scaled(scale)
    except (ProfileError, UnknownSystemError, ValueError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summaries: list[ReplaySummary] = []
    bounds: dict[str, ReplayBounds] = {}
    runs: list[dict[str, Any]] = []
    for profile in profiles:
        settings = sim_settings(args, profile)
        if settings is None:
            return 2
        executor, max_batch = settings.executor, settings.max_batch
        ts = build_trace_scenario(trace, profile, options)
        bounds[profile.name] = replay_bounds(ts)
        got = replay_trace(profile, ts, systems, settings, chunk_size=options.chunk_size)
        summaries += got
        runs.append({"profile": profile.name, "profile_source": profile.source, "executor": executor,
                     "max_batch": max_batch, "prefill_steps": args.prefill_steps or profile.prefill_steps,
                     "trace": ts.info, "bounds": bounds[profile.name].as_dict()})
        info = ts.info
        say(f"{profile.name} ({profile.source}; executor {executor}, max_batch {max_batch}): {info['requests']} "
            f"requests of {info['prompt_tokens_mean']:.0f} prompt tokens on average at "
            f"{info['mean_rate_rps']:.3g} req/s after {info['warmup_requests']} warm-up ones; DRAM "
            f"{info['dram_bytes'] / 1e9:.3g} GB, SSD {info['ssd_bytes'] / 1e9:.3g} GB")
    table = replay_table(summaries, bounds)
    title = (f"pcr-rag simulate --trace {args.trace} ({datetime.datetime.now(datetime.UTC):%Y-%m-%d}; "
             f"{len(trace.requests)} requests, speed {speeds[0]:g}, length scale {scale:g})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": "simulate-trace", "title": title, "runs": runs,
                       "systems": [{"name": s.name, "blend": s.blend, "blend_recompute": s.blend_recompute}
                                   for s in systems],
                       "summaries": [x.as_dict() for x in summaries]}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join([f"# {title}", "", *table]) + "\n")
    if not args.quiet:
        print()
        print(title)
        print()
        print("\n".join(table))
    return 0
