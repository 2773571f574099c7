"""What does blend mode cost in answer quality, and what does it buy in TTFT, per recompute fraction? (issue 48,
item 5: the table the default ``blend_recompute`` is chosen from.)

Per model, on the bench's retrieval workload (the ``pcr-rag bench --standard --retrieval`` preset's: questions
generated from the stdlib corpus's own titles, top-3 passages of about 120 tokens from Chroma + MiniLM, topics
drawn with Zipf popularity, documents in relevance order; built once with the first model's tokenizer, the same
texts for every model), these systems serve the same requests:

- ``no-reuse``: the cache off (its TTFT is the baseline; it generates one token: only its TTFT is used, and its
  first token is checked against exact's);
- ``pcr``: exact reuse (the prefix tree): the reference answer of every request;
- ``blend-<f>`` for each recompute fraction ``f``: ``reuse="blend"`` with ``blend_recompute=f``;
- with ``--backfill``, also ``blend-<f>+backfill`` for each ``f``: the same with ``blend_backfill=True``.

Backfill (``EngineConfig.blend_backfill``, `pcr_rag.sched.blend_gate`): after a blended request whose prompt the
exact prefix tree does not hold, the engine prefills the prompt's exact twin (one output token) on idle capacity,
i.e. once no request of that engine waits or runs, so the same prompt coming back is served by exact reuse. The
idle gap this script gives it: after every request of a backfill system (warm-up requests too) it waits until
that engine has nothing queued or running and its backfill, if the engine queued one, has finished (the engine's
completed-backfill count rose; `wait_for_backfill`), before any system's next request starts. So no backfill runs inside a timed request of any engine (the engines share the process and the
CPU), and every backfill is done before its prompt can come back: the measurement is what serving gives when the
idle gap after each request lasts at least one exact prefill of the prompt's uncached part. Under back-to-back
traffic backfills never run and a backfill system serves like plain blend. The waiting is not part of any TTFT;
it is reported per system (seconds, and backfills completed), as is each engine's final blend snapshot.

Every cached engine has its own cache directory, sized so nothing is evicted, and is warmed with the same warm-up
requests (one output token each: only their KV matters). Measured requests run one at a time (no queueing: TTFT
is the prefill), every system on request ``k`` before any system on ``k + 1``, the systems' order rotated per
request, greedy decoding.

Per blend system it reports: the reused fraction (exact prefix + placed tokens whose KV an earlier request left,
over prompt tokens; `pcr_rag.bench.blend_ledger` replays each request's plan and checks it against the engine's
counts; placed tokens computed in isolation for their own request are shown apart, they are not reuse); mean
TTFT over exact pcr's and over no-reuse's with 95% paired bootstrap intervals (`pcr_rag.bench.stats`); greedy
answers identical to exact's; the median first-token KL divergence ``KL(exact || blend)`` in nats, from the
prefill's last-position logits (`GenerationResult.first_token_logits`); ROUGE-L F-measure of the blend answer
against the exact answer (``rouge-score``, the ``bench`` extra; identical token ids score 1). The quality columns
are given over every request and over the requests that placed any token (the others were served like exact).
A backfill system's rows are the same (a request its backfill made exact counts as served like exact), and its
backfills and the wait for them are printed under the table (``backfill:`` lines) and kept in the JSON (per row
``backfills``, ``backfill_wait_s``, ``backfill_wait_max_s``; per request ``backfills``, ``backfill_wait_s``; per
model ``blend_stats``).

The default fraction is the smallest whose mean ROUGE-L over blended requests reaches
`BLEND_QUALITY_MIN_ROUGE_L` on every model (printed as ``default:``), judged on the plain blend systems only.

Run: ``python benchmarks/blend_quality.py --out results/blend-quality.json`` (both default models);
``--quick`` for a smoke run (few requests, short answers); ``--fractions 0.15 --backfill`` for blend at 15% with
and without backfill. A model without a chat template (``gemma3-270m`` is a
base model) is served with ``chat_template="plain"``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pcr_rag.bench.blend_ledger import BlendLedger
from pcr_rag.bench.config import RETRIEVAL_PASSAGES, SYSTEM_PROMPT, BenchConfig, standard_config
from pcr_rag.bench.stats import RequestTable, mean_interval, paired_ratio_interval
from pcr_rag.bench.targets import BLEND_QUALITY_MIN_ROUGE_L
from pcr_rag.bench.traces import build_traces
from pcr_rag.config import EngineConfig
from pcr_rag.engine import GenerationResult, PCREngine
from pcr_rag.model.model import load_model
from pcr_rag.prompt import PromptBuilder

log = logging.getLogger(__name__)

DEFAULT_MODELS: tuple[str, ...] = ("smollm2-135m-instruct", "gemma3-270m")
DEFAULT_FRACTIONS: tuple[float, ...] = (0.0, 0.05, 0.15, 0.30)
#: Each cached engine's tiers: large enough that nothing of these workloads is evicted (KV of one model's
#: requests and documents, with their position-independent copies).
_DRAM = "4GiB"
_SSD = "8GiB"
#: How long one request's backfill may take before the script gives up on it (seconds): an exact prefill of a few
#: hundred tokens takes seconds on a CPU; a backfill that fails is logged by the engine and never completes.
BACKFILL_TIMEOUT_S = 600.0
_POLL_S = 0.005  # how often the gap checks whether the engine's backfill is done (seconds)


@dataclass(frozen=True)
class Served:
    """One request served by one system: times in seconds, tokens. ``exact``: exact prefix reused; ``placed`` /
    ``blended_reused`` / ``blended_fresh``: blend mode's placed tokens and their split (`BlendLedger`; None for
    the other systems or when the plan could not be replayed). ``backfills`` / ``backfill_wait_s``: backfill
    systems only (None for the others): backfills the engine completed in the gap after this request, and the
    seconds the script waited for that gap to end (`wait_for_backfill`). ``logits``: first-token logits (not
    serialised)."""

    model: str
    system: str
    index: int
    ttft_s: float
    prompt_tokens: int
    exact: int
    blended: int
    blended_reused: int | None
    blended_fresh: int | None
    token_ids: tuple[int, ...]
    text: str
    logits: Any = None
    backfills: int | None = None
    backfill_wait_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("logits")
        d["token_ids"] = list(self.token_ids)
        return d


def blend_name(fraction: float) -> str:
    """``blend-0.15`` for a recompute fraction of 0.15."""
    return f"blend-{fraction:g}"


def backfill_name(fraction: float) -> str:
    """``blend-0.15+backfill`` for a recompute fraction of 0.15 with ``blend_backfill=True``."""
    return f"{blend_name(fraction)}+backfill"


def workload(cfg: BenchConfig, tokenizer: Any, kv_bytes_per_token: int) -> tuple[list[tuple[str, list[str]]],
                                                                                 list[tuple[str, list[str]]]]:
    """(warm-up, measured) requests of the bench's retrieval workload ``cfg`` (`build_traces`): (question,
    document texts in relevance order) each."""
    traces = build_traces(cfg, tokenizer, kv_bytes_per_token)
    (measured,) = traces.unit_traces.values()
    return ([(r.question, traces.documents(r)) for r in traces.warmup],
            [(r.question, traces.documents(r)) for r in measured])


def _engine_config(system: str, fraction: float | None, cache_dir: Path, *, chunk_size: int, plain: bool,
                   max_new_tokens: int, backfill: bool = False) -> EngineConfig:
    common: dict[str, Any] = {"cache_dir": cache_dir, "chunk_size": chunk_size, "device": "cpu",
                              "max_new_tokens": max_new_tokens, "dram_capacity": _DRAM, "ssd_capacity": _SSD}
    if plain:
        common["chat_template"] = "plain"
    if system == "no-reuse":
        return EngineConfig(enable_cache=False, **common)
    if fraction is None:
        return EngineConfig(**common)
    return EngineConfig(reuse="blend", blend_recompute=fraction, blend_backfill=backfill, **common)


def wait_for_backfill(engine: PCREngine, question: str, docs: Sequence[str], before: int, *,
                      timeout_s: float = BACKFILL_TIMEOUT_S) -> tuple[float, int]:
    """The idle gap after a request of a backfill engine (module docstring): wait until ``engine`` has no request
    or backfill waiting or running and, when the exact tree did not hold the request's whole prompt as the gap
    began, until its completed-backfill count rose above ``before`` (its count before the request). Returns
    (seconds waited, backfills completed since ``before``).

    Why the tree decides: the engine queues a backfill exactly when the tree does not hold the prompt once the
    request finished, and only that backfill can make the tree hold it. So a prompt the tree lacks as the gap begins
    has a backfill queued (its done-callback may run after the caller's ``generate`` returned, and a queued
    backfill leaves the queue a moment before its twin enters the scheduler: in both moments the engine looks
    idle) and the gap ends only when the count rises (the twin writes the prompt's chunks a moment before the
    count rises). A prompt the tree holds as the gap begins has nothing queued: the gap ends when the engine is
    idle. Raises `RuntimeError` after ``timeout_s`` (a backfill that failed: the engine logs it and drops it)."""
    keys = [c.key for c in engine.plan_for(question, list(docs), system=SYSTEM_PROMPT)]
    held = engine.cache is not None and len(engine.cache.match(keys).keys) == len(keys)
    started = time.perf_counter()
    while True:
        s = engine.stats()
        done = int(s.blend.get("backfills", 0)) - before
        idle = s.queue_depth == 0 and s.running == 0 and not s.blend.get("pending_shadows", 0)
        if idle and (held or done > 0):
            return time.perf_counter() - started, done
        if time.perf_counter() - started > timeout_s:
            raise RuntimeError(f"a backfill did not finish within {timeout_s:g} s (the engine logs a failed one)")
        time.sleep(_POLL_S)


def measure_model(model: Any, tokenizer: Any, name: str, warmup: Sequence[tuple[str, Sequence[str]]],
                  requests: Sequence[tuple[str, Sequence[str]]], fractions: Sequence[float], *, max_new_tokens: int,
                  chunk_size: int, work_dir: Path, plain: bool = False, backfill: bool = False,
                  blend_stats: dict[str, dict[str, Any]] | None = None, progress: bool = False) -> list[Served]:
    """Serve ``requests`` on no-reuse, pcr and one blend engine per fraction, plus one blend engine with backfill
    per fraction when ``backfill`` (see the module docstring), and return every request of every system, in
    serving order. ``blend_stats``, when given, receives each blend engine's final ``stats().blend`` snapshot
    (backfills completed over warm-up and measured requests, ...) by system name."""
    systems: dict[str, tuple[float | None, bool]] = {"no-reuse": (None, False), "pcr": (None, False)}
    for f in fractions:
        systems[blend_name(f)] = (f, False)
        if backfill:
            systems[backfill_name(f)] = (f, True)
    engines: dict[str, PCREngine] = {}
    ledgers: dict[str, BlendLedger] = {}
    builder = PromptBuilder(tokenizer, plain_text=plain)
    served: list[Served] = []
    try:
        for system, (fraction, fills) in systems.items():
            config = _engine_config(system, fraction, work_dir / system, chunk_size=chunk_size, plain=plain,
                                    max_new_tokens=max_new_tokens, backfill=fills)
            engines[system] = PCREngine(model=model, tokenizer=tokenizer, config=config)
            if fraction is not None:
                ledgers[system] = BlendLedger(builder, fraction, SYSTEM_PROMPT)
        for system, engine in engines.items():  # warm-up: the caches (and kernels), one output token each
            for question, docs in (warmup if system != "no-reuse" else warmup[:2]):
                before = _backfills(engine)
                res = _generate(engine, question, docs, 1)
                if system in ledgers:
                    ledgers[system].serve(question, docs, res.prompt_token_ids, res.metrics.reused_tokens,
                                          res.metrics.blended_tokens)
                if systems[system][1]:
                    wait_for_backfill(engine, question, docs, before)
        names = list(engines)
        started = time.perf_counter()
        for k, (question, docs) in enumerate(requests):
            for system in names[k % len(names):] + names[:k % len(names)]:
                engine = engines[system]
                before = _backfills(engine)
                res = _generate(engine, question, docs, 1 if system == "no-reuse" else max_new_tokens)
                m = res.metrics
                split = (ledgers[system].serve(question, docs, res.prompt_token_ids, m.reused_tokens,
                                               m.blended_tokens) if system in ledgers else None)
                waited, filled = (wait_for_backfill(engine, question, docs, before) if systems[system][1]
                                  else (None, None))
                served.append(Served(name, system, k, float(m.ttft_s), int(m.prompt_tokens), int(m.reused_tokens),
                                     int(getattr(m, "blended_tokens", 0)),
                                     None if split is None else split.blended_reused,
                                     None if split is None else split.fresh, tuple(res.token_ids), res.text,
                                     res.first_token_logits, filled, waited))
            if progress:
                log.info("%s: request %d/%d done (%.0f s)", name, k + 1, len(requests),
                         time.perf_counter() - started)
        if blend_stats is not None:
            for system, (fraction, _) in systems.items():
                if fraction is not None:
                    blend_stats[system] = dict(engines[system].stats().blend)
    finally:
        for engine in engines.values():
            engine.close()
    return served


def _backfills(engine: PCREngine) -> int:
    """The engine's completed backfills so far (0 without backfill)."""
    return int(engine.stats().blend.get("backfills", 0))


