"""The remote tier's values: one self-describing value per chunk, in the chunk file format (``chunk_file``).

A value is the chunk file's header (magic, version, key, parent, root/partial flags, token count, tokens
digest, dtype, shape, per-layer xxh3-64 checksums, header checksum; padded to its ``data_offset``) followed by the
payload bytes, without the file's trailing padding. Its name is ``<namespace>:<chunk key hex>``: the chained
blake2b chunk keys are the same in every process and on every machine, so replicas find each other's values.

Everything needed to use a value is in the value, so no separate metadata key can drift from it after the store
evicts something: a reader verifies the header (checksum, the key it asked for), the value's length, and the
checksum of every layer it uses, and raises ``CorruptChunkError`` otherwise.

Metadata-only chunks (the simulator) are stored as a short record of their sizes (``VIRTUAL_MAGIC``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import xxhash

from pcr_rag.cache.errors import CorruptChunkError
from pcr_rag.cache.tiers.base import ChunkRecord, ChunkRef
from pcr_rag.cache.tiers.chunk_file import (
    NO_DIGEST,
    ChunkHeader,
    ChunkMeta,
    announced_header_len,
    byte_view,
    check_layers,
    decode_header,
    encode_header,
    header_bytes,
)

__all__ = [
    "PROBE_BYTES",
    "RemoteHeader",
    "decode_probe",
    "decode_value",
    "encode_value",
    "header_len_needed",
    "value_bytes",
    "value_name",
]

#: Bytes a lookup reads from the start of each value: the fixed header and the checksums of up to ~100 layers
#: (a longer header is read again in full).
PROBE_BYTES = 1024
VIRTUAL_MAGIC = b"PCRKVVT\x00"
_VIRTUAL = struct.Struct("<8s16s16s16sBIQI")  # magic, key, parent, digest, flags, tokens, nbytes, layers
_FLAG_ROOT, _FLAG_PARTIAL = 1, 2


def value_name(namespace: str, key: bytes) -> str:
    """The store key of a chunk: ``<namespace>:<key hex>``."""
    return f"{namespace}:{key.hex()}"


def value_bytes(chunk: ChunkRef | ChunkRecord) -> int:
    """Bytes a chunk's value occupies in the store (header padded to its data offset + payload)."""
    return header_bytes(5, chunk.num_layers) + chunk.nbytes


@dataclass(frozen=True)
class RemoteHeader:
    """What a lookup learns about a stored value: enough to add the chunk's node to the tree."""

    record: ChunkRecord
    value_bytes: int




def encode_value(chunk: ChunkRef | ChunkRecord, payload: torch.Tensor | None) -> bytes:
    """The value of ``chunk`` (``payload`` None for a metadata-only chunk)."""
    if payload is None or chunk.virtual:
        flags = (_FLAG_ROOT if chunk.parent_is_root else 0) | (_FLAG_PARTIAL if chunk.partial else 0)
        return _VIRTUAL.pack(VIRTUAL_MAGIC, chunk.key, chunk.parent_key, chunk.tokens_digest or NO_DIGEST,
                             flags, chunk.num_tokens, chunk.nbytes, chunk.num_layers)
    if payload.device.type != "cpu":
        payload = payload.cpu()
    payload = payload.contiguous()
    data = byte_view(payload)
    lb = data.nbytes // payload.shape[0]
    checksums = [xxhash.xxh3_64_intdigest(data[i * lb : (i + 1) * lb]) for i in range(payload.shape[0])]
    return b"".join((encode_header(ChunkMeta.of(chunk), payload, checksums), data))


def header_len_needed(raw: bytes) -> int | None:
    """When ``raw`` (a value's first ``PROBE_BYTES``) is too short for the header it announces, the bytes to read
    instead; None when ``raw`` is enough (or is no header at all: decoding then says what is wrong)."""
    if raw[:8] == VIRTUAL_MAGIC:
        return None
    hlen = announced_header_len(raw)
    return hlen if hlen is not None and hlen > len(raw) else None


def _decode_virtual(raw: bytes, key: bytes) -> RemoteHeader:
    if len(raw) < _VIRTUAL.size:
        raise CorruptChunkError(f"metadata-only value truncated ({len(raw)} bytes)")
    _, k, parent, digest, flags, tokens, nbytes, layers = _VIRTUAL.unpack_from(raw, 0)
    if k != key:
        raise CorruptChunkError(f"value holds key {k.hex()} but {key.hex()} was expected")
    record = ChunkRecord(key, parent, bool(flags & _FLAG_ROOT), tokens, bool(flags & _FLAG_PARTIAL),
                         digest if digest != NO_DIGEST else None, nbytes, layers, True)
    return RemoteHeader(record, value_bytes(record))


def _record(header: ChunkHeader) -> ChunkRecord:
    m = header.meta
    return ChunkRecord(m.key, m.parent, m.parent_is_root, m.num_tokens, m.partial,
                       m.digest if m.digest != NO_DIGEST else None, header.payload_nbytes, header.shape[0])


def decode_probe(raw: bytes, key: bytes) -> RemoteHeader:
    """The chunk a value's first bytes describe (header verified, key checked); ``CorruptChunkError`` otherwise."""
    if raw[:8] == VIRTUAL_MAGIC:
        return _decode_virtual(raw, key)
    header = decode_header(raw, expected_key=key)
    return RemoteHeader(_record(header), header.data_offset + header.payload_nbytes)


def decode_value(raw: bytes, key: bytes, chunk: ChunkRef) -> tuple[ChunkHeader | None, torch.Tensor | None]:
    """A whole value as (header, payload view over ``raw``), header and length verified and checked against
    ``chunk`` (sizes, parent); layers are verified by the caller (``check_layer``). (None, None) for a
    metadata-only value. Raises ``CorruptChunkError``."""
    if raw[:8] == VIRTUAL_MAGIC:
        rec = _decode_virtual(raw, key).record
        if rec.nbytes != chunk.nbytes or rec.num_layers != chunk.num_layers:
            raise CorruptChunkError(f"metadata-only value of {key.hex()} does not match the chunk's sizes")
        return None, None
    header = decode_header(raw, expected_key=key)
    if len(raw) != header.data_offset + header.payload_nbytes:
        raise CorruptChunkError(
            f"value is {len(raw)} bytes, its header says {header.data_offset + header.payload_nbytes} (truncated?)"
        )
    if header.payload_nbytes != chunk.nbytes or header.shape[0] != chunk.num_layers:
        raise CorruptChunkError(f"value of {key.hex()} holds {header.payload_nbytes} bytes in {header.shape[0]} "
                                f"layers, the chunk has {chunk.nbytes} in {chunk.num_layers}")
    if header.meta.parent != chunk.parent_key or header.meta.num_tokens != chunk.num_tokens:
        raise CorruptChunkError(f"value of {key.hex()} has another parent or token count than the chunk")
    flat = torch.frombuffer(raw, dtype=torch.uint8, offset=header.data_offset, count=header.payload_nbytes)
    return header, flat.view(header.dtype).view(header.shape)


def check_layer(header: ChunkHeader, payload: torch.Tensor, layer: int, key: bytes) -> None:
    """Verify one layer of a decoded value; ``CorruptChunkError`` names it otherwise."""
    check_layers(header, byte_view(payload[layer]), key, layer)
