"""One replica in its own OS process (run by tests/remote/test_replicas_share_store.py, not collected by pytest).

    python replica.py REQUESTS_JSON OUT_PT --cache-dir DIR [--url URL] [--prefetch]

Builds a `PCREngine` on the tiny test model (same weights in every process) with its own cache directory and,
with ``--url``, the remote tier; answers every request of REQUESTS_JSON ([[question, [documents...]], ...]) in
order, flushes its writes, and saves answers, reuse and stats to OUT_PT (``torch.save``).
"""

from __future__ import annotations

import argparse
import json

import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.testing import tiny_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("requests")
    p.add_argument("out")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--url")
    p.add_argument("--prefetch", action="store_true")
    args = p.parse_args()
    with open(args.requests) as f:
        requests = json.load(f)
    model, tok = tiny_model("llama", num_layers=2, dtype=torch.float32)
    cfg = EngineConfig(cache_dir=args.cache_dir, chunk_size=16, dram_capacity="64MiB", ssd_capacity="64MiB",
                       max_new_tokens=6, device="cpu", dtype="float32", prefetch=args.prefetch,
                       remote_url=args.url, remote_timeout_s=2.0)
    with PCREngine(model=model, tokenizer=tok, config=cfg) as eng:
        results = [eng.generate(q, docs) for q, docs in requests]
        eng.flush(timeout=30)
        stats = eng.stats()
        torch.save({
            "token_ids": [r.token_ids for r in results],
            "logits": [r.first_token_logits for r in results],
            "reused_by_tier": [dict(r.metrics.reused_by_tier) for r in results],
            "remote_io": dict(stats.cache.remote_io),
            "hit_chunks": dict(stats.cache.hit_chunks),
            "prometheus": stats.prometheus(),
        }, args.out)


if __name__ == "__main__":
    main()