def _generate(engine: PCREngine, question: str, docs: Sequence[str], max_new_tokens: int) -> GenerationResult:
    return engine.generate(question, documents=list(docs), system=SYSTEM_PROMPT, max_new_tokens=max_new_tokens,
                           temperature=0.0)


def first_token_kl(exact_logits: Any, blend_logits: Any) -> float:
    """``KL(exact || blend)`` in nats between the softmax of two first-token logit vectors (float64)."""
    p = torch.log_softmax(torch.as_tensor(exact_logits, dtype=torch.float64).flatten(), dim=-1)
    q = torch.log_softmax(torch.as_tensor(blend_logits, dtype=torch.float64).flatten(), dim=-1)
    return float(torch.sum(p.exp() * (p - q)).clamp_min(0.0))


def rouge_l(reference: str, candidate: str, *, scorer: Any = None) -> float:
    """ROUGE-L F-measure of ``candidate`` against ``reference`` (``rouge-score``'s tokenizer: lower case, words)."""
    if scorer is None:
        scorer = _scorer()
    return float(scorer.score(reference, candidate)["rougeL"].fmeasure)


def _scorer() -> Any:
    try:
        from rouge_score import rouge_scorer
    except ImportError as exc:  # the bench extra brings it
        raise SystemExit("ROUGE-L needs the rouge-score package: pip install 'pcr-rag[bench]'") from exc
    return rouge_scorer.RougeScorer(["rougeL"])


