"""``RemoteTier``: the shared remote tier below SSD, one self-describing value per chunk (``remote_value``) in a
Valkey/Redis server (``remote_store``), every call through ``RemoteClient`` (breaker, timeouts, counters).

The tier is *shared*: replicas on other machines write to the same store and read each other's chunks. So:

- ``drop`` only forgets a copy locally (another replica may still use the value); a value that fails
  verification is deleted from the store, so no replica reads it again (counted in ``corrupt``, or in ``forged``
  when its MAC fails or its authenticated header contradicts the reader: see ``remote_value``).
- Every value is sealed under the replicas' secret (``RemoteConfig.secret``) and bound to its namespace root,
  which the tier finds from the chunk's node (the root its chain hangs from) and never stores.
- ``recover`` lists nothing: the engine learns remote chunks by looking them up (``probe``: the first bytes of
  each value, one pipelined round trip) after its local match ends.
- The store may evict or expire a value at any time: reading it then raises ``RemoteMissError`` (a miss; the
  engine drops the copy and the request recomputes).
- A copy costs ``value_bytes`` of the tier's budget: the budget bounds what this engine tracks, the store's
  ``maxmemory`` what it holds.
- Root manifests (``note_root``; `pcr_rag.cache.roots`): the manifest of each namespace root the engine names is
  written (``SET NX``, sealed, with the tier's ``ttl_s``) just before the first chunk under that root this engine
  writes, and with a TTL offered again each ``ttl_s`` / 2 while it writes there (so one the store expired comes back
  while its root's chunks are still written). At start the engine runs ``start_census``: a background thread reads
  the manifests the store holds (a bounded SCAN, values read up to ``MAX_MANIFEST_VALUE_BYTES``) and counts the
  roots of another identity (``roots``, in ``stats().remote_io``), logging one line when there are any. A manifest
  is never deleted (a newer replica's format may be one this one cannot read), only counted as unreadable. Nothing a
  manifest says decides what is served: another identity's chunks have other keys.

Reads fetch the whole value in one GET (a round trip per layer would cost more than the bytes), verify the
header (MAC, the chunk's own plan, the KV layout) and length at once and each layer's tag when that layer is used.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Sequence

import torch

from pcr_rag.cache.background import lower_this_thread_priority
from pcr_rag.cache.config import RemoteConfig
from pcr_rag.cache.errors import CorruptChunkError, RemoteMissError, RemoteUnavailableError
from pcr_rag.cache.payload import Payload, VirtualPayload
from pcr_rag.cache.roots import ManifestError, RootCensus, RootIdentity, RootManifest, foreign_roots_note
from pcr_rag.cache.seal import ForgedChunkError, Sealer
from pcr_rag.cache.tiers.base import ChunkRef, PayloadLayers, Tier, TierKind, TierRecovery
from pcr_rag.cache.tiers.breaker import CircuitBreaker
from pcr_rag.cache.tiers.chunk_file import ChunkHeader, header_bytes
from pcr_rag.cache.tiers.remote_client import RemoteClient
from pcr_rag.cache.tiers.remote_store import RemoteStore, redacted_url
from pcr_rag.cache.tiers.remote_url import open_store
from pcr_rag.cache.tiers.remote_value import (
    MAX_MANIFEST_VALUE_BYTES,
    PROBE_BYTES,
    Expected,
    RemoteHeader,
    ValueCodec,
    header_len_needed,
    manifest_prefix,
    manifest_value_name,
    root_of_manifest_value,
    value_bytes,
    value_name,
)

__all__ = ["RemoteTier", "open_remote_tier", "root_of"]

log = logging.getLogger(__name__)

#: Bounds of a census of the store's root manifests: manifests read, SCAN round trips (each looks at ~1000 keys, so
#: a store of up to ~1M values is walked whole), manifests read per round trip.
MAX_CENSUS_ROOTS = 1024
MAX_CENSUS_SCANS = 1024
_CENSUS_BATCH = 128

# Payloads are views over the immutable bytes a GET returned (no copy); nothing writes into a cached payload.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=r"pcr_rag\.cache\.tiers\.remote_value")


def root_of(chunk: ChunkRef) -> bytes | None:
    """The namespace root ``chunk``'s chain hangs from: its parent key when that is a root, else the root its
    tree node's ancestors end at (None for a record that is neither)."""
    if chunk.parent_is_root:
        return chunk.parent_key
    node = getattr(chunk, "parent", None)  # a tree node: parents are fixed for a node's life
    while node is not None and not node.is_root:
        node = node.parent
    return node.key if node is not None else None


