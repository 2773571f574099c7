"""`pcr-rag cache info --remote-url`: the root manifests a real Valkey holds (tests/remote/conftest.py), per root
its identity and host, this engine's marked, values that are no readable manifest counted and left alone; the URL's
password never printed; a store that is down is one line on stderr and status 1."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache.config import RemoteConfig
from pcr_rag.cache.roots import RootIdentity, RootManifest, host_description
from pcr_rag.cache.tiers.remote import open_remote_tier
from pcr_rag.cache.tiers.remote_value import manifest_value_name
from pcr_rag.cli import main
from pcr_rag.testing import save_tiny_model

from .conftest import SECRET, _free_port

NS = "pcr-rag"
DOC = "The rivers of the world are studied by many scientists, who measure and map them each year. " * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("cacheinfo") / "model", "llama")


def _flags(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32", "--device", "cpu", "--chunk-size", "16"]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["cache", "info", *argv])
    got = capsys.readouterr()
    return code, got.out, got.err


def _private(path: Path, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return str(path)


def _write_root(model_dir: Path, cache_dir: Path, url: str):
    """An engine on the tiny model writes its root's manifest (with its first chunk) to the store; its identity
    and root."""
    config = EngineConfig(cache_dir=cache_dir, chunk_size=16, max_new_tokens=2, device="cpu", dtype="float32",
                          dram_capacity="16MiB", ssd_capacity="16MiB", remote_url=url, load_planner="always-load",
                          prefetch=False)
    with PCREngine(model=str(model_dir), config=config) as eng:
        eng.generate("What do we know about rivers?", [DOC])
        eng.flush(timeout=30)
        return eng.identity, eng.root_key


def test_info_lists_the_stores_roots_marks_this_engines_and_counts_unreadable_ones(valkey, model_dir, tmp_path,
                                                                                   capsys):
    identity, root = _write_root(model_dir, tmp_path / "kv", valkey.url)
    other = dataclasses.replace(identity, kernels="b2" * 8)  # a replica whose kernels round otherwise
    foreign = RootManifest.new(other, host="another host (avx2), 4 threads, torch 2.x")
    forged = RootManifest.new(dataclasses.replace(identity, chunk_size=32), host="h")
    tier = open_remote_tier(RemoteConfig(valkey.url, secret=SECRET))
    liar = open_remote_tier(RemoteConfig(valkey.url, secret="another-secret-of-16+chars"))
    try:
        assert tier.client.write_meta(manifest_value_name(NS, foreign.root), tier.codec.encode_manifest(foreign), 0)
        assert liar.client.write_meta(manifest_value_name(NS, forged.root), liar.codec.encode_manifest(forged), 0)
    finally:
        tier.close()
        liar.close()
    junk = manifest_value_name(NS, bytes(16))
    valkey.client().set(junk, b"not a manifest")

    code, out, _ = _cli(capsys, "--remote-url", valkey.url, "--json", *_flags(model_dir))
    assert code == 0
    remote = json.loads(out)["remote"]
    assert (remote["identities"], remote["unreadable"], remote["complete"]) == (2, 2, True)  # junk, bad MAC
    roots = {r["root"]: r for r in remote["roots"]}
    assert set(roots) == {root.hex(), foreign.root.hex()}
    ours, theirs = roots[root.hex()], roots[foreign.root.hex()]
    assert ours["identity"]["kernels"] == identity.kernels != "" and ours["identity"]["model"] == identity.model
    assert ours["identity"]["plan"] == identity.plan and ours["identity"]["fingerprint"] == identity.fingerprint
    assert ours["current"] is True and theirs["current"] is False
    assert ours["this_host"] is True and ours["host"] == host_description()
    assert theirs["this_host"] is False and theirs["identity"]["kernels"] == "b2" * 8
    assert "cache_dir" not in json.loads(out)  # no --cache-dir: the store only

    code, text, _ = _cli(capsys, "--remote-url", valkey.url, "--no-engine")
    assert code == 0
    assert "2 root manifests of 2 identities" in text and "unreadable root manifests: 2" in text
    lines = text.splitlines()
    ours_line = next(line for line in lines if f"kernels {identity.kernels}" in line)
    assert ours_line.startswith(" ") and f"model {identity.model}" in ours_line  # no engine: nothing marked
    assert any(f"root {root.hex()}" in line and "(this host)" in line for line in lines)
    assert any(f"root {foreign.root.hex()}" in line and "another host (avx2)" in line for line in lines)
    assert valkey.client().get(junk) == b"not a manifest"  # counted, never deleted


def test_the_password_never_shows_and_a_dead_store_is_one_line_and_status_1(valkey_with_password, tmp_path,
                                                                           monkeypatch, capsys, caplog):
    server = valkey_with_password
    monkeypatch.delenv("PCR_RAG_REMOTE_SECRET")
    secret_file = _private(tmp_path / "secret", SECRET)
    url_file = _private(tmp_path / "url", server.url)
    tier = open_remote_tier(RemoteConfig(server.url, secret=SECRET))
    try:
        manifest = RootManifest.new(RootIdentity("tiny", "f" * 16, "float32", 16, "plan-a", "dense", "c3" * 8),
                                    host="h")
        assert tier.client.write_meta(manifest_value_name(NS, manifest.root), tier.codec.encode_manifest(manifest), 0)
    finally:
        tier.close()
    code, out, err = _cli(capsys, "--remote-url-file", url_file, "--remote-secret-file", secret_file, "--no-engine")
    assert code == 0 and f"root {manifest.root.hex()}" in out and "unreadable" not in out  # its MAC checked
    assert server.password not in out + err and ":***@" in out

    code, out, err = _cli(capsys, "--remote-url-file", url_file, "--no-engine")  # no secret: refused, says why
    assert code == 2 and "secret" in err and server.password not in out + err

    dead = f"redis://:{server.password}@127.0.0.1:{_free_port()}/0"
    code, out, err = _cli(capsys, "--remote-url", dead, "--remote-secret-file", secret_file, "--no-engine", "--json")
    assert code == 1 and out == ""
    assert "pcr-rag cache info: cannot read the remote store: redis://:***@127.0.0.1" in err
    assert "Traceback" not in err and server.password not in err
    assert not [r for r in caplog.records if "local tiers" in r.getMessage()]  # an engine's line, not the CLI's

