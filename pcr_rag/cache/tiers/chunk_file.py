"""The on-disk chunk format: one self-describing, verifiable file per chunk.

Why one file per chunk: a chunk is the unit of caching (MBs: 5.9 MB for 256 SmolLM2 bf16 tokens), so per-file
overhead is small; a write is atomic by temp file + rename, with no compaction or free-space management; deletion
is one ``unlink``; recovery is a directory scan where each file stands on its own, so one bad file costs one chunk.
Files live at ``<hh>/<key hex>.kv`` (256 sub-directories keep directories small).

Layout (little endian, version 1)::

    fixed header  magic "PCRKVCH\\0", version u16, flags u16 (1 = parent is a namespace root, 2 = partial),
                  header_len u32, num_tokens u32, data_offset u64, payload_nbytes u64, written_at f64 (unix s),
                  key[16], parent[16], tokens digest[16], dtype name[16], ndim u8
    shape         ndim x u64                 (dim 0 = layers)
    checksums     layers x u64               (xxh3-64 of each layer's bytes)
    header sum    u64                        (xxh3-64 of every header byte before it)
    padding       to data_offset (a multiple of 4096, so the payload is O_DIRECT-aligned)
    payload       payload_nbytes bytes, layer after layer, then zero padding to a multiple of 4096

A reader verifies the header checksum, that the header's key is the key asked for, that the file size matches,
and the checksum of every layer it returns. Any failure raises ``CorruptChunkError``.
"""

from __future__ import annotations

import re
import struct
import time
from dataclasses import dataclass

import torch
import xxhash

from pcr_rag.cache.errors import CorruptChunkError
from pcr_rag.cache.tiers.base import ChunkRecord, ChunkRef

__all__ = [
    "ALIGN",
    "ChunkHeader",
    "ChunkMeta",
    "NO_DIGEST",
    "align",
    "announced_header_len",
    "byte_view",
    "check_layers",
    "chunk_file_bytes",
    "chunk_name",
    "decode_header",
    "encode_header",
    "header_bytes",
    "key_of_name",
    "stored_header_len",
]

MAGIC = b"PCRKVCH\x00"
VERSION = 1
ALIGN = 4096
FLAG_PARENT_IS_ROOT = 1
FLAG_PARTIAL = 2
NO_DIGEST = b"\x00" * 16  # the tokens-digest field of a chunk without one
_FIXED = struct.Struct("<8sHHIIQQd16s16s16s16sB")
_U64 = struct.Struct("<Q")
_MAX_HEADER = 1 << 24
_NAME_RE = re.compile(r"^([0-9a-f]{2})/([0-9a-f]{32})\.kv$")
_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def chunk_name(key: bytes) -> str:
    h = key.hex()
    return f"{h[:2]}/{h}.kv"


def key_of_name(name: str) -> bytes | None:
    """The key a chunk file name stands for, or None for a name that is not a chunk file's."""
    m = _NAME_RE.match(name)
    if m is None or m.group(2)[:2] != m.group(1):
        return None
    return bytes.fromhex(m.group(2))


def _header_len(ndim: int, num_layers: int) -> int:
    return _FIXED.size + 8 * ndim + 8 * num_layers + 8


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def header_bytes(ndim: int, num_layers: int) -> int:
    """Bytes before the payload (the header padded to ``ALIGN``): the payload's offset in the file."""
    return align(_header_len(ndim, num_layers))


def stored_header_len(raw: bytes) -> int | None:
    """The header length a file's first bytes announce, when it is plausible and more than ``ALIGN`` (then the
    caller reads that many bytes before decoding); None otherwise."""
    if len(raw) < _FIXED.size:
        return None
    hlen = _FIXED.unpack_from(raw, 0)[3]
    return hlen if ALIGN < hlen <= _MAX_HEADER else None


def announced_header_len(raw: bytes) -> int | None:
    """The header length (bytes before the header padding) that a chunk's first bytes announce, when they hold
    the fixed part of a header and the length is plausible; None otherwise (the decoder then says what is wrong)."""
    if len(raw) < _FIXED.size:
        return None
    hlen = _FIXED.unpack_from(raw, 0)[3]
    return hlen if _FIXED.size < hlen <= _MAX_HEADER else None


def chunk_file_bytes(payload_nbytes: int, ndim: int = 5, num_layers: int = 1) -> int:
    """Size in bytes of a chunk file holding ``payload_nbytes`` (what the SSD tier's budget is charged): the
    header padded to 4096, the payload, and zero padding to the next multiple of 4096 (O_DIRECT-friendly)."""
    return header_bytes(ndim, num_layers) + align(payload_nbytes)


@dataclass(frozen=True)
class ChunkMeta:
    """What the tree needs to rebuild a chunk's node: key, parent, whether the parent is a namespace root,
    token count, partial flag and the tokens digest (for the supersede rule)."""

    key: bytes
    parent: bytes
    parent_is_root: bool
    num_tokens: int
    partial: bool
    digest: bytes

    @classmethod
    def of(cls, chunk: ChunkRef | ChunkRecord) -> ChunkMeta:
        """The meta of a chunk as the tiers pass it around (a missing tokens digest is `NO_DIGEST`)."""
        return cls(key=chunk.key, parent=chunk.parent_key, parent_is_root=chunk.parent_is_root,
                   num_tokens=chunk.num_tokens, partial=chunk.partial, digest=chunk.tokens_digest or NO_DIGEST)


