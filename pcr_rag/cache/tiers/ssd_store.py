"""``SSDStore``: chunk files (``chunk_file`` format) on a ``StorageBackend``, verified reads, restart recovery.

Every read verifies what it returns (header, key, file size, the checksum of each layer returned) and raises
``CorruptChunkError`` otherwise; the caller drops the chunk and recomputes it.

With a ``sealer`` (``CacheConfig.ssd_secret``) every file is sealed and encrypted (``chunk_file.seal_chunk``:
one AES-GCM message per layer, so a layer is still read, verified and decrypted on its own); a file without a
valid seal fails as forged (``ForgedChunkError``). SSD files are local, so they are sealed under one key for the
directory (no namespace root).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
import xxhash

from pcr_rag.cache.errors import CorruptChunkError
from pcr_rag.cache.roots import (
    MAX_MANIFEST_BYTES,
    ManifestError,
    RootManifest,
    manifest_name,
    root_of_manifest_name,
)
from pcr_rag.cache.seal import Sealer
from pcr_rag.cache.storage import BlobReader, DeferredHead, StorageBackend, aligned_scratch
from pcr_rag.cache.tiers.chunk_file import (
    ALIGN,
    ChunkHeader,
    ChunkMeta,
    align,
    byte_view,
    check_layers,
    chunk_name,
    decode_header,
    encode_header,
    header_bytes,
    key_of_name,
    open_layer,
    read_header,
    seal_chunk,
    verify_seal,
)

__all__ = ["RecoveryReport", "SSDLayerReader", "SSDStore"]

log = logging.getLogger(__name__)

_ROOT = b""  # SSD files are sealed without a namespace root (see the module docstring)


def _open_layers(header: ChunkHeader, stored: memoryview, sealer: Sealer | None, first_layer: int = 0) -> None:
    """Verify the layers held back to back in ``stored`` (from ``first_layer``), decrypting them in place."""
    if sealer is None or not header.sealed:
        verify_seal(header, sealer, _ROOT)  # an encrypted file and no secret: CorruptChunkError
        check_layers(header, stored, header.meta.key, first_layer)
        return
    lb = header.layer_nbytes
    for i in range(stored.nbytes // lb):
        part = stored[i * lb : (i + 1) * lb]
        plain = open_layer(header, first_layer + i, part, sealer, _ROOT)
        if plain is not part:
            part[:] = plain


@dataclass(frozen=True)
class RecoveryReport:
    """The valid chunk headers found at start-up (oldest write first), how many bad files were deleted, and the
    roots whose manifest (`pcr_rag.cache.roots`) is stored."""

    headers: list[ChunkHeader]
    corrupt: int
    manifests: frozenset[bytes] = frozenset()


def _aligned_buffer(nbytes: int, pin_memory: bool) -> torch.Tensor:
    """``nbytes`` uninitialised bytes whose storage starts 4096-aligned (an O_DIRECT read lands in it directly).
    Page-locked buffers come page-aligned from the host allocator, so they get no slack: it rounds every request up
    to a power of two, and 4 KiB of slack would double a 32 MiB chunk's locked memory (`pinned_footprint`)."""
    if pin_memory:
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN == 0:
            return raw
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


