"""`pcr-rag cache-bench`: micro-benchmarks of the cache engine (prints measured figures; not a test).

1. ``match`` latency for an 8k-token prompt (32 chunks of 256 tokens) on a tree of ``--nodes`` chunks (default 1M,
   metadata-only payloads), and the engine's memory per million nodes (RSS delta while building the tree).
2. SSD store write and read throughput for realistic chunks (256 tokens x SmolLM2-135M bf16 = 30 layers x 2 x 3
   kv heads x 256 x 64 x 2 bytes = 5.9 MB), as a ratio to ``dd`` on the same directory in the same run
   (``oflag=direct`` / ``iflag=direct``; ``conv=fdatasync`` and a page-cache drop where O_DIRECT is unsupported).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pcr_rag.bench.disk import drop_page_cache
from pcr_rag.cache import (
    CacheConfig,
    CacheManager,
    ChunkSpec,
    LocalDirBackend,
    ManualClock,
    VirtualPayload,
    chunk_key,
    namespace_key,
)
from pcr_rag.cache.tiers.chunk_file import ChunkMeta
from pcr_rag.cache.tiers.ssd_store import SSDStore
from pcr_rag.metrics import percentile
from pcr_rag.units import format_bytes

# SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, bf16
SMOLLM2_SHAPE = (30, 2, 3, 256, 64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=1_000_000, help="chunks in the tree for the match benchmark")
    parser.add_argument("--prompt-chunks", type=int, default=32, help="chunks per prompt (32 x 256 = 8k tokens)")
    parser.add_argument("--match-iters", type=int, default=2000, help="timed match calls")
    parser.add_argument("--ssd-dir", type=Path, default=Path(".pcr-cache/bench"), help="directory on the disk to test")
    parser.add_argument("--ssd-chunks", type=int, default=16, help="5.9 MB chunks written and read per round")
    parser.add_argument("--rounds", type=int, default=9, help="paired store/dd rounds (medians are reported)")
    parser.add_argument("--skip-match", action="store_true")
    parser.add_argument("--skip-ssd", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_match(nodes: int, prompt_chunks: int, iters: int) -> dict[str, float]:
    root = namespace_key("cache-bench", "bfloat16", 256)
    cfg = CacheConfig(chunk_size=256, dram_bytes=1 << 60, sync_io=True, pin_memory=False)
    payload = VirtualPayload(5_898_240, 30)
    gc.collect()
    rss0 = _rss()
    t0 = time.perf_counter()
    engine = CacheManager(cfg, clock=ManualClock())
    prompts = max(1, nodes // prompt_chunks)
    last_keys: list[bytes] = []
    for p in range(prompts):
        parent = root
        keys = []
        for c in range(prompt_chunks):
            key = chunk_key(parent, (p, c))
            engine.insert(ChunkSpec(key, parent, c * 256, (c + 1) * 256, 0, False), payload)
            keys.append(key)
            parent = key
        last_keys = keys
    build_s = time.perf_counter() - t0
    gc.collect()
    built = len(engine)
    rss_delta = _rss() - rss0
    probe = last_keys
    assert engine.match(probe).num_chunks == prompt_chunks
    for _ in range(100):  # warm-up
        engine.match(probe)
    lat: list[float] = []
    for _ in range(iters):
        t = time.perf_counter_ns()
        engine.match(probe)
        lat.append((time.perf_counter_ns() - t) / 1e3)
    acq: list[float] = []
    for _ in range(iters):
        t = time.perf_counter_ns()
        engine.acquire(probe).release()
        acq.append((time.perf_counter_ns() - t) / 1e3)
    engine.close()
    return {
        "nodes": built,
        "build_s": build_s,
        "insert_us_per_node": build_s / built * 1e6,
        "match_p50_us": statistics.median(lat),
        "match_p99_us": percentile(lat, 99),
        "acquire_release_p50_us": statistics.median(acq),
        "rss_delta_bytes": rss_delta,
        "bytes_per_node": rss_delta / built,
        "mib_per_million_nodes": rss_delta / built * 1e6 / 2**20,
    }


def _dd(args: list[str]) -> tuple[float, str]:
    """Run dd; return (seconds, stderr). Raises CalledProcessError on failure."""
    t0 = time.perf_counter()
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    m = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    return (float(m.group(1)) if m else wall), proc.stderr.strip().splitlines()[-1]


def bench_dd(directory: Path, chunk_bytes: int, count: int) -> dict[str, object]:
    target = directory / "dd.bin"
    try:
        write_s, write_line = _dd([f"of={target}", "if=/dev/zero", f"bs={chunk_bytes}", f"count={count}", "oflag=direct"])
        write_mode = "oflag=direct"
    except subprocess.CalledProcessError:
        write_s, write_line = _dd(
            [f"of={target}", "if=/dev/zero", f"bs={chunk_bytes}", f"count={count}", "conv=fdatasync"]
        )
        write_mode = "conv=fdatasync"
    drop_page_cache(target)
    try:
        read_s, read_line = _dd([f"if={target}", "of=/dev/null", f"bs={chunk_bytes}", "iflag=direct"])
        read_mode = "iflag=direct"
    except subprocess.CalledProcessError:
        drop_page_cache(target)
        read_s, read_line = _dd([f"if={target}", "of=/dev/null", f"bs={chunk_bytes}"])
        read_mode = "page cache dropped"
    target.unlink()
    total = chunk_bytes * count
    return {
        "write_mb_s": total / write_s / 1e6,
        "read_mb_s": total / read_s / 1e6,
        "write_mode": write_mode,
        "read_mode": read_mode,
        "write_line": write_line,
        "read_line": read_line,
    }


def _smollm2_payload() -> torch.Tensor:
    return torch.randn(SMOLLM2_SHAPE).to(torch.bfloat16)


def _store_round(store_dir: Path, count: int, payload: torch.Tensor, fsync: bool) -> dict[str, float]:
    """One round on a fresh store: write ``count`` chunks, read them whole into fresh memory and into a reused
    buffer (every layer verified either way). MB/s of payload bytes."""
    shutil.rmtree(store_dir, ignore_errors=True)
    store = SSDStore(LocalDirBackend(store_dir, fsync=fsync, drop_page_cache=True))
    root = namespace_key("cache-bench", "bfloat16", 256)
    metas = []
    parent = root
    for i in range(count):
        key = chunk_key(parent, (i,))
        metas.append(ChunkMeta(key, parent, i == 0, 256, False, b"\x00" * 16))
        parent = key
    t0 = time.perf_counter()
    for m in metas:
        store.write(m, payload)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for m in metas:  # into fresh memory, as a load into the DRAM tier does
        out = store.read(m.key)
    read_s = time.perf_counter() - t0
    if not torch.equal(out.view(torch.uint8), payload.view(torch.uint8)):
        raise AssertionError("SSD store round trip is not byte-exact")
    t0 = time.perf_counter()
    for m in metas:  # into one reused buffer (a buffer pool; dd reuses its buffer too)
        store.read(m.key, out=out)
    reuse_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for m in metas[:4]:
        for layer in range(SMOLLM2_SHAPE[0]):
            store.read_layer(m.key, layer)
    layer_s = time.perf_counter() - t0
    total = payload.nbytes * count
    return {
        "write_mb_s": total / write_s / 1e6,
        "read_mb_s": total / read_s / 1e6,
        "read_reuse_mb_s": total / reuse_s / 1e6,
        "read_layer_mb_s": payload.nbytes * 4 / layer_s / 1e6,
    }


def bench_ssd(directory: Path, count: int, rounds: int) -> dict[str, object]:
    """Paired rounds: each round measures the store and ``dd`` back to back on the same directory, so a shared or
    virtual disk's drifting speed hits both alike; the figures are medians over rounds of throughputs and of the
    per-round ratios."""
    directory.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cache-bench-", dir=directory))
    payload = _smollm2_payload()
    chunk_bytes = payload.nbytes
    store_rounds, dd_rounds, synced = [], [], []
    try:
        for r in range(rounds):
            if r % 2 == 0:
                store_rounds.append(_store_round(work / "store", count, payload, fsync=False))
                dd_rounds.append(bench_dd(work, chunk_bytes, count))
            else:
                dd_rounds.append(bench_dd(work, chunk_bytes, count))
                store_rounds.append(_store_round(work / "store", count, payload, fsync=False))
            synced.append(_store_round(work / "store", max(2, count // 4), payload, fsync=True)["write_mb_s"])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(rows: list, key: str) -> float:
        return statistics.median(float(row[key]) for row in rows)

    def ratio(key: str, dd_key: str) -> float:
        return statistics.median(float(s[key]) / float(d[dd_key]) for s, d in zip(store_rounds, dd_rounds, strict=True))

    return {
        "directory": str(directory.resolve()),
        "chunk_bytes": chunk_bytes,
        "chunks_per_round": count,
        "rounds": rounds,
        "store": {k: med(store_rounds, k) for k in store_rounds[0]},
        "store_fsync_write_mb_s": statistics.median(synced),
        "dd": {
            "write_mb_s": med(dd_rounds, "write_mb_s"),
            "read_mb_s": med(dd_rounds, "read_mb_s"),
            "write_mode": dd_rounds[0]["write_mode"],
            "read_mode": dd_rounds[0]["read_mode"],
        },
        "write_ratio": ratio("write_mb_s", "write_mb_s"),
        "read_ratio": ratio("read_mb_s", "read_mb_s"),
        "read_reuse_ratio": ratio("read_reuse_mb_s", "read_mb_s"),
        "store_rounds": store_rounds,
        "dd_rounds": dd_rounds,
    }


def run(args: argparse.Namespace) -> int:
    results: dict[str, object] = {}
    if not args.skip_match:
        print(f"match: building a tree of {args.nodes:,} chunks (metadata-only payloads) ...", flush=True)
        m = bench_match(args.nodes, args.prompt_chunks, args.match_iters)
        results["match"] = m
        print(
            f"  built {m['nodes']:,} nodes in {m['build_s']:.1f} s ({m['insert_us_per_node']:.1f} us/insert)\n"
            f"  match of {args.prompt_chunks} chunks: p50 {m['match_p50_us']:.1f} us, p99 {m['match_p99_us']:.1f} us;"
            f" acquire+release p50 {m['acquire_release_p50_us']:.1f} us\n"
            f"  memory: {m['bytes_per_node']:.0f} B/node = {m['mib_per_million_nodes']:.0f} MiB per million nodes"
            f" (RSS delta {format_bytes(m['rss_delta_bytes'])})",
            flush=True,
        )
    if not args.skip_ssd:
        print(f"ssd: {args.rounds} paired rounds of {args.ssd_chunks} x 5.9 MB chunks in {args.ssd_dir} ...", flush=True)
        s = bench_ssd(args.ssd_dir, args.ssd_chunks, args.rounds)
        results["ssd"] = s
        st, dd = s["store"], s["dd"]
        print(
            f"  store write {st['write_mb_s']:.0f} MB/s (default, no fdatasync) vs dd {dd['write_mb_s']:.0f} MB/s"
            f" ({dd['write_mode']}): ratio {s['write_ratio']:.2f}; with fsync=True"
            f" {s['store_fsync_write_mb_s']:.0f} MB/s\n"
            f"  store read  {st['read_mb_s']:.0f} MB/s into fresh memory, {st['read_reuse_mb_s']:.0f} MB/s into a"
            f" reused buffer (every layer verified, no page cache) vs dd {dd['read_mb_s']:.0f} MB/s"
            f" ({dd['read_mode']}): ratio {s['read_ratio']:.2f} / {s['read_reuse_ratio']:.2f}\n"
            f"  read_layer (1/30 of a chunk, verified) {st['read_layer_mb_s']:.0f} MB/s"
            f" (medians over rounds; ratios are medians of per-round ratios)",
            flush=True,
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0
