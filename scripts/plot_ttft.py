"""The README's picture: mean time to first token per system, from a `pcr-rag bench` report.

    make bench-quick                                      # writes results/bench-quick.json
    .venv/bin/python scripts/plot_ttft.py results/bench-quick.json --host "AMD EPYC, AVX-512, 2 cores"

One group of bars per request rate of the report (saturation runs, all requests at once, are left out), one bar per
system present among ``--systems`` (default: plain transformers, llama.cpp, the engine with the cache off, the
engine with the cache on), each the mean TTFT of that run's requests with its 95% percentile-bootstrap interval
(`pcr_rag.bench.stats.mean_interval`: how far the mean could move with other requests of the same kind; it does not
cover the machine's drift between runs). Under the bars: the model, the host, the report's date and kind, and the
cache-on speed-ups over the others at each rate. A system the report lacks is named as missing, never drawn.

Writes a PNG (default ``docs/assets/ttft.png``) with matplotlib's object API (no pyplot, no display needed).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from pcr_rag.bench.report import load_report
from pcr_rag.bench.stats import mean_interval

DEFAULT_SYSTEMS = ("transformers", "llama-cpp", "no-reuse", "pcr")
LABELS = {
    "transformers": "transformers (model.generate)",
    "llama-cpp": "llama.cpp (LlamaRAMCache)",
    "no-reuse": "pcr-rag, cache off",
    "pcr": "pcr-rag, cache on",
}
COLORS = {"transformers": "#9e9e9e", "llama-cpp": "#b08f5a", "no-reuse": "#7aa6d6", "pcr": "#1f5fa8"}
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "assets" / "ttft.png"


@dataclass(frozen=True)
class Bar:
    """One system at one rate: mean TTFT and its interval, in seconds; ``n`` requests."""

    system: str
    rate: float
    mean_s: float
    low_s: float | None
    high_s: float | None
    n: int


def _rate(value: Any) -> float:
    return math.inf if value == "inf" else float(value)


def collect(report: Mapping[str, Any], systems: Sequence[str]) -> tuple[list[float], dict[tuple[str, float], Bar]]:
    """The report's finite rates (ascending) and a `Bar` for every (system, rate) run among ``systems`` that has
    per-request TTFTs. A report naming a system as an alias of another resolves to that run."""
    aliases = report.get("aliases") or {}
    wanted = {aliases.get(s, s): s for s in systems}
    bars: dict[tuple[str, float], Bar] = {}
    for run in report["runs"]:
        rate = _rate(run["rate"])
        if math.isinf(rate) or run["system"] not in wanted:
            continue
        ttft = [float(v) for v in (run.get("requests") or {}).get("ttft") or [] if v is not None]
        if not ttft:
            continue
        interval = mean_interval(ttft)
        system = wanted[run["system"]]
        bars[(system, rate)] = Bar(system, rate, sum(ttft) / len(ttft), interval[0] if interval else None,
                                   interval[1] if interval else None, len(ttft))
    rates = sorted({rate for _, rate in bars})
    return rates, bars


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def plot(report: Mapping[str, Any], out: str | Path, *, host: str | None = None,
         systems: Sequence[str] = DEFAULT_SYSTEMS) -> Path:
    """Draw the report's TTFT bars into the PNG ``out``; returns its path. ValueError when the report has no
    finite-rate run of ``pcr`` (the cache-on system the picture is about)."""
    rates, bars = collect(report, systems)
    if not any(system == "pcr" for system, _ in bars):
        raise ValueError("the report has no finite-rate pcr run with per-request TTFTs: nothing to compare")
    present = [s for s in systems if any((s, r) in bars for r in rates)]
    missing = [s for s in systems if s not in present]

    fig = Figure(figsize=(8.0, 4.6), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(present)
    for i, system in enumerate(present):
        xs, heights, errs = [], [], [[], []]
        for j, rate in enumerate(rates):
            bar = bars.get((system, rate))
            if bar is None:
                continue
            xs.append(j + (i - (len(present) - 1) / 2) * width)
            heights.append(bar.mean_s * 1e3)
            errs[0].append((bar.mean_s - bar.low_s) * 1e3 if bar.low_s is not None else 0.0)
            errs[1].append((bar.high_s - bar.mean_s) * 1e3 if bar.high_s is not None else 0.0)
        drawn = ax.bar(xs, heights, width * 0.92, yerr=errs, capsize=3, color=COLORS.get(system, "#555555"),
                       label=LABELS.get(system, system), error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
        ax.bar_label(drawn, labels=[f"{h:,.0f}" for h in heights], padding=2, fontsize=7)
    ax.set_xticks(range(len(rates)), [f"{rate:.2g} requests/s" for rate in rates])
    ax.set_ylabel("mean time to first token (ms)")
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(frameon=False, fontsize=8, loc="upper left")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)

    config, env = report.get("config") or {}, report.get("environment") or {}
    model = re.sub(r"-[0-9a-f]{12}$", "", Path(str(config.get("model_name") or "the default model")).name)
    ax.set_title(f"RAG requests on {model} ({env.get('dtype', '?')}, {env.get('device', '?')}): "
                 "time to first token", fontsize=10)
    speedups = []
    for rate in rates:
        ours = bars.get(("pcr", rate))
        if ours is None:
            continue
        parts = [f"{bars[(s, rate)].mean_s / ours.mean_s:.1f}x sooner than {s}" for s in present
                 if s != "pcr" and (s, rate) in bars]
        if parts:
            speedups.append(f"at {rate:.2g} req/s, first tokens with the cache on come " + ", ".join(parts))
    n = sorted({bar.n for bar in bars.values()})
    host_text = host or f"{env.get('cpus', '?')} CPUs"
    preset = " --quick" if config.get("quick") else " --standard" if config.get("standard") else ""
    lines = [
        f"{host_text}; pcr-rag bench{preset}, {str(report.get('created_utc', '?'))[:10]}",
        f"{'/'.join(map(str, n))} requests per bar; whiskers: 95% bootstrap interval of the mean",
        *speedups,
    ]
    if missing:
        lines.append("not in this run: " + ", ".join(missing))
    fig.text(0.01, 0.0, "\n".join(lines), fontsize=7, color="#444444", va="top", ha="left",
             transform=fig.transFigure)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight", metadata={"Software": None})
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a `pcr-rag bench --json` report")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="PNG to write (default: docs/assets/ttft.png)")
    parser.add_argument("--host", default=None, help='the host kind to print, e.g. "AMD EPYC, AVX-512, 2 cores"')
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help="comma-separated systems, in drawing order (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        report = load_report(args.report)
        path = plot(report, args.out, host=args.host, systems=[s for s in args.systems.split(",") if s])
    except (OSError, ValueError) as exc:
        print(f"plot_ttft: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
