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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TICKET_ID_BITS = 53


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
    claimed: bool = False
    expired: bool = False


class AnnouncementBoard:
    """Announced, not yet claimed requests in arrival order. Thread-safe."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._tickets: deque[Ticket] = deque()
        self.announced = 0
        self.claimed = 0
        self.expired = 0

    def add(self, documents: tuple[str, ...], keys: Sequence[bytes],
            ssd_keys: frozenset[bytes] = frozenset(), namespace: str = "") -> Ticket:
        now = self.clock()
        with self._lock:
            pending = {t.ticket_id for t in self._tickets}
            ticket_id = 0
            while ticket_id == 0 or ticket_id in pending:
                ticket_id = secrets.randbits(TICKET_ID_BITS)
            t = Ticket(ticket_id, documents, tuple(keys), now, now + self.ttl_s, ssd_keys, namespace)
            self._tickets.append(t)
            self.announced += 1
        return t

    def claim(self, documents: tuple[str, ...], namespace: str = "") -> Ticket | None:
        """The oldest live ticket of ``namespace`` with exactly these documents, removed from the board."""
        with self._lock:
            for t in self._tickets:
                if t.documents == documents and t.namespace == namespace:
                    self._tickets.remove(t)
                    t.claimed = True
                    self.claimed += 1
                    return t
        return None

    def cancel(self, ticket: Ticket) -> bool:
        with self._lock:
            if ticket in self._tickets:
                self._tickets.remove(ticket)
                ticket.expired = True
                return True
        return False

    def expire(self) -> int:
        now = self.clock()
        n = 0
        with self._lock:
            while self._tickets and self._tickets[0].expires_at <= now:
                t = self._tickets.popleft()
                t.expired = True
                n += 1
            self.expired += n
        return n

    def keys(self, limit: int) -> list[tuple[bytes, ...]]:
        with self._lock:
            return [t.keys for t in itertools.islice(self._tickets, limit)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._tickets)
