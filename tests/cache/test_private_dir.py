"""The SSD cache directory is private: created 0700 (files 0600) whatever the umask, refused when another user owns
it or others can write to it, never read or written through a planted symbolic link, and fsynced after renames."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
import torch

from pcr_rag.cache import CacheConfig, CacheManager, LocalDirBackend, Tier
from pcr_rag.cache.errors import CacheError, UnsafeCacheDirError
from pcr_rag.cache.tiers.chunk_file import ChunkMeta, chunk_name, decode_header
from pcr_rag.cache.tiers.ssd_store import SSDStore
from pcr_rag.errors import ConfigError

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another user")


def cfg(cache_dir: Path, **kw) -> CacheConfig:
    base = dict(chunk_size=4, dram_bytes=1 << 20, ssd_bytes=1 << 22, cache_dir=cache_dir, sync_io=True)
    base.update(kw)
    return CacheConfig(**base)


def fill(eng: CacheManager, specs, make_payload) -> None:
    for s in specs:
        assert eng.insert(s, make_payload(s), tokens=None)


def modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and of everything under it, by path relative to ``root``."""
    out = {".": stat.S_IMODE(root.lstat().st_mode)}
    for path in root.rglob("*"):
        out[path.relative_to(root).as_posix()] = stat.S_IMODE(path.lstat().st_mode)
    return out


@pytest.fixture
def umask0():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_created_directory_files_and_lock_are_private_even_with_umask_0(tmp_path, chunks, make_payload, umask0):
    kv = tmp_path / "new" / "kv"  # the parent is missing too
    path = chunks.path([[1, 2, 3, 4], [5, 6, 7, 8], [9]])
    with CacheManager(cfg(kv)) as eng:
        fill(eng, path, make_payload)
        eng.flush()
        found = modes(kv)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    dirs = {p for p in found if (kv / p).is_dir()}
    files = set(found) - dirs
    assert ".lock" in files and len(files) == 1 + len(path)  # the lock and one file per chunk
    assert len(dirs) >= 2 and {found[d] for d in dirs} == {0o700}
    assert {found[f] for f in files} == {0o600}


@pytest.mark.parametrize("direct_io", [True, False])
def test_chunk_files_written_by_either_io_path_are_0600(tmp_path, chunks, umask0, direct_io):
    store = SSDStore(LocalDirBackend(tmp_path / "kv", direct_io=direct_io))
    spec = chunks.child(None, [1] * 256)
    store.write(ChunkMeta(spec.key, spec.parent, True, 256, False, b"\x00" * 16), torch.randn(2, 2, 2, 256, 8))
    assert stat.S_IMODE((tmp_path / "kv" / chunk_name(spec.key)).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "kv" / chunk_name(spec.key)).parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700


def test_a_readable_directory_of_an_older_version_is_tightened(tmp_path, chunks, make_payload, caplog):
    kv = tmp_path / "kv"
    path = chunks.path([[1, 2, 3, 4], [5, 6, 7, 8]])
    with CacheManager(cfg(kv)) as eng:
        fill(eng, path, make_payload)
    for p in [kv, *kv.rglob("*")]:  # what an older version left: 0755 directories, 0644 files
        p.chmod(0o755 if p.is_dir() else 0o644)
    with caplog.at_level(logging.WARNING, logger="pcr_rag.cache.storage"), CacheManager(cfg(kv)) as eng:
        assert eng.load([s.key for s in path]) == 2  # nothing was lost
        assert torch.equal(eng.get_payload(path[1].key), make_payload(path[1]))
    found = modes(kv)
    assert {m for p, m in found.items() if (kv / p).is_dir()} == {0o700}
    assert {m for p, m in found.items() if not (kv / p).is_dir()} == {0o600}
    messages = [r.getMessage() for r in caplog.records]
    assert any(str(kv) in m and "0755" in m for m in messages)  # the directory itself
    assert any(m.startswith(f"{len(found) - 1} entries under the cache directory {kv}") for m in messages)


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777, 0o1777])
def test_a_directory_others_can_write_is_refused(tmp_path, mode):
    kv = tmp_path / "kv"
    kv.mkdir()
    kv.chmod(mode)
    with pytest.raises(UnsafeCacheDirError) as err:
        CacheManager(cfg(kv))
    msg = str(err.value)
    assert str(kv) in msg and f"chmod 700 {kv}" in msg and "writable" in msg
    assert isinstance(err.value, CacheError) and isinstance(err.value, ConfigError)
    assert stat.S_IMODE(kv.stat().st_mode) == mode  # refused, not silently changed
    assert not (kv / ".lock").exists()