class SSDStore:
    """Chunk files on a ``StorageBackend`` plus an index (key -> file bytes) of what is stored.

    Thread-safe: distinct keys may be written and read concurrently; the engine guarantees that one key is never
    written while it is read or deleted."""

    def __init__(self, backend: StorageBackend, *, pin_memory: bool = False, sealer: Sealer | None = None) -> None:
        self.backend = backend
        self.pin_memory = pin_memory
        self.sealer = sealer
        self.index: dict[bytes, tuple[int, int]] = {}  # key -> (file bytes, data offset)
        self._mutex = threading.Lock()

    # ------------------------------------------------------------------ write / delete
    def write(self, meta: ChunkMeta, payload: torch.Tensor) -> int:
        """Store ``payload`` (a contiguous CPU tensor) for ``meta.key``; returns the file size in bytes.
        Raises OSError on I/O failure (nothing is left behind)."""
        if payload.device.type != "cpu":
            payload = payload.cpu()
        payload = payload.contiguous()
        data = byte_view(payload)
        layer_bytes = data.nbytes // payload.shape[0]
        sealed = self.sealer is not None
        if self.sealer is not None:
            head, data = seal_chunk(meta, payload, self.sealer, _ROOT)

            def header() -> bytes:
                return head
        else:

            def header() -> bytes:  # checksums are computed while the payload is being written
                checksums = [
                    xxhash.xxh3_64_intdigest(data[i * layer_bytes : (i + 1) * layer_bytes])
                    for i in range(payload.shape[0])
                ]
                return encode_header(meta, payload, checksums)

        head_bytes = header_bytes(payload.dim(), payload.shape[0], sealed, meta.owner is not None)
        pad = b"\x00" * (align(data.nbytes) - data.nbytes)
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
            header = read_header(reader, key)
            verify_seal(header, self.sealer, _ROOT)
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
                body = _aligned_buffer(align(header.payload_nbytes), self.pin_memory)
                out = body[: header.payload_nbytes].view(header.dtype).view(header.shape)
                padded = memoryview(body.numpy())
            else:
                if tuple(out.shape) != header.shape or out.dtype != header.dtype or not out.is_contiguous():
                    raise ValueError(
                        f"out must be a contiguous {header.dtype} tensor of shape {header.shape}, got "
                        f"{out.dtype} {tuple(out.shape)}"
                    )
                padded = byte_view(out)
            got = reader.readinto_at(header.data_offset, padded)
        finally:
            reader.close()
        if got < header.payload_nbytes:
            raise CorruptChunkError(f"chunk payload short read ({got} of {header.payload_nbytes} bytes)")
        _open_layers(header, byte_view(out), self.sealer)
        return out

    def _read_whole(
        self, key: bytes, file_bytes: int, data_offset: int, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Header and payload in one I/O: into one aligned buffer (the payload tensor is a view past the header),
        or header into scratch and payload straight into ``out`` - or, page-locked, into a buffer of the payload's
        own (the copy a pinned DRAM tier keeps then locks no header bytes: `pinned_footprint`). None when the file
        is not the size the index expects or ``out`` does not fit the fast path (the caller then reads step by
        step)."""
        padded_payload = file_bytes - data_offset
        own: torch.Tensor | None = None  # a page-locked payload buffer of this read's own
        if out is not None and (
            out.nbytes != padded_payload or not out.is_contiguous() or out.device.type != "cpu"
        ):
            return None
        reader = self.backend.open(chunk_name(key))
        try:
            if reader.size != file_bytes:
                return None
            if out is None and self.pin_memory:
                own = _aligned_buffer(padded_payload, True)
            if out is None and own is None:
                body = _aligned_buffer(file_bytes, self.pin_memory)
                got = reader.readv_at(0, [memoryview(body.numpy())])
                head = memoryview(body.numpy())[:data_offset]
                payload_bytes = memoryview(body.numpy())[data_offset:]
            else:
                head = aligned_scratch(data_offset, "ssd-header")[
                    :data_offset
                ]  # copied out by bytes(head) below
                payload_bytes = memoryview(own.numpy()) if own is not None else byte_view(out)
                got = reader.readv_at(0, [head, payload_bytes])
        finally:
            reader.close()
        header = decode_header(bytes(head), expected_key=key)
        verify_seal(header, self.sealer, _ROOT)
        if header.file_bytes != file_bytes or header.data_offset != data_offset or got != file_bytes:
            raise CorruptChunkError(f"chunk file read {got} bytes, header says {header.file_bytes}")
        if out is not None and (tuple(out.shape) != header.shape or out.dtype != header.dtype):
            raise ValueError(f"out must be a {header.dtype} tensor of shape {header.shape}")
        _open_layers(header, payload_bytes[: header.payload_nbytes], self.sealer)
        if out is not None:
            return out
        if own is not None:
            return own[: header.payload_nbytes].view(header.dtype).view(header.shape)
        return body[data_offset : data_offset + header.payload_nbytes].view(header.dtype).view(header.shape)

    def open_layers(self, key: bytes) -> SSDLayerReader:
        """Open a chunk once (header read and verified once) to read its layers one by one (layer-wise loads)."""
        reader, header = self._open_verified(key)
        return SSDLayerReader(key, reader, header, self.pin_memory, self.sealer)

    def read_layer(self, key: bytes, layer: int) -> torch.Tensor:
        """One layer ``[2, kv_heads, tokens, head_dim]``, verified; reads only that layer's bytes."""
        with self.open_layers(key) as layers:
            return layers.read_layer(layer)

    # ------------------------------------------------------------------ recovery
    def recover(self) -> RecoveryReport:
        """Scan the backend: remove temp files of interrupted writes, verify every chunk header (and file size),
        delete files that fail, rebuild the index. Payload checksums are verified later, on read. Returns the
        valid headers, oldest write first."""
        remove_temp = getattr(
            self.backend, "remove_temp_files", None
        )  # a backend without temp files has none
        if callable(remove_temp):
            remove_temp()
        headers: list[ChunkHeader] = []
        corrupt = 0
        manifests: set[bytes] = set()
        for name in list(self.backend.names()):
            key = key_of_name(name)
            if key is None:
                root = root_of_manifest_name(name)
                if root is not None:
                    manifests.add(root)
                else:
                    log.debug("ignoring foreign file %s in the SSD store", name)
                continue
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
        return RecoveryReport(headers, corrupt, frozenset(manifests))

    # ------------------------------------------------------------------ root manifests
    def write_manifest(self, manifest: RootManifest) -> None:
        """Store ``manifest`` as its root's manifest blob (atomic; raises OSError)."""
        self.backend.write_atomic(manifest_name(manifest.root), [manifest.encode()])

    def read_manifest(self, root: bytes) -> RootManifest | None:
        """``root``'s stored manifest; None when it has none or it is unreadable or malformed (logged)."""
        try:
            reader = self.backend.open(manifest_name(root))
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot open the manifest of cache root %s: %s", root.hex(), exc)
            return None
        try:
            if reader.size > MAX_MANIFEST_BYTES:
                raise ManifestError(f"manifest of root {root.hex()} is {reader.size} bytes, not a manifest")
            return RootManifest.decode(reader.read_at(0, reader.size), root)
        except (ManifestError, OSError) as exc:
            log.warning("ignoring the manifest of cache root %s: %s", root.hex(), exc)
            return None
        finally:
            reader.close()

    def delete_manifest(self, root: bytes) -> bool:
        """Remove ``root``'s manifest; False when it had none."""
        return bool(self.backend.delete(manifest_name(root)))


class SSDLayerReader:
    """An open chunk file whose header was verified once; `read_layer` reads and verifies one layer's bytes.

    ``out`` (a contiguous tensor of the layer's shape and dtype, e.g. a reused staging buffer) avoids a fresh
    allocation per layer. Not thread-safe; close it (or use it as a context manager) when done."""

    def __init__(self, key: bytes, reader: BlobReader, header: ChunkHeader, pin_memory: bool,
                 sealer: Sealer | None = None) -> None:
        self.key = key
        self._reader = reader
        self.header = header
        self._pin = pin_memory
        self._sealer = sealer

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
        view = byte_view(out)
        lb = h.layer_nbytes
        got = self._reader.readinto_at(h.data_offset + layer * lb, view)
        if got != lb:
            raise CorruptChunkError(f"chunk {self.key.hex()} layer {layer} failed verification (short read)")
        _open_layers(h, view, self._sealer, layer)
        return out

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> SSDLayerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
