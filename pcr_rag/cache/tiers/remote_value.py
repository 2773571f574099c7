"""The remote tier's values: one self-describing value per chunk, in the chunk file format (``chunk_file``).

A value is the chunk file's header (magic, version, key, parent, root/partial flags, token count, tokens
digest, dtype, shape, per-layer xxh3-64 checksums, the seal, header checksum; padded to its ``data_offset``)
followed by the payload bytes, without the file's trailing padding. Its name is ``<namespace>:<chunk key hex>``:
the chained blake2b chunk keys are the same in every process and on every machine, so replicas find each other's
values.

Trust (the store is writable by others, so nothing in a value is believed on its own):

- With a secret (``ValueCodec.sealer``) every value is sealed: a header MAC over the namespace root and every
  header byte, and a tag per layer (AES-GMAC, or AES-GCM when encrypted) that the header MAC covers. The root is
  never stored: the first chunk of a chain stores a zero parent, and the reader supplies the root it expects.
- A reader also checks the authenticated header against what it knows itself (``Expected``, or the chunk node):
  the parent, the token count, the partial flag and tokens digest of its own chunk plan, and the engine's KV
  layout (dtype and shape). Any contradiction raises ``ForgedChunkError``; structural damage (truncation, bad
  magic, a checksum) ``CorruptChunkError``.
- Sizes come from the reader's KV layout and the chunk's token count, never from the header.

Metadata-only chunks (the simulator) are stored as a short record of their sizes (``VIRTUAL_MAGIC``), followed by
a MAC when sealed.

Root manifests (``pcr_rag.cache.roots.RootManifest``: which model, plan and kernels a namespace root stands for) are
values too, one per root, named ``<namespace>:root:<root hex>`` (a chunk name never holds a second ``:``):
``MANIFEST_MAGIC``, a sealed flag, the manifest's JSON and, when sealed, an HMAC over the root and all of that under
the header key (the magic keeps it from ever verifying as a chunk header, whose signed bytes start with
``chunk_file.MAGIC``). A reader reads at most ``MAX_MANIFEST_VALUE_BYTES`` + 1 of one.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

import torch
import xxhash

from pcr_rag.cache.config import KVLayout
from pcr_rag.cache.errors import CorruptChunkError
from pcr_rag.cache.keys import KEY_BYTES
from pcr_rag.cache.roots import MAX_MANIFEST_BYTES, ManifestError, RootManifest
from pcr_rag.cache.seal import MAC_BYTES, ForgedChunkError, Sealer
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
    open_layer,
    seal_chunk,
    verify_seal,
)

__all__ = [
    "MAX_MANIFEST_VALUE_BYTES",
    "PROBE_BYTES",
    "Expected",
    "RemoteHeader",
    "ValueCodec",
    "header_len_needed",
    "manifest_prefix",
    "manifest_value_name",
    "root_of_manifest_value",
    "value_bytes",
    "value_name",
]

#: Bytes a lookup reads from the start of each value: the fixed header, checksums and seal of up to ~30 layers
#: (a longer header is read again in full).
PROBE_BYTES = 1024
VIRTUAL_MAGIC = b"PCRKVVT\x00"
_VIRTUAL = struct.Struct("<8s16s16s16sBIQI")  # magic, key, parent, digest, flags, tokens, nbytes, layers
_FLAG_ROOT, _FLAG_PARTIAL, _FLAG_SEALED = 1, 2, 4
_ZERO_PARENT = NO_DIGEST  # the parent field of a chain's first chunk: the root is never stored
MANIFEST_MAGIC = b"PCRROOT\x00"
_MANIFEST_HEAD = len(MANIFEST_MAGIC) + 1  # magic, sealed flag
#: The longest root manifest value: its head, the longest manifest and a MAC.
MAX_MANIFEST_VALUE_BYTES = _MANIFEST_HEAD + MAX_MANIFEST_BYTES + MAC_BYTES


def value_name(namespace: str, key: bytes) -> str:
    """The store key of a chunk: ``<namespace>:<key hex>``."""
    return f"{namespace}:{key.hex()}"


def manifest_prefix(namespace: str) -> str:
    """What the names of every root manifest of ``namespace`` start with."""
    return f"{namespace}:root:"


def manifest_value_name(namespace: str, root: bytes) -> str:
    """The store key of a namespace root's manifest: ``<namespace>:root:<root hex>``."""
    return f"{manifest_prefix(namespace)}{root.hex()}"


