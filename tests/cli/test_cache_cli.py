"""`pcr-rag cache` (info, prune, verify) and the engine's start-up line about chunks it cannot use.

A directory written by two engines on the same tiny model with different chunk sizes holds two root identities;
the one with chunk size 16 also served a tenant namespace (a second root of the same identity).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache.roots import MANIFEST_DIR, attribute
from pcr_rag.cache.tiers.chunk_file import decode_header
from pcr_rag.cli import main
from pcr_rag.testing import save_tiny_model

DOCS = [
    "The mitochondrion is the powerhouse of the cell and makes ATP for the cell. " * 3,
    "TCP retransmits lost segments and orders bytes for the application above it. " * 3,
]
QUESTION = "What does TCP do?"
TENANT = "tenant-acme-secret-name"


def _engine(model_dir: Path, cache_dir: Path, chunk_size: int) -> PCREngine:
    return PCREngine(model=str(model_dir), config=EngineConfig(
        cache_dir=cache_dir, chunk_size=chunk_size, dtype="float32", device="cpu", max_new_tokens=4,
        dram_capacity="8MiB", ssd_capacity="64MiB", load_planner="always-load"))  # on the tiny model computing beats any read, so the measured planner would rightly skip the SSD this test is about


def _chunk_files(cache_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(cache_dir)): p.stat().st_size for p in cache_dir.glob("*/*.kv")}


def _flags(model_dir: Path, chunk_size: int = 16) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32", "--device", "cpu", "--chunk-size", str(chunk_size)]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(model dir, cache dir, files of the chunk-16 engine, files of the chunk-32 engine, first answer)."""
    base = tmp_path_factory.mktemp("cachecli")
    model_dir = save_tiny_model(base / "model", "llama")
    cache_dir = base / "kv"
    with _engine(model_dir, cache_dir, 16) as eng:
        first = eng.generate(QUESTION, DOCS)
        eng.generate("Who makes ATP?", DOCS[:1], namespace=TENANT)
        eng.flush()
    files_a = _chunk_files(cache_dir)
    with _engine(model_dir, cache_dir, 32) as eng:
        eng.generate(QUESTION, DOCS)
        eng.flush()
    files_b = {k: v for k, v in _chunk_files(cache_dir).items() if k not in files_a}
    assert files_a and files_b
    return model_dir, cache_dir, files_a, files_b, first


@pytest.fixture
def copy(written, tmp_path):
    """A private copy of the written directory (tests that change it)."""
    model_dir, cache_dir, files_a, files_b, first = written
    dst = tmp_path / "kv"
    shutil.copytree(cache_dir, dst)
    return model_dir, dst, files_a, files_b, first


def _cli(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["cache", *argv])
    return code, capsys.readouterr().out


def test_info_shows_each_root_identity_with_its_counts_and_marks_the_current_one(written, capsys):
    model_dir, cache_dir, files_a, files_b, _ = written
    code, out = _cli(capsys, "info", "--cache-dir", str(cache_dir), "--json", *_flags(model_dir))
    assert code == 0
    info = json.loads(out)
    groups = {g["identity"]["chunk_size"]: g for g in info["groups"]}
    assert set(groups) == {16, 32}
    a, b = groups[16], groups[32]
    assert a["current"] and not b["current"]
    assert (a["chunks"], a["bytes"]) == (len(files_a), sum(files_a.values()))
    assert (b["chunks"], b["bytes"]) == (len(files_b), sum(files_b.values()))
    assert a["namespaces"] == 2 and b["namespaces"] == 1  # the engine's own root and the tenant's
    assert info["current"]["root"] in a["roots"] and info["current"]["chunk_size"] == 16
    assert a["identity"]["plan"] == info["current"]["plan"] and "tile=256" in a["identity"]["plan"]
    assert a["identity"]["dtype"] == "float32" and b["identity"]["model"] == a["identity"]["model"]
    assert len(a["hosts"]) == 1 and "threads, torch" in a["hosts"][0]  # who wrote it: the sharing rule's inputs
    code, text = _cli(capsys, "info", "--cache-dir", str(cache_dir), *_flags(model_dir, 32))
    current = [line for line in text.splitlines() if line.startswith("*")]
    assert len(current) == 1 and "chunk size 32" in current[0] and f"{len(files_b)} chunks" in current[0]


