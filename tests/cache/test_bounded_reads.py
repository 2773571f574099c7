"""Bounded reads from the store and the disk (issue 47, item 4): a writer of the shared store, or of the cache
directory, cannot make a replica or ``pcr-rag cache`` read more than the local KV layout implies.

- A sealed remote value padded with many MiB keeps its header and header MAC valid; before, the replica fetched the
  whole value before checking its length (the audit's peak RSS doubled). Now it reads the layout's value size plus
  one byte, rejects the value and recomputes.
- A chunk file whose header claims a huge layer (a sparse file of that size) is verified in bounded slices: memory
  stays small (the audit's 4.3 GiB on a 12 KiB sparse file).
- ``written_at=1e300`` or NaN in a header is refused as corrupt instead of crashing ``cache info``.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash

from pcr_rag.cache import CacheConfig, CacheManager, CorruptChunkError, ManualClock
from pcr_rag.cache.seal import Sealer
from pcr_rag.cache.tiers.chunk_file import ChunkMeta, decode_header, encode_header, verify_seal
from pcr_rag.cache.tiers.remote_store import MemoryRemoteStore
from pcr_rag.cache.tiers.remote_value import value_name

from .test_remote_tier import SECRET, fill, remote_config

NS = "pcr-rag"
PAD = 64 << 20



def engine(store_name: str) -> CacheManager:
    cfg = CacheConfig(chunk_size=4, dram_bytes=1 << 20, sync_io=True, remote=remote_config(f"memory://{store_name}"))
    return CacheManager(cfg, clock=ManualClock())


def test_a_padded_sealed_value_is_read_only_up_to_the_layout(store_name, chunks, make_payload) -> None:
    specs = chunks.path([[1] * 4, [2] * 4])
    store = MemoryRemoteStore.named(store_name)
    with engine(store_name) as a, engine(store_name) as b:
        fill(a, specs, make_payload)
        name = value_name(NS, specs[1].key)
        raw = store.values[name]
        store.values[name] = raw + bytes(PAD)
        header = decode_header(store.values[name])  # the padding leaves the header and its MAC valid
        verify_seal(header, Sealer(SECRET, "remote"), chunks.root)
        with b.acquire(specs):
            pass
        b.load([s.key for s in specs])
        io = b.stats().remote_io
        assert io["bytes_read"] <= 2 * (len(raw) + 1), io["bytes_read"]  # both values, not the padding
        assert io["corrupt"] + io["forged"] == 1 and name not in store.values  # rejected and deleted


# ------------------------------------------------------------------------------------------------ pcr-rag cache
def _chunk_file(path: Path, layer_elems: int, *, written_at: float | None = None) -> Path:
    """A valid unsealed chunk file of 2 layers of ``layer_elems`` float32s each: header written, payload a hole
    (a sparse file), so a huge claim costs no disk. ``written_at`` patches the header's timestamp (checksum
    recomputed, as a writer of the directory can)."""
    shape = (2, 2, 1, layer_elems // 2, 1)
    meta = ChunkMeta(b"\x11" * 16, b"\x22" * 16, True, layer_elems // 2, False, b"\x00" * 16)
    fake = torch.zeros(1).expand(shape)  # the header needs the shape and dtype only
    head = bytearray(encode_header(meta, fake, [0, 0]))
    header = decode_header(bytes(head))
    if written_at is not None:
        _patch_written_at(head, written_at)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.write(head)
        f.truncate(header.file_bytes)
    return path


def _patch_written_at(head: bytearray, value: float) -> None:
    from pcr_rag.cache.tiers import chunk_file

    fixed = chunk_file._FIXED
    fields = list(fixed.unpack_from(head, 0))
    fields[7] = value  # written_at
    fixed.pack_into(head, 0, *fields)
    hlen = fields[3]
    struct.pack_into("<Q", head, hlen - 8, xxhash.xxh3_64_intdigest(bytes(head[: hlen - 8])))


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``pcr-rag cache ARGS`` in a fresh process that reports how much its peak RSS grew while the command ran."""
    script = ("import resource, sys\nfrom pcr_rag.cli import main\n"
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\ncode = main(sys.argv[1:])\n"
              "print('GREW_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, file=sys.stderr)\n"
              "sys.exit(code)\n")
    return subprocess.run([sys.executable, "-c", script, "cache", *args], capture_output=True, text=True,
                          timeout=300)


def _grew_kib(done: subprocess.CompletedProcess) -> int:
    return int(done.stderr.rsplit("GREW_KIB", 1)[1].split()[0])


def test_verify_reads_a_huge_sparse_layer_in_bounded_slices(tmp_path) -> None:
    from pcr_rag.cache.tiers.chunk_file import chunk_name

    cache = tmp_path / "kv"
    cache.mkdir(mode=0o700)
    layer_bytes = 256 << 20  # per layer claimed, a hole on disk
    path = _chunk_file(cache / chunk_name(b"\x11" * 16), layer_bytes // 4)
    assert path.stat().st_blocks * 512 < 1 << 20
    done = _cli("verify", "--cache-dir", str(cache), "--json", "--secret-env", "PCR_RAG_NO_SUCH_SECRET")
    assert done.returncode == 1, done.stderr  # the hole's zeros fail the layer checksums: bad, no crash
    report = json.loads(done.stdout)
    assert report["checked"] == 1 and "checksum" in report["bad"][0]["reason"]
    assert _grew_kib(done) < 64 * 1024, _grew_kib(done)  # slices, far below one claimed layer (256 MiB)


@pytest.mark.parametrize("written_at", [1e300, math.inf, math.nan, -5.0])
def test_an_out_of_range_timestamp_is_corrupt(tmp_path, written_at) -> None:
    path = _chunk_file(tmp_path / "chunk.kv", 8, written_at=written_at)
    with pytest.raises(CorruptChunkError, match="written_at"):
        decode_header(path.read_bytes()[:4096])


def test_cache_info_reports_a_bad_timestamp_without_a_traceback(tmp_path) -> None:
    from pcr_rag.cache.tiers.chunk_file import chunk_name

    cache = tmp_path / "kv"
    cache.mkdir(mode=0o700)
    _chunk_file(cache / chunk_name(b"\x11" * 16), 8, written_at=1e300)
    done = _cli("info", "--no-engine", "--cache-dir", str(cache))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "unreadable chunk files: 1" in done.stdout and "written_at" in done.stdout
