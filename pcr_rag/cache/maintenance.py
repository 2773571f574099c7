"""Offline maintenance of an SSD cache directory (``pcr-rag cache``): what it holds per root, pruning, verifying.

Everything here works on a `StorageBackend` (a `LocalDirBackend` for a directory) with no engine running on it:
`scan` reads every chunk header (not the payloads) and every root manifest; `summarize` groups the chunks by root
identity (`pcr_rag.cache.roots`); `prune_unusable` / `prune_older` delete chunk files (and the manifests of roots
left empty); `verify` reads every chunk file in full and checks it as a reader would. The caller holds the
backend's lock for anything that deletes, so an engine cannot be using the directory meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from pcr_rag.cache.errors import CorruptChunkError
from pcr_rag.cache.roots import (
    RootIdentity,
    RootManifest,
    RootUsage,
    attribute,
    manifest_name,
    root_of_manifest_name,
)
from pcr_rag.cache.seal import ForgedChunkError, LayerCheck, Sealer
from pcr_rag.cache.storage import StorageBackend
from pcr_rag.cache.tiers.chunk_file import (
    ChunkHeader,
    chunk_name,
    key_of_name,
    read_header,
    verify_seal,
)
from pcr_rag.cache.tiers.ssd_store import SSDStore

__all__ = [
    "ChunkEntry",
    "DirScan",
    "PruneResult",
    "RootGroup",
    "VerifyResult",
    "prune_older",
    "prune_unusable",
    "scan",
    "summarize",
    "verify",
]

log = logging.getLogger(__name__)

VERIFY_SLICE_BYTES = 4 << 20  # bytes `verify` reads at a time: its memory, whatever a header claims
_ROOT = b""  # SSD files are sealed without a namespace root (`ssd_store`)


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk file whose header decoded: its key, parent link, file bytes and write time (unix s)."""

    key: bytes
    parent: bytes
    parent_is_root: bool
    file_bytes: int
    written_at: float
    sealed: bool


@dataclass(frozen=True)
class DirScan:
    """What a backend holds: readable chunks, unreadable chunk files (name, reason), each chunk's root (None for an
    orphan) and the root manifests that parse (name -> reason for those that do not)."""

    chunks: tuple[ChunkEntry, ...]
    unreadable: tuple[tuple[str, str], ...]
    root_of: dict[bytes, bytes | None]
    manifests: dict[bytes, RootManifest]
    bad_manifests: tuple[tuple[str, str], ...] = ()

    def usage(self) -> dict[bytes | None, RootUsage]:
        """Per root (None: orphans), its chunks' usage."""
        out: dict[bytes | None, RootUsage] = {}
        for c in self.chunks:
            root = self.root_of.get(c.key)
            prev = out.get(root)
            out[root] = (RootUsage(1, c.file_bytes, c.written_at, c.written_at) if prev is None
                         else prev.plus(c.file_bytes, c.written_at))
        return out


def _read_header(backend: StorageBackend, key: bytes) -> tuple[ChunkHeader, int]:
    """``key``'s header, decoded and checked against its name, and the file size; CorruptChunkError / OSError."""
    reader = backend.open(chunk_name(key))
    try:
        return read_header(reader, key), reader.size
    finally:
        reader.close()


def scan(backend: StorageBackend) -> DirScan:
    """Read every chunk header and root manifest under ``backend`` (payloads are not read; see `verify`)."""
    store = SSDStore(backend)
    chunks: list[ChunkEntry] = []
    unreadable: list[tuple[str, str]] = []
    manifests: dict[bytes, RootManifest] = {}
    bad_manifests: list[tuple[str, str]] = []
    for name in sorted(backend.names()):
        key = key_of_name(name)
        if key is None:
            root = root_of_manifest_name(name)
            if root is not None:
                manifest = store.read_manifest(root)
                if manifest is None:
                    bad_manifests.append((name, "unreadable or malformed"))
                else:
                    manifests[root] = manifest
            continue
        try:
            header, size = _read_header(backend, key)
        except FileNotFoundError:
            continue  # deleted since it was listed (an engine evicting)
        except (CorruptChunkError, OSError) as exc:
            unreadable.append((name, str(exc)))
            continue
        m = header.meta
        chunks.append(ChunkEntry(m.key, m.parent, m.parent_is_root, size, header.written_at, header.sealed))
    root_of = attribute({c.key: (c.parent, c.parent_is_root) for c in chunks})
    return DirScan(tuple(chunks), tuple(unreadable), root_of, manifests, tuple(bad_manifests))