def test_manifests_are_private_and_name_no_tenant(written):
    _, cache_dir, *_ = written
    manifests = list((cache_dir / MANIFEST_DIR).glob("*.json"))
    assert len(manifests) == 3  # two roots of the chunk-16 engine, one of the chunk-32 engine
    for path in manifests:
        assert path.stat().st_mode & 0o777 == 0o600
        assert TENANT not in path.read_text() and "acme" not in path.read_text()
    assert (cache_dir / MANIFEST_DIR).stat().st_mode & 0o777 == 0o700


def test_prune_unusable_removes_only_the_other_roots_chunks_and_the_engine_still_reuses(copy, capsys):
    model_dir, cache_dir, files_a, files_b, first = copy
    code, out = _cli(capsys, "prune", "--unusable", "--dry-run", "--json", "--cache-dir", str(cache_dir),
                     *_flags(model_dir))
    assert code == 0 and json.loads(out)["chunks"] == len(files_b)
    assert _chunk_files(cache_dir) == {**files_a, **files_b}  # a dry run removes nothing
    code, out = _cli(capsys, "prune", "--unusable", "--json", "--cache-dir", str(cache_dir), *_flags(model_dir))
    result = json.loads(out)
    assert code == 0 and result["chunks"] == len(files_b) and result["bytes"] == sum(files_b.values())
    assert _chunk_files(cache_dir) == files_a
    assert len(list((cache_dir / MANIFEST_DIR).glob("*.json"))) == 2  # the pruned root's manifest went too
    with _engine(model_dir, cache_dir, 16) as eng:
        again = eng.generate(QUESTION, DOCS)
    assert again.metrics.reused_tokens > 0 and again.token_ids == first.token_ids


def test_prune_older_than_a_date(copy, capsys):
    model_dir, cache_dir, files_a, files_b, _ = copy
    code, out = _cli(capsys, "prune", "--older-than", "1d", "--json", "--cache-dir", str(cache_dir))
    assert code == 0 and json.loads(out)["chunks"] == 0
    assert len(_chunk_files(cache_dir)) == len(files_a) + len(files_b)
    code, out = _cli(capsys, "prune", "--older-than", "2999-01-01", "--cache-dir", str(cache_dir))
    assert code == 0 and f"removed {len(files_a) + len(files_b)} chunks" in out
    assert not _chunk_files(cache_dir) and not list((cache_dir / MANIFEST_DIR).glob("*.json"))


def test_prune_refuses_while_an_engine_holds_the_directory(copy, capsys):
    model_dir, cache_dir, files_a, files_b, _ = copy
    with _engine(model_dir, cache_dir, 16):
        code = main(["cache", "prune", "--older-than", "2999-01-01", "--cache-dir", str(cache_dir)])
    assert code == 2 and "in use by another cache engine" in capsys.readouterr().err
    assert len(_chunk_files(cache_dir)) >= len(files_a) + len(files_b)


def test_verify_finds_and_deletes_a_corrupted_file(copy, capsys):
    _, cache_dir, files_a, files_b, _ = copy
    code, out = _cli(capsys, "verify", "--cache-dir", str(cache_dir))
    assert code == 0 and f"{len(files_a) + len(files_b)} chunk files checked" in out and ", 0 bad" in out
    victim = sorted(files_a)[0]
    path = cache_dir / victim
    raw = bytearray(path.read_bytes())
    header = decode_header(bytes(raw[:4096]))
    raw[header.data_offset + header.payload_nbytes - 1] ^= 0x01  # last payload byte: the last layer's checksum
    path.write_bytes(bytes(raw))
    code, out = _cli(capsys, "verify", "--json", "--cache-dir", str(cache_dir))
    bad = json.loads(out)["bad"]
    assert code == 1 and [b["name"] for b in bad] == [victim] and "checksum mismatch" in bad[0]["reason"]
    code, out = _cli(capsys, "verify", "--delete", "--cache-dir", str(cache_dir))
    assert code == 0 and not path.exists()
    code, out = _cli(capsys, "verify", "--cache-dir", str(cache_dir))
    assert code == 0 and ", 0 bad" in out


