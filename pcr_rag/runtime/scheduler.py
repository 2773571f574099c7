"""Waiting queue, request states and the executor loop.

Policy: one executor thread; requests are admitted first-come first-served. Admitting a request runs its whole
prefill (one forward per chunk); its decode then joins the set of active decodes, which advance one token each per
round, round-robin, between admissions (prefill first, then a decode round: a newcomer's TTFT never waits for
other requests' whole answers, and at most `max_active` requests hold KV buffers at once). With
``max_active=1`` it is plain run-to-completion FCFS. On a 2-core CPU one forward already uses the cores, and the
waiting queue is exactly what queue-based prefetch exploits. Requests enter from any thread or event loop; TTFT
counts from submission, queueing included.

Announced requests (`AnnouncementBoard`): a retriever that has finished announces its documents before the LLM
call exists; the announcement joins the prefetch window behind the waiting queue, and a later request with the
same documents claims it. Unclaimed announcements expire after a TTL.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pcr_rag.errors import EngineClosedError, QueueFullError, RequestCancelledError
from pcr_rag.requests import Request, RequestState

log = logging.getLogger(__name__)


@dataclass
class Ticket:
    """An announced request: its documents, the chunk keys its prefix is predicted to have, and its deadline."""

    ticket_id: int
    documents: tuple[str, ...]
    keys: tuple[bytes, ...]
    announced_at: float
    expires_at: float
    ssd_keys_at_entry: frozenset[bytes] = frozenset()
    claimed: bool = False
    expired: bool = False


class AnnouncementBoard:
    """Announced, not yet claimed requests in arrival order. Thread-safe."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._tickets: deque[Ticket] = deque()
        self._ids = itertools.count(1)
        self.announced = 0
        self.claimed = 0
        self.expired = 0

    def add(self, documents: tuple[str, ...], keys: Sequence[bytes],
            ssd_keys: frozenset[bytes] = frozenset()) -> Ticket:
        now = self.clock()
        t = Ticket(next(self._ids), documents, tuple(keys), now, now + self.ttl_s, ssd_keys)
        with self._lock:
            self._tickets.append(t)
            self.announced += 1
        return t

    def claim(self, documents: tuple[str, ...]) -> Ticket | None:
        """The oldest live ticket with exactly these documents, removed from the board."""
        with self._lock:
            for t in self._tickets:
                if t.documents == documents:
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


class ActiveDecode(Protocol):
    """A request whose prefill is done: `step()` emits one token and returns True once it has finished (and
    delivered its result); `fail(exc)` delivers an error instead."""

    def step(self) -> bool: ...

    def fail(self, exc: BaseException) -> None: ...


class Scheduler:
    """FCFS waiting queue plus the executor thread: ``prefill(request)`` admits a request (returning its active
    decode, or None when it already finished), and active decodes advance round-robin between admissions."""

    def __init__(self, prefill: Callable[[Request], ActiveDecode | None], *, max_queue: int, max_active: int = 8,
                 on_change: Callable[[], None] | None = None) -> None:
        self._prefill = prefill
        self.max_queue = max_queue
        self.max_active = max(1, max_active)
        self.on_change = on_change
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self.active = 0  # decodes in progress (as of the last loop iteration)
        self._closed = False
        self._ids = itertools.count(1)
        self.max_depth = 0
        self._thread = threading.Thread(target=self._loop, name="pcr-executor", daemon=True)
        self._thread.start()

    def next_id(self) -> int:
        return next(self._ids)

    def submit(self, req: Request) -> Request:
        with self._cond:
            if self._closed:
                raise EngineClosedError("the engine is closed; create a new PCREngine")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")
            self._waiting.append(req)
            self.max_depth = max(self.max_depth, len(self._waiting))
            self._cond.notify_all()
        if self.on_change is not None:
            self.on_change()
        return req

    def remove_waiting(self, req: Request) -> bool:
        with self._cond:
            if req in self._waiting:
                self._waiting.remove(req)
                return True
        return False

    def window(self, limit: int) -> list[Request]:
        """The next ``limit`` waiting requests in the order they will run."""
        with self._cond:
            return list(itertools.islice(self._waiting, limit))

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    def _loop(self) -> None:
        active: list[ActiveDecode] = []
        while True:
            req = None
            with self._cond:
                while not self._waiting and not active and not self._closed:
                    self._cond.wait()
                if self._closed and not self._waiting and not active:
                    return
                if self._waiting and len(active) < self.max_active:
                    req = self._waiting.popleft()
                self.active = len(active)
            if req is not None:
                if self.on_change is not None:
                    self.on_change()
                task = self._admit(req)
                if task is not None:
                    active.append(task)
            for task in list(active):  # one decode round
                try:
                    finished = task.step()
                except BaseException as exc:  # noqa: BLE001 - delivered to the caller through the future
                    task.fail(exc)
                    finished = True
                if finished:
                    active.remove(task)

    def _admit(self, req: Request) -> ActiveDecode | None:
        try:
            if req.cancelled.is_set():
                raise RequestCancelledError("request cancelled while waiting")
            req.state = RequestState.RUNNING
            return self._prefill(req)
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller through the future
            req.state = RequestState.CANCELLED if isinstance(exc, RequestCancelledError) else RequestState.FAILED
            if not req.future.done():
                req.future.set_exception(exc)
            return None

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting work; waiting requests fail with `EngineClosedError`, the running one finishes."""
        with self._cond:
            self._closed = True
            pending = list(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
        for req in pending:
            if not req.future.done():
                req.state = RequestState.FAILED
                req.future.set_exception(EngineClosedError("the engine was closed before this request ran"))
        self._thread.join(timeout=timeout)
