"""The on-disk chunk format: one self-describing, verifiable file per chunk.

Why one file per chunk: a chunk is the unit of caching (MBs: 5.9 MB for 256 SmolLM2 bf16 tokens), so per-file
overhead is small; a write is atomic by temp file + rename, with no compaction or free-space management; deletion
is one ``unlink``; recovery is a directory scan where each file stands on its own, so one bad file costs one chunk.
Files live at ``<hh>/<key hex>.kv`` (256 sub-directories keep directories small).

Layout (little endian, version 1)::

    fixed header  magic "PCRKVCH\\0", version u16, flags u16 (1 = parent is a namespace root, 2 = partial,
                  4 = sealed, 8 = encrypted, 16 = owner recorded),
                  header_len u32, num_tokens u32, data_offset u64, payload_nbytes u64, written_at f64 (unix s),
                  key[16], parent[16], tokens digest[16], dtype name[16], ndim u8
    shape         ndim x u64                 (dim 0 = layers)
    owner         only with flag 16: tenant[16] (whom the chunk's bytes are charged to: the tenant root key of the
                  request that computed it, zeros when unknown; the SSD tier always writes it, remote values never)
    checksums     layers x u64               (xxh3-64 of each layer's stored bytes)
    seal          only when sealed (flag 4): nonce[12], pad[4], layers x tag[16], mac[32] (``seal``: a layer's
                  GMAC tag, or its AES-GCM tag when encrypted (flag 8); the MAC covers the namespace root and
                  every header byte before it)
    header sum    u64                        (xxh3-64 of every header byte before it)
    padding       to data_offset (a multiple of 4096, so the payload is O_DIRECT-aligned)
    payload       payload_nbytes bytes, layer after layer, then zero padding to a multiple of 4096

A reader verifies the header checksum, that the header's key is the key asked for, that the file size matches,
and the checksum of every layer it returns. Any failure raises ``CorruptChunkError``. A reader holding a
``Sealer`` (``verify_seal``, ``open_layer``) also requires the seal: the header MAC under the root it expects, and
each layer's tag (decrypting it when encrypted); an unsealed chunk then fails as forged (``ForgedChunkError``).
The *core* (the fixed header, the shape and the owner) is each encrypted layer's associated data; the owner is
covered by the header checksum and the MAC like every header byte.
"""

from __future__ import annotations

import hmac
import re
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xxhash

from pcr_rag.cache.errors import CorruptChunkError
from pcr_rag.cache.seal import LAYER_TAG_BYTES, MAC_BYTES, NONCE_BYTES, ForgedChunkError, Sealer
from pcr_rag.cache.tiers.base import ChunkRecord, ChunkRef

if TYPE_CHECKING:
    from pcr_rag.cache.storage import BlobReader

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
    "open_layer",
    "seal_chunk",
    "stored_header_len",
    "verify_seal",
]

MAGIC = b"PCRKVCH\x00"
VERSION = 1
ALIGN = 4096
MAX_WRITTEN_AT = 253402300799.0  # 9999-12-31T23:59:59Z: the last time `datetime` can show
FLAG_PARENT_IS_ROOT = 1
FLAG_PARTIAL = 2
FLAG_SEALED = 4
FLAG_ENCRYPTED = 8
FLAG_OWNER = 16
OWNER_BYTES = 16
_NO_OWNER = b"\x00" * OWNER_BYTES  # the owner field of a chunk of no known tenant (``UNATTRIBUTED``)
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


def _seal_len(num_layers: int) -> int:
    return NONCE_BYTES + 4 + LAYER_TAG_BYTES * num_layers + MAC_BYTES


def _header_len(ndim: int, num_layers: int, sealed: bool = False, owned: bool = False) -> int:
    return (_FIXED.size + 8 * ndim + (OWNER_BYTES if owned else 0) + 8 * num_layers
            + (_seal_len(num_layers) if sealed else 0) + 8)


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def header_bytes(ndim: int, num_layers: int, sealed: bool = False, owned: bool = False) -> int:
    """Bytes before the payload (the header padded to ``ALIGN``): the payload's offset in the file."""
    return align(_header_len(ndim, num_layers, sealed, owned))


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


