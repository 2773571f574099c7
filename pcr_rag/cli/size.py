"""`pcr-rag size`: KV bytes per token, chunk and document for a model (from its config, no weights loaded), and the
DRAM/SSD that serve a target hit rate over a Zipf-popular corpus (`pcr_rag.cli.sizing`).

    pcr-rag size --model smollm2-135m-instruct --documents 100000 --tokens-per-doc 800 --zipf 1.0 --hit-rate 0.9
    pcr-rag size --model Qwen/Qwen2.5-7B-Instruct --allow-download --documents 1000000 --tokens-per-doc 500 --json
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from pcr_rag.cli.sizing import HIT_RATES, SizingError, kv_size, model_config, need_for_hit_rate
from pcr_rag.config import EngineConfig
from pcr_rag.errors import PCRError
from pcr_rag.units import format_bytes

DEFAULTS = EngineConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="known alias, local model directory, .gguf file or Hugging Face repo id (default: the "
                             "default model); only its config is read")
    parser.add_argument("--documents", type=int, required=True, help="documents in the corpus")
    parser.add_argument("--tokens-per-doc", type=int, required=True, help="mean tokens per document")
    parser.add_argument("--zipf", type=float, default=1.0,
                        help="Zipf exponent of document popularity (P(rank r) ~ r^-s; 0 = uniform; default 1.0)")
    parser.add_argument("--hit-rate", type=float, default=0.9,
                        help="target fraction of document reads served from the cache (default 0.9)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULTS.chunk_size,
                        help=f"tokens per cached chunk (default {DEFAULTS.chunk_size}, as the engine)")
    parser.add_argument("--dtype", default="auto",
                        help="KV dtype: auto (as the engine: bfloat16 on CUDA and CPUs with native bf16, else "
                             "float32), float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="the device the engine would run on (for --dtype auto)")
    parser.add_argument("--model-cache-dir", default=None, help="where converted GGUF models live")
    parser.add_argument("--allow-download", action="store_true",
                        help="fetch a Hugging Face repo's config.json (no weights) when it is not cached")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def report(args: argparse.Namespace) -> dict[str, Any]:
    """The figures `run` prints, as plain numbers (bytes, documents, fractions)."""
    if args.tokens_per_doc < 1:
        raise SizingError(f"--tokens-per-doc must be >= 1, got {args.tokens_per_doc}")
    if args.chunk_size < 1:
        raise SizingError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    config, name = model_config(args.model, model_cache_dir=args.model_cache_dir, allow_download=args.allow_download)
    kv = kv_size(config, args.dtype, args.device)
    per_token = kv.bytes_per_token
    per_doc = per_token * args.tokens_per_doc
    rates = sorted({*HIT_RATES, args.hit_rate})
    needs = [need_for_hit_rate(args.documents, args.zipf, h, per_doc) for h in rates]
    target = next(n for n in needs if n.hit_rate == args.hit_rate)
    return {
        "model": name,
        "kv": {"layers": kv.num_layers, "kv_heads": kv.num_kv_heads, "head_dim": kv.head_dim,
               "dtype": str(kv.dtype).removeprefix("torch."), "dtype_bytes": kv.dtype.itemsize},
        "bytes_per_token": per_token,
        "chunk_size": args.chunk_size,
        "bytes_per_chunk": per_token * args.chunk_size,
        "chunks_per_document": math.ceil(args.tokens_per_doc / args.chunk_size),
        "bytes_per_document": per_doc,
        "documents": args.documents,
        "corpus_bytes": per_doc * args.documents,
        "zipf": args.zipf,
        "hit_rate": args.hit_rate,
        "capacity": [{"hit_rate": n.hit_rate, "lru_documents": n.lru_documents, "lru_bytes": n.lru_bytes,
                      "ideal_documents": n.ideal_documents, "ideal_bytes": n.ideal_bytes} for n in needs],
        "target": {"dram_bytes": target.lru_bytes, "ssd_bytes": target.lru_bytes,
                   "documents": target.lru_documents},
    }


def _text(r: dict[str, Any]) -> str:
    kv = r["kv"]
    lines = [
        f"model {r['model']}: {kv['layers']} layers x {kv['kv_heads']} KV heads x {kv['head_dim']} head dim, "
        f"KV in {kv['dtype']} ({kv['dtype_bytes']} B)",
        f"KV per token:     {r['bytes_per_token']:,} B ({format_bytes(r['bytes_per_token'])})",
        f"KV per chunk:     {format_bytes(r['bytes_per_chunk'])} ({r['chunk_size']} tokens)",
        f"KV per document:  {format_bytes(r['bytes_per_document'])} ({r['chunks_per_document']} chunks)",
        f"whole corpus:     {format_bytes(r['corpus_bytes'])} ({r['documents']:,} documents)",
        "",
        f"cache capacity for a hit rate (document reads served from cache; Zipf {r['zipf']:g} popularity):",
        f"  {'hit rate':>8}  {'LRU: documents':>15}  {'capacity':>10}  {'best case: documents':>21}  {'capacity':>10}",
    ]
    for row in r["capacity"]:
        mark = "  <- target" if row["hit_rate"] == r["hit_rate"] else ""
        lines.append(f"  {row['hit_rate']:>8.0%}  {row['lru_documents']:>15,}  {format_bytes(row['lru_bytes']):>10}  "
                     f"{row['ideal_documents']:>21,}  {format_bytes(row['ideal_bytes']):>10}{mark}")
    t = r["target"]
    lines += [
        "",
        f"for {r['hit_rate']:.0%} of reads from memory: dram_capacity >= {format_bytes(t['dram_bytes'])}; for "
        f"{r['hit_rate']:.0%} from memory or SSD: ssd_capacity >= {format_bytes(t['ssd_bytes'])} (DRAM then holds "
        f"the hottest part: read the table for what a smaller DRAM serves)",
        "LRU figures: Che's approximation; best case: the most popular documents pinned. A document's KV counts as "
        "one unit (see docs/sizing.md for top-k prompts).",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        r = report(args)
    except (PCRError, ValueError, OSError) as exc:
        print(f"pcr-rag size: {exc}")
        return 2
    print(json.dumps(r, indent=2) if args.json else _text(r))
    return 0
