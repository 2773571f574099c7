"""`pcr-rag simulate --fleet`: N replicas behind each routing, with the remote tier off, on one node or on a
cluster, per network link (`pcr_rag.sim.fleet`); prints a table and writes JSON (``--json``).
``--fleet-validate`` instead runs the two-replica experiment both ways (its own code and the fleet's) and prints
the figures side by side, judged against the simulator's validation tolerance."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from pcr_rag.bench.cli import parse_ints
from pcr_rag.bench.targets import SIM_VALIDATION_TOLERANCE
from pcr_rag.sim.experiment import (
    SimSettings,
    SimWorkload,
    build_scenario,
    no_reuse_capacity_rps,
    workload_from_args,
)
from pcr_rag.sim.fleet import (
    REMOTE_MODES,
    ROUTINGS,
    FleetConfigError,
    FleetResult,
    FleetSpec,
    FleetTraceBuilder,
    FleetWorkload,
    compare_two_replicas,
    fleet_two_replicas,
    replica_capacity_rps,
    run_fleet,
)
from pcr_rag.sim.profiles import Profile
from pcr_rag.sim.remote_link import RemoteLink, get_link
from pcr_rag.sim.replicas import two_replica_experiment

GB = 1e9
MAX_REPLICAS = 1000


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    f = parser.add_argument_group("fleet (--fleet: N replicas, routing, a shared remote tier)")
    f.add_argument("--fleet", action="store_true",
                   help="instead of the comparison: simulate fleets of --replicas replicas per --routings, "
                        "--remote-tiers and --fleet-links on a Zipf workload over --documents documents")
    f.add_argument("--replicas", type=parse_ints, default=(10, 30, 100), help="fleet sizes (default 10,30,100)")
    f.add_argument("--routings", default=",".join(ROUTINGS), help=f"routing policies ({', '.join(ROUTINGS)})")
    f.add_argument("--remote-tiers", default=",".join(REMOTE_MODES),
                   help="remote tier: off, single (one store node), cluster (--shards nodes)")
    f.add_argument("--fleet-links", default="100gbe", help="network links replica <-> store, comma-separated")
    f.add_argument("--shards", type=int, default=8, help="store nodes of a cluster (default 8)")
    f.add_argument("--shard-gbps", type=float, default=None,
                   help="read bandwidth of one store node, GB/s (default: the link's)")
    f.add_argument("--eps", type=float, default=0.25,
                   help="bounded-affinity: a replica over (1 + eps) x the mean load passes a request on")
    f.add_argument("--documents", type=int, default=100_000, help="documents the Zipf law draws from")
    f.add_argument("--requests-per-replica", type=int, default=120,
                   help="requests per replica (the first --warmup-fraction of all are not measured)")
    f.add_argument("--warmup-fraction", type=float, default=0.5)
    f.add_argument("--load", type=float, default=0.9,
                   help="per-replica arrival rate as a multiple of one replica's no-reuse capacity")
    f.add_argument("--replica-rate", type=float, default=None, help="per-replica arrival rate, req/s (overrides --load)")
    f.add_argument("--dram-gb", type=float, default=32.0, help="DRAM tier per replica, GB")
    f.add_argument("--ssd-gb", type=float, default=128.0, help="SSD tier per replica, GB")
    f.add_argument("--fleet-validate", action="store_true",
                   help="with --fleet: the two-replica experiment through its own code and through the fleet's, "
                        "side by side (workload: the comparison's flags, links: --remote-links)")


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise FleetConfigError(f"{what} {text!r}: expected a comma-separated list of {', '.join(known)}")
    return names


def _links(text: str) -> list[RemoteLink]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise FleetConfigError(f"links {text!r}: name at least one link")
    try:
        return [get_link(n) for n in names]
    except ValueError as exc:
        raise FleetConfigError(str(exc)) from None


def fleet_plan(args: argparse.Namespace) -> tuple[FleetWorkload, list[FleetSpec]]:
    """The workload and every configuration the arguments ask for; raises `FleetConfigError` (before any work)
    for a setting out of range."""
    replicas = list(args.replicas)
    if not replicas or any(not 1 <= n <= MAX_REPLICAS for n in replicas):
        raise FleetConfigError(f"--replicas {replicas}: each between 1 and {MAX_REPLICAS}")
    routings = _names(args.routings, ROUTINGS, "--routings")
    tiers = _names(args.remote_tiers, REMOTE_MODES, "--remote-tiers")
    links = _links(args.fleet_links)
    checks = {
        "--requests-per-replica": args.requests_per_replica >= 1,
        "--warmup-fraction": 0.0 <= args.warmup_fraction < 1.0,
        "--load": args.load > 0 and math.isfinite(args.load),
        "--replica-rate": args.replica_rate is None or (args.replica_rate > 0 and math.isfinite(args.replica_rate)),
        "--dram-gb": args.dram_gb >= 0, "--ssd-gb": args.ssd_gb >= 0, "--shards": args.shards >= 1,
        "--eps": args.eps >= 0, "--shard-gbps": args.shard_gbps is None or args.shard_gbps > 0,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise FleetConfigError(f"out of range: {', '.join(bad)} (requests >= 1, 0 <= warm-up fraction < 1, load and "
                               "rates > 0, capacities >= 0, shards >= 1, eps >= 0, shard bandwidth > 0)")
    wl = FleetWorkload(num_documents=args.documents, zipf=args.zipf, top_k=args.top_k, doc_tokens=args.passage_tokens,
                       system_tokens=args.system_tokens, question_tokens=args.question_tokens,
                       output_tokens=args.max_new_tokens, chunk_size=args.chunk_size, seed=args.seed)
    shard_bw = None if args.shard_gbps is None else args.shard_gbps * GB
    specs = []
    for n in replicas:
        for tier in tiers:
            for link in ([links[0]] if tier == "off" else links):
                for routing in routings:
                    specs.append(FleetSpec(n, routing, tier, link, args.shards, args.eps, shard_bw))
    return wl, specs


def format_table(results: Sequence[FleetResult]) -> str:
    lines = ["| replicas | routing | remote tier | device | DRAM | SSD | remote | recompute | mean TTFT | P99 TTFT | "
             "read GB | written GB | store GB | busiest / mean |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        s = r.spec
        tier = {"off": "off", "single": f"single, {s.link.name}",
                "cluster": f"cluster x{s.shards}, {s.link.name}"}[s.remote]
        sh = r.tier_share
        lines.append(f"| {s.replicas} | {s.routing} | {tier} | "
                     + " | ".join(f"{sh[t]:.1%}" for t in ("device", "dram", "ssd", "remote", "recompute"))
                     + f" | {r.mean_ttft_s * 1e3:.0f} ms | {r.p99_ttft_s * 1e3:.0f} ms | "
                       f"{r.network_read_bytes / GB:.0f} | {r.network_write_bytes / GB:.0f} | {r.store_bytes / GB:.0f} | "
                       f"{r.spread:.2f} |")
    return "\n".join(lines)


def run_fleet_cli(args: argparse.Namespace, profile: Profile, settings: SimSettings,
                  say: Callable[[str], None]) -> int:
    """`pcr-rag simulate --fleet` (see the module docstring); returns the exit status."""
    try:
        if args.fleet_validate:
            links = _links(args.remote_links)
        else:
            wl, specs = fleet_plan(args)
    except FleetConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.fleet_validate:
        return _validate(args, profile, settings, links, say)
    t0 = time.perf_counter()
    builder = FleetTraceBuilder(wl, profile.model)
    capacity = replica_capacity_rps(profile, builder, settings)
    rate = args.replica_rate if args.replica_rate is not None else args.load * capacity
    say(f"profile {profile.name}; {wl.num_documents} documents, Zipf {wl.zipf}, top-{wl.top_k}; one replica's "
        f"no-reuse capacity {capacity:.3g} req/s -> {rate:.3g} req/s per replica; {len(specs)} configurations")
    results: list[FleetResult] = []
    for spec in specs:
        res = run_fleet(profile, spec, builder, settings, rate_per_replica=rate,
                        requests_per_replica=args.requests_per_replica, warmup_fraction=args.warmup_fraction,
                        dram_bytes=int(args.dram_gb * GB), ssd_bytes=int(args.ssd_gb * GB), seed=args.seed)
        results.append(res)
        say(f"  {spec.label}: mean TTFT {res.mean_ttft_s * 1e3:.0f} ms, P99 {res.p99_ttft_s * 1e3:.0f} ms, "
            f"recompute {res.tier_share['recompute']:.1%} ({res.wall_s:.1f} s)")
    wall = time.perf_counter() - t0
    print(format_table(results))
    say(f"wall time {wall:.0f} s")
    if args.json:
        report: dict[str, Any] = {
            "schema": "pcr-rag-fleet/1", "profile": profile.name, "workload": asdict(wl),
            "capacity_rps": capacity, "rate_per_replica": rate, "requests_per_replica": args.requests_per_replica,
            "warmup_fraction": args.warmup_fraction, "dram_bytes": int(args.dram_gb * GB),
            "ssd_bytes": int(args.ssd_gb * GB), "executor": settings.executor, "max_batch": settings.max_batch,
            "wall_s": wall, "results": [r.as_dict() for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _validate(args: argparse.Namespace, profile: Profile, settings: SimSettings, links: Sequence[RemoteLink],
              say: Callable[[str], None]) -> int:
    wl: SimWorkload = workload_from_args(args)
    scenario = build_scenario(wl, profile, 1)
    rate = args.load * no_reuse_capacity_rps(profile, scenario, settings, wl.chunk_size)
    say(f"two replicas at {rate:.3g} req/s ({args.load} x no-reuse capacity), links "
        f"{', '.join(link.name for link in links)}: the experiment's code vs the fleet's")
    ref = two_replica_experiment(profile, scenario, settings, links, rate=rate, chunk_size=wl.chunk_size)
    got = fleet_two_replicas(profile, scenario, settings, links, rate=rate, chunk_size=wl.chunk_size)
    rows = compare_two_replicas(ref, got)
    print("| figure | two-replica experiment | fleet (N=2) | error |\n|---|---:|---:|---:|")
    for name, a, b, err in rows:
        print(f"| {name} | {a:.6g} | {b:.6g} | {err:+.2%} |")
    ok = all(abs(err) <= SIM_VALIDATION_TOLERANCE for *_, err in rows)
    print(f"{'PASS' if ok else 'MISS'}: every figure within {SIM_VALIDATION_TOLERANCE:.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": "pcr-rag-fleet-validation/1", "experiment": ref, "fleet": got,
                       "rows": [dict(zip(("figure", "experiment", "fleet", "error"), r, strict=True)) for r in rows],
                       "passed": ok}, f, indent=2)
    return 0 if ok else 1