def chunk_file_bytes(payload_nbytes: int, ndim: int = 5, num_layers: int = 1, sealed: bool = False,
                     owned: bool = False) -> int:
    """Size in bytes of a chunk file holding ``payload_nbytes`` (what the SSD tier's budget is charged): the
    header padded to 4096, the payload, and zero padding to the next multiple of 4096 (O_DIRECT-friendly)."""
    return header_bytes(ndim, num_layers, sealed, owned) + align(payload_nbytes)


@dataclass(frozen=True)
class ChunkMeta:
    """What the tree needs to rebuild a chunk's node: key, parent, whether the parent is a namespace root,
    token count, partial flag, the tokens digest (for the supersede rule) and the owner (the tenant its bytes are
    charged to, ``b""`` when unknown; None: the header has no owner field)."""

    key: bytes
    parent: bytes
    parent_is_root: bool
    num_tokens: int
    partial: bool
    digest: bytes
    owner: bytes | None = None

    @classmethod
    def of(cls, chunk: ChunkRef | ChunkRecord, *, with_owner: bool = False) -> ChunkMeta:
        """The meta of a chunk as the tiers pass it around (a missing tokens digest is `NO_DIGEST`), with its
        tenant as the owner when ``with_owner``."""
        return cls(key=chunk.key, parent=chunk.parent_key, parent_is_root=chunk.parent_is_root,
                   num_tokens=chunk.num_tokens, partial=chunk.partial, digest=chunk.tokens_digest or NO_DIGEST,
                   owner=chunk.tenant if with_owner else None)


@dataclass(frozen=True)
class ChunkHeader:
    meta: ChunkMeta
    dtype: torch.dtype
    shape: tuple[int, ...]
    checksums: tuple[int, ...]
    data_offset: int
    payload_nbytes: int
    written_at: float
    flags: int = 0
    core: bytes = b""  # the fixed header and the shape: each encrypted layer's associated data
    signed: bytes = b""  # the header bytes the MAC covers (sealed only)
    nonce: bytes = b""
    tags: tuple[bytes, ...] = ()
    mac: bytes = b""

    @property
    def sealed(self) -> bool:
        return bool(self.flags & FLAG_SEALED)

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & FLAG_ENCRYPTED)

    @property
    def file_bytes(self) -> int:
        return self.data_offset + align(self.payload_nbytes)

    @property
    def layer_nbytes(self) -> int:
        return self.payload_nbytes // self.shape[0]


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"payload dtype {dtype} cannot be stored in a chunk; supported: {sorted(_DTYPES)}")
    return name


def _owner_field(owner: bytes) -> bytes:
    if not owner:
        return _NO_OWNER
    if len(owner) != OWNER_BYTES or owner == _NO_OWNER:
        raise ValueError(f"a chunk's owner must be {OWNER_BYTES} bytes (a tenant root key), not zeros, "
                         f"or b'' for none; got {len(owner)} bytes")
    return owner


def _core(meta: ChunkMeta, payload: torch.Tensor, flags: int) -> bytes:
    """The fixed header, the shape of ``payload``'s chunk and (``meta.owner`` not None) its owner."""
    shape = tuple(int(s) for s in payload.shape)
    owned = meta.owner is not None
    flags |= ((FLAG_PARENT_IS_ROOT if meta.parent_is_root else 0) | (FLAG_PARTIAL if meta.partial else 0)
              | (FLAG_OWNER if owned else 0))
    hlen = _header_len(len(shape), shape[0], bool(flags & FLAG_SEALED), owned)
    body = _FIXED.pack(
        MAGIC,
        VERSION,
        flags,
        hlen,
        meta.num_tokens,
        align(hlen),
        payload.nbytes,
        time.time(),
        meta.key,
        meta.parent,
        meta.digest,
        _dtype_name(payload.dtype).encode("ascii"),
        len(shape),
    )
    body += struct.pack(f"<{len(shape)}Q", *shape)
    return body + (_owner_field(meta.owner) if meta.owner is not None else b"")


