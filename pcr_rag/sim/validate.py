"""``pcr-rag simulate --validate BENCH_JSON --profile MEASURED.json``: re-simulate a real bench run, side by side.

The bench's own trace builder (`pcr_rag.bench.traces.build_traces`) rebuilds the exact requests of that run from
its config (same corpus, passages, seeds, topics); every request is then laid out with the runtime's
`PromptBuilder` and cut with `plan_chunks`, so the simulated chunk plans are the real ones. Each system is
simulated the way the bench ran it: one engine, the warm-up trace at once, then every repeat's rate slots in order
(window variants: warm-up and their sweep slots only), with the bench's capacities and absolute rates, the runtime's own
executor (``engine-steps``: the engine's rows and ITL budget, or the system's own) and its prefill steps.
Output tokens per request are the run's measured mean (the answers are the same for
every system). Prints simulated vs measured mean TTFT for every run and judges the validation target
(`pcr_rag.bench.targets`: within 15% for no-reuse, dram-only and pcr at two rates).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pcr_rag.bench.config import SYSTEM_PROMPT, BenchConfig, quick_config
from pcr_rag.bench.report import RunRecord, load_report, write_json, write_report
from pcr_rag.bench.serving import run_bench
from pcr_rag.bench.stats import RequestTable, mean_interval, paired_ratio_interval
from pcr_rag.bench.targets import SIM_VALIDATION_MIN_RATES, SIM_VALIDATION_SYSTEMS, SIM_VALIDATION_TOLERANCE
from pcr_rag.bench.traces import build_traces
from pcr_rag.cache import namespace_key, plan_chunks
from pcr_rag.model.model import load_model
from pcr_rag.prompt import PromptBuilder
from pcr_rag.sim.experiment import Scenario, SimSettings, run_system
from pcr_rag.sim.measure_profile import build_profile
from pcr_rag.sim.profiles import Profile
from pcr_rag.sim.simulator import default_max_batch
from pcr_rag.sim.systems import get_system
from pcr_rag.sim.trace import SimRequest


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One (system, rate) run, measured vs simulated: mean TTFT (seconds; what the verdict judges), reused share of
    prompt tokens, and where both runs report them, mean queue time and ITL P99 (seconds: what the executor model
    decides) and the mean split of a request's time in its row (seconds): its own prefill steps (``own``: what the
    cost model prices) and the other requests' steps run between them (``between``: what the executor decides).
    Mean TTFT ~= queue + own + between. ``measured_ttft_interval_s``: the 95% bootstrap interval of the measured
    mean over the run's requests (`pcr_rag.bench.stats.mean_interval`; None without per-request columns), i.e.
    how far the measured mean itself could move with other requests of the same kind. ``error_interval``: the
    95% interval of `error`, paired over the same requests (simulated / measured mean TTFT - 1, resampling request
    keys: what request mix the run drew cancels, the per-request misfit stays); None without per-request columns.
    A run whose interval reaches inside the tolerance has not shown an error beyond it."""

    system: str
    rate: float
    measured_ttft_s: float
    simulated_ttft_s: float
    measured_reuse: float | None = None
    simulated_reuse: float | None = None
    measured_queue_s: float | None = None
    simulated_queue_s: float | None = None
    measured_itl_p99_s: float | None = None
    simulated_itl_p99_s: float | None = None
    measured_own_s: float | None = None
    simulated_own_s: float | None = None
    measured_between_s: float | None = None
    simulated_between_s: float | None = None
    measured_ttft_interval_s: tuple[float, float] | None = None
    error_interval: tuple[float, float] | None = None

    @property
    def within_interval(self) -> bool | None:
        """Whether the simulated mean TTFT lies inside the measured mean's interval (None without one)."""
        if self.measured_ttft_interval_s is None:
            return None
        low, high = self.measured_ttft_interval_s
        return low <= self.simulated_ttft_s <= high

    @property
    def error(self) -> float:
        return (self.simulated_ttft_s - self.measured_ttft_s) / self.measured_ttft_s

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "error": self.error, "within_interval": self.within_interval}


def _rate(x: Any) -> float:
    return math.inf if x in ("inf", None) else float(x)


