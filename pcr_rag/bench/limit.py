"""The limit ratio: how close a fully cached request gets to the ideal of "the prefix KV is already resident".

    limit ratio = TTFT of a request whose whole document prefix is cached
                  / a raw transformers forward of the same suffix over an already-resident DynamicCache

measured A/B interleaved in one run (timings on a shared machine are noisy; ratios within one run hold). The
numerator includes everything a user waits for (queue, match, load, suffix prefill, first token); the
denominator only the suffix forward plus the argmax. Variants: prefix in DRAM, prefix only on SSD (page cache
dropped before each try), each with layer-wise overlap on and off.

Run: ``python -m pcr_rag.bench.limit`` (default model) or call `measure_limit_ratio`.

``python -m pcr_rag.bench.limit --miss`` measures the other end instead, the miss cost (`measure_miss_cost`): a
trace whose requests reuse nothing, run with the cache on and off, TTFT ratio per request (target <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache

from pcr_rag.bench.disk import drop_page_cache
from pcr_rag.bench.targets import LIMIT_RATIO_DRAM_MAX, LIMIT_RATIO_SSD_MAX, LIMIT_RATIO_TARGETS
from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.model.model import load_model
from pcr_rag.rag.corpus import load_corpus, split_passages

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LimitRatioResult:
    """Medians in seconds; ratios are medians of per-try ratios (A/B interleaved)."""

    prefix_tokens: int
    suffix_tokens: int
    raw_forward_s: float
    ttft_dram_s: float
    ttft_ssd_s: float
    ttft_dram_no_overlap_s: float
    ttft_ssd_no_overlap_s: float
    ratio_dram: float
    ratio_ssd: float
    ratio_dram_no_overlap: float
    ratio_ssd_no_overlap: float
    ttft_uncached_s: float
    reps: int

    @property
    def speedup_dram(self) -> float:
        """Uncached TTFT / cached (DRAM) TTFT."""
        return self.ttft_uncached_s / self.ttft_dram_s

    @property
    def speedup_ssd(self) -> float:
        return self.ttft_uncached_s / self.ttft_ssd_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def passed(self) -> dict[str, bool]:
        """Each limit-ratio target (`pcr_rag.bench.targets.LIMIT_RATIO_TARGETS`) -> whether it is met."""
        return {name: getattr(self, name) <= bound for name, bound in LIMIT_RATIO_TARGETS.items()}

    def summary(self) -> str:
        return (f"limit ratio (prefix {self.prefix_tokens} tok, suffix {self.suffix_tokens} tok, "
                f"raw forward {self.raw_forward_s * 1000:.1f} ms): DRAM {self.ratio_dram:.2f} "
                f"(target <= {LIMIT_RATIO_DRAM_MAX:.2f}; no overlap {self.ratio_dram_no_overlap:.2f}), SSD "
                f"{self.ratio_ssd:.2f} (target <= {LIMIT_RATIO_SSD_MAX:.2f}; no overlap "
                f"{self.ratio_ssd_no_overlap:.2f}); TTFT uncached "
                f"{self.ttft_uncached_s * 1000:.0f} ms vs cached DRAM {self.ttft_dram_s * 1000:.0f} ms "
                f"(x{self.speedup_dram:.1f}), SSD {self.ttft_ssd_s * 1000:.0f} ms (x{self.speedup_ssd:.1f})")


def _raw_suffix_forward(model, prefix_ids: list[int], suffix_ids: list[int], device) -> float:
    """Seconds for one forward of the suffix over a resident DynamicCache of the prefix, plus argmax."""
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=torch.tensor([prefix_ids], device=device), cache=cache, use_cache=True, logits_to_keep=1)
        n = len(prefix_ids)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)  # the prefix's queued kernels are not the suffix's time
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([suffix_ids], device=device),
                    position_ids=torch.arange(n, n + len(suffix_ids), device=device).unsqueeze(0),
                    cache=cache, use_cache=True, logits_to_keep=1)
        int(torch.argmax(out.logits[0, -1]).item())
        return time.perf_counter() - t0


def measure_limit_ratio(model=None, tokenizer=None, *, documents: Sequence[str], query: str = "Summarize.",
                        reps: int = 5, chunk_size: int = 256, workdir: str | Path | None = None,
                        dtype="auto", device: str = "cpu") -> LimitRatioResult:
    """Measure the limit ratios with ``documents`` as the cached prefix (see the module docstring), on ``device``
    (on CUDA the DRAM tier is page-locked and loads run on a side stream)."""
    loaded = load_model(model, tokenizer, dtype=dtype, device=device)
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="pcr-limit-"))  # removed after
    queries = [f"{query} (variant {i})" for i in range(reps + 1)]

    def engine(path: Path, *, layerwise: bool, dram: int | str) -> PCREngine:
        cfg = EngineConfig(cache_dir=path, chunk_size=chunk_size, dram_capacity=dram, ssd_capacity="8GiB",
                           layerwise=layerwise, prefetch=False, max_new_tokens=1, device=device)
        return PCREngine(model=loaded.model, tokenizer=loaded.tokenizer, config=cfg)

    # Warm both caches: one with the prefix in DRAM (kept open), one SSD-only (reopened per try).
    dram_dirs = {lw: work / f"dram-{lw}" for lw in (True, False)}
    ssd_dir = work / "ssd"
    dram_engines = {lw: engine(dram_dirs[lw], layerwise=lw, dram="4GiB") for lw in (True, False)}
    no_cache = PCREngine(model=loaded.model, tokenizer=loaded.tokenizer, config=EngineConfig(
        cache_dir=work / "off", enable_cache=False, chunk_size=chunk_size, max_new_tokens=1, device=device))
    try:
        first = None
        for eng in dram_engines.values():
            first = eng.generate(queries[0], documents)
        with engine(ssd_dir, layerwise=True, dram="4GiB") as warm:  # stage in DRAM, persist to SSD
            warm.generate(queries[0], documents)
            warm.flush()
        # untimed, like the DRAM engines' first call: the cache-off engine's first full-length prompt pays one-time
        # costs (on a GPU, kernel and library set-up per new shape) that are no part of a cold request's TTFT
        no_cache.generate(queries[0], documents)
        prompt = first.prompt_token_ids
        doc_end = 0
        raw, t_dram, t_dram_no, t_ssd, t_ssd_no, t_off = [], [], [], [], [], []
        for i in range(reps):
            q = queries[i + 1]
            r_lw = dram_engines[True].generate(q, documents)
            r_no = dram_engines[False].generate(q, documents)
            ids = r_lw.prompt_token_ids
            doc_end = r_lw.metrics.reused_tokens  # the raw baseline splits the prompt exactly where reuse did
            raw.append(_raw_suffix_forward(loaded.model, ids[:doc_end], ids[doc_end:], loaded.device))
            t_dram.append(r_lw.metrics.ttft_s)
            t_off.append(no_cache.generate(q, documents).metrics.ttft_s)
            t_dram_no.append(r_no.metrics.ttft_s)
            for lw, bucket in ((True, t_ssd), (False, t_ssd_no)):
                drop_page_cache(ssd_dir)  # the next tries read the disk, not the page cache
                with engine(ssd_dir, layerwise=lw, dram=0) as eng:
                    r = eng.generate(q, documents)
                if r.metrics.reused_by_tier["ssd"] == 0:
                    log.warning("SSD try did not hit the SSD tier: %s", r.metrics.reused_by_tier)
                bucket.append(r.metrics.ttft_s)
    finally:
        for eng in dram_engines.values():
            eng.close()
        no_cache.close()
        if workdir is None:  # our own temp dir: its cache directories hold the prefix's KV (GBs on a big model)
            shutil.rmtree(work, ignore_errors=True)

    def ratio(xs: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(xs, raw))

    return LimitRatioResult(
        prefix_tokens=doc_end, suffix_tokens=len(prompt) - doc_end,
        raw_forward_s=statistics.median(raw), ttft_dram_s=statistics.median(t_dram),
        ttft_ssd_s=statistics.median(t_ssd), ttft_dram_no_overlap_s=statistics.median(t_dram_no),
        ttft_ssd_no_overlap_s=statistics.median(t_ssd_no), ratio_dram=ratio(t_dram), ratio_ssd=ratio(t_ssd),
        ratio_dram_no_overlap=ratio(t_dram_no), ratio_ssd_no_overlap=ratio(t_ssd_no),
        ttft_uncached_s=statistics.median(t_off), reps=reps,
    )


@dataclass(frozen=True)
class ChunkStepCost:
    """Prefill time of one prompt in chunk-aligned steps vs one shot (seconds, medians of interleaved tries)."""

    prompt_tokens: int
    chunk_size: int
    one_shot_s: float
    chunked_s: float

    @property
    def ratio(self) -> float:
        return self.chunked_s / self.one_shot_s


def measure_chunk_step_cost(model, token_ids: Sequence[int], chunk_size: int = 256, reps: int = 3,
                            device="cpu") -> ChunkStepCost:
    """What the fidelity invariant costs: prefill in ``chunk_size`` steps vs a single forward (A/B interleaved)."""
    ids = torch.tensor([list(token_ids)], device=device)
    n = ids.shape[1]
    one, chunked = [], []
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
            one.append(time.perf_counter() - t0)
            cache = DynamicCache()
            t0 = time.perf_counter()
            for lo in range(0, n, chunk_size):
                hi = min(n, lo + chunk_size)
                model(input_ids=ids[:, lo:hi], position_ids=torch.arange(lo, hi, device=device).unsqueeze(0),
                      cache=cache, use_cache=True, logits_to_keep=1)
            chunked.append(time.perf_counter() - t0)
    return ChunkStepCost(n, chunk_size, statistics.median(one), statistics.median(chunked))


@dataclass
class MissCostResult:
    """A miss with the cache on vs the same request with the cache off ("a miss costs what it computes").

    ``ratios``: per request, TTFT with the cache on / TTFT with it off (same prompt, same pass); target <= 1.05.
    Seconds are medians. ``on_breakdown_s``: medians of the cache-on requests' queue, prefill and load-wait times.
    ``flush_s``: median wait, after each cache-on request, for its SSD write-back to finish (not in any TTFT).
    """

    requests: int
    passes: int
    prompt_tokens_mean: float
    computed_tokens_mean: float
    reused_tokens_total: int
    ttft_on_s: float
    ttft_off_s: float
    ratio_median: float
    ratio_mean: float
    ratios: list[float]
    on_breakdown_s: dict[str, float]
    off_breakdown_s: dict[str, float]
    flush_s: float
    threads: int
    cache_stats: dict

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        dram = self.cache_stats.get("capacity_bytes", {}).get("dram", 0)
        return (f"miss cost ({self.requests} requests x {self.passes} passes, {self.prompt_tokens_mean:.0f}-token "
                f"prompts of distinct documents, {self.reused_tokens_total} tokens reused, {self.threads} threads, "
                f"DRAM tier {dram / 2**20:.0f} MiB, {self.cache_stats.get('dram_buffers_reused', 0)} payload "
                f"buffers reused): TTFT cache on / off per request: median {self.ratio_median:.3f}, mean "
                f"{self.ratio_mean:.3f} (target <= 1.05); TTFT on {self.ttft_on_s * 1000:.0f} ms vs off "
                f"{self.ttft_off_s * 1000:.0f} ms")


def miss_trace(tokenizer, count: int, *, prompt_tokens: int = 650, docs_per_request: int = 2,
               corpus: str | None = None) -> list[tuple[str, list[str]]]:
    """``count`` (query, documents) requests whose documents are all distinct (nothing is reused between them):
    corpus passages of about (prompt_tokens - 50) / docs_per_request tokens each, in corpus order."""

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    target = max(16, (prompt_tokens - 50) // docs_per_request)
    need = count * docs_per_request
    texts: list[str] = []
    for doc in load_corpus(corpus):  # split document by document, only as far as needed (token counting is slow)
        texts += [p.text for p in split_passages([doc], tokens_per_passage=target, tokenizer=count_tokens)
                  if count_tokens(p.text) >= 0.8 * target]
        if len(texts) >= need:
            break
    if len(texts) < need:
        raise ValueError(f"the corpus has {len(texts)} passages of ~{target} tokens; {count} requests of "
                         f"{docs_per_request} distinct documents need {need}")
    return [(f"Question {i}: what do these documents describe?", texts[i * docs_per_request:(i + 1) * docs_per_request])
            for i in range(count)]


def measure_miss_cost(model=None, tokenizer=None, *, requests: int = 13, passes: int = 3, prompt_tokens: int = 650,
                      workdir: str | Path | None = None, dtype="auto", corpus: str | None = None,
                      dram_capacity: int | str = "2GiB", progress: bool = True) -> MissCostResult:
    """Run the same trace of requests that reuse nothing through an engine with the cache on (DRAM + SSD tiers in
    ``workdir``, defaults otherwise) and one with the cache off, interleaved request by request (ABAB.., the first
    engine alternating) so that each pair of tries is adjacent in time. After each cache-on request its SSD
    write-back is waited for (``flush_s``, not part of any TTFT) so that it never runs during a cache-off request;
    write-back that overlaps the request's own later prefill steps stays in its TTFT. Requests are sequential (each
    submitted when the previous one finished), one output token each (TTFT is the whole cost).
    """


    loaded = load_model(model, tokenizer, dtype=dtype, device="cpu")
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="pcr-miss-"))  # removed after
    reqs = miss_trace(loaded.tokenizer, 1 + passes * requests, prompt_tokens=prompt_tokens, corpus=corpus)
    warmup = reqs[0]  # warms both engines, never measured
    trace = [reqs[1 + p * requests: 1 + (p + 1) * requests] for p in range(passes)]
    on = PCREngine(model=loaded.model, tokenizer=loaded.tokenizer, config=EngineConfig(
        cache_dir=work / "on", device="cpu", max_new_tokens=1, dram_capacity=dram_capacity))
    off = PCREngine(model=loaded.model, tokenizer=loaded.tokenizer, config=EngineConfig(
        cache_dir=work / "off", enable_cache=False, device="cpu", max_new_tokens=1))
    results: dict[str, list] = {"on": [], "off": []}
    flushes = []
    try:
        on.generate(*warmup)
        off.generate(*warmup)
        on.flush()
        bar = tqdm(total=2 * passes * requests, desc="miss cost", disable=not progress, leave=False)
        for p in range(passes):
            for i, (q, docs) in enumerate(trace[p]):
                order = (("on", on), ("off", off)) if (p * requests + i) % 2 == 0 else (("off", off), ("on", on))
                for name, eng in order:
                    results[name].append(eng.generate(q, docs).metrics)
                    bar.update()
                    if name == "on":  # its write-back must not run during the cache-off request
                        t0 = time.perf_counter()
                        on.flush()
                        flushes.append(time.perf_counter() - t0)
        bar.close()
        cache_stats = on.stats().cache.as_dict()
    finally:
        on.close()
        off.close()
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    m_on, m_off = results["on"], results["off"]
    ratios = [a.ttft_s / b.ttft_s for a, b in zip(m_on, m_off)]

    def breakdown(ms) -> dict[str, float]:
        return {k: statistics.median(getattr(m, k) for m in ms) for k in ("ttft_s", "queue_s", "prefill_s",
                                                                           "load_wait_s")}

    return MissCostResult(
        requests=requests, passes=passes, prompt_tokens_mean=statistics.mean(m.prompt_tokens for m in m_on),
        computed_tokens_mean=statistics.mean(m.computed_tokens for m in m_on),
        reused_tokens_total=sum(m.reused_tokens for m in m_on),
        ttft_on_s=statistics.median(m.ttft_s for m in m_on), ttft_off_s=statistics.median(m.ttft_s for m in m_off),
        ratio_median=statistics.median(ratios), ratio_mean=statistics.mean(ratios), ratios=ratios,
        on_breakdown_s=breakdown(m_on), off_breakdown_s=breakdown(m_off), flush_s=statistics.median(flushes),
        threads=torch.get_num_threads(), cache_stats=cache_stats,
    )


def default_documents(target_tokens: int = 1536, tokenizer=None) -> list[str]:
    """Passages of the offline corpus adding up to about ``target_tokens`` tokens (whitespace estimate)."""
    passages = split_passages(load_corpus(max_docs=40), tokens_per_passage=300)
    docs, total = [], 0
    for p in passages:
        n = len(tokenizer(p.text, add_special_tokens=False)["input_ids"]) if tokenizer else len(p.text.split())
        docs.append(p.text)
        total += n
        if total >= target_tokens:
            break
    return docs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=1536, help="document prefix size (tokens)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--miss", action="store_true",
                        help="measure the miss cost instead: TTFT with the cache on / off on a trace that reuses "
                             "nothing (13 requests x 3 passes of ~650-token prompts; see --requests, --passes)")
    parser.add_argument("--requests", type=int, default=13, help="--miss: requests per pass")
    parser.add_argument("--passes", type=int, default=3, help="--miss: passes of the trace")
    parser.add_argument("--prompt-tokens", type=int, default=650, help="--miss: tokens per prompt (about)")
    parser.add_argument("--dram-capacity", default="2GiB",
                        help="--miss: the cache-on engine's DRAM tier (e.g. 32MiB: full, every new chunk evicts one)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's setting)")
    parser.add_argument("--json", metavar="PATH", help="--miss: write the result as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.miss:
        res = measure_miss_cost(args.model, requests=args.requests, passes=args.passes,
                                prompt_tokens=args.prompt_tokens, dtype=args.dtype, dram_capacity=args.dram_capacity)
        print(res.summary())
        for k, v in res.as_dict().items():
            if k not in ("ratios", "cache_stats"):
                print(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
        print("  ratios: " + " ".join(f"{r:.3f}" for r in res.ratios))
        if args.json:
            Path(args.json).write_text(json.dumps(res.as_dict(), indent=2) + "\n")
        return 0

    loaded = load_model(args.model, dtype=args.dtype)
    docs = default_documents(args.tokens, loaded.tokenizer)
    res = measure_limit_ratio(loaded.model, loaded.tokenizer, documents=docs, reps=args.reps, dtype=args.dtype)
    print(res.summary())
    for k, v in res.as_dict().items():
        print(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
    ids = loaded.tokenizer("\n\n".join(docs), add_special_tokens=False)["input_ids"]
    for cs in (256, 64):
        cost = measure_chunk_step_cost(loaded.model, ids, chunk_size=cs, reps=args.reps)
        print(f"plain transformers forward, {cost.prompt_tokens} tokens in {cs}-token steps: {cost.chunked_s:.3f} s "
              f"vs one shot {cost.one_shot_s:.3f} s (x{cost.ratio:.2f}; a reference: the engine's own prefill is "
              f"in `pcr-rag bench kernels`)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