def root_of_manifest_value(namespace: str, name: str) -> bytes | None:
    """The root a store key names the manifest of (None: not a manifest name of ``namespace``)."""
    prefix = manifest_prefix(namespace)
    digits = name[len(prefix) :] if name.startswith(prefix) else ""
    if len(digits) != 2 * KEY_BYTES or any(c not in "0123456789abcdef" for c in digits):
        return None
    return bytes.fromhex(digits)


def value_bytes(chunk: ChunkRef | ChunkRecord, sealed: bool = True) -> int:
    """Bytes a chunk's value occupies in the store (header padded to its data offset + payload)."""
    return header_bytes(5, chunk.num_layers, sealed) + chunk.nbytes


@dataclass(frozen=True)
class RemoteHeader:
    """What a lookup learns about a stored value: enough to add the chunk's node to the tree (sizes from the
    reader's KV layout)."""

    record: ChunkRecord
    value_bytes: int


@dataclass(frozen=True)
class Expected:
    """What a reader knows of a chunk before reading its value: its key, its namespace root, its parent (None:
    the chunk starts its chain, its parent is ``root``), and from its chunk plan, where known, its token count,
    partial flag and tokens digest (None: unknown, e.g. a lookup by keys alone)."""

    key: bytes
    root: bytes
    parent: bytes | None
    num_tokens: int | None = None
    partial: bool | None = None
    digest: bytes | None = None


def header_len_needed(raw: bytes) -> int | None:
    """When ``raw`` (a value's first ``PROBE_BYTES``) is too short for the header it announces, the bytes to read
    instead; None when ``raw`` is enough (or is no header at all: decoding then says what is wrong)."""
    if raw[:8] == VIRTUAL_MAGIC:
        return None
    hlen = announced_header_len(raw)
    return hlen if hlen is not None and hlen > len(raw) else None


def _forged(key: bytes, what: str) -> ForgedChunkError:
    return ForgedChunkError(f"value of chunk {key.hex()}: {what}")