class RemoteTier:
    """Chunk values in a shared store (see the module docstring)."""

    tier = Tier.REMOTE
    kind = TierKind.STORAGE
    shared = True

    def __init__(self, client: RemoteClient, config: RemoteConfig) -> None:
        self.client = client
        self.capacity_bytes = int(config.capacity_bytes)
        self.namespace = config.namespace
        self.ttl_s = config.ttl_s
        sealer = Sealer(config.secret, "remote", encrypt=config.encrypt) if config.secret is not None else None
        self.codec = ValueCodec(sealer, config.kv_layout)
        self._known: set[bytes] = set()  # keys this engine tracks as stored (``holds``)
        self._roots_lock = threading.Lock()
        self._manifests: dict[bytes, RootManifest] = {}  # roots this engine named (``note_root``)
        self._manifest_written: dict[bytes, float] = {}  # when each root's manifest was last written (monotonic s)
        self.roots: RootCensus | None = None  # the start-up census (``start_census``), once it has run
        self._closed = False  # a census still running stops reading manifests

    def name(self, key: bytes) -> str:
        return value_name(self.namespace, key)

    def charge(self, chunk: ChunkRef) -> int:
        return value_bytes(chunk, self.codec.sealed)

    def place(self, payload: Payload) -> Payload:
        return payload  # encoded (a CPU copy made if needed) by ``store``

    def store(self, chunk: ChunkRef, payload: Payload, root: bytes | None = None) -> None:
        """``SET NX``: a value another replica wrote for this key is the same chunk and stays. ``root``: the
        chunk's namespace root (default: ``root_of(chunk)``; ``ValueError`` when unknown)."""
        root = root if root is not None else root_of(chunk)
        if root is None:
            raise ValueError(f"chunk {chunk.key.hex()}: its namespace root is unknown, so it cannot be sealed")
        if self._manifests:
            self._write_manifest(root)
        tensor = None if chunk.virtual or isinstance(payload, VirtualPayload) else payload
        self.client.set_nx(self.name(chunk.key), self.codec.encode(chunk, tensor, root), self.ttl_s)
        self._known.add(chunk.key)

    # ------------------------------------------------------------------ root manifests
    def note_root(self, manifest: RootManifest) -> None:
        """Have ``manifest`` written to the store with the first chunk this tier writes under its root (no I/O
        now: ``root_for`` calls this on a request's path)."""
        with self._roots_lock:
            self._manifests.setdefault(manifest.root, manifest)

    def _write_manifest(self, root: bytes) -> None:
        """Write ``root``'s manifest when it is due (never written, or half the TTL ago). A failure is logged and
        leaves it due: the next chunk under the root tries again; the chunk's own write goes on either way."""
        now = time.monotonic()
        with self._roots_lock:
            manifest = self._manifests.get(root)
            last = self._manifest_written.get(root)
            if manifest is None or (last is not None and (self.ttl_s <= 0 or now - last < self.ttl_s / 2)):
                return
            self._manifest_written[root] = now  # one writer at a time; undone below on failure
        try:
            self.client.write_meta(manifest_value_name(self.namespace, root), self.codec.encode_manifest(manifest),
                                   self.ttl_s)
        except RemoteUnavailableError as exc:
            with self._roots_lock:
                if self._manifest_written.get(root) == now:
                    if last is None:
                        del self._manifest_written[root]
                    else:
                        self._manifest_written[root] = last
            log.debug("could not write the manifest of namespace root %s to the remote store: %s", root.hex(), exc)

    def census(self, identity: RootIdentity) -> RootCensus:
        """Read the root manifests the store holds (`read_manifests`) and count them against ``identity``; kept as
        ``roots``. Raises ``RemoteUnavailableError`` when the store cannot be read."""
        manifests, complete = self.read_manifests()
        census = RootCensus.of(identity, manifests, complete=complete)
        self.roots = census
        return census

    def read_manifests(self) -> tuple[list[RootManifest | None], bool]:
        """The root manifests the store holds (at most ``MAX_CENSUS_ROOTS``, in at most ``MAX_CENSUS_SCANS`` SCAN
        round trips, each value read up to ``MAX_MANIFEST_VALUE_BYTES``), None for a value under a manifest name
        that is not a readable manifest of its root (never raised, never deleted), and whether the scan saw the
        whole store. Used by the census and ``pcr-rag cache info --remote-url``. Raises
        ``RemoteUnavailableError`` when the store cannot be read."""
        names, complete = self.client.scan(manifest_prefix(self.namespace), MAX_CENSUS_ROOTS, MAX_CENSUS_SCANS)
        manifests: list[RootManifest | None] = []
        named = [(n, root_of_manifest_value(self.namespace, n)) for n in sorted(names)]
        manifests.extend(None for _, root in named if root is None)
        roots = [(n, root) for n, root in named if root is not None]
        for i in range(0, len(roots), _CENSUS_BATCH):
            if self._closed:
                raise RemoteUnavailableError(f"remote tier {self.describe()} closed during the census")
            batch = roots[i : i + _CENSUS_BATCH]
            raws = self.client.read_meta([n for n, _ in batch], MAX_MANIFEST_VALUE_BYTES + 1)
            for (name, root), raw in zip(batch, raws, strict=True):
                if raw is None:
                    continue  # evicted or expired since the scan
                try:
                    manifests.append(self.codec.decode_manifest(raw, root))
                except (ManifestError, CorruptChunkError) as exc:
                    log.debug("remote value %s is not a readable root manifest: %s", name, exc)
                    manifests.append(None)
        return manifests, complete

    def start_census(self, identity: RootIdentity) -> threading.Thread:
        """Run ``census`` on a background thread (never on a request's path) and log one line when the store holds
        roots of another identity (`foreign_roots_note`); a store that cannot be read is logged, never raised."""
        def run() -> None:
            lower_this_thread_priority()  # start-up work: the engine's own threads come first
            try:
                census = self.census(identity)
            except RemoteUnavailableError as exc:
                log.info("could not read the root manifests of remote store %s: %s", self.client.store.describe(),
                         exc)
                return
            except Exception:  # noqa: BLE001 - a census only informs; it must never take the engine down
                log.warning("reading the root manifests of remote store %s failed", self.client.store.describe(),
                            exc_info=True)
                return
            note = foreign_roots_note(census, identity, f"{self.client.store.describe()} namespace "
                                                        f"{self.namespace!r}")
            if note is not None:
                log.warning("%s", note)

        thread = threading.Thread(target=run, name="pcr-cache-remote-census", daemon=True)
        thread.start()
        return thread

    def learn(self, chunk: ChunkRef) -> None:
        """Track a value a lookup found (engine lock held)."""
        self._known.add(chunk.key)

    def get(self, chunk: ChunkRef) -> Payload | None:
        return None  # a value must be read (and verified) before use

    # ------------------------------------------------------------------ reads
    def _bad(self, key: bytes, exc: CorruptChunkError) -> CorruptChunkError:
        forged = isinstance(exc, ForgedChunkError)
        self.client.count("forged" if forged else "corrupt")
        self.client.delete(self.name(key))
        log.warning("remote value of chunk %s %s (%s): deleted", key.hex(),
                    "rejected as forged" if forged else "failed verification", exc)
        return exc

    def _fetch(self, chunk: ChunkRef) -> tuple[ChunkHeader | None, memoryview | None, bytes]:
        root = root_of(chunk)
        if root is None:
            raise CorruptChunkError(f"chunk {chunk.key.hex()}: its namespace root is unknown (no tree node)")
        if chunk.virtual:
            return None, None, root  # metadata-only: nothing to move (as on SSD)
        # read no more than the value this chunk's layout implies, plus one byte to tell a padded value: a writer
        # cannot make a replica take in (or hold) more than a real value of this chunk
        limit = value_bytes(chunk, sealed=True) + 1
        raw = self.client.get_many([self.name(chunk.key)], limit)[0]
        if raw is None:
            self.client.count("misses")
            raise RemoteMissError(f"the remote store no longer holds chunk {chunk.key.hex()} (evicted or expired)")
        try:
            header, stored = self.codec.decode(raw, chunk, root)
        except CorruptChunkError as exc:
            raise self._bad(chunk.key, exc) from None
        self.client.count("hits")
        return header, stored, root

    def read(self, chunk: ChunkRef) -> Payload:
        header, stored, root = self._fetch(chunk)
        if header is None or stored is None:
            return VirtualPayload(chunk.nbytes, chunk.num_layers)
        try:
            return self.codec.payload(header, stored, root)
        except CorruptChunkError as exc:
            raise self._bad(chunk.key, exc) from None

    def read_layer(self, chunk: ChunkRef, layer: int) -> torch.Tensor | VirtualPayload:
        """Fetches the whole value (one round trip), verifies and returns one layer."""
        source = self.open_layers(chunk)
        try:
            return source.read_layer(layer)
        finally:
            source.close()

    def open_layers(self, chunk: ChunkRef) -> PayloadLayers | _ValueLayers:
        header, stored, root = self._fetch(chunk)
        if header is None or stored is None:
            return PayloadLayers(VirtualPayload(chunk.nbytes, chunk.num_layers))
        return _ValueLayers(self, chunk.key, header, stored, root)

    def probe(self, expected: Sequence[Expected], *, strict: bool = True) -> list[RemoteHeader | None]:
        """What the store holds for each expected chunk (None: nothing, or a value that fails verification), from
        the first bytes of each value in one pipelined round trip (a second one for headers of > ~30 layers).
        ``strict``: a value that fails is deleted and counted; otherwise (the root was only a guess) it is left
        alone. Nothing is learned without a KV layout to size chunks by. Raises ``RemoteUnavailableError``."""
        if self.codec.layout is None:
            return [None] * len(expected)
        names = [self.name(e.key) for e in expected]
        raws = self.client.probe(names, PROBE_BYTES)
        # a header announcing more than this layout's sealed header is not a header of ours: read no more of it
        # (decoding the cut header then fails it), so a lookup's reads stay bounded by the layout
        most = header_bytes(5, self.codec.layout.num_layers, sealed=True)
        longer = {i: min(n, most) for i, raw in enumerate(raws)
                  if raw is not None and (n := header_len_needed(raw))}
        if longer:
            more = self.client.probe([names[i] for i in longer], max(longer.values()))
            for i, raw in zip(longer, more, strict=True):
                raws[i] = raw
        out: list[RemoteHeader | None] = []
        for exp, raw in zip(expected, raws, strict=True):
            if raw is None:
                out.append(None)
                continue
            try:
                out.append(self.codec.probe(raw, exp))
            except CorruptChunkError as exc:
                if strict:
                    self._bad(exp.key, exc)
                out.append(None)
        return out

    # ------------------------------------------------------------------ bookkeeping
    def drop(self, chunk: ChunkRef) -> None:
        self._known.discard(chunk.key)  # forget only: the value is shared

    def holds(self, chunk: ChunkRef) -> bool:
        return chunk.key in self._known

    def recover(self) -> TierRecovery:
        return TierRecovery()  # learned by lookups, never scanned

    def describe(self) -> str:
        return f"remote {self.client.store.describe()} namespace {self.namespace!r}"

    def close(self) -> None:
        self._closed = True
        self.client.close()


