"""Is a cache on a slow disk ever slower than no cache? Cache on / cache off total TTFT with the load-or-recompute
planner (``load_planner="measured"``) and without it (``"always-load"``, the behaviour before), per storage speed.

Three systems serve the same requests, interleaved request by request in rotated order: ``off`` (an engine with
the cache off), and one cache engine switched between ``always-load`` and ``measured`` (its planner's mode; the
two share the cache directory and the measured speeds). The cache engine's storage is a local directory behind
``SlowBackend`` (reads and writes throttled to a bandwidth, changed between phases). Phases:

- ``ssd-<n>MBps``: every request's documents are cached and sit on the throttled SSD only (flushed and dropped
  from DRAM before each request), as on a network disk, a busy disk or a cold EBS volume;
- ``local-disk``: the same, unthrottled (a normal local disk, page cache dropped by the tier as always);
- ``dram``: the documents sit in DRAM (a DRAM-resident workload: the planner must change nothing);
- ``miss``: fresh documents each request, nothing cached (the cache's miss cost; ``off`` and ``measured`` only:
  with nothing to load both modes do the same, and a second cache system would hit the first one's chunks).

Every system gets the same prompt, so the answers are compared; the second cache system of a request may reuse the
question's chunk that the first one computed (the order rotates per request, so neither mode is favoured).

Per phase it prints each cache system's total TTFT over ``off``'s, and ``measured``'s over ``always-load``'s, each
with a 95% paired bootstrap interval (requests resampled); the log says the chunks the planner recomputed instead
of loading and its estimates. It also times the planner's call directly
(``ReusePlanner.plan`` over an 8-chunk path, and ``CacheManager.reuse_limit``: match + plan under the lock), in
microseconds: below the host's TTFT noise, so timed alone.

Run: ``python benchmarks/load_planner.py`` (default model, one torch thread) or call `measure`.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from pcr_rag.cache import LocalDirBackend, SlowBackend, Tier
from pcr_rag.cache.reuse_planner import Segment
from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.rag.corpus import split_passages, stdlib_corpus

log = logging.getLogger(__name__)

SYSTEMS = ("off", "always-load", "measured")
MB = 1_000_000


@dataclass(frozen=True)
class Row:
    """One request of one system in one phase: its TTFT (seconds), prompt and reused tokens, and its tokens."""

    phase: str
    system: str
    index: int
    ttft_s: float
    prompt_tokens: int
    reused_tokens: int
    token_ids: tuple[int, ...]


def _prompts(passages: Sequence[str], documents: int) -> Iterator[tuple[str, ...]]:
    for start in range(0, len(passages) - documents + 1, documents):
        yield tuple(passages[start:start + documents])


def measure(off: PCREngine, on: PCREngine, storage: SlowBackend, passages: Sequence[str], *,
            phases: Sequence[tuple[str, float | None]], requests: int = 8, documents: int = 4,
            max_new_tokens: int = 4) -> tuple[list[Row], list[bytes]]:
    """The phases of the module docstring on ``off`` (cache off) and ``on`` (cache on, its storage ``storage``);
    each phase's requests use their own passages. ``phases``: (name, bandwidth in bytes/s or None); a name
    starting with ``dram`` or ``miss`` is that kind of phase. Returns the rows and the chunk keys of the last
    request (cached: for `time_planner`)."""
    sets = _prompts(passages, documents)
    rows: list[Row] = []
    keys: list[bytes] = []
    planner = on.cache.planner
    for phase, bandwidth in phases:
        kind = "dram" if phase.startswith("dram") else "miss" if phase.startswith("miss") else "ssd"
        doc_sets = [next(sets) for _ in range(requests)]
        storage.bandwidth = None
        if kind != "miss":  # cache every request's documents (unthrottled: the warm-up is not measured)
            for k, docs in enumerate(doc_sets):
                on.generate(f"Warm-up question {k} of {phase}?", list(docs), max_new_tokens=1)
            on.flush()
        storage.bandwidth = bandwidth
        systems = ("off", "measured") if kind == "miss" else SYSTEMS  # on a miss both modes load nothing
        for k, docs in enumerate(doc_sets):
            order = systems[k % len(systems):] + systems[:k % len(systems)]
            for system in order:
                question = f"What does set {k} of {phase} say?"  # the same prompt for all three: same answer
                engine = off if system == "off" else on
                if system != "off":
                    planner.mode = system
                    on.flush()
                    keys = [c.key for c in on.plan_for(question, list(docs))]
                    if kind == "ssd":
                        on.cache.evict(Tier.DRAM, 1 << 40)
                    elif kind == "dram":
                        on.cache.load(keys)
                r = engine.generate(question, list(docs), max_new_tokens=max_new_tokens)
                rows.append(Row(phase, system, k, r.metrics.ttft_s, r.metrics.prompt_tokens,
                                r.metrics.reused_tokens, tuple(r.token_ids)))
        st = on.stats().cache
        log.info("%s done: recomputed instead of loaded so far %s, SSD read estimate %.2f MB/s, compute %.2f ms "
                 "per token + %.3g s per token per position", phase, st.recomputed_instead_of_loaded,
                 st.planner["read_bytes_per_s"]["ssd"] / MB, st.planner["compute_s_per_token"] * 1e3,
                 st.planner["compute_s_per_token_position"])
    storage.bandwidth = None
    return rows, keys


def paired_total_ratio(a: Sequence[float], b: Sequence[float], *, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float, float]:
    """sum(a) / sum(b) over paired requests, with a 95% percentile-bootstrap interval (requests resampled)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))
    ratios = x[idx].sum(axis=1) / y[idx].sum(axis=1)
    low, high = np.quantile(ratios, [0.025, 0.975])
    return float(x.sum() / y.sum()), float(low), float(high)