def _finish(body: bytes) -> bytes:
    body += _U64.pack(xxhash.xxh3_64_intdigest(body))
    return body + b"\x00" * (align(len(body)) - len(body))


def _checksums(stored: memoryview, num_layers: int) -> bytes:
    lb = stored.nbytes // num_layers
    sums = [xxhash.xxh3_64_intdigest(stored[i * lb : (i + 1) * lb]) for i in range(num_layers)]
    return struct.pack(f"<{num_layers}Q", *sums)


def encode_header(meta: ChunkMeta, payload: torch.Tensor, checksums: list[int]) -> bytes:
    """The header of an unsealed chunk (xxh3 checksums only)."""
    core = _core(meta, payload, 0)
    return _finish(core + struct.pack(f"<{len(checksums)}Q", *checksums))


def seal_chunk(meta: ChunkMeta, payload: torch.Tensor, sealer: Sealer, root: bytes) -> tuple[bytes, memoryview]:
    """(header, the payload bytes to store after it) of a sealed chunk: per-layer GMAC tags, or per-layer AES-GCM
    ciphertexts and tags when ``sealer.encrypt``; the header MAC binds ``root``. ``payload``: contiguous, CPU."""
    num_layers = int(payload.shape[0])
    data = byte_view(payload)
    lb = data.nbytes // num_layers
    core = _core(meta, payload, FLAG_SEALED | (FLAG_ENCRYPTED if sealer.encrypt else 0))
    nonce = sealer.new_nonce()
    if sealer.encrypt:
        parts = [sealer.seal_layer(root, nonce, i, core, data[i * lb : (i + 1) * lb]) for i in range(num_layers)]
        stored = memoryview(b"".join(ct for ct, _ in parts))
        tags = [tag for _, tag in parts]
    else:
        stored = data
        tags = [sealer.layer_tag(nonce, i, data[i * lb : (i + 1) * lb]) for i in range(num_layers)]
    signed = core + _checksums(stored, num_layers) + nonce + b"\x00" * 4 + b"".join(tags)
    return _finish(signed + sealer.sign_header(root, signed)), stored


