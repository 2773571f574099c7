"""Offline Belady (MIN) eviction on a prefix-chunk trace: the hit-ratio upper bound for a policy on that trace.

The trace is the sequence of requests in execution order, each a list of chunks (key, bytes, tokens) in prompt
order. A request hits the longest run of its leading chunks that are cached (prefix semantics); missed chunks are
then admitted, evicting the cached chunk whose next use is furthest in the future, or bypassed when the new chunk
itself is used furthest (MIN with bypass).

Ties in next use are broken deeper-first. Since a chunk is only ever used together with its parent, a parent's next
use is never later than its child's, so MIN only ever evicts leaves: the cache stays a prefix tree and every cached
chunk is usable. With equal-size chunks and a capacity in chunks MIN maximises the number of chunk hits, so no
online policy (LRU, look-ahead LRU) can beat it on that count; with partial chunks and byte capacities it is the
standard furthest-next-use bound (a heuristic for variable sizes), reported as such.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

INF = math.inf


@dataclass(frozen=True)
class TraceChunk:
    key: bytes
    nbytes: int
    tokens: int


@dataclass(frozen=True)
class HitResult:
    """Hits over a whole trace (tokens and chunks) and the ratios; ``policy`` names who produced them."""

    policy: str
    hit_tokens: int
    total_tokens: int
    hit_chunks: int
    total_chunks: int

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def chunk_hit_ratio(self) -> float:
        return self.hit_chunks / self.total_chunks if self.total_chunks else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "policy": self.policy,
            "hit_tokens": self.hit_tokens,
            "total_tokens": self.total_tokens,
            "hit_chunks": self.hit_chunks,
            "total_chunks": self.total_chunks,
            "token_hit_ratio": self.token_hit_ratio,
            "chunk_hit_ratio": self.chunk_hit_ratio,
        }


def _next_uses(trace: Sequence[Sequence[TraceChunk]]) -> list[list[float]]:
    last: dict[bytes, float] = {}
    out: list[list[float]] = [[] for _ in trace]
    for r in range(len(trace) - 1, -1, -1):
        req = trace[r]
        out[r] = [last.get(c.key, INF) for c in req]
        for c in req:
            last[c.key] = r
    return out


def belady(trace: Sequence[Sequence[TraceChunk]], capacity_bytes: float) -> HitResult:
    """Run MIN with bypass over ``trace`` with a cache of ``capacity_bytes``; returns its hits."""
    per = belady_hits_per_request(trace, capacity_bytes)
    return HitResult(
        "belady",
        sum(h for h, _ in per),
        sum(c.tokens for req in trace for c in req),
        sum(c for _, c in per),
        sum(len(req) for req in trace),
    )


def belady_hits_per_request(trace: Sequence[Sequence[TraceChunk]], capacity_bytes: float) -> list[tuple[int, int]]:
    """MIN with bypass over ``trace``: ``(hit tokens, hit chunks)`` of each request, in order (so hits can be
    counted over a part of the trace while the cache history covers all of it)."""
    nxt = _next_uses(trace)
    cached: dict[bytes, tuple[float, int, int]] = {}  # key -> (next use, depth, nbytes)
    heap: list[tuple[float, int, int, bytes]] = []  # (-next use, -depth, seq, key); stale entries skipped
    used = 0
    seq = 0
    out: list[tuple[int, int]] = []
    for r, req in enumerate(trace):
        nu = nxt[r]
        matched = True
        hit_tokens = hit_chunks = 0
        for depth, chunk in enumerate(req):
            entry = cached.get(chunk.key)
            if matched and entry is not None:
                hit_tokens += chunk.tokens
                hit_chunks += 1
                cached[chunk.key] = (nu[depth], depth, entry[2])
                seq += 1
                heapq.heappush(heap, (-nu[depth], -depth, seq, chunk.key))
                continue
            matched = False
            if entry is not None:  # cannot happen while the tree invariant holds; refresh and keep going
                cached[chunk.key] = (nu[depth], depth, entry[2])
                seq += 1
                heapq.heappush(heap, (-nu[depth], -depth, seq, chunk.key))
                continue
            freed = _make_room(chunk, nu[depth], depth, cached, heap, capacity_bytes - used)
            if freed is None:
                break  # bypassed: its descendants in this request are used no sooner, bypass them too
            used -= freed
            cached[chunk.key] = (nu[depth], depth, chunk.nbytes)
            used += chunk.nbytes
            seq += 1
            heapq.heappush(heap, (-nu[depth], -depth, seq, chunk.key))
        out.append((hit_tokens, hit_chunks))
    return out


def _make_room(chunk, next_use, depth, cached, heap, free_bytes) -> int | None:
    """Evict the chunks used furthest in the future (deeper first) until ``chunk`` fits; return the bytes freed.

    Only chunks ordered strictly after ``chunk`` by (next use, depth) may go; if they cannot make room, nothing is
    evicted and ``None`` says: bypass ``chunk``.
    """
    if chunk.nbytes <= free_bytes:
        return 0
    if next_use == INF:
        return None
    victims: list[tuple[float, int, int, bytes]] = []
    freed = 0
    while chunk.nbytes > free_bytes + freed:
        top = _top(cached, heap)
        if top is None or (-top[0], -top[1]) <= (next_use, depth):
            for v in victims:
                heapq.heappush(heap, v)
            return None
        heapq.heappop(heap)
        victims.append(top)
        freed += cached[top[3]][2]
    for v in victims:
        del cached[v[3]]
    return freed


def _top(cached: dict[bytes, tuple[float, int, int]], heap: list[tuple[float, int, int, bytes]]):
    """The valid heap top (furthest next use, deepest), dropping stale entries; None when empty."""
    while heap:
        neg_nu, neg_depth, _, key = heap[0]
        entry = cached.get(key)
        if entry is not None and entry[0] == -neg_nu and entry[1] == -neg_depth:
            return heap[0]
        heapq.heappop(heap)
    return None
