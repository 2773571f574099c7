"""No benchmark figure lives in a docstring or comment under pcr_rag/ (issue 41).

Measured figures go stale and bury the invariant a comment exists to state, so they belong in
docs/measurements-history.md (section "Figures moved from code comments"); a comment may link there.
The scan reads comments with ``tokenize`` and docstrings with ``ast``, so code (thresholds, constants,
data tables such as pcr_rag/sim/profiles.py) is never looked at.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pcr_rag"

# A standalone number, or either end of a range such as 6-8 (not the digits of a name such as float32, AVX512,
# Llama-3-8B, top-3 or M=1).
_NUM = r"(?:(?<![\w.\-/=])|(?<=\d-))\d[\d,]*(?:\.\d+)?"
# A number with a time, rate or ratio unit: "0.51 ms", "861 ms", "3.2 GB/s", "1.3x", "12 µs".
_FIGURE = (
    _NUM + r"\s?(?:ms|µs|us|ns|s|sec|seconds|milliseconds|microseconds|minutes|min|hours"
    r"|GB/s|MB/s|GiB/s|MiB/s|TB/s|tok/s|tokens/s|req/s|x|×)(?![\w/])"
)
_STANDALONE = _NUM + r"(?:x|×|%)?(?!\w|-(?!\d))"
# Words that say the figure was observed rather than chosen.
_OBSERVED = r"(?:measured|took|waited|went|costs?|vs\.?|versus|observed|benchmark(?:ed)?|median|P50|P99)"
# Host kinds a measurement is quoted on.
_HOST = (
    r"(?:AVX-?512|AVX2|EPYC|Xeon|Zen ?\d|H100|H200|A100|\bVM\b|this host|this machine|this CPU|\d+-core"
    r"|\d+ (?:quiet )?(?:CPU )?cores|\bon (?:a |the )?CPU\b)"
)

PATTERNS: dict[str, re.Pattern[str]] = {
    # "measured on a 2-core AVX-512 VM ... 0.87x", "(AVX512-BF16 Zen 4: 0.55 vs 0.11 ms)"
    "host with a figure": re.compile(rf"{_HOST}[^.;\n]{{0,80}}{_STANDALONE}|{_STANDALONE}[^.;\n]{{0,80}}{_HOST}"),
    # "0.51 vs 0.59 ms a call", "ITL P99 861 ms", "costs 3.9 ms"
    "observed figure": re.compile(
        rf"{_OBSERVED}\b[^.;\n]{{0,60}}{_FIGURE}|{_FIGURE}[^.;\n]{{0,60}}\b{_OBSERVED}\b", re.IGNORECASE
    ),
    # "measured: 2-8 % for every M", "(measured 23 vs 35 us a call)", "about 2x the rate, measured here"
    "measured number": re.compile(
        rf"measured\b[^.;\n]{{0,40}}{_STANDALONE}|{_FIGURE}[^.;\n]{{0,40}}\bmeasured\b", re.IGNORECASE
    ),
}

# (path relative to pcr_rag/, a substring of the matched text): why it is not a measured figure.
ALLOWED: dict[tuple[str, str], str] = {
    ("bench/cli.py", "measured no-reuse capacity, 32"):
        "the full run's workload: load factors of the no-reuse capacity and 32 timed ('measured') requests",
    ("bench/traces.py", "for 1 req/s"): "the unit rate a trace's arrival times are drawn for, not an observation",
    ("sim/experiment.py", "for 1 req/s"): "the unit rate a trace's arrival times are drawn for, not an observation",
    ("sim/validate.py", "measured mean TTFT - 1"): "the definition of the relative error (simulated / measured - 1)",
    ("sim/profiles.py", '4090 (the paper\'s "Llama-8B on RTX 4090") and an H200'):
        "names the paper's set-ups (GPU models), no figure",
    ("sim/fleet.py", "measured trace, then replica 1"):
        "the warm-up/timed phases and a replica index, no figure (file owned by the fleet simulation work)",
}
DOC_LINK = "docs/measurements-history.md"


def _comments(source: str) -> list[tuple[int, str]]:
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def _docstrings(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
        else:
            continue
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            value = body[0].value.value
            if isinstance(value, str):
                out.append((body[0].lineno, value))
        # attribute docstrings: a string literal right after an assignment (dataclass fields)
        for prev, stmt in zip(body, body[1:]):
            if (
                isinstance(prev, (ast.Assign, ast.AnnAssign))
                and isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                out.append((stmt.lineno, stmt.value.value))
    return out


def _raw_findings(path: Path) -> list[tuple[str, int, str, str]]:
    """(path relative to pcr_rag/, line, pattern name, matched text) of every match, allowed or not."""
    source = path.read_text(encoding="utf-8")
    rel = path.relative_to(PACKAGE).as_posix()
    found = []
    for lineno, text in _comments(source) + _docstrings(source):
        # join wrapped lines so a figure split over two comment lines is still seen
        flat = re.sub(r"\s*\n\s*#?\s*", " ", text)
        for kind, pattern in PATTERNS.items():
            for match in pattern.finditer(flat):
                found.append((rel, lineno, kind, match.group(0)))
    return found


def _allowed(rel: str, snippet: str) -> bool:
    return any(rel == a_rel and a_text in snippet for a_rel, a_text in ALLOWED)


def _findings(path: Path) -> list[str]:
    return [f"{rel}:{line}: {kind}: {snippet!r}" for rel, line, kind, snippet in _raw_findings(path)
            if not _allowed(rel, snippet)]


def test_scanner_catches_measured_figures() -> None:
    samples = [
        "# 0.51 vs 0.59 ms a call, measured on a 2-core AVX-512 VM",
        "# (measured on a 2-core AVX2 VM in float32: ITL P99 861 ms vs P50 85 ms)",
        '"""Verifying costs 3.9 ms per chunk."""',
        "# on an H200 the copy runs at 40 GB/s",
        "# 1.3x faster than the loop (benchmark)",
        "# the probe shows it in a few outputs (measured: 2-8 % for every M that differs)",
        "# a full collection took ~190 ms on a 2-core VM",
        "# about 15 minutes on 2 quiet CPU cores",
    ]
    for sample in samples:
        flat = sample
        assert any(p.search(flat) for p in PATTERNS.values()), sample


def test_scanner_lets_definitions_through() -> None:
    samples = [
        "# buffers are aligned to 4096 bytes",
        "# timeout in seconds",
        "# the default budget is 2GiB",
        "# measure the step time (see docs/measurements-history.md#figures-moved-from-code-comments)",
        "# a 2-tuple of (start, end) offsets",
    ]
    for sample in samples:
        assert not any(p.search(sample) for p in PATTERNS.values()), sample


def test_allow_list_entries_have_reasons_and_still_match() -> None:
    raw = [f for path in sorted(PACKAGE.rglob("*.py")) for f in _raw_findings(path)]
    for (rel, text), reason in ALLOWED.items():
        assert reason.strip(), (rel, text)
        assert any(r == rel and text in snippet for r, _, _, snippet in raw), f"stale allow-list entry: {rel}: {text!r}"


def test_no_measured_figures_in_comments_or_docstrings() -> None:
    findings = [f for path in sorted(PACKAGE.rglob("*.py")) for f in _findings(path)]
    assert not findings, (
        f"measured figures in code comments or docstrings; move them to {DOC_LINK} "
        "(section 'Figures moved from code comments') and state the invariant instead:\n" + "\n".join(findings)
    )