@dataclass(frozen=True)
class RootGroup:
    """The roots of one identity (None: roots of unknown origin, each its own group), their chunks' usage, and
    whether the engine whose identity was given can use them (``current``: it computes the same KV)."""

    identity: RootIdentity | None
    roots: tuple[bytes, ...]
    usage: RootUsage
    current: bool
    hosts: tuple[str, ...] = ()  # the hosts whose engines wrote the manifests (`roots.host_description`)

    @property
    def namespaces(self) -> int:
        return len(self.roots)


def summarize(found: DirScan, identity: RootIdentity | None = None,
              own_roots: Iterable[bytes] = ()) -> list[RootGroup]:
    """Chunks grouped by root identity, largest first (orphans left out: `DirScan.usage`). A group is current when
    ``identity`` is `compatible` with its manifest's, or, without a manifest, when its root is one of
    ``own_roots``."""
    own = set(own_roots)
    groups: dict[object, tuple[RootIdentity | None, list[bytes], RootUsage, bool]] = {}
    for root, usage in found.usage().items():
        if root is None:
            continue
        manifest = found.manifests.get(root)
        ident = manifest.identity if manifest is not None else None
        current = (root in own) or (identity is not None and ident is not None and identity.compatible(ident))
        if ident is None and current and identity is not None:
            ident = identity  # one of the engine's own roots, written before manifests
        group_key: object = ((ident.fingerprint, ident.dtype, ident.chunk_size, ident.plan, ident.kernels) if ident
                             else root)
        prev = groups.get(group_key)
        if prev is None:
            groups[group_key] = (ident, [root], usage, current)
        else:
            u = prev[2]
            merged = RootUsage(u.chunks + usage.chunks, u.nbytes + usage.nbytes, min(u.oldest, usage.oldest),
                               max(u.newest, usage.newest))
            groups[group_key] = (prev[0], [*prev[1], root], merged, prev[3] or current)
    out = [RootGroup(ident, tuple(sorted(roots)), usage, current,
                     tuple(sorted({found.manifests[r].host for r in roots if r in found.manifests} - {""})))
           for ident, roots, usage, current in groups.values()]
    return sorted(out, key=lambda g: (not g.current, -g.usage.nbytes))


@dataclass(frozen=True)
class PruneResult:
    """What a prune removed (or, with ``dry_run``, would remove): chunk files, their bytes, the roots left without
    chunks (their manifests removed too), and the deletions that failed (name, reason)."""

    chunks: int
    nbytes: int
    roots: tuple[bytes, ...]
    dry_run: bool
    failed: tuple[tuple[str, str], ...] = field(default=())


def _remove(backend: StorageBackend, found: DirScan, doomed: set[bytes], dry_run: bool) -> PruneResult:
    """Delete the chunks ``doomed`` and every chunk whose chain runs through one (an orphan the next start would
    drop anyway), then the manifests of roots that no chunk is left under."""
    by_key = {c.key: c for c in found.chunks}
    doomed = set(doomed)
    for c in found.chunks:  # descendants: follow each chain up to a doomed chunk (memoized)
        if c.key in doomed:
            continue
        path: list[bytes] = []
        seen: set[bytes] = set()
        key: bytes | None = c.key
        while key is not None and key in by_key and key not in doomed and key not in seen:
            entry = by_key[key]
            path.append(key)
            seen.add(key)
            key = None if entry.parent_is_root else entry.parent
        if key is not None and key in doomed:
            doomed.update(path)
    failed: list[tuple[str, str]] = []
    nbytes = 0
    removed = 0
    for key in sorted(doomed):
        name = chunk_name(key)
        if not dry_run:
            try:
                backend.delete(name)
            except OSError as exc:
                failed.append((name, str(exc)))
                continue
        removed += 1
        nbytes += by_key[key].file_bytes
    left = {found.root_of.get(c.key) for c in found.chunks if c.key not in doomed}
    emptied = tuple(sorted({found.root_of.get(k) for k in doomed} - left - {None}))  # type: ignore[arg-type]
    for root in emptied:
        if root in found.manifests and not dry_run:
            try:
                backend.delete(manifest_name(root))
            except OSError as exc:
                failed.append((manifest_name(root), str(exc)))
    return PruneResult(removed, nbytes, emptied, dry_run, tuple(failed))


def prune_unusable(backend: StorageBackend, found: DirScan, identity: RootIdentity, own_roots: Iterable[bytes] = (),
                   *, dry_run: bool = False) -> PruneResult:
    """Remove every chunk under a root that ``identity`` cannot use (`summarize`'s non-current groups: other
    models, dtypes, chunk sizes or plans, and roots of unknown origin that are not among ``own_roots``), and the
    orphans. Manifests of other namespaces of ``identity`` are kept."""
    keep: set[bytes] = set()
    for group in summarize(found, identity, own_roots):
        if group.current:
            keep.update(group.roots)
    doomed = {c.key for c in found.chunks if found.root_of.get(c.key) not in keep}
    result = _remove(backend, found, doomed, dry_run)
    stale = tuple(r for r in found.manifests if r not in keep and r not in result.roots
                  and not any(found.root_of.get(c.key) == r for c in found.chunks))
    if not dry_run:  # manifests of roots with no chunks at all, of another identity
        for root in stale:
            try:
                backend.delete(manifest_name(root))
            except OSError as exc:
                log.warning("could not delete manifest %s: %s", manifest_name(root), exc)
    return result


