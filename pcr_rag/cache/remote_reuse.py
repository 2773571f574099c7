"""The engine's side of the remote tier: learning what the shared store holds, and the write-through queue.

- ``discover(keys)``: after the local match of a chunk chain ends, one pipelined lookup of the rest; the longest
  run of verified values that continues the chain is added to the prefix tree as remote copies (within the
  tier's budget), sized from the engine's KV layout and the chunk's token count (never from a stored header).
  Skipped, without any network call, while the circuit breaker is open. Each value is checked against what the
  engine knows itself (``remote_value.Expected``): the chain's namespace root (the local match's, or the plan's
  when ``keys`` are ``ChunkSpec`` s) and, from a plan, each chunk's token count and partial flag; a value that
  contradicts them is deleted and counted as forged. Keys alone with no local match give no root: the few roots
  recently seen are tried as guesses, and a value that fails under a guess is left alone.
- Whether loading a remote chunk beats recomputing it is decided with every other tier's chunks by
  ``cache.reuse_planner`` (from the client's measured round trip and bandwidth: ``client.load_seconds``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from pcr_rag.cache.errors import RemoteUnavailableError
from pcr_rag.cache.keys import ChunkSpec
from pcr_rag.cache.lock import CacheLock
from pcr_rag.cache.payload import Payload
from pcr_rag.cache.remote_writer import RemoteWriter
from pcr_rag.cache.residency import ResidencyIndex, Room
from pcr_rag.cache.tiers.base import ChunkRecord, Tier, tier_bit
from pcr_rag.cache.tiers.remote import RemoteTier, root_of
from pcr_rag.cache.tiers.remote_value import Expected, RemoteHeader

__all__ = ["RemoteReuse"]

_BIT = tier_bit(Tier.REMOTE)
_GUESS_ROOTS = 4  # recent namespace roots tried for a lookup by keys alone (one round trip each, at most)


class RemoteReuse:
    """Discovery and write-through for one engine's remote tier (see the module docstring)."""

    def __init__(self, sync: CacheLock, index: ResidencyIndex, tier: RemoteTier, *, write_queue: int,
                 inline: bool) -> None:
        self.tier = tier
        self.client = tier.client
        self._sync = sync
        self._index = index
        self.writer = RemoteWriter(sync, index, tier, capacity=write_queue, inline=inline)
        self._speed_lock = threading.Lock()
        self._roots: OrderedDict[bytes, None] = OrderedDict()  # namespace roots recently seen, newest last

    # ------------------------------------------------------------------ discovery (no lock held)
    def saw_root(self, root: bytes) -> None:
        """Remember a namespace root this engine uses (a guess for lookups by keys alone)."""
        with self._speed_lock:
            self._roots[root] = None
            self._roots.move_to_end(root)
            while len(self._roots) > _GUESS_ROOTS:
                self._roots.popitem(last=False)

    def discover(self, keys: Sequence[bytes | ChunkSpec]) -> int:
        """Look up the chunks of ``keys`` (chunk keys, or a plan's ``ChunkSpec`` s) after the local match; returns
        how many were added to the tree."""
        if not keys or not self.client.available():
            return 0
        raw = [k.key if isinstance(k, ChunkSpec) else k for k in keys]
        specs = [k for k in keys if isinstance(k, ChunkSpec)]
        plan = specs if len(specs) == len(keys) else None
        if plan is not None and plan[0].start == 0:
            self.saw_root(plan[0].parent)
        with self._sync.lock:
            local = self._index.tree.match(raw)
            start = len(local)
            parent = local[-1].key if local else None
            root = root_of(local[-1]) if local else None
        if start >= len(raw):
            return 0
        if root is None and plan is not None and plan[0].start == 0:
            root = plan[0].parent
        todo = raw[start:]
        todo_plan = plan[start:] if plan is not None else None
        if root is not None:
            guesses = [(root, True)]
        else:
            with self._speed_lock:
                guesses = [(r, False) for r in reversed(self._roots)]
        found: list[RemoteHeader] = []
        headers: list[RemoteHeader | None] = []
        for guess, strict in guesses:
            try:
                headers = self.tier.probe(_expected(todo, todo_plan, guess, parent), strict=strict)
            except RemoteUnavailableError:
                return 0
            found = _chain(todo, headers)
            if found:
                break
        self.client.count("lookup_found", len(found))
        self.client.count("misses", sum(1 for h in headers if h is None))
        return self._learn(found) if found else 0

    def _learn(self, found: list[RemoteHeader]) -> int:
        index, tier = self._index, self.tier
        learned = 0
        with self._sync.lock:
            for h in found:
                rec = h.record
                node = index.get(rec.key)
                if node is None:
                    parent_ok = rec.parent_is_root or index.get(rec.parent_key) is not None
                    if not parent_ok or index.make_room(Tier.REMOTE, tier.charge(rec)) is not Room.RESERVED:
                        break
                    node = index.add_node(rec)
                elif node.resident_mask & _BIT:
                    continue
                elif index.make_room(Tier.REMOTE, tier.charge(node)) is not Room.RESERVED:
                    break
                tier.learn(node)
                index.mark_resident(node, Tier.REMOTE)
                index.touch(node)
                learned += 1
        return learned

    # ------------------------------------------------------------------ writes and stats
    def offer(self, chunk: ChunkRecord, payload: Payload) -> None:
        if chunk.parent_is_root:
            self.saw_root(chunk.parent_key)
        self.writer.offer(chunk, payload)

    def counters(self) -> dict[str, object]:
        out: dict[str, object] = dict(self.client.counters())
        out["write_queue_depth"] = self.writer.depth
        return out

    def flush(self, timeout: float | None = None) -> None:
        self.writer.flush(timeout)

    def stop(self) -> None:
        self.writer.stop()


def _expected(keys: Sequence[bytes], plan: Sequence[ChunkSpec] | None, root: bytes,
              parent: bytes | None) -> list[Expected]:
    """What the engine knows of each chunk of the chain ``keys`` (continuing ``parent``, None: from ``root``)."""
    out: list[Expected] = []
    for i, key in enumerate(keys):
        before = parent if i == 0 else keys[i - 1]
        spec = plan[i] if plan is not None else None
        out.append(Expected(key, root, before, spec.num_tokens if spec else None, spec.partial if spec else None))
    return out


def _chain(keys: Sequence[bytes], headers: Sequence[RemoteHeader | None]) -> list[RemoteHeader]:
    """The leading headers that exist (each verified against the chain it continues by the codec)."""
    found: list[RemoteHeader] = []
    for key, h in zip(keys, headers, strict=True):
        if h is None or h.record.key != key:
            break
        found.append(h)
    return found