def test_startup_logs_one_line_about_chunks_it_cannot_use(copy, caplog):
    model_dir, cache_dir, files_a, files_b, _ = copy
    with caplog.at_level(logging.INFO, logger="pcr_rag"), _engine(model_dir, cache_dir, 16):
        pass
    lines = [r.getMessage() for r in caplog.records if "cannot use" in r.getMessage()]
    assert len(lines) == 1
    assert f"holds {len(files_b)} chunks" in lines[0]
    assert f"pcr-rag cache prune --unusable --cache-dir {cache_dir}" in lines[0]
    caplog.clear()
    assert main(["cache", "prune", "--unusable", "--cache-dir", str(cache_dir), *_flags(model_dir)]) == 0
    with caplog.at_level(logging.INFO, logger="pcr_rag"), _engine(model_dir, cache_dir, 16):
        pass
    assert not [r for r in caplog.records if "cannot use" in r.getMessage()]


def test_attribute_follows_parent_links_to_roots_and_flags_orphans_and_loops():
    r1, r2 = b"\x01" * 16, b"\x02" * 16
    a, b, c, d, e, f = (bytes([i]) * 16 for i in range(10, 16))
    links = {a: (r1, True), b: (a, False), c: (b, False), d: (r2, True), e: (b"\x99" * 16, False), f: (f, False)}
    assert attribute(links) == {a: r1, b: r1, c: r1, d: r2, e: None, f: None}


def test_a_cache_written_before_manifests_counts_as_unknown_until_its_engine_names_it(copy, capsys):
    model_dir, cache_dir, files_a, files_b, _ = copy
    for path in (cache_dir / MANIFEST_DIR).glob("*.json"):
        os.unlink(path)
    code, out = _cli(capsys, "info", "--json", "--cache-dir", str(cache_dir), *_flags(model_dir))
    groups = json.loads(out)["groups"]
    current = [g for g in groups if g["current"]]
    assert len(current) == 1 and current[0]["chunks"] < len(files_a)  # the tenant's root is of unknown origin
    assert sum(g["chunks"] for g in groups) == len(files_a) + len(files_b)
    with _engine(model_dir, cache_dir, 16):  # its own root has chunks on disk: the manifest is written at once
        pass
    assert len(list((cache_dir / MANIFEST_DIR).glob("*.json"))) == 1


def test_verify_with_the_secret_catches_a_forgery_that_checksums_pass(tmp_path, written, capsys, monkeypatch):
    """An encrypted directory: a payload byte changed and its layer checksum and header sum rewritten passes the
    checksum-only check, but not the MAC/AES-GCM check with the engine's secret."""
    import struct

    import xxhash

    from pcr_rag.cache.tiers.chunk_file import _FIXED

    secret = "x" * 32
    model_dir = written[0]
    cache_dir = tmp_path / "sealed"
    with PCREngine(model=str(model_dir), config=EngineConfig(
            cache_dir=cache_dir, chunk_size=16, dtype="float32", device="cpu", max_new_tokens=2,
            ssd_capacity="64MiB", remote_secret=secret, ssd_encrypt=True)) as eng:
        eng.generate(QUESTION, DOCS)
        eng.flush()
    files = sorted(_chunk_files(cache_dir))
    monkeypatch.setenv("PCR_TEST_SECRET", secret)
    code, out = _cli(capsys, "verify", "--cache-dir", str(cache_dir), "--secret-env", "PCR_TEST_SECRET")
    assert code == 0 and "MACs" in out and ", 0 bad" in out
    path = cache_dir / files[0]
    raw = bytearray(path.read_bytes())
    header = decode_header(bytes(raw[:4096]))
    assert header.encrypted
    layer = header.shape[0] - 1
    at = header.data_offset + layer * header.layer_nbytes
    raw[at] ^= 0x01
    core_len = len(header.core)  # the fixed header, the shape and the owner: the layer checksums follow
    struct.pack_into("<Q", raw, core_len + 8 * layer,
                     xxhash.xxh3_64_intdigest(bytes(raw[at: at + header.layer_nbytes])))
    hlen = _FIXED.unpack_from(raw, 0)[3]
    struct.pack_into("<Q", raw, hlen - 8, xxhash.xxh3_64_intdigest(bytes(raw[: hlen - 8])))
    path.write_bytes(bytes(raw))
    code, out = _cli(capsys, "verify", "--cache-dir", str(cache_dir), "--secret-env", "UNSET_PCR_VAR")
    assert code == 0 and ", 0 bad" in out  # checksums alone cannot tell
    code, out = _cli(capsys, "verify", "--json", "--cache-dir", str(cache_dir), "--secret-env", "PCR_TEST_SECRET")
    bad = json.loads(out)["bad"]
    assert code == 1 and [b["name"] for b in bad] == [files[0]] and "forged" in bad[0]["reason"]


