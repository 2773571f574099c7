"""On-disk chunk format and the SSD store: one file per chunk, verified reads, recovery after restart.

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

A read verifies the header checksum, that the header's key is the key asked for, that the file size matches, and
the checksum of every layer it returns (one layer for ``read_layer``, all for ``read``). Any failure raises
``CorruptChunkError``; the caller drops the chunk and recomputes it.
"""

from __future__ import annotations

import logging
import re
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import xxhash

from pcr_rag.cache.errors import CorruptChunkError
from pcr_rag.cache.storage import BlobReader, DeferredHead, StorageBackend, aligned_scratch

__all__ = [
    "ChunkHeader",
    "ChunkMeta",
    "SSDStore",
    "chunk_file_bytes",
    "decode_header",
    "encode_header",
    "chunk_name",
]

log = logging.getLogger(__name__)

MAGIC = b"PCRKVCH\x00"
VERSION = 1
ALIGN = 4096
FLAG_PARENT_IS_ROOT = 1
FLAG_PARTIAL = 2
_FIXED = struct.Struct("<8sHHIIQQd16s16s16s16sB")
_U64 = struct.Struct("<Q")
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


def _header_len(ndim: int, num_layers: int) -> int:
    return _FIXED.size + 8 * ndim + 8 * num_layers + 8


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def chunk_file_bytes(payload_nbytes: int, ndim: int = 5, num_layers: int = 1) -> int:
    """Size in bytes of a chunk file holding ``payload_nbytes`` (what the SSD tier's budget is charged): the
    header padded to 4096, the payload, and zero padding to the next multiple of 4096 (O_DIRECT-friendly)."""
    return _align(_header_len(ndim, num_layers)) + _align(payload_nbytes)


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
        return self.data_offset + _align(self.payload_nbytes)

    @property
    def layer_nbytes(self) -> int:
        return self.payload_nbytes // self.shape[0]


def encode_header(meta: ChunkMeta, payload: torch.Tensor, checksums: list[int]) -> bytes:
    dtype_name = str(payload.dtype).removeprefix("torch.")
    if dtype_name not in _DTYPES:
        raise TypeError(f"payload dtype {payload.dtype} cannot be stored on SSD; supported: {sorted(_DTYPES)}")
    shape = tuple(int(s) for s in payload.shape)
    flags = (FLAG_PARENT_IS_ROOT if meta.parent_is_root else 0) | (FLAG_PARTIAL if meta.partial else 0)
    hlen = _header_len(len(shape), shape[0])
    data_offset = _align(hlen)
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
    if expected_nbytes != nbytes or nbytes % num_layers or data_offset != _align(hlen):
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


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass
class RecoveryReport:
    headers: list[ChunkHeader]
    corrupt: int
    temp_files_removed: int