def summarize(rows: Sequence[Row]) -> list[str]:
    lines = []
    for phase in dict.fromkeys(r.phase for r in rows):
        by = {s: sorted((r for r in rows if r.phase == phase and r.system == s), key=lambda r: r.index)
              for s in SYSTEMS}
        base = [r.ttft_s for r in by["off"]]
        parts = [f"off {sum(base):.2f} s"]
        for system in [s for s in SYSTEMS[1:] if by[s]]:
            ratio, low, high = paired_total_ratio([r.ttft_s for r in by[system]], base)
            reused = sum(r.reused_tokens for r in by[system]) / max(1, sum(r.prompt_tokens for r in by[system]))
            parts.append(f"{system} {ratio:.3f}x [{low:.3f}, {high:.3f}] (reused {reused:.0%})")
        if by["always-load"]:
            ratio, low, high = paired_total_ratio([r.ttft_s for r in by["measured"]],
                                                  [r.ttft_s for r in by["always-load"]])
            parts.append(f"measured over always-load {ratio:.3f}x [{low:.3f}, {high:.3f}]")
        same = all(a.token_ids == b.token_ids for s in SYSTEMS[1:] if by[s]
                   for a, b in zip(by["off"], by[s], strict=True))
        lines.append(f"{phase}: total TTFT over cache off: " + ", ".join(parts) + f"; answers equal: {same}")
    return lines


def time_planner(engine: PCREngine, keys: Sequence[bytes], *, chunks: int = 8,
                 calls: int = 20000) -> dict[str, float]:
    """Microseconds per ``ReusePlanner.plan`` call over ``chunks`` SSD chunks of the engine's KV size, and per
    ``CacheManager.reuse_limit`` over ``keys`` (a cached request's: the lock, the match and the planner)."""
    planner = engine.cache.planner
    kv = engine.loaded.kv
    nbytes = kv.bytes_per_token * engine.config.chunk_size
    segs = [Segment(bytes([i]), Tier.SSD, engine.config.chunk_size, nbytes, kv.num_layers) for i in range(chunks)]
    saved = planner.mode
    planner.mode = "measured"
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            planner.plan(segs, chunks * engine.config.chunk_size + 40)
        plan_us = (time.perf_counter() - t0) / calls * 1e6
        t0 = time.perf_counter()
        for _ in range(calls):
            engine.cache.reuse_limit(keys)
        limit_us = (time.perf_counter() - t0) / calls * 1e6
    finally:
        planner.mode = saved
    return {"plan_us": plan_us, "reuse_limit_us": limit_us, "chunks": chunks,
            "matched": engine.cache.match(keys).num_chunks}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/load_planner.py", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8, help="requests per system and phase")
    parser.add_argument("--documents", type=int, default=4, help="passages per request")
    parser.add_argument("--passage-tokens", type=int, default=250)
    parser.add_argument("--bandwidths", default="20,50", help="throttled SSD phases, MB/s, comma-separated")
    parser.add_argument("--phases", default="ssd,local-disk,dram,miss",
                        help="which phases: ssd (one per bandwidth), local-disk, dram, miss")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the serving bench uses 1)")
    parser.add_argument("--json", help="write the rows and the planner timing here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    wanted = args.phases.split(",")
    phases: list[tuple[str, float | None]] = []
    if "ssd" in wanted:
        phases += [(f"ssd-{b}MBps", float(b) * MB) for b in args.bandwidths.split(",")]
    phases += [(p, None) for p in ("local-disk", "dram", "miss") if p in wanted]
    with tempfile.TemporaryDirectory(prefix="pcr-load-planner-") as tmp:
        storage = SlowBackend(LocalDirBackend(Path(tmp) / "cache"))
        with PCREngine(config=EngineConfig(enable_cache=False)) as off, \
                PCREngine(config=EngineConfig(cache_dir=Path(tmp) / "cache", dram_capacity="512MiB"),
                          storage=storage) as on:
            tok = on.tokenizer
            docs = split_passages(stdlib_corpus(), tokens_per_passage=args.passage_tokens, tokenizer=tok)
            passages = [p.text for p in docs if len(tok.encode(p.text)) >= 0.9 * args.passage_tokens]
            rows, keys = measure(off, on, storage, passages, phases=phases, requests=args.requests,
                                 documents=args.documents)
            timing = time_planner(on, keys)
    for line in summarize(rows):
        print(line)
    print(f"planner call: {timing['plan_us']:.1f} us per plan over {timing['chunks']} SSD chunks; "
          f"{timing['reuse_limit_us']:.1f} us per CacheManager.reuse_limit over {timing['matched']} matched chunks "
          f"(lock + match + plan)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": [asdict(r) for r in rows], "planner": timing}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