def _table(rows: Sequence[Served]) -> RequestTable | None:
    return RequestTable.from_run({"requests": {"ttft": [r.ttft_s for r in rows], "key": [[0, r.index] for r in rows]}})


def _ci(a: Sequence[Served], b: Sequence[Served]) -> dict[str, Any] | None:
    ta, tb = _table(a), _table(b)
    ci = paired_ratio_interval(ta, tb, "ttft.mean") if ta is not None and tb is not None else None
    return None if ci is None else {"ratio": ci.ratio, "low": ci.low, "high": ci.high, "n": ci.n}


def summarize(served: Sequence[Served], fractions: Sequence[float]) -> list[dict[str, Any]]:
    """One row per (model, system): reuse, TTFT ratios with intervals, and (blend) quality against exact."""
    scorer = None
    out: list[dict[str, Any]] = []
    for model in dict.fromkeys(r.model for r in served):
        rows = [r for r in served if r.model == model]
        by = {s: sorted((r for r in rows if r.system == s), key=lambda r: r.index)
              for s in dict.fromkeys(r.system for r in rows)}
        exact = {r.index: r for r in by["pcr"]}
        none = {r.index: r for r in by["no-reuse"]}
        first_same = sum(none[i].token_ids[:1] == exact[i].token_ids[:1] for i in exact if i in none)
        for system in ["no-reuse", "pcr", *(n for f in fractions for n in (blend_name(f), backfill_name(f)))]:
            rs = by.get(system, [])
            if not rs:
                continue
            prompt = sum(r.prompt_tokens for r in rs)
            known = all(r.blended_reused is not None for r in rs if r.system.startswith("blend"))
            placed_reused = sum(r.blended_reused or 0 for r in rs)
            fresh = sum(r.blended_fresh or 0 for r in rs)
            row: dict[str, Any] = {
                "model": model, "system": system, "requests": len(rs),
                "recompute": next((f for f in fractions if system in (blend_name(f), backfill_name(f))), None),
                "backfill": system.endswith("+backfill"),
                "reused": (sum(r.exact for r in rs) + placed_reused) / prompt if known else None,
                "exact": sum(r.exact for r in rs) / prompt, "blended_reused": placed_reused / prompt,
                "blended_fresh": fresh / prompt, "plan_replayed": known,
                "ttft_mean_s": statistics.mean(r.ttft_s for r in rs),
                "ttft_vs_pcr": _ci(rs, by["pcr"]) if system != "pcr" else None,
                "ttft_vs_no_reuse": _ci(rs, by["no-reuse"]) if system != "no-reuse" else None,
            }
            if system == "no-reuse":
                row["first_token_same_as_exact"] = first_same
            if row["backfill"]:
                waits = [r.backfill_wait_s or 0.0 for r in rs]
                row.update(backfills=sum(r.backfills or 0 for r in rs), backfill_wait_s=sum(waits),
                           backfill_wait_max_s=max(waits))
            if system.startswith("blend"):
                if scorer is None:
                    scorer = _scorer()
                quality = []
                for r in rs:
                    e = exact[r.index]
                    same = r.token_ids == e.token_ids
                    kl = (first_token_kl(e.logits, r.logits) if e.logits is not None and r.logits is not None
                          else math.nan)
                    quality.append({"index": r.index, "identical": same, "kl": kl,
                                    "rouge_l": 1.0 if same else rouge_l(e.text, r.text, scorer=scorer),
                                    "blended": r.blended > 0 or bool(r.blended_reused) or bool(r.blended_fresh)})
                row.update(_quality(quality, "all"))
                row.update(_quality([q for q in quality if q["blended"]], "blended"))
                row["per_request"] = quality
            out.append(row)
    return out


