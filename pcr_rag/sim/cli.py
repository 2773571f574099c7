"""`pcr-rag simulate`: the GPU regime (or any profile) simulated on the real cache engine.

Runs every system at every rate on one trace, the prefetch-window sweep, the hit-ratio study (LRU vs look-ahead
LRU vs Belady), and optionally a speed check; writes the bench's report (JSON with the same keys as
``pcr-rag bench --json``, Markdown, PNG plots). ``--validate BENCH_JSON`` instead re-simulates a real bench run
with a measured profile and prints simulated vs measured mean TTFT side by side. ``--fleet`` simulates fleets of N
replicas per routing, remote tier and link (`pcr_rag.sim.fleet_cli`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from typing import Any

from pcr_rag.bench.cli import parse_floats, parse_ints
from pcr_rag.bench.report import build_report, markdown_report, write_report
from pcr_rag.bench.targets import PAPER_TARGETS
from pcr_rag.errors import ConfigError
from pcr_rag.sched.step_budget import check_budget_steps
from pcr_rag.sim.experiment import (
    SimSettings,
    SimWorkload,
    build_scenario,
    hit_ratio_study,
    no_reuse_capacity_rps,
    speed_check,
    sweep,
    workload_from_args,
)
from pcr_rag.sim.fleet_cli import add_fleet_arguments, run_fleet_cli
from pcr_rag.sim.profiles import PREFILL_STEP_MODES, ProfileError, get_profile, shipped_profile_names
from pcr_rag.sim.remote_link import REMOTE_LINKS, get_link
from pcr_rag.sim.replicas import two_replica_experiment
from pcr_rag.sim.simulator import (
    ENGINE_DEFAULT_ITL_BUDGET,
    ENGINE_DEFAULT_MAX_ACTIVE,
    EXECUTORS,
    PREFILL_FIRST_DEFAULT_BATCH,
)
from pcr_rag.sim.systems import DEFAULT_SYSTEMS, UnknownSystemError, get_system, parse_systems
from pcr_rag.sim.trace_replay import TRACE_SIM_SYSTEMS, TRACE_WARMUP, run_trace_cli, sim_settings
from pcr_rag.sim.validate import run_validation

log = logging.getLogger(__name__)

def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("set-up")
    g.add_argument("--profile", default="rtx4090-llama2-7b",
                   help=f"shipped profile ({', '.join(shipped_profile_names())}) or a JSON file from "
                        "`pcr-rag profile`")
    g.add_argument("--systems", default=None, help=f"comma-separated systems (default: {','.join(DEFAULT_SYSTEMS)})")
    g.add_argument("--windows", type=parse_ints, default=(2, 4, 8, 10), help="prefetch windows to sweep besides pcr's ('' = none)")
    g.add_argument("--sweep-rates", default="mid", choices=("mid", "all"), help="rates of the window sweep")
    g.add_argument("--rates", type=parse_floats, default=None, help="request rates in req/s, comma-separated")
    g.add_argument("--loads", type=parse_floats, default=(0.3, 0.5, 0.7, 0.9, 1.1),
                   help="rates as multiples of the no-reuse system's capacity on the same traces (unless --rates)")
    g.add_argument("--executor", choices=EXECUTORS, default=None,
                   help="engine-steps = the runtime's executor (rows, one decode step + one prefill step per engine "
                        "step, ITL budget); prefill-first = vLLM-like batched decode; serial = one request at a time "
                        "(default: engine-steps for a CPU profile, prefill-first otherwise)")
    g.add_argument("--max-batch", type=int, default=None,
                   help=f"rows (engine-steps) or running requests (prefill-first); default: the engine's max_active "
                        f"({ENGINE_DEFAULT_MAX_ACTIVE}) for engine-steps, {PREFILL_FIRST_DEFAULT_BATCH} for "
                        f"prefill-first")
    g.add_argument("--itl-budget", type=_budget, default=ENGINE_DEFAULT_ITL_BUDGET,
                   help="engine-steps: the ITL budget in decode steps, or 'none' for whole prefill steps (the "
                        "engine's itl_budget_steps; default %(default)s)")
    g.add_argument("--prefill-steps", choices=PREFILL_STEP_MODES, default=None,
                   help="one forward per prefill, or one per chunk like the runtime (default: the profile's)")
    w = parser.add_argument_group("workload (the bench's generator and defaults)")
    w.add_argument("--requests", type=int, default=1000, help="measured requests per system and rate")
    w.add_argument("--warmup", type=int, default=None,
                   help=f"warm-up requests per system (all at once; default {SimWorkload.warmup_requests}, with "
                        f"--trace {TRACE_WARMUP})")
    w.add_argument("--passages", type=int, default=256, help="passage pool size")
    w.add_argument("--passage-tokens", type=int, default=300, help="mean passage length, tokens")
    w.add_argument("--top-k", type=int, default=3)
    w.add_argument("--topics", type=int, default=64, help="distinct retrieval lists (0 = per-request draws)")
    w.add_argument("--zipf", type=float, default=1.0)
    w.add_argument("--system-tokens", type=int, default=40)
    w.add_argument("--question-tokens", type=int, default=30)
    w.add_argument("--max-new-tokens", type=int, default=32)
    w.add_argument("--burstiness", type=float, default=1.0)
    w.add_argument("--chunk-size", type=int, default=256)
    w.add_argument("--dram-fraction", type=float, default=0.25, help="DRAM tier / working set")
    w.add_argument("--ssd-fraction", type=float, default=1.0, help="SSD tier / working set")
    w.add_argument("--seed", type=int, default=0)
    o = parser.add_argument_group("output")
    o.add_argument("--json", default=None, help="write the JSON report here")
    o.add_argument("--markdown", default=None, help="write the Markdown report here")
    o.add_argument("--plots", default=None, help="write PNG plots into this directory")
    o.add_argument("--no-belady", action="store_true", help="skip the hit-ratio study")
    o.add_argument("--speed", type=int, default=0, help="also time a pcr simulation of this many requests")
    o.add_argument("--quiet", action="store_true")
    r = parser.add_argument_group("remote tier (a store shared by replicas)")
    r.add_argument("--two-replicas", action="store_true",
                   help="instead of the comparison: a cold pcr replica behind a store a warm replica filled, vs the "
                        "same cold replica without the remote tier, per --remote-links, at the middle rate")
    r.add_argument("--remote-links", default="100gbe,10gbe,1gbe",
                   help=f"network profiles replica <-> store ({', '.join(REMOTE_LINKS)})")
    v = parser.add_argument_group("validation against a real bench run")
    v.add_argument("--validate", default=None, metavar="BENCH_JSON",
                   help="re-simulate the runs of this `pcr-rag bench --json` report with a measured --profile and "
                        "print both side by side; 'run' = measure a profile and run `bench --quick` first, back to "
                        "back (same machine load), then compare")
    v.add_argument("--validate-repeats", type=int, default=1, metavar="N",
                   help="with --validate run: N > 1 runs quick's workload with N interleaved repeats of no-reuse, "
                        "dram-only and pcr only (about 8 minutes per repeat on 2 cores), so the paired interval of "
                        "the error narrows")
    t = parser.add_argument_group("trace replay (the file `pcr-rag bench --trace` replays)")
    t.add_argument("--trace", default=None, metavar="FILE",
                   help="instead of the comparison: replay a RAG segment trace (or Mooncake block-hash trace) and "
                        "print each system's mean TTFT and its prompt tokens reused exactly, blended and computed per profile; "
                        "--profile may then name several, comma-separated; --requests takes the first N; "
                        f"systems default to {','.join(TRACE_SIM_SYSTEMS)}")
    t.add_argument("--trace-speed", type=parse_floats, default=None, metavar="X",
                   help="arrivals are the trace's timestamps divided by X (default 1; 'inf' = all at once)")
    t.add_argument("--trace-length-scale", type=float, default=None, metavar="F",
                   help="every segment's and output's length times F (rounded, at least 1)")
    t.add_argument("--blend-recompute", type=parse_floats, default=None, metavar="F[,F...]",
                   help="run each blend system (pcr-blend) once per recompute fraction, named NAME@r=F (default: "
                        "the engine's blend_recompute)")
    add_fleet_arguments(parser)


def _budget(text: str) -> float | None:
    """``--itl-budget``: a number of decode steps > 1, or "none"."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of decode steps > 1 or 'none', got {text!r}") from None
    try:
        check_budget_steps(value)  # the engine's own check
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def run(args: argparse.Namespace) -> int:
    say = (lambda _m: None) if args.quiet else (lambda m: print(m, flush=True))
    if args.trace:
        if args.fleet or args.validate or args.two_replicas:
            print("error: --trace runs on its own: leave out --fleet, --validate and --two-replicas", file=sys.stderr)
            return 2
        return run_trace_cli(args, say)
    try:
        profile = get_profile(args.profile)
        systems = parse_systems(args.systems)
        if args.validate_repeats < 1 or (args.validate_repeats > 1 and args.validate != "run"):
            raise ValueError(f"--validate-repeats {args.validate_repeats}: a number >= 1, with --validate run "
                             "(a saved report keeps the repeats it was run with)")
        if args.fleet_validate and not args.fleet:
            raise ValueError("--fleet-validate goes with --fleet")
        if args.fleet and (args.validate or args.two_replicas):
            raise ValueError("--fleet runs on its own: leave out --validate and --two-replicas")
    except (ProfileError, UnknownSystemError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.validate:
        return run_validation(args, profile, say)
    settings = sim_settings(args, profile)
    if settings is None:
        return 2
    executor, max_batch = settings.executor, settings.max_batch
    if args.fleet:
        return run_fleet_cli(args, profile, settings, say)
    if profile.device_is_host and args.systems is None:
        systems = [s for s in systems if not s.device_cache]  # a CPU has no device KV pool to cache in
    windows = list(args.windows)
    wl = workload_from_args(args)
    t0 = time.perf_counter()
    slots = list(args.rates or args.loads)
    scenario = build_scenario(wl, profile, len(slots))
    capacity = no_reuse_capacity_rps(profile, scenario, settings, wl.chunk_size)
    if args.rates:
        rates = slots
        loads = [r / capacity for r in rates]
    else:
        loads = slots
        rates = [lf * capacity for lf in loads]
    load_of = dict(zip(rates, loads, strict=True))
    say(f"profile {profile.name}: {profile.description}")
    say(f"scenario: {len(scenario.warmup)} warm-up + {len(slots)} x {wl.num_requests} requests, working set "
        f"{scenario.working_set_bytes / 1e9:.2f} GB, DRAM {scenario.dram_bytes / 1e9:.2f} GB, SSD "
        f"{scenario.ssd_bytes / 1e9:.2f} GB, reuse upper bound {scenario.reuse_upper_bound:.1%}; no-reuse capacity "
        f"{capacity:.3g} req/s -> rates {', '.join(f'{r:.3g}' for r in rates)} req/s "
        f"({time.perf_counter() - t0:.1f} s)")

    def extra(rate: float) -> dict[str, Any]:
        return {"load": load_of.get(rate)}

    finite = [i for i, r in enumerate(rates) if not math.isinf(r)]
    mid = finite[(len(finite) - 1) // 2] if finite else None
    if args.two_replicas:
        return _two_replicas(args, profile, scenario, settings, rates, mid, wl.chunk_size, say)
    runs = sweep(profile, scenario, systems, rates, settings, chunk_size=wl.chunk_size, extra=extra, progress=say)
    pcr_window = get_system("pcr").window
    sweep_windows = [w for w in windows if w != pcr_window]
    if sweep_windows and mid is not None:
        at = [mid] if args.sweep_rates == "mid" else finite
        runs += sweep(profile, scenario, parse_systems([], sweep_windows), rates, settings, slots=at,
                      chunk_size=wl.chunk_size, extra=extra, progress=say)
    notes = [
        f"simulated: profile {profile.name} ({profile.source}); compute and transfer times from the cost model, "
        "cache decisions from the real CacheManager, the runtime's plan_prefetch and its admission policy",
        f"executor {executor}, max_batch={max_batch} ("
        + {"serial": "one request at a time",
           "prefill-first": "vLLM-like batched decode, prefill-first",
           "engine-steps": f"the runtime's rows: a decode step and one prefill step per engine step, ITL budget "
                           f"{args.itl_budget} decode steps"}[executor]
        + f"), prefill steps {args.prefill_steps or profile.prefill_steps}",
        f"no-reuse capacity {capacity:.4g} req/s on these traces; loads {[round(x, 3) for x in loads]}",
    ]
    report = build_report(
        runs, kind="simulate", targets=PAPER_TARGETS,
        target_rate=rates[mid] if mid is not None else None,
        config={"profile": profile.name, "profile_source": profile.source, "systems": [s.name for s in systems],
                "rates": rates, "loads": loads, "windows": windows, "sweep_rates": args.sweep_rates,
                "executor": executor, "itl_budget_steps": args.itl_budget,
                "max_batch": max_batch, "prefill_steps": args.prefill_steps or profile.prefill_steps,
                "workload": wl.describe(), "working_set_bytes": scenario.working_set_bytes,
                "dram_capacity": scenario.dram_bytes, "ssd_capacity": scenario.ssd_bytes,
                "reuse_upper_bound": scenario.reuse_upper_bound, "capacity_rps": capacity},
        notes=notes,
    )
    report["rate_loads"] = {str(r): lf for r, lf in load_of.items()}
    report["profile"] = json.loads(profile.to_json())
    if not args.no_belady and mid is not None:
        say("hit-ratio study (one DRAM tier): LRU vs look-ahead LRU vs Belady ...")
        study = hit_ratio_study(profile, scenario, mid, rates[mid], settings, window=pcr_window,
                                chunk_size=wl.chunk_size)
        report["hit_ratio_study"] = study.as_dict()
        for r in study.results:
            say(f"  {r.policy:>14s}: token hit ratio {r.token_hit_ratio:.2%} (chunks {r.chunk_hit_ratio:.2%})")
    if args.speed:
        say(f"speed check: {args.speed} requests of pcr ...")
        sp = speed_check(profile, wl, settings, args.speed)
        report["speed"] = sp
        say(f"  {sp['num_requests']} requests: build {sp['build_s']:.1f} s, no-reuse capacity "
            f"{sp['no_reuse_capacity_s']:.1f} s, pcr {sp['simulate_s']:.1f} s")
    report["wall_s"] = time.perf_counter() - t0
    write_report(report, json_path=args.json, markdown_path=args.markdown, plot_dir=args.plots,
                 title=f"pcr-rag simulate ({profile.name})")
    if not args.quiet:
        print()
        print(markdown_report(report, title=f"pcr-rag simulate ({profile.name})"))
        if "hit_ratio_study" in report:
            print(json.dumps(report["hit_ratio_study"], indent=2))
    return 0


def _two_replicas(args: argparse.Namespace, profile: Any, scenario: Any, settings: SimSettings,
                  rates: list[float], mid: int | None, chunk_size: int, say: Any) -> int:
    try:
        links = [get_link(n.strip()) for n in args.remote_links.split(",") if n.strip()]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    slot = mid if mid is not None else 0
    say(f"two replicas at {rates[slot]:.3g} req/s: cold replica behind a warm store, links "
        f"{', '.join(link.name for link in links)}")
    out = two_replica_experiment(profile, scenario, settings, links, rate=rates[slot], slot=slot,
                                 chunk_size=chunk_size)
    base = out["cold_no_remote"]["mean_ttft_s"]
    say(f"  cold replica, no remote tier: mean TTFT {base:.4g} s")
    for name, r in out["links"].items():
        c = r["cold_with_remote"]
        say(f"  {name:>9s}: mean TTFT {c['mean_ttft_s']:.4g} s ({c['ttft_over_no_remote']:.2f}x), "
            f"{c['reused_tokens']['remote']} tokens from the store, {c['recompute_chosen']} chunks recomputed "
            "instead of loaded")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def _main(argv: list[str] | None = None) -> Any:  # `python -m pcr_rag.sim.cli`
    p = argparse.ArgumentParser(prog="pcr-rag simulate", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(_main())
