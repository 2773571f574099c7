"""``RemoteTier``: the shared remote tier below SSD, one self-describing value per chunk (``remote_value``) in a
Valkey/Redis server (``remote_store``), every call through ``RemoteClient`` (breaker, timeouts, counters).

The tier is *shared*: replicas on other machines write to the same store and read each other's chunks. So:

- ``drop`` only forgets a copy locally (another replica may still use the value); a value that fails
  verification is deleted from the store, so no replica reads it again.
- ``recover`` lists nothing: the engine learns remote chunks by looking them up (``probe``: the first bytes of
  each value, one pipelined round trip) after its local match ends.
- The store may evict or expire a value at any time: reading it then raises ``RemoteMissError`` (a miss; the
  engine drops the copy and the request recomputes).
- A copy costs ``value_bytes`` of the tier's budget: the budget bounds what this engine tracks, the store's
  ``maxmemory`` what it holds.

Reads fetch the whole value in one GET (a round trip per layer would cost more than the bytes), verify the
header and length at once and each layer's checksum when that layer is used.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import torch

from pcr_rag.cache.config import RemoteConfig
from pcr_rag.cache.errors import CorruptChunkError, RemoteMissError
from pcr_rag.cache.payload import Payload, VirtualPayload
from pcr_rag.cache.tiers.base import ChunkRef, PayloadLayers, Tier, TierKind, TierRecovery
from pcr_rag.cache.tiers.breaker import CircuitBreaker
from pcr_rag.cache.tiers.chunk_file import ChunkHeader, byte_view, check_layers
from pcr_rag.cache.tiers.remote_client import RemoteClient
from pcr_rag.cache.tiers.remote_store import RemoteStore, open_store
from pcr_rag.cache.tiers.remote_value import (
    PROBE_BYTES,
    RemoteHeader,
    check_layer,
    decode_probe,
    decode_value,
    encode_value,
    header_len_needed,
    value_bytes,
    value_name,
)

__all__ = ["RemoteTier", "open_remote_tier"]

log = logging.getLogger(__name__)

# Payloads are views over the immutable bytes a GET returned (no copy); nothing writes into a cached payload.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=r"pcr_rag\.cache\.tiers\.remote_value")


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
        self._known: set[bytes] = set()  # keys this engine tracks as stored (``holds``)

    def name(self, key: bytes) -> str:
        return value_name(self.namespace, key)

    def charge(self, chunk: ChunkRef) -> int:
        return value_bytes(chunk)

    def place(self, payload: Payload) -> Payload:
        return payload  # encoded (a CPU copy made if needed) by ``store``

    def store(self, chunk: ChunkRef, payload: Payload) -> None:
        """``SET NX``: a value another replica wrote for this key is the same chunk and stays."""
        tensor = None if chunk.virtual or isinstance(payload, VirtualPayload) else payload
        self.client.set_nx(self.name(chunk.key), encode_value(chunk, tensor), self.ttl_s)
        self._known.add(chunk.key)

    def learn(self, chunk: ChunkRef) -> None:
        """Track a value a lookup found (engine lock held)."""
        self._known.add(chunk.key)

    def get(self, chunk: ChunkRef) -> Payload | None:
        return None  # a value must be read (and verified) before use

    # ------------------------------------------------------------------ reads
    def _bad(self, chunk: ChunkRef, exc: CorruptChunkError) -> CorruptChunkError:
        self.client.count("corrupt")
        self.client.delete(self.name(chunk.key))
        log.warning("remote value of chunk %s failed verification (%s): deleted", chunk.key.hex(), exc)
        return exc

    def _fetch(self, chunk: ChunkRef) -> tuple[ChunkHeader | None, torch.Tensor | None]:
        if chunk.virtual:
            return None, None  # metadata-only: nothing to move (as on SSD)
        raw = self.client.get_many([self.name(chunk.key)])[0]
        if raw is None:
            self.client.count("misses")
            raise RemoteMissError(f"the remote store no longer holds chunk {chunk.key.hex()} (evicted or expired)")
        try:
            found = decode_value(raw, chunk.key, chunk)
        except CorruptChunkError as exc:
            raise self._bad(chunk, exc) from None
        self.client.count("hits")
        return found

    def read(self, chunk: ChunkRef) -> Payload:
        header, payload = self._fetch(chunk)
        if header is None or payload is None:
            return VirtualPayload(chunk.nbytes, chunk.num_layers)
        try:
            check_layers(header, byte_view(payload), chunk.key)
        except CorruptChunkError as exc:
            raise self._bad(chunk, exc) from None
        return payload

    def read_layer(self, chunk: ChunkRef, layer: int) -> torch.Tensor | VirtualPayload:
        """Fetches the whole value (one round trip), verifies and returns one layer."""
        source = self.open_layers(chunk)
        try:
            return source.read_layer(layer)
        finally:
            source.close()

    def open_layers(self, chunk: ChunkRef) -> PayloadLayers | _ValueLayers:
        header, payload = self._fetch(chunk)
        if header is None or payload is None:
            return PayloadLayers(VirtualPayload(chunk.nbytes, chunk.num_layers))
        return _ValueLayers(self, chunk, header, payload)

    def probe(self, keys: Sequence[bytes]) -> list[RemoteHeader | None]:
        """What the store holds for each key (None: nothing, or a value that fails verification - deleted), from
        the first bytes of each value in one pipelined round trip (a second one for headers of > ~100 layers).
        Raises ``RemoteUnavailableError``."""
        names = [self.name(k) for k in keys]
        raws = self.client.probe(names, PROBE_BYTES)
        longer = {i: n for i, raw in enumerate(raws) if raw is not None and (n := header_len_needed(raw))}
        if longer:
            more = self.client.probe([names[i] for i in longer], max(longer.values()))
            for i, raw in zip(longer, more, strict=True):
                raws[i] = raw
        out: list[RemoteHeader | None] = []
        for key, raw in zip(keys, raws, strict=True):
            if raw is None:
                out.append(None)
                continue
            try:
                out.append(decode_probe(raw, key))
            except CorruptChunkError as exc:
                self._bad(_KeyOnly(key), exc)
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
        self.client.close()


class _KeyOnly:
    """A chunk reference by key alone (deleting a bad value found by a lookup)."""

    def __init__(self, key: bytes) -> None:
        self.key = key


class _ValueLayers:
    """A fetched value read layer by layer; each layer's checksum is verified the first time it is read."""

    def __init__(self, tier: RemoteTier, chunk: ChunkRef, header: ChunkHeader, payload: torch.Tensor) -> None:
        self._tier = tier
        self._chunk = chunk
        self._header = header
        self._payload = payload
        self._verified: set[int] = set()

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``layer`` (a view of the fetched value; ``out`` is not needed and left untouched)."""
        if layer not in self._verified:
            try:
                check_layer(self._header, self._payload, layer, self._chunk.key)
            except CorruptChunkError as exc:
                raise self._tier._bad(self._chunk, exc) from None
            self._verified.add(layer)
        return self._payload[layer]

    def close(self) -> None:
        self._payload = None  # type: ignore[assignment]


def open_remote_tier(config: RemoteConfig, *, store: RemoteStore | None = None,
                     breaker: CircuitBreaker | None = None) -> RemoteTier:
    """The remote tier of ``config`` (``store`` / ``breaker`` injectable). Opening does not touch the network:
    an unreachable store only makes calls fail (and the breaker skip them)."""
    client = RemoteClient(
        store or open_store(config),
        breaker or CircuitBreaker(config.breaker_errors, config.breaker_backoff_s),
    )
    return RemoteTier(client, config)
