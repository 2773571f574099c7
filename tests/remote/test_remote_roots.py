"""Root manifests in a real Valkey and a Valkey Cluster (tests/remote/conftest.py): replicas write their roots'
manifests next to their chunks and, at start, count the roots of another identity the store holds (in
``stats().cache.remote_io`` and ``pcr:remote_roots_of_other_identity``) without ever serving their chunks; the
census reads values only up to a manifest's bound, walks every primary of a cluster, and a dead shard leaves it
incomplete, not failed. (Over the in-process store: tests/cache/test_remote_roots.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache.config import KVLayout, RemoteConfig
from pcr_rag.cache.roots import RootIdentity, RootManifest
from pcr_rag.cache.tiers.remote import open_remote_tier
from pcr_rag.cache.tiers.remote_store import RedisStore
from pcr_rag.cache.tiers.remote_value import manifest_value_name
from pcr_rag.server.metrics import ServerMetrics
from pcr_rag.testing import tiny_model

from .conftest import SECRET, wait_for

NS = "pcr-rag"
DOC = "The rivers of the world are studied by many scientists, who measure and map them each year. " * 3
QUESTION = "What do we know about rivers?"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2, dtype=torch.float32)


def make_engine(model, cache_dir: Path, url: str) -> PCREngine:
    model, tok = model
    cfg = EngineConfig(cache_dir=cache_dir, chunk_size=16, max_new_tokens=4, device="cpu", dtype="float32",
                       dram_capacity="64MiB", ssd_capacity="64MiB", remote_url=url, load_planner="always-load",
                       prefetch=False)
    return PCREngine(model=model, tokenizer=tok, config=cfg)


def census_of(eng: PCREngine) -> dict:
    """The engine's remote counters once its start-up census has run (a background thread)."""
    wait_for("the start-up census of the store's root manifests", lambda: eng.cache.remote.tier.roots is not None)
    return eng.stats().cache.remote_io


def test_replicas_count_the_roots_of_other_identities_and_share_only_their_own(valkey, tiny, tmp_path):
    with make_engine(tiny, tmp_path / "a", valkey.url) as a:
        assert census_of(a)["roots_seen"] == 0
        a.generate(QUESTION, [DOC])
        a.flush(timeout=30)
        root_a = a.root_key
    assert valkey.client().exists(manifest_value_name(NS, root_a))  # written with A's first chunk
    other = tiny_model("llama", num_layers=2, dtype=torch.float32, seed=1)  # another model: another identity
    with make_engine(other, tmp_path / "b", valkey.url) as b:
        io = census_of(b)
        assert (io["roots_seen"], io["roots_of_other_identity"], io["roots_unreadable"]) == (1, 1, 0)
        scraped = ServerMetrics("tiny", b.stats).render().decode()  # what /metrics serves
        assert 'pcr:remote_roots_of_other_identity{model_name="tiny"} 1.0' in scraped
        res = b.generate(QUESTION, [DOC])
        assert res.metrics.reused_tokens == 0 and b.stats().cache.remote_io["hits"] == 0
        b.flush(timeout=30)
    # a value under a manifest name that is far too long: read up to the bound only, counted, left alone
    junk = manifest_value_name(NS, bytes(16))
    valkey.client().set(junk, b"x" * 300_000)
    with make_engine(tiny, tmp_path / "c", valkey.url) as c:  # A's identity again
        io = census_of(c)
        assert (io["roots_seen"], io["roots_of_other_identity"], io["roots_unreadable"]) == (2, 1, 1)
        assert io["bytes_read"] == 0  # manifests are no chunk reads (nor read-speed samples)
        res = c.generate(QUESTION, [DOC])
        assert res.metrics.reused_by_tier["remote"] > 0  # A's chunks, from the store
    assert valkey.client().strlen(junk) == 300_000


def test_the_scan_is_bounded_in_round_trips(valkey):
    store = RedisStore(RemoteConfig(valkey.url, secret=SECRET))
    try:
        pipe = valkey.client().pipeline(transaction=False)
        for i in range(3000):
            pipe.set(f"{NS}:filler{i}", b"v")
        for i in range(3):
            pipe.set(f"{NS}:root:{i:032x}", b"m")
        pipe.execute()
        names, complete = store.scan(f"{NS}:root:", 100, 1000)
        assert sorted(names) == [f"{NS}:root:{i:032x}" for i in range(3)] and complete
        assert store.scan(f"{NS}:root:", 100, 1)[1] is False  # one SCAN of ~1000 of 3003 keys
        names, complete = store.scan(f"{NS}:root:", 2, 1000)  # more names than asked for
        assert len(names) == 2 and not complete
        assert store.scan("pcr-[rag]*:root:", 100, 1000) == ([], True)  # glob characters are matched literally
    finally:
        store.close()


def test_the_census_walks_every_primary_of_a_cluster_and_a_dead_one_leaves_it_incomplete(valkey_cluster):
    cluster = valkey_cluster
    x = RootIdentity("tiny", "f" * 16, "float32", 16, "plan-a", "dense", kernels="a1a1")
    y = dataclasses.replace(x, kernels="b2b2")
    tier = open_remote_tier(RemoteConfig(cluster.url(), secret=SECRET, kv_layout=KVLayout(2, 2, 64, torch.float32),
                                         timeout_s=0.5, connect_timeout_s=0.25))
    try:
        manifests = [RootManifest.new(y if i % 4 else x, f"tenant-{i}", host="h") for i in range(16)]
        names = [manifest_value_name(NS, m.root) for m in manifests]
        for m, name in zip(manifests, names, strict=True):
            assert tier.client.write_meta(name, tier.codec.encode_manifest(m), 0)
        census = tier.census(x)
        assert (census.roots, census.other, census.unreadable, census.complete) == (16, 12, 0, True)
        on = [tier.client.store.node_of(n) for n in names]
        dead = cluster.node_name(2)  # primary 2: no replica
        assert len(set(on)) == 3 and dead in on
        cluster.primaries[2].kill()
        census = tier.census(x)  # the other primaries still answer
        alive = [m for m, node in zip(manifests, on, strict=True) if node != dead]
        assert census.complete is False and census.roots == len(alive)
        assert census.other == sum(1 for m in alive if m.identity == y)
    finally:
        tier.close()