def read_header(reader: BlobReader, key: bytes) -> ChunkHeader:
    """The header at the start of ``reader`` (a chunk file), decoded and checked against ``key`` and against the
    file's size (a truncated or padded file is corrupt); raises CorruptChunkError / OSError. Seals are not checked
    here (`verify_seal`)."""
    raw = reader.read_at(0, ALIGN)
    hlen = stored_header_len(raw)
    if hlen is not None:
        raw = reader.read_at(0, hlen)
    header = decode_header(raw, expected_key=key)
    if reader.size != header.file_bytes:
        raise CorruptChunkError(f"chunk file is {reader.size} bytes, its header says {header.file_bytes} "
                                f"(truncated or padded)")
    return header


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
    sealed = bool(flags & FLAG_SEALED)
    owned = bool(flags & FLAG_OWNER)
    if hlen != _header_len(ndim, num_layers, sealed, owned) or num_layers < 1:
        raise CorruptChunkError("chunk header length does not match its shape")
    (stored_sum,) = _U64.unpack_from(raw, hlen - 8)
    if xxhash.xxh3_64_intdigest(raw[: hlen - 8]) != stored_sum:
        raise CorruptChunkError("chunk header checksum mismatch")
    core_len = _FIXED.size + 8 * ndim + (OWNER_BYTES if owned else 0)
    owner = bytes(raw[core_len - OWNER_BYTES : core_len]) if owned else None
    checksums = struct.unpack_from(f"<{num_layers}Q", raw, core_len)
    seal: dict[str, object] = {}
    if sealed:
        at = core_len + 8 * num_layers
        tags_at = at + NONCE_BYTES + 4
        mac_at = tags_at + LAYER_TAG_BYTES * num_layers
        seal = {
            "signed": bytes(raw[:mac_at]),
            "nonce": bytes(raw[at : at + NONCE_BYTES]),
            "tags": tuple(bytes(raw[tags_at + i * LAYER_TAG_BYTES : tags_at + (i + 1) * LAYER_TAG_BYTES])
                          for i in range(num_layers)),
            "mac": bytes(raw[mac_at : mac_at + MAC_BYTES]),
        }
    elif flags & FLAG_ENCRYPTED:
        raise CorruptChunkError("chunk header says encrypted but carries no seal")
    dtype_name = dtype_raw.rstrip(b"\x00").decode("ascii", "replace")
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise CorruptChunkError(f"unknown dtype {dtype_name!r} in chunk header")
    expected_nbytes = dtype.itemsize
    for s in shape:
        expected_nbytes *= s
    if expected_nbytes != nbytes or nbytes % num_layers or data_offset != align(hlen):
        raise CorruptChunkError("chunk header sizes are inconsistent")
    if not 0 <= written_at <= MAX_WRITTEN_AT:  # NaN fails the comparison too
        raise CorruptChunkError(f"chunk header written_at={written_at!r} is not a time (unix seconds up to the year "
                                f"9999)")
    if expected_key is not None and key != expected_key:
        raise CorruptChunkError(f"chunk header holds key {key.hex()} but {expected_key.hex()} was expected")
    meta = ChunkMeta(
        key=key,
        parent=parent,
        parent_is_root=bool(flags & FLAG_PARENT_IS_ROOT),
        num_tokens=num_tokens,
        partial=bool(flags & FLAG_PARTIAL),
        digest=digest,
        owner=None if owner is None else (b"" if owner == _NO_OWNER else owner),
    )
    return ChunkHeader(meta, dtype, tuple(shape), tuple(checksums), data_offset, nbytes, written_at, flags,
                       bytes(raw[:core_len]), **seal)  # type: ignore[arg-type]


def verify_seal(header: ChunkHeader, sealer: Sealer | None, root: bytes) -> None:
    """With a ``sealer``: the header must be sealed and its MAC valid under ``root`` (``ForgedChunkError``).
    Without one (an insecure reader) nothing more is checked here, but an encrypted chunk cannot be read."""
    key = header.meta.key
    if sealer is None:
        if header.encrypted:
            raise CorruptChunkError(f"chunk {key.hex()} is encrypted and this reader has no secret")
        return
    if not header.sealed:
        raise ForgedChunkError(f"chunk {key.hex()} carries no MAC (written without the secret)")
    sealer.check_header(root, header.signed, header.mac, key)


def open_layer(header: ChunkHeader, layer: int, stored: memoryview, sealer: Sealer | None, root: bytes) \
        -> memoryview | bytes:
    """Layer ``layer``'s plaintext bytes from its ``stored`` bytes, verified: its AES-GCM tag (decrypting), its GMAC
    tag, or (no ``sealer``) its xxh3 checksum; the header must have passed ``verify_seal`` with the same
    ``sealer`` and ``root``. Raises ``ForgedChunkError`` / ``CorruptChunkError``."""
    key = header.meta.key
    if sealer is None or not header.sealed:
        check_layers(header, stored, key, layer)
        return stored
    if header.encrypted:
        return sealer.open_layer(root, header.nonce, layer, header.core, stored, header.tags[layer], key)
    if not hmac.compare_digest(sealer.layer_tag(header.nonce, layer, stored), header.tags[layer]):
        raise ForgedChunkError(f"chunk {key.hex()} layer {layer}: MAC mismatch (forged or tampered)")
    return stored


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