def bench_scenario(report: Mapping[str, Any], *, model: Any = None, tokenizer: Any = None
                   ) -> tuple[Scenario, list[float], int]:
    """The scenario of a bench report: its warm-up and measured traces as chunk plans, its capacities, its rates
    (req/s), and its chunk size. ``scenario.traces`` holds every repeat's traces in the bench's service order,
    repeat-major: trace ``rep * len(rates) + i`` is repeat ``rep`` at rate ``i``."""
    cfg_in = dict(report["config"])
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    kwargs = {k: v for k, v in cfg_in.items() if k in fields}
    for k in ("loads", "windows", "systems"):
        if isinstance(kwargs.get(k), list):
            kwargs[k] = tuple(kwargs[k])
    if kwargs.get("rates") is not None:
        kwargs["rates"] = tuple(_rate(r) for r in kwargs["rates"])
    bcfg = BenchConfig(**kwargs)
    bcfg.validate()
    loaded = load_model(model if model is not None else bcfg.model, tokenizer, dtype=bcfg.dtype, device="cpu")
    bench = build_traces(bcfg, loaded.tokenizer, loaded.kv.bytes_per_token)
    builder = PromptBuilder(loaded.tokenizer)
    root = namespace_key("validation", "float32", bcfg.chunk_size)

    def sim(reqs: Sequence[Any], output_tokens: int) -> list[SimRequest]:
        out = []
        for r in reqs:
            seg = builder.build_rag(r.question, bench.documents(r), SYSTEM_PROMPT)
            plan = plan_chunks(root, seg.segments, bcfg.chunk_size)
            out.append(SimRequest(r.request_id, r.arrival_s, tuple(plan), output_tokens, tuple(r.doc_ids)))
        return out

    rates = [_rate(r) for r in cfg_in["rates"]]
    outputs = _mean_outputs(report, rates, default=bcfg.max_new_tokens)
    warm = sim(bench.warmup, bcfg.max_new_tokens)
    traces = [sim(bench.unit_traces[(rep, i)], outputs[i]) for rep in range(bcfg.repeats) for i in range(len(rates))]
    scenario = Scenario(warm, traces, int(cfg_in["dram_capacity"]), int(cfg_in["ssd_capacity"]), bench.ws_bytes,
                        float(bench.ws_info["reuse_upper_bound"]), {"bench_config": cfg_in})
    return scenario, rates, bcfg.chunk_size


def _mean_outputs(report: Mapping[str, Any], rates: Sequence[float], default: int) -> list[int]:
    out = []
    for rate in rates:
        vals = [r["tokens"]["output"] / r["num_requests"] for r in report["runs"]
                if r.get("num_requests") and math.isclose(_rate(r["rate"]), rate, rel_tol=1e-9)]
        out.append(max(1, round(statistics.fmean(vals))) if vals else default)
    return out