def test_roots_hash_the_plan_and_the_kernel_identity(written, tmp_path):
    """The engine's roots are the keys of before manifests existed with the kernel identity (issue 47) beside the
    plan: a cache written before kernel identities were probed is another identity's (its kernels are unknown)."""
    from pcr_rag.cache.keys import namespace_key

    model_dir = written[0]
    with _engine(model_dir, tmp_path / "kv", 16) as eng:
        plan, fp, kernels = eng.forward.plan_id, eng.loaded.fingerprint, eng.identity.kernels
        assert len(kernels) == 16 and int(kernels, 16) >= 0
        assert eng.root_for(None) == namespace_key(fp, "float32", 16, f"{plan};kernels={kernels}|")
        assert eng.root_for(TENANT) == namespace_key(fp, "float32", 16, f"{plan};kernels={kernels}||{TENANT}")
        before = replace(eng.identity, kernels="")
        assert before.root() == namespace_key(fp, "float32", 16, f"{plan}|")
        assert not eng.identity.compatible(before) and "kernels unknown" in eng.identity.difference(before)


def test_info_without_an_engine_lists_roots_without_loading_a_model(written, capsys):
    _, cache_dir, files_a, files_b, _ = written
    code, out = _cli(capsys, "info", "--no-engine", "--json", "--cache-dir", str(cache_dir),
                     "--model", "/nonexistent/model")
    info = json.loads(out)
    assert code == 0 and info["current"] is None and not any(g["current"] for g in info["groups"])
    assert sum(g["chunks"] for g in info["groups"]) == len(files_a) + len(files_b)
    code = main(["cache", "info", "--cache-dir", str(cache_dir.parent / "missing")])
    assert code == 2 and "no cache directory" in capsys.readouterr().err


@pytest.mark.parametrize("body", [
    "[" * 30_000 + "]" * 30_000,  # under the size limit, nested past the parser's recursion limit
    "model-with-newline",  # a model name holding a line break and an escape sequence (log and terminal injection)
    "nan-time",
    "other-root",
])
def test_a_hostile_manifest_leaves_its_root_of_unknown_origin(copy, capsys, caplog, body):
    model_dir, cache_dir, files_a, files_b, _ = copy
    victim = next(p for p in (cache_dir / MANIFEST_DIR).glob("*.json") if '"chunk_size": 32' in p.read_text())
    good = json.loads(victim.read_text())
    if body == "model-with-newline":
        body = json.dumps({**good, "model": "x\nERROR forged line \x1b[2J"})
    elif body == "nan-time":
        body = json.dumps({**good, "written_at": float("nan")})
    elif body == "other-root":
        body = json.dumps({**good, "root": "00" * 16})
    victim.write_text(body)
    code, out = _cli(capsys, "info", "--json", "--cache-dir", str(cache_dir), *_flags(model_dir))
    groups = json.loads(out)["groups"]
    assert code == 0 and [g["identity"] for g in groups if not g["current"]] == [None]
    with caplog.at_level(logging.WARNING, logger="pcr_rag"), _engine(model_dir, cache_dir, 16):
        pass
    lines = [r.getMessage() for r in caplog.records if "cannot use" in r.getMessage()]
    assert len(lines) == 1 and f"{len(files_b)} of unknown origin" in lines[0] and "\n" not in lines[0]