class SSDStore:
    """Chunk files on a ``StorageBackend`` plus an index (key -> file bytes) of what is stored.

    Thread-safe: distinct keys may be written and read concurrently; the engine guarantees that one key is never
    written while it is read or deleted."""

    def __init__(self, backend: StorageBackend, *, pin_memory: bool = False) -> None:
        self.backend = backend
        self.pin_memory = pin_memory
        self.index: dict[bytes, tuple[int, int]] = {}  # key -> (file bytes, data offset)
        self._mutex = threading.Lock()

    # ------------------------------------------------------------------ write / delete
    def write(self, meta: ChunkMeta, payload: torch.Tensor) -> int:
        """Store ``payload`` (a contiguous CPU tensor) for ``meta.key``; returns the file size in bytes.
        Raises OSError on I/O failure (nothing is left behind)."""
        if payload.device.type != "cpu":
            payload = payload.cpu()
        payload = payload.contiguous()
        data = _byte_view(payload)
        layer_bytes = data.nbytes // payload.shape[0]

        def header() -> bytes:  # checksums are computed while the payload is being written
            checksums = [
                xxhash.xxh3_64_intdigest(data[i * layer_bytes : (i + 1) * layer_bytes])
                for i in range(payload.shape[0])
            ]
            return encode_header(meta, payload, checksums)

        head_bytes = _align(_header_len(payload.dim(), payload.shape[0]))
        pad = b"\x00" * (_align(data.nbytes) - data.nbytes)
        self.backend.write_atomic(chunk_name(meta.key), [data, pad], DeferredHead(head_bytes, header))
        size = head_bytes + data.nbytes + len(pad)
        with self._mutex:
            self.index[meta.key] = (size, head_bytes)
        return size

    def delete(self, key: bytes) -> None:
        with self._mutex:
            self.index.pop(key, None)
        try:
            self.backend.delete(chunk_name(key))
        except OSError as exc:
            log.warning("could not delete SSD chunk %s: %s", key.hex(), exc)

    def __contains__(self, key: object) -> bool:
        return key in self.index

    # ------------------------------------------------------------------ reads
    def _open_verified(self, key: bytes) -> tuple[BlobReader, ChunkHeader]:
        reader = self.backend.open(chunk_name(key))
        try:
            raw = reader.read_at(0, ALIGN)
            if len(raw) >= _FIXED.size:
                hlen = _FIXED.unpack_from(raw, 0)[3]
                if ALIGN < hlen <= 1 << 24:
                    raw = reader.read_at(0, hlen)
            header = decode_header(raw, expected_key=key)
            if reader.size != header.file_bytes:
                raise CorruptChunkError(
                    f"chunk file is {reader.size} bytes, header says {header.file_bytes} (truncated or padded)"
                )
        except BaseException:
            reader.close()
            raise
        return reader, header

    def read_header(self, key: bytes) -> ChunkHeader:
        reader, header = self._open_verified(key)
        reader.close()
        return header

    def read(self, key: bytes, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole payload, every layer verified. Raises CorruptChunkError / FileNotFoundError / OSError.

        ``out`` (optional, a contiguous CPU tensor of the chunk's shape and dtype, e.g. from a buffer pool) is
        filled instead of a new allocation; a 4096-aligned one is filled by O_DIRECT without a bounce copy."""
        entry = self.index.get(key)
        if entry is not None:
            whole = self._read_whole(key, *entry, out=out)
            if whole is not None:
                return whole
        reader, header = self._open_verified(key)
        try:
            if out is None:
                out, padded = self._aligned_empty(header.shape, header.dtype, header.payload_nbytes)
            else:
                if tuple(out.shape) != header.shape or out.dtype != header.dtype or not out.is_contiguous():
                    raise ValueError(
                        f"out must be a contiguous {header.dtype} tensor of shape {header.shape}, got "
                        f"{out.dtype} {tuple(out.shape)}"
                    )
                padded = _byte_view(out)
            got = reader.readinto_at(header.data_offset, padded)
        finally:
            reader.close()
        view = _byte_view(out)
        if got < header.payload_nbytes:
            raise CorruptChunkError(f"chunk payload short read ({got} of {header.payload_nbytes} bytes)")
        lb = header.layer_nbytes
        for i, expected in enumerate(header.checksums):
            if xxhash.xxh3_64_intdigest(view[i * lb : (i + 1) * lb]) != expected:
                raise CorruptChunkError(f"chunk {key.hex()} layer {i} checksum mismatch")
        return out

    def _read_whole(
        self, key: bytes, file_bytes: int, data_offset: int, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Header and payload in one I/O: into one aligned buffer (the payload tensor is a view past the header),
        or header into scratch and payload straight into ``out``. None when the file is not the size the index
        expects or ``out`` does not fit the fast path (the caller then reads step by step)."""
        padded_payload = file_bytes - data_offset
        if out is not None and (out.nbytes != padded_payload or not out.is_contiguous() or out.device.type != "cpu"):
            return None
        reader = self.backend.open(chunk_name(key))
        try:
            if reader.size != file_bytes:
                return None
            if out is None:
                raw = torch.empty(file_bytes + ALIGN, dtype=torch.uint8, pin_memory=self.pin_memory)
                skip = (-raw.data_ptr()) % ALIGN
                body = raw[skip : skip + file_bytes]
                got = reader.readv_at(0, [memoryview(body.numpy())])
                head = memoryview(body.numpy())[:data_offset]
                payload_bytes = memoryview(body.numpy())[data_offset:]
            else:
                head = aligned_scratch(data_offset, "ssd-header")[:data_offset]  # copied out by bytes(head) below
                payload_bytes = _byte_view(out)
                got = reader.readv_at(0, [head, payload_bytes])
        finally:
            reader.close()
        header = decode_header(bytes(head), expected_key=key)
        if header.file_bytes != file_bytes or header.data_offset != data_offset or got != file_bytes:
            raise CorruptChunkError(f"chunk file read {got} bytes, header says {header.file_bytes}")
        if out is not None and (tuple(out.shape) != header.shape or out.dtype != header.dtype):
            raise ValueError(f"out must be a {header.dtype} tensor of shape {header.shape}")
        nbytes = header.payload_nbytes
        lb = header.layer_nbytes
        for i, expected in enumerate(header.checksums):
            if xxhash.xxh3_64_intdigest(payload_bytes[i * lb : (i + 1) * lb]) != expected:
                raise CorruptChunkError(f"chunk {key.hex()} layer {i} checksum mismatch")
        if out is not None:
            return out
        return body[data_offset : data_offset + nbytes].view(header.dtype).view(header.shape)

    def _aligned_empty(
        self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int
    ) -> tuple[torch.Tensor, memoryview]:
        """An uninitialised tensor whose storage starts 4096-aligned, and a byte view of it rounded up to 4096
        (so an O_DIRECT read lands in it without a bounce copy)."""
        padded = _align(nbytes)
        raw = torch.empty(padded + ALIGN, dtype=torch.uint8, pin_memory=self.pin_memory)
        skip = (-raw.data_ptr()) % ALIGN
        body = raw[skip : skip + padded]
        out = body[:nbytes].view(dtype).view(shape)
        return out, memoryview(body.numpy())

    def open_layers(self, key: bytes) -> SSDLayerReader:
        """Open a chunk once (header read and verified once) to read its layers one by one (layer-wise loads)."""
        reader, header = self._open_verified(key)
        return SSDLayerReader(key, reader, header, self.pin_memory)

    def read_layer(self, key: bytes, layer: int) -> torch.Tensor:
        """One layer ``[2, kv_heads, tokens, head_dim]``, verified; reads only that layer's bytes."""
        reader, header = self._open_verified(key)
        try:
            num_layers = header.shape[0]
            if not 0 <= layer < num_layers:
                raise IndexError(f"layer {layer} out of range for a chunk of {num_layers} layers")
            out = torch.empty(header.shape[1:], dtype=header.dtype, pin_memory=self.pin_memory)
            view = _byte_view(out)
            lb = header.layer_nbytes
            got = reader.readinto_at(header.data_offset + layer * lb, view)
        finally:
            reader.close()
        if got != lb or xxhash.xxh3_64_intdigest(view) != header.checksums[layer]:
            raise CorruptChunkError(f"chunk {key.hex()} layer {layer} failed verification")
        return out

    # ------------------------------------------------------------------ recovery
    def recover(self) -> RecoveryReport:
        """Scan the backend: verify every chunk header (and file size), delete files that fail, rebuild the index.
        Payload checksums are verified later, on read. Returns the valid headers, oldest write first."""
        removed = 0
        remove_temp = getattr(self.backend, "remove_temp_files", None)
        if callable(remove_temp):
            removed = int(remove_temp())
        headers: list[ChunkHeader] = []
        corrupt = 0
        for name in list(self.backend.names()):
            m = _NAME_RE.match(name)
            if m is None or m.group(2)[:2] != m.group(1):
                log.debug("ignoring foreign file %s in the SSD store", name)
                continue
            key = bytes.fromhex(m.group(2))
            try:
                header = self.read_header(key)
            except (CorruptChunkError, OSError) as exc:
                corrupt += 1
                log.warning("dropping corrupt SSD chunk %s: %s", name, exc)
                try:
                    self.backend.delete(name)
                except OSError:
                    pass
                continue
            headers.append(header)
        headers.sort(key=lambda h: h.written_at)
        with self._mutex:
            self.index = {h.meta.key: (h.file_bytes, h.data_offset) for h in headers}
        return RecoveryReport(headers, corrupt, removed)

    def iter_keys(self) -> Iterator[bytes]:
        with self._mutex:
            return iter(list(self.index))


class SSDLayerReader:
    """An open chunk file whose header was verified once; `read_layer` reads and verifies one layer's bytes.

    ``out`` (a contiguous tensor of the layer's shape and dtype, e.g. a reused staging buffer) avoids a fresh
    allocation per layer. Not thread-safe; close it (or use it as a context manager) when done."""

    def __init__(self, key: bytes, reader: BlobReader, header: ChunkHeader, pin_memory: bool) -> None:
        self.key = key
        self._reader = reader
        self.header = header
        self._pin = pin_memory

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return tuple(self.header.shape[1:])

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        h = self.header
        if not 0 <= layer < h.shape[0]:
            raise IndexError(f"layer {layer} out of range for a chunk of {h.shape[0]} layers")
        if out is None:
            out = torch.empty(h.shape[1:], dtype=h.dtype, pin_memory=self._pin)
        elif tuple(out.shape) != tuple(h.shape[1:]) or out.dtype != h.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {h.dtype} tensor of shape {tuple(h.shape[1:])}")
        view = _byte_view(out)
        lb = h.layer_nbytes
        got = self._reader.readinto_at(h.data_offset + layer * lb, view)
        if got != lb or xxhash.xxh3_64_intdigest(view) != h.checksums[layer]:
            raise CorruptChunkError(f"chunk {self.key.hex()} layer {layer} failed verification")
        return out

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> SSDLayerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
