"""`pcr-rag bench`: the RAG serving benchmark (baselines, ablations, window sweep, percentiles, plots).

Every ratio comes with a 95% bootstrap interval over requests (systems run interleaved on the same trace); a
target counts as met only when the interval's unfavourable end meets it.

Quick smoke run (all systems, two rates, 12 requests each; ratios indicative only; wall times of every preset:
docs/benchmarks.md)::

    pcr-rag bench --quick --json results/bench-quick.json

Standard run (few systems, one rate, 4 interleaved repeats of 20 requests: resolves a 10% difference); with real
questions from the corpus's titles, pcr in both document orders::

    pcr-rag bench --standard --json results/bench-standard.json
    pcr-rag bench --standard --retrieval --json results/bench-standard-retrieval.json

Full run (load factors 0.4, 0.7, 1.0 of the measured no-reuse capacity, 32 measured requests per system and
rate, top-3 passages of ~300 tokens from 64 Zipf-popular topics, prefetch windows 2/4/6/8/10 at the middle
rate, 32 output tokens; the longest preset, since low rates are mostly waiting for arrivals)::

    pcr-rag bench --json results/bench.json

Replay a trace file (a RAG trace of per-segment ids and token lengths, or a Mooncake block-hash trace) and report
its reuse bounds next to what each system reached (docs/benchmarks.md, "Replaying a trace")::

    pcr-rag bench --trace benchmarks/traces/example_rag.jsonl --requests 16 --trace-speed 2 --json results/trace.json

The kernel benchmark (prefill and decode of the forward pass against the machine's limit) is its own command:
``pcr-rag bench kernels --help`` (`pcr_rag.bench.kernels`).

Outputs: the JSON report (``--json``), a Markdown table next to it (``--markdown``, default ``<json>.md``),
PNG plots (``--plots``, default ``<json stem>-plots/``), and a summary on stdout. Exit status 0 even when a
target is missed (the report says which); 2 on bad arguments, 1 when the benchmark could not run.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pcr_rag.bench.config import (
    QUICK_CAVEAT,
    RETRIEVAL_PASSAGES,
    BenchConfig,
    BenchError,
    quick_config,
    standard_config,
)
from pcr_rag.bench.report import markdown_report, write_report
from pcr_rag.bench.serving import run_bench
from pcr_rag.bench.systems import BENCH_DEFAULT_SYSTEMS, ORDERS, SYSTEMS, UnknownSystemError
from pcr_rag.bench.trace_file import read_trace
from pcr_rag.bench.trace_replay import run_trace_bench, trace_config

log = logging.getLogger(__name__)


def parse_floats(text: str) -> tuple[float, ...]:
    """``"0.5,1,inf"`` -> ``(0.5, 1.0, inf)`` (``all`` is ``inf`` too: all at once); an argparse ``type``."""
    try:
        return tuple(math.inf if x.strip().lower() in ("inf", "all") else float(x)
                     for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers (or 'inf'), got {text!r}") from None


def parse_ints(text: str) -> tuple[int, ...]:
    """``"2,4,8"`` -> ``(2, 4, 8)``; ``""`` -> ``()``; an argparse ``type``."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    parser.epilog = "\n".join(__doc__.splitlines()[2:])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("run")
    g.add_argument("--quick", action="store_true",
                   help="smoke preset: all systems, loads 0.7,1.0, 12 requests per run, window sweep {2,6}; "
                        "ratios indicative only")
    g.add_argument("--standard", action="store_true",
                   help="preset that resolves a 10%% difference in ~20 minutes: few systems, load 0.7, 4 "
                        "interleaved repeats x 20 requests (with --retrieval: cached systems in cache-aware order "
                        "plus pcr@relevance)")
    g.add_argument("--json", metavar="PATH", help="write the JSON report here")
    g.add_argument("--markdown", metavar="PATH", help="Markdown report (default: next to --json, .md)")
    g.add_argument("--plots", metavar="DIR", help="PNG plots directory (default: <json stem>-plots)")
    g.add_argument("--no-plots", action="store_true", help="skip the plots")
    g.add_argument("--work-dir", metavar="DIR", help="cache directories of the systems (default: a temp dir, removed)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--no-limit-ratio", action="store_true", help="skip the limit-ratio measurement")
    m = parser.add_argument_group("model")
    m.add_argument("--model", help="model alias or local HF directory (default: the engine's default model)")
    m.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16")
    m.add_argument("--device", default=None, help="auto (default), cpu, cuda[:N]")
    m.add_argument("--threads", type=int, help="torch compute threads (default: CPUs - 1, at least 1)")
    w = parser.add_argument_group("workload")
    w.add_argument("--corpus", help="directory of .txt/.md files or a .jsonl file (default: stdlib pydoc corpus)")
    w.add_argument("--max-docs", type=int, help="use at most this many corpus documents")
    w.add_argument("--passage-tokens", type=int, help="tokens per passage (default 300; quick 120)")
    w.add_argument("--passages", type=int, help="passage pool size, seeded sample (default 256; quick 96; 0 = all)")
    w.add_argument("--top-k", type=int, help="documents per request (default 3)")
    w.add_argument("--topics", type=int,
                   help="distinct retrieval lists with Zipf popularity (default 64; quick 16; 0 = every request "
                        "draws its own documents)")
    w.add_argument("--retrieval", action="store_true",
                   help="topics are real questions with their top-k passages from Chroma + MiniLM")
    w.add_argument("--questions", metavar="FILE",
                   help="questions for --retrieval, one per line (default: questions generated from the corpus's "
                        "own titles, pydoc entries or Markdown headings, each with its gold passage)")
    w.add_argument("--num-questions", type=int,
                   help="generated questions at most (default 200; the stdlib corpus needs --passages >= ~300)")
    w.add_argument("--order", choices=ORDERS,
                   help="document order of the cached systems (default relevance; with --retrieval cache-aware, "
                        "plus pcr@relevance to compare); a system named X@ORDER overrides it")
    w.add_argument("--zipf", type=float, help="Zipf exponent of popularity (default 1.0)")
    w.add_argument("--requests", type=int, help="measured requests per system and rate (default 32; quick 12)")
    w.add_argument("--warmup", type=int, help="warm-up requests per cached system, not measured: the most popular topics (default 16; quick 8)")
    w.add_argument("--loads", type=parse_floats,
                   help="rates as multiples of the measured no-reuse capacity (default 0.4,0.7,1.0; quick 0.7,1.0)")
    w.add_argument("--rates", type=parse_floats, help="absolute request rates in req/s ('inf' = all at once); "
                                                 "overrides --loads")
    w.add_argument("--burstiness", type=float, help="gamma shape of inter-arrivals (1.0 = Poisson)")
    w.add_argument("--repeats", type=int, help="repeat every (system, rate) run this many times (default 1)")
    w.add_argument("--max-new-tokens", type=int, help="output tokens per request (default 32; quick 8)")
    w.add_argument("--seed", type=int, help="workload seed (default 0)")
    t = parser.add_argument_group("trace replay (docs/benchmarks.md#replaying-a-trace)")
    t.add_argument("--trace", metavar="FILE",
                   help="replay a trace file instead of the corpus workload: a RAG segment trace (JSON Lines of "
                        "timestamp, segments, output_length) or a Mooncake block-hash trace; reports the reuse "
                        "bounds next to what each system reached (default systems no-reuse,pcr; --requests N: "
                        "the first N requests; e.g. benchmarks/traces/example_rag.jsonl)")
    t.add_argument("--trace-speed", type=parse_floats, metavar="X",
                   help="replay X times faster than the trace's timestamps (default 1; 'inf' = all at once)")
    t.add_argument("--trace-length-scale", type=float, metavar="F",
                   help="every segment's length and output length times F (default 1; e.g. 0.5 for a CPU)")
    s = parser.add_argument_group("systems and cache")
    s.add_argument("--systems", help=f"comma-separated, from: {', '.join(SYSTEMS)}, pcr-window-N, "
                                     "pcr-max-active-N, pcr-schedule-{fcfs,cache-aware}, <cached system>@ORDER "
                                     f"(default: {','.join(BENCH_DEFAULT_SYSTEMS)})")
    s.add_argument("--saturation", type=parse_ints,
                   help="max_active values compared at saturation, all requests at once (presets: 1,8; "
                        "otherwise none; '' = none)")
    s.add_argument("--saturation-requests", type=int,
                   help="requests of a saturation run (default: --requests)")
    s.add_argument("--windows", type=parse_ints,
                   help="prefetch windows to sweep besides pcr's own (default 2,4,8,10; quick 2; '' = none)")
    s.add_argument("--sweep-rates", choices=("mid", "all"), help="rates of the window sweep (default mid)")
    s.add_argument("--chunk-size", type=int, help="tokens per cached chunk (default 256)")
    s.add_argument("--dram-fraction", type=float, help="DRAM tier as a fraction of the working set (default 0.25)")
    s.add_argument("--ssd-fraction", type=float, help="SSD tier as a fraction of the working set (default 1.0)")