class _ValueLayers:
    """A fetched value read layer by layer; each layer is verified (and decrypted) the first time it is read."""

    def __init__(self, tier: RemoteTier, key: bytes, header: ChunkHeader, stored: memoryview, root: bytes) -> None:
        self._tier = tier
        self._key = key
        self._header = header
        self._stored = stored
        self._root = root
        self._layers: dict[int, torch.Tensor] = {}

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``layer`` (a view of the fetched value, or its decrypted copy; ``out`` is left untouched)."""
        got = self._layers.get(layer)
        if got is None:
            try:
                got = self._tier.codec.layer(self._header, self._stored, layer, self._root)
            except CorruptChunkError as exc:
                raise self._tier._bad(self._key, exc) from None
            self._layers[layer] = got
        return got

    def close(self) -> None:
        self._stored = None  # type: ignore[assignment]
        self._layers.clear()


def open_remote_tier(config: RemoteConfig, *, store: RemoteStore | None = None,
                     breaker: CircuitBreaker | None = None) -> RemoteTier:
    """The remote tier of ``config`` (``store`` / ``breaker`` injectable). Opening does not touch the network:
    an unreachable store only makes calls fail (and the breaker skip them). Without a secret (``insecure``) it
    logs one warning."""
    if config.secret is None:
        log.warning("remote tier %s runs without a secret (remote_insecure=True): its values are checked by unkeyed "
                    "checksums only, so anyone who can write to the store can change answers; set remote_secret",
                    redacted_url(config.url))
    client = RemoteClient(
        store or open_store(config),
        breaker or CircuitBreaker(config.breaker_errors, config.breaker_backoff_s),
    )
    return RemoteTier(client, config)
