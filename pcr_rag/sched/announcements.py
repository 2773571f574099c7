"""Announced requests: a retriever that has finished announces its documents before the LLM call exists.

The announcement joins the prefetch window behind the waiting queue (its chunks are protected and prefetched);
a later request with the same documents claims it. Unclaimed announcements expire after a TTL. Thread-safe.

Ticket ids are random (positive, below 2**53, unique among pending tickets), not a sequence: an id tells its
holder nothing about how many announcements others made. 53 bits keep them exact as JSON numbers in clients that
read numbers as doubles (JavaScript), and the server's routes take them as ints.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TICKET_ID_BITS = 53
DEFAULT_MAX_PENDING = 4096  # tickets on a board, all namespaces together (as the server's max_tickets)
DEFAULT_MAX_PER_NAMESPACE = 1024  # tickets of one namespace (tenant) on a board


@dataclass
class Ticket:
    """An announced request: its documents, the chunk keys its prefix is predicted to have, and its deadline.
    ``ticket_id``: a random int in [1, 2**53), unique among the board's pending tickets."""

    ticket_id: int
    documents: tuple[str, ...]
    keys: tuple[bytes, ...]
    announced_at: float
    expires_at: float
    ssd_keys_at_entry: frozenset[bytes] = frozenset()
    namespace: str = ""  # tenant namespace: only a request of the same namespace claims it
    chains: tuple[tuple[bytes, ...], ...] = ()  # blend mode: each document's position-independent chain
    claimed: bool = False
    expired: bool = False


class AnnouncementBoard:
    """Announced, not yet claimed requests in arrival order. Thread-safe.

    Bounded: at most ``max_pending`` tickets in all and ``max_per_namespace`` per namespace (a tenant); an
    announcement beyond either bound evicts the oldest ticket of its namespace (over the namespace's bound) or of
    the board (over the total), which is marked expired as a lapsed one would be, so one tenant announcing without
    end holds at most its share and never pushes out another tenant's tickets while under the total. Every
    operation but `keys` costs O(1) in the board's size: tickets are indexed by id and by (namespace, documents)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic, *,
                 max_pending: int = DEFAULT_MAX_PENDING, max_per_namespace: int = DEFAULT_MAX_PER_NAMESPACE) -> None:
        for name, value in (("max_pending", max_pending), ("max_per_namespace", max_per_namespace)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.ttl_s = ttl_s
        self.clock = clock
        self.max_pending = max_pending
        self.max_per_namespace = max_per_namespace
        self._lock = threading.Lock()
        self._tickets: OrderedDict[int, Ticket] = OrderedDict()  # by id, oldest first
        self._by_docs: dict[tuple[str, tuple[str, ...]], OrderedDict[int, Ticket]] = {}
        self._by_namespace: dict[str, OrderedDict[int, Ticket]] = {}
        self.announced = 0
        self.claimed = 0
        self.expired = 0
        self.evicted = 0

    def add(self, documents: tuple[str, ...], keys: Sequence[bytes],
            ssd_keys: frozenset[bytes] = frozenset(), namespace: str = "",
            chains: Sequence[Sequence[bytes]] = ()) -> Ticket:
        now = self.clock()
        with self._lock:
            ticket_id = 0
            while ticket_id == 0 or ticket_id in self._tickets:
                ticket_id = secrets.randbits(TICKET_ID_BITS)
            t = Ticket(ticket_id, documents, tuple(keys), now, now + self.ttl_s, ssd_keys, namespace,
                       tuple(tuple(c) for c in chains))
            own = self._by_namespace.get(namespace)
            if own is not None and len(own) >= self.max_per_namespace:
                self._evict(next(iter(own.values())))
            if len(self._tickets) >= self.max_pending:
                self._evict(next(iter(self._tickets.values())))
            self._tickets[ticket_id] = t
            self._by_docs.setdefault((namespace, documents), OrderedDict())[ticket_id] = t
            self._by_namespace.setdefault(namespace, OrderedDict())[ticket_id] = t
            self.announced += 1
        return t

    def claim(self, documents: tuple[str, ...], namespace: str = "") -> Ticket | None:
        """The oldest live ticket of ``namespace`` with exactly these documents, removed from the board."""
        with self._lock:
            same = self._by_docs.get((namespace, documents))
            if not same:
                return None
            t = next(iter(same.values()))
            self._remove(t)
            t.claimed = True
            self.claimed += 1
            return t

    def cancel(self, ticket: Ticket) -> bool:
        with self._lock:
            if self._tickets.get(ticket.ticket_id) is ticket:
                self._remove(ticket)
                ticket.expired = True
                return True
        return False

    def expire(self) -> int:
        now = self.clock()
        n = 0
        with self._lock:
            while self._tickets:
                t = next(iter(self._tickets.values()))
                if t.expires_at > now:
                    break
                self._remove(t)
                t.expired = True
                n += 1
            self.expired += n
        return n

    def keys(self, limit: int) -> list[tuple[bytes, ...]]:
        """The key chains of the first ``limit`` tickets: each one's prefix, then (blend mode) its documents'
        position-independent chains."""
        with self._lock:
            return [chain for t in itertools.islice(self._tickets.values(), limit) for chain in (t.keys, *t.chains)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._tickets)

    def pending(self, namespace: str) -> int:
        """Tickets of ``namespace`` on the board."""
        with self._lock:
            return len(self._by_namespace.get(namespace, ()))

    # ------------------------------------------------------------------ under the lock
    def _evict(self, t: Ticket) -> None:
        self._remove(t)
        t.expired = True
        self.evicted += 1

    def _remove(self, t: Ticket) -> None:
        del self._tickets[t.ticket_id]
        docs_key = (t.namespace, t.documents)
        same = self._by_docs[docs_key]
        del same[t.ticket_id]
        if not same:
            del self._by_docs[docs_key]
        own = self._by_namespace[t.namespace]
        del own[t.ticket_id]
        if not own:
            del self._by_namespace[t.namespace]