_FIELDS = {
    "model": "model", "dtype": "dtype", "device": "device", "threads": "threads", "corpus": "corpus",
    "max_docs": "max_docs", "passage_tokens": "tokens_per_passage", "passages": "num_passages", "top_k": "top_k",
    "topics": "num_topics", "zipf": "zipf_exponent", "requests": "num_requests", "warmup": "warmup_requests",
    "loads": "loads", "rates": "rates", "burstiness": "burstiness", "repeats": "repeats",
    "max_new_tokens": "max_new_tokens", "seed": "seed", "windows": "windows", "sweep_rates": "sweep_rates",
    "chunk_size": "chunk_size", "dram_fraction": "dram_fraction", "ssd_fraction": "ssd_fraction",
    "work_dir": "work_dir", "questions": "questions", "num_questions": "num_questions", "order": "order",
    "saturation": "saturation", "saturation_requests": "saturation_requests",
}


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A `BenchConfig` from parsed arguments (preset first, then every option given).

    ``--retrieval`` (or ``--questions``) without ``--passages`` samples `RETRIEVAL_PASSAGES` passages (enough
    titles for the generated questions); without ``--order`` the cached systems use cache-aware order and, unless
    ``--systems`` is given, ``pcr@relevance`` joins them so both orders are compared."""
    retrieval = bool(args.retrieval or args.questions)
    if args.quick and args.standard:
        raise BenchError("choose one preset: --quick or --standard")
    if args.standard:
        cfg = standard_config(retrieval=retrieval)
    else:
        cfg = quick_config() if args.quick else BenchConfig()
        if retrieval:
            cfg = replace(cfg, retrieval=True, num_passages=RETRIEVAL_PASSAGES, order="cache-aware")
    changes: dict[str, Any] = {}
    for arg, fld in _FIELDS.items():
        value = getattr(args, arg, None)
        if value is not None:
            changes[fld] = value
    if changes.get("num_passages") == 0:
        changes["num_passages"] = None
    if changes.get("num_topics") == 0:
        changes["num_topics"] = None
    if args.systems:
        changes["systems"] = tuple(x.strip() for x in args.systems.split(",") if x.strip())
    if retrieval:
        changes["retrieval"] = True
    if args.no_limit_ratio:
        changes["limit_ratio"] = False
    cfg = replace(cfg, **changes)
    if retrieval and not args.systems:  # compare both orders: pcr in the other one joins
        other = next(o for o in ORDERS if o != cfg.order)
        cfg = replace(cfg, systems=(*(n for n in cfg.systems if not n.startswith("pcr@")), f"pcr@{other}"))
    return cfg


def output_paths(args: argparse.Namespace) -> tuple[Path | None, Path | None, Path | None]:
    """(json, markdown, plots dir); without --json the Markdown and plots go to ./bench-results/ by default."""
    json_path = Path(args.json) if args.json else None
    base = json_path.with_suffix("") if json_path else Path("bench-results") / "bench"
    md = Path(args.markdown) if args.markdown else base.with_suffix(".md")
    plots = None if args.no_plots else (Path(args.plots) if args.plots else Path(f"{base}-plots"))
    return json_path, md, plots


def trace_run(args: argparse.Namespace) -> tuple[BenchConfig, Any]:
    """(config, run) of ``--trace``: the trace read, cut to ``--requests`` and scaled, and a callable that replays
    it (`pcr_rag.bench.trace_replay`). Raises `BenchError` naming what to change."""
    speeds = args.trace_speed or (1.0,)
    scale = 1.0 if args.trace_length_scale is None else args.trace_length_scale
    if len(speeds) != 1:
        raise BenchError(f"--trace-speed takes one factor, got {len(speeds)}")
    if not scale > 0:
        raise BenchError(f"--trace-length-scale must be > 0, got {scale}")
    trace = read_trace(args.trace).head(args.requests).scaled(scale)
    cfg = trace_config(config_from_args(args), trace, speed=speeds[0], systems_given=bool(args.systems),
                       warmup_given=args.warmup is not None)
    cfg.validate()

    def replay() -> dict[str, Any]:
        return run_trace_bench(cfg, trace, speed=speeds[0], progress=not args.no_progress,
                               ttft_bound=not args.no_limit_ratio)

    return cfg, replay


def run(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "trace", None):
            cfg, replay = trace_run(args)
        else:
            cfg = config_from_args(args)
            cfg.validate()
            replay = None
    except (BenchError, UnknownSystemError, TypeError, ValueError) as exc:
        print(f"pcr-rag bench: {exc}", file=sys.stderr)
        return 2
    try:
        report = replay() if replay is not None else run_bench(cfg, progress=not args.no_progress)
    except BenchError as exc:
        print(f"pcr-rag bench: {exc}", file=sys.stderr)
        return 1
    json_path, md_path, plot_dir = output_paths(args)
    out = write_report(report, json_path=json_path, markdown_path=md_path, plot_dir=plot_dir,
                       title="pcr-rag bench")
    print(markdown_report(report, title="pcr-rag bench"))
    print()
    if cfg.quick:
        print(QUICK_CAVEAT)
    print(f"what a user would see: {report.get('summary')}")
    for kind, path in (("json", out["json"]), ("markdown", out["markdown"])):
        if path:
            print(f"{kind}: {path}")
    if out["plots"]:
        print(f"plots: {', '.join(str(p) for p in out['plots'])}")
    return 0