class ValueCodec:
    """Encodes and verifies values for one remote tier: its ``sealer`` (None: insecure, checksums only) and the
    engine's KV ``layout`` (None: sizes are checked against known chunks only, lookups learn nothing)."""

    def __init__(self, sealer: Sealer | None, layout: KVLayout | None) -> None:
        self.sealer = sealer
        self.layout = layout

    @property
    def sealed(self) -> bool:
        return self.sealer is not None

    # ------------------------------------------------------------------ encode
    def encode(self, chunk: ChunkRef | ChunkRecord, payload: torch.Tensor | None, root: bytes) -> bytes:
        """The value of ``chunk`` under namespace root ``root`` (``payload`` None for a metadata-only chunk)."""
        parent = _ZERO_PARENT if chunk.parent_is_root else chunk.parent_key
        digest = chunk.tokens_digest or NO_DIGEST
        if payload is None or chunk.virtual:
            flags = ((_FLAG_ROOT if chunk.parent_is_root else 0) | (_FLAG_PARTIAL if chunk.partial else 0)
                     | (_FLAG_SEALED if self.sealer is not None else 0))
            body = _VIRTUAL.pack(VIRTUAL_MAGIC, chunk.key, parent, digest, flags, chunk.num_tokens, chunk.nbytes,
                                 chunk.num_layers)
            return body + (self.sealer.sign_header(root, body) if self.sealer is not None else b"")
        if payload.device.type != "cpu":
            payload = payload.cpu()
        payload = payload.contiguous()
        meta = ChunkMeta(chunk.key, parent, chunk.parent_is_root, chunk.num_tokens, chunk.partial, digest)
        if self.sealer is not None:
            head, stored = seal_chunk(meta, payload, self.sealer, root)
            return b"".join((head, stored))
        data = byte_view(payload)
        lb = data.nbytes // payload.shape[0]
        checksums = [xxhash.xxh3_64_intdigest(data[i * lb : (i + 1) * lb]) for i in range(payload.shape[0])]
        return b"".join((encode_header(meta, payload, checksums), data))

    # ------------------------------------------------------------------ lookups
    def probe(self, raw: bytes, exp: Expected) -> RemoteHeader:
        """The chunk a value's first bytes describe, verified and checked against ``exp`` (sized by the layout,
        which is required); ``ForgedChunkError`` / ``CorruptChunkError`` otherwise."""
        if self.layout is None:
            raise CorruptChunkError("the remote tier has no KV layout to size chunks by")
        if raw[:8] == VIRTUAL_MAGIC:
            meta, nbytes, num_layers = self._virtual(raw, exp.key, exp.root)
            if nbytes != self.layout.nbytes(meta.num_tokens) or num_layers != self.layout.num_layers:
                raise _forged(exp.key, "metadata-only sizes differ from the engine's KV layout")
        else:
            header = self._header(raw, exp.key)
            verify_seal(header, self.sealer, exp.root)
            meta = header.meta
            self._check_layout(header)
        self._check_plan(meta, exp)
        layout = self.layout
        record = ChunkRecord(exp.key, exp.root if meta.parent_is_root else meta.parent, meta.parent_is_root,
                             meta.num_tokens, meta.partial, meta.digest if meta.digest != NO_DIGEST else None,
                             layout.nbytes(meta.num_tokens), layout.num_layers, raw[:8] == VIRTUAL_MAGIC)
        return RemoteHeader(record, value_bytes(record, self.sealed))

    @staticmethod
    def _header(raw: bytes, key: bytes) -> ChunkHeader:
        """The header of a value stored under ``key``; one naming another key was moved there (forged)."""
        header = decode_header(raw)
        if header.meta.key != key:
            raise _forged(key, f"its header names chunk {header.meta.key.hex()} (moved from another key)")
        return header

    def _check_plan(self, meta: ChunkMeta, exp: Expected) -> None:
        key = exp.key
        if meta.parent_is_root != (exp.parent is None):
            raise _forged(key, "starts a chain where the reader's plan does not, or the reverse")
        if meta.parent_is_root and meta.parent != _ZERO_PARENT:
            raise _forged(key, "names a namespace root (values never store one)")
        if exp.parent is not None and meta.parent != exp.parent:
            raise _forged(key, f"names parent {meta.parent.hex()}, the reader's chain has {exp.parent.hex()}")
        if exp.num_tokens is not None and meta.num_tokens != exp.num_tokens:
            raise _forged(key, f"claims {meta.num_tokens} tokens, the reader's plan has {exp.num_tokens}")
        if exp.partial is not None and meta.partial != exp.partial:
            raise _forged(key, "partial flag differs from the reader's plan")
        if not meta.partial and meta.digest != NO_DIGEST:
            raise _forged(key, "a full chunk carries a tokens digest")
        if exp.digest is not None and meta.digest not in (NO_DIGEST, exp.digest):
            raise _forged(key, "tokens digest differs from the reader's plan")

    def _check_layout(self, header: ChunkHeader) -> None:
        layout = self.layout
        if layout is None:
            return
        want = layout.shape(header.meta.num_tokens)
        if header.dtype != layout.dtype or header.shape != want:
            raise _forged(header.meta.key, f"holds {header.dtype} {header.shape}, the engine's KV layout is "
                                           f"{layout.dtype} {want}")

    def _virtual(self, raw: bytes, key: bytes, root: bytes) -> tuple[ChunkMeta, int, int]:
        if len(raw) < _VIRTUAL.size:
            raise CorruptChunkError(f"metadata-only value truncated ({len(raw)} bytes)")
        _, k, parent, digest, flags, tokens, nbytes, layers = _VIRTUAL.unpack_from(raw, 0)
        if k != key:
            raise _forged(key, f"its record names chunk {k.hex()} (moved from another key)")
        if self.sealer is not None:
            if not flags & _FLAG_SEALED or len(raw) < _VIRTUAL.size + MAC_BYTES:
                raise _forged(key, "carries no MAC (written without the secret)")
            mac = raw[_VIRTUAL.size : _VIRTUAL.size + MAC_BYTES]
            if not hmac.compare_digest(self.sealer.sign_header(root, raw[: _VIRTUAL.size]), mac):
                raise _forged(key, "MAC mismatch (forged, or written under another secret or namespace root)")
        meta = ChunkMeta(key, parent, bool(flags & _FLAG_ROOT), tokens, bool(flags & _FLAG_PARTIAL), digest)
        return meta, nbytes, layers

    # ------------------------------------------------------------------ whole values
    def decode(self, raw: bytes, chunk: ChunkRef, root: bytes) -> tuple[ChunkHeader | None, memoryview | None]:
        """A whole value as (header, its stored payload bytes: a view over ``raw``), header and length verified
        and checked against ``chunk`` (the engine's own node: parent, tokens, partial flag, digest, sizes, and
        the KV layout); layers are verified by ``layer``. (None, None) for a metadata-only value."""
        key = chunk.key
        exp = Expected(key, root, None if chunk.parent_is_root else chunk.parent_key, chunk.num_tokens,
                       chunk.partial, chunk.tokens_digest)
        if raw[:8] == VIRTUAL_MAGIC:
            meta, nbytes, layers = self._virtual(raw, key, root)
            self._check_plan(meta, exp)
            if nbytes != chunk.nbytes or layers != chunk.num_layers:
                raise _forged(key, "metadata-only value does not match the chunk's sizes")
            return None, None
        header = self._header(raw, key)
        verify_seal(header, self.sealer, root)  # the header alone: authentic, and of this plan and layout
        self._check_plan(header.meta, exp)
        self._check_layout(header)
        if header.payload_nbytes != chunk.nbytes or header.shape[0] != chunk.num_layers:
            raise _forged(key, f"holds {header.payload_nbytes} bytes in {header.shape[0]} layers, the chunk has "
                               f"{chunk.nbytes} in {chunk.num_layers}")
        size = header.data_offset + header.payload_nbytes
        if len(raw) != size:  # a read stops one byte past the layout's size: more is padding
            raise CorruptChunkError(f"value is {len(raw)}{' or more' if len(raw) > size else ''} bytes, its header "
                                    f"says {size} (truncated or padded)")
        return header, memoryview(raw)[header.data_offset :]

    def layer(self, header: ChunkHeader, stored: memoryview, layer: int, root: bytes) -> torch.Tensor:
        """Layer ``layer`` of a decoded value, verified (and decrypted): a view over the fetched bytes, or a new
        tensor when encrypted. Raises ``ForgedChunkError`` / ``CorruptChunkError`` naming the layer."""
        lb = header.layer_nbytes
        plain = open_layer(header, layer, stored[layer * lb : (layer + 1) * lb], self.sealer, root)
        return torch.frombuffer(plain, dtype=torch.uint8).view(header.dtype).view(header.shape[1:])

    def payload(self, header: ChunkHeader, stored: memoryview, root: bytes) -> torch.Tensor:
        """The whole payload of a decoded value, every layer verified (and decrypted)."""
        if self.sealer is None or not header.sealed:
            check_layers(header, stored, header.meta.key)
            flat = torch.frombuffer(stored, dtype=torch.uint8, count=header.payload_nbytes)
            return flat.view(header.dtype).view(header.shape)
        if not header.encrypted:
            for i in range(header.shape[0]):
                self.layer(header, stored, i, root)
            flat = torch.frombuffer(stored, dtype=torch.uint8, count=header.payload_nbytes)
            return flat.view(header.dtype).view(header.shape)
        out = torch.empty(header.payload_nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
        lb = header.layer_nbytes
        for i in range(header.shape[0]):
            view[i * lb : (i + 1) * lb] = open_layer(header, i, stored[i * lb : (i + 1) * lb], self.sealer, root)
        return out.view(header.dtype).view(header.shape)

    # ------------------------------------------------------------------ root manifests
    def encode_manifest(self, manifest: RootManifest) -> bytes:
        """The store value of ``manifest`` (sealed under its root when this tier has a secret)."""
        signed = MANIFEST_MAGIC + bytes([self.sealer is not None]) + manifest.encode()
        return signed + self.sealer.sign_header(manifest.root, signed) if self.sealer is not None else signed

    def decode_manifest(self, raw: bytes, root: bytes) -> RootManifest:
        """The manifest a value read from ``root``'s manifest name holds; ``ManifestError`` when it is none (too
        long, malformed, of another root) and ``ForgedChunkError`` when this tier has a secret and its MAC fails or
        is missing."""
        if len(raw) > MAX_MANIFEST_VALUE_BYTES:
            raise ManifestError(f"the value of root {root.hex()}'s manifest is {len(raw)} bytes or more, not a "
                                f"manifest")
        if len(raw) < _MANIFEST_HEAD or raw[: len(MANIFEST_MAGIC)] != MANIFEST_MAGIC or raw[8] not in (0, 1):
            raise ManifestError(f"the value of root {root.hex()}'s manifest does not start as a manifest")
        sealed = raw[8] == 1
        body = raw[_MANIFEST_HEAD : len(raw) - MAC_BYTES] if sealed else raw[_MANIFEST_HEAD:]
        if self.sealer is not None:
            if not sealed or len(raw) < _MANIFEST_HEAD + MAC_BYTES:
                raise ForgedChunkError(f"manifest of root {root.hex()}: carries no MAC (written without the secret)")
            signed, mac = raw[: len(raw) - MAC_BYTES], raw[len(raw) - MAC_BYTES :]
            if not hmac.compare_digest(self.sealer.sign_header(root, signed), mac):
                raise ForgedChunkError(f"manifest of root {root.hex()}: MAC mismatch (forged, or written under "
                                       f"another secret or root)")
        return RootManifest.decode(body, root)