def simulate_bench(report: Mapping[str, Any], profile: Profile, scenario: Scenario, rates: Sequence[float],
                   chunk_size: int, say: Callable[[str], None] = lambda _m: None, executor: str = "engine-steps"
                   ) -> dict[tuple[str, float], dict[str, Any]]:
    """The simulated run (the bench's run dict layout) per (system, rate) for every run of the report, under
    ``executor`` (the runtime's ``engine-steps`` by default; ``serial`` is how it was simulated before the runtime
    batched, kept for comparison)."""
    settings = SimSettings(max_batch=default_max_batch(executor), prefill_steps="engine", executor=executor)
    per_repeat = len(rates)
    repeats = len(scenario.traces) // per_repeat
    slot_rates = [rates[j % per_repeat] for j in range(len(scenario.traces))]
    by_system: dict[str, set[int]] = {}
    for run in report["runs"]:
        rate = _rate(run["rate"])
        idx = next((i for i, r in enumerate(rates) if math.isclose(r, rate, rel_tol=1e-9)), None)
        if idx is not None:
            by_system.setdefault(run["system"], set()).update(rep * per_repeat + idx for rep in range(repeats))
    out: dict[tuple[str, float], dict[str, Any]] = {}
    main = set(report["config"].get("systems") or ())
    for name, slots in by_system.items():
        system = get_system(name)
        recs = run_system(profile, system, scenario, slot_rates, settings, slots=sorted(slots),
                          chunk_size=chunk_size, history=name in main)
        merged: dict[float, RunRecord] = {}
        for slot, rec in zip(sorted(slots), recs, strict=True):  # run_system reports its slots in order
            rec.samples = [dataclasses.replace(x, key=(slot // per_repeat, x.key[1])) for x in rec.samples]
            if rec.rate in merged:
                merged[rec.rate].merge(rec)
            else:
                merged[rec.rate] = rec
        for rate, rec in merged.items():
            out[(name, rate)] = rec.to_dict()
        say(f"simulated {name}")
    return out


def compare(report: Mapping[str, Any], simulated: Mapping[tuple[str, float], Mapping[str, Any]]
            ) -> list[Comparison]:
    """Pair every measured run with its simulated twin (run dicts with ``ttft.mean`` and ``reuse_ratio``)."""
    rows = []
    for run in report["runs"]:
        key = (run["system"], _rate(run["rate"]))
        m = run["ttft"]["mean"]
        sim = simulated.get(key)
        if sim is not None and m:
            rows.append(Comparison(key[0], key[1], float(m), float(sim["ttft"]["mean"]), run.get("reuse_ratio"),
                                   sim.get("reuse_ratio"), _stat(run, "queue", "mean"), _stat(sim, "queue", "mean"),
                                   _stat(run, "itl", "p99"), _stat(sim, "itl", "p99"),
                                   _stat(run, "prefill_compute", "mean"), _stat(sim, "prefill_compute", "mean"),
                                   _between(run), _between(sim),
                                   mean_interval((run.get("requests") or {}).get("ttft") or []),
                                   _error_interval(sim, run)))
    return rows


def _error_interval(sim: Mapping[str, Any], run: Mapping[str, Any]) -> tuple[float, float] | None:
    """The paired 95% interval of simulated / measured mean TTFT - 1 over the requests both runs hold (keys
    ``(repeat, request id)``), or None."""
    a, b = RequestTable.from_run(sim), RequestTable.from_run(run)
    if a is None or b is None:
        return None
    ratio = paired_ratio_interval(a, b, "ttft.mean")
    return None if ratio is None else (ratio.low - 1.0, ratio.high - 1.0)


def _between(run: Mapping[str, Any]) -> float | None:
    """Mean seconds of other requests' steps inside a request's prefill: mean prefill - mean own prefill steps
    (None when the run does not report both, e.g. a report from before they were recorded)."""
    total, own = _stat(run, "prefill", "mean"), _stat(run, "prefill_compute", "mean")
    return None if total is None or own is None or total == 0.0 else max(0.0, total - own)  # no -0 from rounding


def _stat(run: Mapping[str, Any], what: str, stat: str) -> float | None:
    """``run[what][stat]`` (seconds) when the run dict has it and it is a number, else None."""
    value = (run.get(what) or {}).get(stat)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def verdict(rows: Sequence[Comparison]) -> tuple[bool, str]:
    """Within `SIM_VALIDATION_TOLERANCE` for each of `SIM_VALIDATION_SYSTEMS` at (at least)
    `SIM_VALIDATION_MIN_RATES` rates."""
    rates = sorted({r.rate for r in rows})
    good_rates = [rate for rate in rates
                  if all(any(r.system == s and r.rate == rate and abs(r.error) <= SIM_VALIDATION_TOLERANCE
                             for r in rows)
                         for s in SIM_VALIDATION_SYSTEMS)]
    ok = len(good_rates) >= SIM_VALIDATION_MIN_RATES
    line = (f"{'PASS' if ok else 'MISS'}: simulated mean TTFT within {SIM_VALIDATION_TOLERANCE:.0%} of "
            f"measured for {', '.join(SIM_VALIDATION_SYSTEMS)} at {len(good_rates)} of {len(rates)} rates "
            f"(need {SIM_VALIDATION_MIN_RATES}): {[round(r, 4) for r in good_rates]}")
    judged = [r for r in rows if r.within_interval is not None]
    if judged:
        inside = sum(r.within_interval for r in judged)
        line += (f"; the simulated mean lies inside the measured mean's 95% interval (bootstrap over its requests) "
                 f"for {inside} of {len(judged)} runs")
    paired = [r for r in rows if r.error_interval is not None]
    if paired:
        reach = sum(r.error_interval[0] <= SIM_VALIDATION_TOLERANCE and r.error_interval[1] >= -SIM_VALIDATION_TOLERANCE
                    for r in paired)
        line += (f"; the error's paired 95% interval reaches within {SIM_VALIDATION_TOLERANCE:.0%} for {reach} of "
                 f"{len(paired)} runs")
    return ok, line


def format_table(rows: Sequence[Comparison]) -> str:
    lines = ["| system | rate (req/s) | measured TTFT [95% interval] | simulated TTFT | error [paired 95%, points] | "
             "reuse measured / simulated | "
             "queue measured / simulated | own prefill steps measured / simulated | "
             "others' steps in its prefill measured / simulated | ITL P99 measured / simulated |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def pair(a: float | None, b: float | None, fmt: str) -> str:
        return " / ".join("n/a" if x is None else format(x, fmt) for x in (a, b))

    for r in sorted(rows, key=lambda x: (x.rate, x.system)):
        ms = [None if x is None else x * 1e3 for x in (r.measured_queue_s, r.simulated_queue_s,
                                                       r.measured_own_s, r.simulated_own_s,
                                                       r.measured_between_s, r.simulated_between_s,
                                                       r.measured_itl_p99_s, r.simulated_itl_p99_s)]
        ci = ("" if r.measured_ttft_interval_s is None else
              " [{:.0f}, {:.0f}]".format(*(x * 1e3 for x in r.measured_ttft_interval_s)))
        inside = {True: "", False: " (outside)", None: ""}[r.within_interval]
        err_ci = ("" if r.error_interval is None else
                  " [{:+.0f}, {:+.0f}]".format(*(x * 100 for x in r.error_interval)))
        lines.append(f"| {r.system} | {r.rate:.4g} | {r.measured_ttft_s * 1e3:.1f} ms{ci} | "
                     f"{r.simulated_ttft_s * 1e3:.1f} ms{inside} | {r.error:+.1%}{err_ci} | "
                     f"{pair(r.measured_reuse, r.simulated_reuse, '.1%')} | "
                     + " | ".join(f"{pair(ms[i], ms[i + 1], '.0f')} ms" for i in range(0, 8, 2)) + " |")
    return "\n".join(lines)


def validation_config(repeats: int = 1) -> BenchConfig:
    """The bench run ``--validate run`` measures: ``--quick``; with ``repeats`` > 1, quick's workload and rates
    with that many interleaved repeats of the validated systems only (`SIM_VALIDATION_SYSTEMS`; no window sweep,
    saturation or limit ratio), so the error's paired interval narrows (~``repeats`` x 12 requests per run)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if repeats == 1:
        return quick_config()
    return quick_config(repeats=repeats, systems=SIM_VALIDATION_SYSTEMS, windows=(), saturation=(), limit_ratio=False)


def measure_then_bench(out_dir: str | Path, say: Callable[[str], None], repeats: int = 1) -> tuple[Profile, Path]:
    """Measure a profile and run the bench of `validation_config` right after it, in one process with one loaded
    model, so both see the same machine load (on a shared machine a profile taken at another time can be several
    times off). Returns the profile and the bench report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    loaded = load_model(None, device="cpu")
    say("measuring the profile ...")
    profile = build_profile(loaded, name="validation", disk_dir=tempfile.gettempdir(), quick=True, say=say)
    profile.save(out / "profile.json")
    say(f"running pcr-rag bench --quick{f' with {repeats} repeats' if repeats > 1 else ''} ...")
    report = run_bench(validation_config(repeats), model=loaded.model, tokenizer=loaded.tokenizer, progress=False)
    bench_path = out / "bench-quick.json"
    write_report(report, json_path=bench_path)
    return profile, bench_path


def run_validation(args: argparse.Namespace, profile: Profile, say: Callable[[str], None]) -> int:
    if args.validate == "run":
        out_dir = Path(args.json).with_suffix("") if args.json else Path("results") / "validation"
        profile, bench_path = measure_then_bench(out_dir, say, getattr(args, "validate_repeats", 1))
        args.validate = str(bench_path)
    report = load_report(args.validate)
    if profile.source != "measured":
        say(f"warning: profile {profile.name} is {profile.source}, not measured on this machine "
            "(run `pcr-rag profile` first)")
    say(f"rebuilding the traces of {args.validate} ...")
    scenario, rates, chunk_size = bench_scenario(report)
    executor = args.executor or "engine-steps"
    say(f"simulating with the {executor} executor ...")
    simulated = simulate_bench(report, profile, scenario, rates, chunk_size, say, executor=executor)
    rows = compare(report, simulated)
    ok, line = verdict(rows)
    print(format_table(rows))
    print(line)
    if args.json:
        write_json({"schema": "pcr-rag-validation/1", "bench_report": str(Path(args.validate)),
                    "profile": json.loads(profile.to_json()), "executor": executor,
                    "rows": [r.as_dict() for r in rows],
                    "passed": ok, "verdict": line}, args.json)
    return 0
