"""Root manifests in the shared store (issue 47: cache identity covers the kernels): an engine writes its roots'
manifests next to its chunks, and at start counts the roots of another identity the store holds. Over the in-process
store (``memory://``) with hand-made identities that differ only in their kernels; the real-server and cluster
tests are in tests/remote/test_remote_roots.py."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest
import torch

from pcr_rag.cache import CacheConfig, CacheManager, ManualClock
from pcr_rag.cache.config import KVLayout, RemoteConfig
from pcr_rag.cache.errors import RemoteUnavailableError
from pcr_rag.cache.roots import RootCensus, RootIdentity, RootManifest, foreign_roots_note
from pcr_rag.cache.seal import Sealer
from pcr_rag.cache.tiers.remote_store import MemoryRemoteStore
from pcr_rag.cache.tiers.remote_value import (
    MANIFEST_MAGIC,
    MAX_MANIFEST_VALUE_BYTES,
    ValueCodec,
    manifest_value_name,
)

from .conftest import Chunks

SECRET = "unit-test-remote-secret"
LAYOUT = KVLayout(2, 1, 4, torch.float32)  # conftest's payload_for
NS = "pcr-rag"
X = RootIdentity(model="tiny", fingerprint="f" * 16, dtype="float32", chunk_size=4, plan="plan-a", weights="dense",
                 kernels="a1a1a1a1")
Y = dataclasses.replace(X, kernels="b2b2b2b2")  # the same model and plan computed by other kernels
RUNS = [[1] * 4, [2] * 4, [3] * 4]



def engine(store_name: str, **remote) -> CacheManager:
    remote.setdefault("secret", SECRET)
    cfg = CacheConfig(chunk_size=4, dram_bytes=1 << 20, sync_io=True,
                      remote=RemoteConfig(f"memory://{store_name}", kv_layout=LAYOUT, namespace=NS, **remote))
    return CacheManager(cfg, clock=ManualClock())


def write_under(eng: CacheManager, identity: RootIdentity, make_payload, namespace: str = "") -> list:
    """What an engine of ``identity`` does: name its root, then store a chain of chunks under it."""
    eng.remote.tier.note_root(RootManifest.new(identity, namespace, host="test host"))
    specs = Chunks(root=identity.root(namespace)).path(RUNS)
    for s in specs:
        assert eng.insert(s, make_payload(s))
    return specs


def test_a_replica_of_other_kernels_counts_the_root_reuses_nothing_and_logs_it(store_name, make_payload, caplog):
    with engine(store_name) as a:
        write_under(a, X, make_payload)
        assert a.stats().remote_io["writes"] == 3  # the manifest is no chunk write
        assert "roots_of_other_identity" not in a.stats().remote_io  # no census run: nothing claimed
    with engine(store_name) as b, caplog.at_level(logging.WARNING, logger="pcr_rag.cache.tiers.remote"):
        b.remote.tier.start_census(Y).join(10)
        io = b.stats().remote_io
        assert (io["roots_seen"], io["roots_of_other_identity"], io["roots_unreadable"]) == (1, 1, 0)
        assert io["roots_census_complete"] == 1
        assert b.acquire(Chunks(root=Y.root()).path(RUNS)).num_chunks == 0  # its own keys: none of X's
        assert b.stats().remote_io["hits"] == 0
        note = next(r.getMessage() for r in caplog.records if "namespace roots" in r.getMessage())
        assert "1 namespace roots" in note and "kernels a1a1a1a1" in note and "kernels b2b2b2b2" in note
    with engine(store_name) as c:  # X again: the root is its own kind, its chunks are reused
        assert c.remote.tier.census(X) == RootCensus(roots=1, other=0, unreadable=0)
        assert c.acquire(Chunks(root=X.root()).path(RUNS)).num_chunks == 3
        assert c.stats().remote_io["roots_of_other_identity"] == 0


def test_other_namespaces_of_the_same_identity_are_not_counted(store_name, make_payload):
    with engine(store_name) as a:
        write_under(a, X, make_payload)
        write_under(a, X, make_payload, namespace="tenant-2")
        write_under(a, Y, make_payload)
        census = a.remote.tier.census(X)
        assert (census.roots, census.other) == (3, 1) and census.differences == ("kernels b2b2b2b2",)


def test_the_manifest_is_sealed_written_with_the_first_chunk_and_once(store_name, make_payload):
    store = MemoryRemoteStore.named(store_name)
    name = manifest_value_name(NS, X.root())
    with engine(store_name) as a:
        a.remote.tier.note_root(RootManifest.new(X, host="h"))
        assert name not in store.values  # naming a root does no I/O (it happens on a request's path)
        specs = write_under(a, X, make_payload)
        value = store.values[name]
        assert value.startswith(MANIFEST_MAGIC) and a.remote.tier.codec.decode_manifest(value, X.root()).identity == X
        other_secret = ValueCodec(Sealer("another-replicas-secret", "remote"), LAYOUT)
        with pytest.raises(Exception, match="MAC"):
            other_secret.decode_manifest(value, X.root())
        store.delete(name)
        a.insert(Chunks(root=X.root()).child(specs[-1], [4] * 4), make_payload(specs[0]))
        assert name not in store.values  # once per root (no TTL: nothing to refresh)


def test_with_a_ttl_the_manifest_is_written_again_after_half_of_it(store_name, make_payload):
    store = MemoryRemoteStore.named(store_name)
    name = manifest_value_name(NS, X.root())
    with engine(store_name, ttl_s=0.2) as a:
        specs = write_under(a, X, make_payload)
        store.delete(name)  # the store expired it
        chunks = Chunks(root=X.root())
        a.insert(chunks.child(specs[-1], [4] * 4), make_payload(specs[0]))
        assert name not in store.values  # written 0 s ago: not yet due
        time.sleep(0.12)
        a.insert(chunks.child(specs[-1], [5] * 4), make_payload(specs[0]))
        assert name in store.values


def test_unreadable_manifests_are_counted_left_alone_and_never_raise(store_name):
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name) as a:
        codec = a.remote.tier.codec
        sealer = codec.sealer
        good = RootManifest.new(X, host="h")
        store.values[manifest_value_name(NS, good.root)] = codec.encode_manifest(good)

        def root(ns: str) -> bytes:
            return X.root(ns)

        signed = MANIFEST_MAGIC + b"\x01" + RootManifest.new(X, "big", host="h").encode() + b" " * 70_000
        bad = {
            # correctly sealed, but longer than any manifest: read no further than the bound
            manifest_value_name(NS, root("big")): signed + sealer.sign_header(root("big"), signed),
            manifest_value_name(NS, root("junk")): b"x" * (10 * MAX_MANIFEST_VALUE_BYTES),
            manifest_value_name(NS, root("json")): (lambda s: s + sealer.sign_header(root("json"), s))(
                MANIFEST_MAGIC + b"\x01{not json"),
            # another root's manifest moved here: its MAC binds its own root
            manifest_value_name(NS, root("moved")): codec.encode_manifest(RootManifest.new(X, "t3", host="h")),
            manifest_value_name(NS, root("plain")): ValueCodec(None, LAYOUT).encode_manifest(
                RootManifest.new(X, "plain", host="h")),  # written without the secret
            manifest_value_name(NS, root("other")): ValueCodec(Sealer("another-replicas-secret", "remote"),
                                                               LAYOUT).encode_manifest(
                RootManifest.new(Y, "other", host="h")),
            f"{NS}:root:not-a-root": b"anything",
        }
        store.values.update(bad)
        census = a.remote.tier.census(Y)
        assert (census.roots, census.other, census.unreadable, census.complete) == (1, 1, 7, True)
        assert all(store.values.get(n) == v for n, v in bad.items())  # counted, never deleted
        note = foreign_roots_note(census, Y, "memory://x")
        assert note is not None and "7 unreadable root manifests" in note


def test_a_store_that_is_down_never_fails_the_census_thread_or_the_engine(store_name, make_payload, caplog):
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name) as a:
        store.down = True
        with pytest.raises(RemoteUnavailableError):
            a.remote.tier.census(X)
        with caplog.at_level(logging.INFO, logger="pcr_rag.cache.tiers.remote"):
            a.remote.tier.start_census(X).join(10)
        assert any("could not read the root manifests" in r.getMessage() for r in caplog.records)
        assert a.remote.tier.roots is None and "roots_seen" not in a.stats().remote_io
        store.down = False
        a.remote.client.breaker.success()  # the failures above opened it; the store answers again
        write_under(a, Y, make_payload)
        assert a.remote.tier.census(X).other == 1


def test_the_census_is_bounded(store_name, monkeypatch):
    from pcr_rag.cache.tiers import remote

    store = MemoryRemoteStore.named(store_name)
    monkeypatch.setattr(remote, "MAX_CENSUS_ROOTS", 3)
    with engine(store_name) as a:
        for i in range(5):
            m = RootManifest.new(Y, f"t{i}", host="h")
            store.values[manifest_value_name(NS, m.root)] = a.remote.tier.codec.encode_manifest(m)
        census = a.remote.tier.census(X)
        assert (census.roots, census.other, census.complete) == (3, 3, False)
        assert "at least" in foreign_roots_note(census, X, "memory://x")