def prune_older(backend: StorageBackend, found: DirScan, before: float, *, dry_run: bool = False) -> PruneResult:
    """Remove every chunk written before ``before`` (unix s), whatever its root, with the chunks that chain from
    one (they could no longer be reached)."""
    return _remove(backend, found, {c.key for c in found.chunks if c.written_at < before}, dry_run)


@dataclass(frozen=True)
class VerifyResult:
    """How many chunk files were checked, which failed (name, reason), and whether those were deleted."""

    checked: int
    bad: tuple[tuple[str, str], ...]
    deleted: bool


def _verify_one(backend: StorageBackend, key: bytes, sealer: Sealer | None) -> None:
    """Read ``key``'s file in full and check it as a reader would: header (checksum, key, sizes), then every layer -
    with ``sealer`` the header MAC and each layer's HMAC or AES-GCM tag (an unsealed file fails as forged), without
    one each layer's stored checksum. Raises CorruptChunkError (ForgedChunkError) / OSError."""
    header, _ = _read_header(backend, key)  # its sizes agree with each other and with the file's size
    if sealer is not None:
        verify_seal(header, sealer, _ROOT)
    reader = backend.open(chunk_name(key))
    try:
        lb = header.layer_nbytes
        view = memoryview(bytearray(min(lb, VERIFY_SLICE_BYTES)))  # a header's layer size never sizes a buffer
        for layer in range(header.shape[0]):
            check = _layer_check(header, layer, sealer, key)
            at, left = header.data_offset + layer * lb, lb
            while left:
                part = view[: min(left, view.nbytes)]
                got = reader.readinto_at(at, part)
                if got != part.nbytes:
                    raise CorruptChunkError(f"layer {layer}: short read ({lb - left + got} of {lb} bytes)")
                check.update(part)
                at, left = at + got, left - got
            check.finish()
    finally:
        reader.close()


class _Checksum:
    """A layer's xxh3-64 checksum check, fed slice by slice (the `LayerCheck` interface)."""

    def __init__(self, want: int, what: str) -> None:
        self._hash = xxhash.xxh3_64()
        self._want = want
        self._what = what

    def update(self, data: memoryview) -> None:
        self._hash.update(data)

    def finish(self) -> None:
        if self._hash.intdigest() != self._want:
            raise CorruptChunkError(f"{self._what} failed verification (checksum mismatch)")


def _layer_check(header: ChunkHeader, layer: int, sealer: Sealer | None, key: bytes) -> LayerCheck | _Checksum:
    """What `open_layer` checks of one layer, incrementally: its GMAC or AES-GCM tag with a ``sealer`` (the header
    then passed `verify_seal`), else its stored checksum."""
    if sealer is None or not header.sealed:
        return _Checksum(header.checksums[layer], f"chunk {key.hex()} layer {layer}")
    tag = header.tags[layer]
    return sealer.layer_check(_ROOT, header.nonce, layer, header.core, tag, key, encrypted=header.encrypted)


def verify(backend: StorageBackend, *, sealer: Sealer | None = None, delete: bool = False,
           progress: Callable[[int], None] | None = None) -> VerifyResult:
    """Check every chunk file under ``backend`` (`_verify_one`); with ``delete``, remove the ones that fail.
    Files named like chunks that cannot be opened (a link, a FIFO) count as bad too."""
    bad: list[tuple[str, str]] = []
    checked = 0
    names: Sequence[str] = sorted(n for n in backend.names() if key_of_name(n) is not None)
    for name in names:
        key = key_of_name(name)
        assert key is not None
        checked += 1
        try:
            _verify_one(backend, key, sealer)
        except FileNotFoundError:
            checked -= 1  # deleted since it was listed
            continue
        except ForgedChunkError as exc:
            bad.append((name, f"forged or written under another secret: {exc}"))
        except (CorruptChunkError, OSError) as exc:
            bad.append((name, str(exc)))
        if progress is not None:
            progress(checked)
    if delete:
        for name, _ in bad:
            try:
                backend.delete(name)
            except OSError as exc:
                log.warning("could not delete %s: %s", name, exc)
    return VerifyResult(checked, tuple(bad), delete)