@pytest.mark.parametrize("what", ["subdir", "file"])
def test_a_writable_entry_inside_the_directory_is_refused(tmp_path, chunks, make_payload, what):
    kv = tmp_path / "kv"
    spec = chunks.child(None, [1, 2, 3, 4])
    with CacheManager(cfg(kv)) as eng:
        fill(eng, [spec], make_payload)
    target = kv / chunk_name(spec.key)
    if what == "subdir":
        target = target.parent
    target.chmod(0o777 if what == "subdir" else 0o666)
    with pytest.raises(UnsafeCacheDirError) as err:
        CacheManager(cfg(kv))
    assert str(target) in str(err.value) and "writable" in str(err.value)


@as_root
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir(mode=0o700)
    os.chown(kv, NOBODY, NOBODY)
    with pytest.raises(UnsafeCacheDirError) as err:
        CacheManager(cfg(kv))
    msg = str(err.value)
    assert str(kv) in msg and f"uid {NOBODY}" in msg and "chown" in msg
    assert not (kv / ".lock").exists()


@as_root
def test_a_chunk_file_owned_by_another_user_is_refused(tmp_path, chunks, make_payload):
    kv = tmp_path / "kv"
    spec = chunks.child(None, [1, 2, 3, 4])
    with CacheManager(cfg(kv)) as eng:
        fill(eng, [spec], make_payload)
    os.chown(kv / chunk_name(spec.key), NOBODY, NOBODY)
    with pytest.raises(UnsafeCacheDirError) as err:
        CacheManager(cfg(kv))
    assert chunk_name(spec.key) in str(err.value) and "chown" in str(err.value)


def plant_poison(outside: Path, victim: Path, payload: torch.Tensor) -> Path:
    """A valid chunk file for ``victim``'s key but another payload, outside the cache; ``victim`` becomes a
    symbolic link to it. Returns the poison's path."""
    meta = decode_header(victim.read_bytes()[:4096]).meta
    SSDStore(LocalDirBackend(outside)).write(meta, payload)
    poison = outside / victim.relative_to(victim.parents[1])
    victim.unlink()
    victim.symlink_to(poison)
    return poison


@pytest.mark.parametrize("phase", ["live", "restart"])
def test_a_symlinked_chunk_file_is_neither_read_nor_overwritten(tmp_path, chunks, make_payload, phase):
    kv, outside = tmp_path / "kv", tmp_path / "outside"
    a, b = chunks.path([[1, 2, 3, 4], [5, 6, 7, 8]])
    other = chunks.child(None, [9, 9, 9, 9])
    eng = CacheManager(cfg(kv, dram_bytes=4 * 64))  # DRAM holds one chunk: the rest lives on SSD
    fill(eng, [a, b, other], make_payload)
    assert eng.tiers_of(b.key) == {Tier.SSD}
    victim = kv / chunk_name(b.key)
    poison = plant_poison(outside, victim, make_payload(b) + 1)
    planted = poison.read_bytes()
    if phase == "restart":
        eng.close()
        eng = CacheManager(cfg(kv, dram_bytes=4 * 64))
    if b.key in eng:
        assert eng.load([b.key]) == 0  # the read refuses the link: a miss
    assert b.key not in eng and not victim.is_symlink()
    assert eng.insert(b, make_payload(b), tokens=None)  # recomputed and stored again
    fill(eng, [other], make_payload)
    eng.flush()
    assert eng.load([b.key]) == 1 and torch.equal(eng.get_payload(b.key), make_payload(b))
    eng.close()
    assert poison.read_bytes() == planted  # never overwritten
    assert not victim.is_symlink()


def test_a_symlinked_subdirectory_is_not_followed(tmp_path):
    kv, outside = tmp_path / "kv", tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    (outside / "ab" / "read-me").write_bytes(b"secret")
    backend = LocalDirBackend(kv)
    (kv / "ab").symlink_to(outside / "ab")
    with pytest.raises(OSError):
        backend.open("ab/read-me")
    with pytest.raises(OSError):
        backend.write_atomic("ab/planted", [b"x" * 10])
    assert sorted(p.name for p in (outside / "ab").iterdir()) == ["read-me"]
    assert not backend.delete("ab/read-me") and (outside / "ab" / "read-me").read_bytes() == b"secret"