@dataclass(frozen=True)
class ChunkHeader:
    meta: ChunkMeta
    dtype: torch.dtype
    shape: tuple[int, ...]
    checksums: tuple[int, ...]
    data_offset: int
    payload_nbytes: int
    written_at: float

    @property
    def file_bytes(self) -> int:
        return self.data_offset + align(self.payload_nbytes)

    @property
    def layer_nbytes(self) -> int:
        return self.payload_nbytes // self.shape[0]


def encode_header(meta: ChunkMeta, payload: torch.Tensor, checksums: list[int]) -> bytes:
    dtype_name = str(payload.dtype).removeprefix("torch.")
    if dtype_name not in _DTYPES:
        raise TypeError(
            f"payload dtype {payload.dtype} cannot be stored on SSD; supported: {sorted(_DTYPES)}"
        )
    shape = tuple(int(s) for s in payload.shape)
    flags = (FLAG_PARENT_IS_ROOT if meta.parent_is_root else 0) | (FLAG_PARTIAL if meta.partial else 0)
    hlen = _header_len(len(shape), shape[0])
    data_offset = align(hlen)
    body = _FIXED.pack(
        MAGIC,
        VERSION,
        flags,
        hlen,
        meta.num_tokens,
        data_offset,
        payload.nbytes,
        time.time(),
        meta.key,
        meta.parent,
        meta.digest,
        dtype_name.encode("ascii"),
        len(shape),
    )
    body += struct.pack(f"<{len(shape)}Q", *shape) + struct.pack(f"<{len(checksums)}Q", *checksums)
    body += _U64.pack(xxhash.xxh3_64_intdigest(body))
    return body + b"\x00" * (data_offset - len(body))


def decode_header(raw: bytes, expected_key: bytes | None = None) -> ChunkHeader:
    """Parse and verify a header; raise CorruptChunkError saying what is wrong."""
    if len(raw) < _FIXED.size:
        raise CorruptChunkError(f"chunk header truncated ({len(raw)} bytes)")
    (magic, version, flags, hlen, num_tokens, data_offset, nbytes, written_at, key, parent, digest, dtype_raw,
     ndim) = _FIXED.unpack_from(raw, 0)  # fmt: skip
    if magic != MAGIC:
        raise CorruptChunkError("not a pcr-rag chunk file (bad magic)")
    if version != VERSION:
        raise CorruptChunkError(f"chunk layout version {version} is not supported (expected {VERSION})")
    if ndim < 1 or hlen > len(raw) or hlen < _FIXED.size + 8 * ndim + 8:
        raise CorruptChunkError(f"chunk header length {hlen} inconsistent (have {len(raw)} bytes)")
    shape = struct.unpack_from(f"<{ndim}Q", raw, _FIXED.size)
    num_layers = shape[0] if shape else 0
    if hlen != _header_len(ndim, num_layers) or num_layers < 1:
        raise CorruptChunkError("chunk header length does not match its shape")
    (stored_sum,) = _U64.unpack_from(raw, hlen - 8)
    if xxhash.xxh3_64_intdigest(raw[: hlen - 8]) != stored_sum:
        raise CorruptChunkError("chunk header checksum mismatch")
    checksums = struct.unpack_from(f"<{num_layers}Q", raw, _FIXED.size + 8 * ndim)
    dtype_name = dtype_raw.rstrip(b"\x00").decode("ascii", "replace")
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise CorruptChunkError(f"unknown dtype {dtype_name!r} in chunk header")
    expected_nbytes = dtype.itemsize
    for s in shape:
        expected_nbytes *= s
    if expected_nbytes != nbytes or nbytes % num_layers or data_offset != align(hlen):
        raise CorruptChunkError("chunk header sizes are inconsistent")
    if expected_key is not None and key != expected_key:
        raise CorruptChunkError(f"chunk header holds key {key.hex()} but {expected_key.hex()} was expected")
    meta = ChunkMeta(
        key=key,
        parent=parent,
        parent_is_root=bool(flags & FLAG_PARENT_IS_ROOT),
        num_tokens=num_tokens,
        partial=bool(flags & FLAG_PARTIAL),
        digest=digest,
    )
    return ChunkHeader(meta, dtype, tuple(shape), tuple(checksums), data_offset, nbytes, written_at)


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def check_layers(header: ChunkHeader, payload: memoryview, key: bytes, first_layer: int = 0) -> None:
    """Verify the checksums of the layers held back to back in ``payload`` (a byte view starting at layer
    ``first_layer``); raise ``CorruptChunkError`` naming the first bad layer."""
    lb = header.layer_nbytes
    count = min(payload.nbytes // lb, len(header.checksums) - first_layer)
    for i in range(count):
        layer = first_layer + i
        if xxhash.xxh3_64_intdigest(payload[i * lb : (i + 1) * lb]) != header.checksums[layer]:
            raise CorruptChunkError(
                f"chunk {key.hex()} layer {layer} failed verification (checksum mismatch)"
            )
