"""`pcr-rag generate`: answer one question over documents (files or inline text), printing timing and reuse."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("query", help="the question")
    parser.add_argument("documents", nargs="*", help="document files (or inline text with --inline)")
    parser.add_argument("--inline", action="store_true", help="treat DOCUMENTS as text, not file paths")
    parser.add_argument("--model", default=None, help="alias, local HF dir (default: smollm2-135m-instruct)")
    parser.add_argument("--cache-dir", default=None, help="SSD tier directory (default: ~/.cache/pcr-rag/kv)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--dram", default="2GiB", help="DRAM tier capacity (e.g. 2GiB)")
    parser.add_argument("--ssd", default="16GiB", help="SSD tier capacity (e.g. 16GiB; 0 disables)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-cache", action="store_true", help="plain prefill, no reuse")
    parser.add_argument("--repeat", type=int, default=1, help="ask N times (the 2nd+ reuse the cache)")
    parser.add_argument("--json", action="store_true", help="print metrics as JSON")


def run(args: argparse.Namespace) -> int:
    docs = list(args.documents) if args.inline else [Path(p).read_text(encoding="utf-8") for p in args.documents]
    cfg = EngineConfig(cache_dir=args.cache_dir, chunk_size=args.chunk_size, dram_capacity=args.dram,
                       ssd_capacity=args.ssd, enable_cache=not args.no_cache, max_new_tokens=args.max_new_tokens)
    with PCREngine(model=args.model, config=cfg) as engine:
        for i in range(args.repeat):
            stream = engine.stream(args.query, docs)
            for chunk in stream:
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            result = stream.result()
            m = result.metrics
            if args.json:
                print(json.dumps({"run": i, "text": result.text, **m.as_dict()}))
            else:
                print(f"\n[run {i}] TTFT {m.ttft_s * 1000:.0f} ms, E2E {m.e2e_s:.2f} s, prompt {m.prompt_tokens} "
                      f"tokens: computed {m.computed_tokens}, reused {m.reused_by_tier}")
    return 0
