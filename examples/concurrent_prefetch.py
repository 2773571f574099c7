"""Concurrent queries and queue-based prefetch: KV waiting on SSD is pulled into DRAM while requests queue.

    python examples/concurrent_prefetch.py [--model ALIAS_OR_DIR]

1. A first engine answers four questions over four document sets; their KV is written back to the cache directory.
2. After a "restart" (a new engine on the same directory: DRAM empty, everything on SSD), the four requests are
   announced the way a retriever hook does (`engine.announce`) and then submitted concurrently. While request 1
   runs, the prefetcher loads the chunks of the requests behind it from SSD into DRAM, so when their turn comes
   their KV is already in memory (`prefetch_hit_chunks`).
3. The same with `prefetch=False`, for comparison: those chunks are read from SSD when each request runs.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from pcr_rag import EngineConfig, PCREngine

DATA = Path(__file__).resolve().parent / "data"
#: each question with the two files of examples/data its request carries as documents
REQUESTS = [("heapq", "collections"), ("bisect", "itertools"), ("textwrap", "json"), ("functools", "pathlib")]


def requests_for(folder: Path = DATA) -> list[tuple[str, list[str]]]:
    return [(f"What is the {name} module for?",
             [(folder / f"{n}.txt").read_text(encoding="utf-8") for n in (name, other)])
            for name, other in REQUESTS]


async def run_all(engine: PCREngine, requests) -> list:
    for query, docs in requests:  # what PCRRetrievalCallback / the LlamaIndex hook do when retrieval ends
        engine.announce(docs, query=query)
    return await asyncio.gather(*(engine.agenerate(q, documents=d) for q, d in requests))


def main(model: str | None = None, cache_dir: str | None = None) -> dict:
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="pcr-prefetch-")
    config = EngineConfig(cache_dir=cache_dir, max_new_tokens=8)
    with PCREngine(model, config=config) as engine:  # 1. warm the SSD tier
        requests = requests_for()
        for query, docs in requests:
            engine.generate(query, documents=docs)
        engine.flush()
    summary = {}
    for label, prefetch in (("prefetch on", True), ("prefetch off", False)):  # 2. and 3.
        with PCREngine(model, config=config.with_overrides(prefetch=prefetch)) as engine:
            results = asyncio.run(run_all(engine, requests))
        print(f"{label}:")
        for (query, _), r in zip(requests, results):
            m = r.metrics
            print(f"  {query:<36} TTFT {m.ttft_s:5.2f} s (queued {m.queue_s:5.2f} s) | reused: DRAM "
                  f"{m.reused_by_tier['dram']:4d}, SSD {m.reused_by_tier['ssd']:4d} | prefetched chunks "
                  f"{m.prefetch_hit_chunks}")
        summary[label] = {
            "prefetch_hit_chunks": sum(r.metrics.prefetch_hit_chunks for r in results),
            "from_ssd": sum(r.metrics.reused_by_tier["ssd"] for r in results),
            "from_dram": sum(r.metrics.reused_by_tier["dram"] for r in results),
            "answers": [r.text for r in results],
        }
    same = summary["prefetch on"]["answers"] == summary["prefetch off"]["answers"]
    print(f"answers identical with and without prefetch: {same}")
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model alias or HF directory (default model if unset)")
    parser.add_argument("--cache-dir", default=None, help="KV cache directory (default: a new temporary one)")
    args = parser.parse_args()
    main(args.model, args.cache_dir)