def _quality(quality: Sequence[dict[str, Any]], part: str) -> dict[str, Any]:
    kls = [q["kl"] for q in quality if not math.isnan(q["kl"])]
    rouge = [q["rouge_l"] for q in quality]
    return {f"{part}_requests": len(quality), f"{part}_identical": sum(q["identical"] for q in quality),
            f"{part}_kl_median": statistics.median(kls) if kls else None,
            f"{part}_rouge_l_mean": statistics.mean(rouge) if rouge else None,
            f"{part}_rouge_l_ci": mean_interval(rouge)}


def default_fraction(rows: Sequence[dict[str, Any]], fractions: Sequence[float]) -> float | None:
    """The smallest fraction whose mean ROUGE-L over blended requests reaches `BLEND_QUALITY_MIN_ROUGE_L` on every
    model (a model with no blended request at that fraction does not count against it); None if none does."""
    for f in sorted(fractions):
        scores = [r.get("blended_rouge_l_mean") for r in rows if r["system"] == blend_name(f)]
        if scores and all(s is None or s >= BLEND_QUALITY_MIN_ROUGE_L for s in scores):
            return f
    return None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _ratio(c: dict[str, Any] | None) -> str:
    return "n/a" if c is None else f"{c['ratio']:.2f}x [{c['low']:.2f}, {c['high']:.2f}]"


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table: one line per (model, system)."""
    lines = ["| model | system | reused (exact + placed from earlier KV) | exact | placed, fresh | TTFT mean "
             "| vs pcr (exact) | vs no-reuse | identical to exact: all / blended | median first-token KL (nats): "
             "all / blended | ROUGE-L F: all / blended [95% CI] |", "|" + "---|" * 11]
    for r in rows:
        q = ("n/a", "n/a", "n/a")
        if r["system"].startswith("blend"):
            kl = "/".join("n/a" if r[f"{p}_kl_median"] is None else f"{r[f'{p}_kl_median']:.4f}"
                          for p in ("all", "blended"))
            ci = r.get("blended_rouge_l_ci")
            rouge = "/".join("n/a" if r[f"{p}_rouge_l_mean"] is None else f"{r[f'{p}_rouge_l_mean']:.3f}"
                             for p in ("all", "blended"))
            q = (f"{r['all_identical']}/{r['all_requests']} / {r['blended_identical']}/{r['blended_requests']}", kl,
                 rouge + ("" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]"))
        lines.append(f"| {r['model']} | {r['system']} | {_pct(r['reused'])} | {_pct(r['exact'])} "
                     f"| {_pct(r['blended_fresh'])} | {r['ttft_mean_s'] * 1000:.0f} ms | {_ratio(r['ttft_vs_pcr'])} "
                     f"| {_ratio(r['ttft_vs_no_reuse'])} | {q[0]} | {q[1]} | {q[2]} |")
    return "\n".join(lines)


def backfill_lines(rows: Sequence[dict[str, Any]]) -> str:
    """One line per backfill system: backfills completed in the gaps after its measured requests and the time the
    script waited for those gaps (not part of any TTFT); empty without backfill systems."""
    return "\n".join(f"backfill: {r['model']} {r['system']}: {r['backfills']} backfills after {r['requests']} "
                     f"requests; waited {r['backfill_wait_s']:.1f} s for them in all, at most "
                     f"{r['backfill_wait_max_s']:.2f} s after one request" for r in rows if r.get("backfill"))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma-separated model aliases or paths (default: %(default)s)")
    p.add_argument("--fractions", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
                   help="blend_recompute fractions (default: %(default)s)")
    p.add_argument("--requests", type=int, default=24, help="measured requests per model")
    p.add_argument("--warmup", type=int, default=8, help="warm-up requests (the most popular topics)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="answer length at most (greedy)")
    p.add_argument("--backfill", action="store_true",
                   help="also serve each fraction with blend_backfill=True (system blend-F+backfill)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--corpus", default=None, help="corpus file or directory (default: the stdlib corpus)")
    p.add_argument("--questions", default=None, help="a question per line (default: generated from titles)")
    p.add_argument("--passages", type=int, default=RETRIEVAL_PASSAGES, help="passage pool (0: all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 requests, 4 warm-up, 8 output tokens")
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--work-dir", default=None, help="cache directories (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.max_new_tokens = 4, 4, 8
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    cfg = replace(standard_config(retrieval=True), corpus=args.corpus, questions=args.questions,
                  num_passages=args.passages or None, num_requests=args.requests, warmup_requests=args.warmup,
                  repeats=1, rates=(1.0,), chunk_size=args.chunk_size, seed=args.seed)
    started = time.perf_counter()
    served: list[Served] = []
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pcr-blend-quality-") as tmp:
        work = Path(args.work_dir or tmp)
        requests: tuple[list[Any], list[Any]] | None = None
        for name in models:
            loaded = load_model(name, None, dtype="auto", device="cpu")
            if requests is None:  # one workload, built with the first model's tokenizer
                requests = workload(cfg, loaded.tokenizer, loaded.kv.bytes_per_token)
            plain = not getattr(loaded.tokenizer, "chat_template", None)
            t0 = time.perf_counter()
            blend_stats: dict[str, dict[str, Any]] = {}
            served += measure_model(loaded.model, loaded.tokenizer, loaded.name, requests[0], requests[1], fractions,
                                    max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size,
                                    work_dir=work / Path(loaded.name).name, plain=plain, backfill=args.backfill,
                                    blend_stats=blend_stats, progress=True)
            info[loaded.name] = {"dtype": str(loaded.dtype).replace("torch.", ""), "plain_template": plain,
                                 "seconds": round(time.perf_counter() - t0, 1), "blend_stats": blend_stats}
            del loaded
    rows = summarize(served, fractions)
    default = default_fraction(rows, fractions)
    print(markdown(rows))
    if args.backfill:
        print(backfill_lines(rows))
    print(f"\ndefault: {'none reaches' if default is None else f'{default:g}'} (smallest fraction whose mean "
          f"ROUGE-L over blended requests is >= {BLEND_QUALITY_MIN_ROUGE_L:g} on every model)")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {"config": {k: v for k, v in vars(args).items()}, "models": info, "fractions": fractions,
                  "rows": rows, "default_fraction": default, "wall_s": round(time.perf_counter() - started, 1),
                  "requests": [r.as_dict() for r in served], "markdown": markdown(rows)}
        out.write_text(json.dumps(report, indent=1), encoding="utf-8")
        print(f"json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