def test_a_symlinked_lock_file_is_not_written_through(tmp_path):
    kv, victim = tmp_path / "kv", tmp_path / "precious"
    victim.write_bytes(b"precious bytes")
    backend = LocalDirBackend(kv)
    (kv / ".lock").symlink_to(victim)
    with pytest.raises(OSError):
        backend.lock()
    assert victim.read_bytes() == b"precious bytes"


def test_a_fifo_planted_as_a_chunk_file_fails_the_read_without_hanging(tmp_path):
    backend = LocalDirBackend(tmp_path / "kv")
    (tmp_path / "kv" / "ab").mkdir(mode=0o700)
    os.mkfifo(tmp_path / "kv" / "ab" / "blob", 0o600)
    outcome: list[BaseException | object] = []

    def read() -> None:
        try:
            outcome.append(backend.open("ab/blob"))
        except OSError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # release the blocked open before failing
        os.close(os.open(tmp_path / "kv" / "ab" / "blob", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("opening a FIFO planted as a chunk file hung")
    assert len(outcome) == 1 and isinstance(outcome[0], OSError)


def test_a_parent_others_can_rename_in_is_warned_about(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone could rename the cache directory away
    with caplog.at_level(logging.WARNING, logger="pcr_rag.cache.storage"):
        LocalDirBackend(shared / "kv")
    assert any(m.startswith(f"{shared}, a parent of the cache directory") for m in caplog.messages)
    caplog.clear()
    shared.chmod(0o1777)  # sticky, as /tmp: only the owner may rename its entries
    with caplog.at_level(logging.WARNING, logger="pcr_rag.cache.storage"):
        LocalDirBackend(shared / "kv")
    assert not any("a parent of the cache directory" in m for m in caplog.messages)


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_syncs_the_directory_after_each_rename(tmp_path, monkeypatch, fsync):
    kv = tmp_path / "kv"
    backend = LocalDirBackend(kv, fsync=fsync)
    synced: list[tuple[int, bool]] = []  # (inode of the directory, whether the new name was visible)
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            synced.append((st.st_ino, (kv / "ab" / "blob").exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    backend.write_atomic("ab/blob", [b"first"])
    backend.write_atomic("ab/blob", [b"second"])
    if not fsync:
        assert synced == []
        return
    sub, root = (kv / "ab").stat().st_ino, kv.stat().st_ino
    assert synced.count((sub, True)) == 2  # after each rename, once the name is visible
    assert (root, False) in synced  # the new subdirectory's entry, before any file goes in it
    assert backend.open("ab/blob").read_at(0, 6) == b"second"


def test_engine_refuses_an_unsafe_cache_dir_and_ignores_planted_links(tmp_path, monkeypatch):
    """End to end: a world-writable cache_dir stops PCREngine before its model loads; chunk files swapped for
    links to poisoned copies are recomputed at restart, the answer and its logits unchanged."""
    import pcr_rag.engine
    from pcr_rag import EngineConfig, PCREngine
    from pcr_rag.testing import tiny_model

    model, tok = tiny_model("llama", num_layers=2)
    docs = ["Alpha centauri is the closest star system to the Sun. " * 4, "TCP retransmits lost segments. " * 4]

    def engine(cache_dir: Path) -> PCREngine:
        return PCREngine(model=model, tokenizer=tok, config=EngineConfig(
            cache_dir=cache_dir, chunk_size=16, dram_capacity="8MiB", ssd_capacity="64MiB", max_new_tokens=6,
            device="cpu"))

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with monkeypatch.context() as patch, pytest.raises(UnsafeCacheDirError):
        patch.setattr(pcr_rag.engine, "load_model", lambda *a, **kw: pytest.fail("the model loaded first"))
        engine(open_dir)
    kv, outside = tmp_path / "kv", tmp_path / "outside"
    with engine(kv) as eng:
        reference = eng.generate("Which star is closest?", docs)
    chunk_files = [p for p in kv.rglob("*.kv") if p.is_file()]
    assert chunk_files
    planted = []
    for victim in chunk_files:
        header = decode_header(victim.read_bytes()[:4096])
        payload = SSDStore(LocalDirBackend(kv)).read(header.meta.key)
        planted.append(plant_poison(outside, victim, payload + 1))
    with engine(kv) as eng:
        again = eng.generate("Which star is closest?", docs)
    assert again.metrics.reused_tokens == 0  # every link was refused: all recomputed
    assert again.token_ids == reference.token_ids
    assert torch.equal(again.first_token_logits, reference.first_token_logits)
    assert all(p.exists() for p in planted) and not any(v.is_symlink() for v in chunk_files)
    shutil.rmtree(outside)
