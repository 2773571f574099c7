"""`ServerState`: what the routes share, one per app (``app.state.pcr``; the routes reach it through
`pcr_rag.server.routes.deps.server_state`).

It holds the engine, the settings, auth, metrics, the request threads, the in-flight handles and the announcement
tickets, and does the steps every route takes the same way: run blocking work off the event loop (`off_loop`), the
cheap checks before any compute (`check_accepting` 503, `check_model` 404, `check_chars` 400
``context_length_exceeded``), submitting a translated request's choices (`submit`) and tracking them until their
response ends (`track`, `finished`), and draining on shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from pcr_rag.engine import PCREngine
from pcr_rag.handle import RequestHandle
from pcr_rag.request import GenerationResult
from pcr_rag.sched.announcements import Ticket
from pcr_rag.server.auth import Authenticator, MetricsGuard, Tenant
from pcr_rag.server.errors import APIError, from_engine_error
from pcr_rag.server.metrics import ServerMetrics
from pcr_rag.server.prompt_bound import PromptCharBound
from pcr_rag.server.settings import ServerSettings
from pcr_rag.server.translate import GenerationRequest

log = logging.getLogger(__name__)

__all__ = ["ServerState"]

T = TypeVar("T")


class ServerState:
    """What the routes share: the engine, settings, auth, metrics, request threads, in-flight handles and
    announcement tickets."""

    def __init__(self, engine: PCREngine, settings: ServerSettings, *, owns_engine: bool) -> None:
        self.engine = engine
        self.settings = settings
        self.owns_engine = owns_engine
        self.auth = Authenticator(settings.api_keys, tenant_per_key=settings.tenant_per_key)
        self.metrics_guard = MetricsGuard(self.auth, settings.metrics_key, public=settings.metrics_public)
        self.model_name = settings.served_model_name or engine.loaded.name
        self.model_names = frozenset({self.model_name, engine.loaded.name})
        self.metrics = ServerMetrics(self.model_name, engine.stats)
        self.char_bound = PromptCharBound.of(engine.tokenizer, engine.max_model_len)
        self.pool = concurrent.futures.ThreadPoolExecutor(settings.request_threads,
                                                          thread_name_prefix="pcr-request")
        self.created = int(time.time())
        self.draining = False
        self.inflight: set[RequestHandle] = set()
        self._tickets: OrderedDict[int, tuple[str, Ticket]] = OrderedDict()

    async def off_loop(self, fn: Callable[..., T], *args: Any, orphan: Callable[[T], None] | None = None) -> T:
        """``fn(*args)`` on a request thread, awaited, in a copy of the caller's context (its request id and span,
        `pcr_rag.server.observability`). When the awaiting task is cancelled while ``fn`` runs, its result goes to
        ``orphan`` (e.g. a submitted request is cancelled) instead of being lost."""
        try:
            future = self.pool.submit(contextvars.copy_context().run, fn, *args)
        except RuntimeError:  # the pool is shut down: the app is shutting down
            raise APIError.unavailable("the server is shutting down; retry against another instance") from None
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if orphan is not None:
                def adopt(done: concurrent.futures.Future) -> None:
                    if not done.cancelled() and done.exception() is None:
                        orphan(done.result())
                future.add_done_callback(adopt)
            raise

    # ------------------------------------------------------------------------------------------ requests
    def check_accepting(self) -> None:
        if self.draining or self.engine.closed:
            raise APIError.unavailable("the server is shutting down; retry against another instance")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError.model_not_found(model, self.model_name)

    def check_chars(self, chars: int, param: str) -> None:
        """400 ``context_length_exceeded`` when ``chars`` characters of prompt text cannot fit the engine's
        ``max_model_len`` tokens (no tokenizing: `PromptCharBound`)."""
        bound = self.char_bound
        if bound is not None and chars > bound.max_chars:
            raise APIError(400, f"the prompt's text has {chars} characters, so at least {bound.min_tokens(chars)} "
                                f"tokens (no token of this model covers more than {bound.chars_per_token} characters), "
                                f"which exceeds the engine's max_model_len of {bound.max_model_len} tokens; "
                                f"retrieve fewer or shorter documents", param=param,
                           code="context_length_exceeded")

    def submit(self, req: GenerationRequest, tenant: Tenant) -> list[RequestHandle]:
        """Submit a translated request (`pcr_rag.server.translate`), one engine request per choice, under the
        tenant's namespace (on a request thread: this tokenizes). The character bound is checked first; a choice
        the engine refuses cancels the choices already submitted."""
        self.check_chars(req.prompt_chars, req.prompt_param)
        handles: list[RequestHandle] = []
        try:
            for params in req.choice_params:
                handles.append(self.engine.submit(req.prompt, params, namespace=tenant.namespace, reuse=req.reuse))
        except Exception as exc:  # noqa: BLE001 - every pre-compute rejection becomes an API error
            for handle in handles:
                handle.close()
            error = from_engine_error(exc)
            if error.code == "context_length_exceeded":
                error.param = req.prompt_param
            raise error from None
        return handles

    def track(self, handles: list[RequestHandle]) -> None:
        """Track accepted requests until their response ends; ones submitted while the server began to drain are
        cancelled instead (503)."""
        if self.draining:
            for handle in handles:
                handle.close()
            raise APIError.unavailable("the server is shutting down; retry against another instance")
        self.inflight.update(handles)

    def finished(self, handles: list[RequestHandle]) -> None:
        """The response is over: cancel the requests that did not finish, stop tracking them."""
        for handle in handles:
            handle.close()
            self.inflight.discard(handle)

    def observe(self, result: GenerationResult) -> None:
        self.metrics.observe(result)

    # ------------------------------------------------------------------------------------------ tickets
    def keep_ticket(self, namespace: str, ticket: Ticket) -> None:
        """Remember ``ticket`` for withdrawal. Past ``max_tickets`` the claimed and expired ones are forgotten,
        then the oldest live ones, which are withdrawn from the engine's board too (a ticket nobody can withdraw
        any more must not hold the board's room until it expires)."""
        if len(self._tickets) >= self.settings.max_tickets:
            stale = [tid for tid, (_, t) in self._tickets.items() if t.claimed or t.expired]
            for tid in stale:
                del self._tickets[tid]
        while len(self._tickets) >= self.settings.max_tickets:
            _, (_, oldest) = self._tickets.popitem(last=False)
            self.engine.cancel_announcement(oldest)
        self._tickets[ticket.ticket_id] = (namespace, ticket)

    def withdraw_ticket(self, namespace: str, ticket_id: int) -> bool:
        entry = self._tickets.get(ticket_id)
        if entry is not None and (entry[1].claimed or entry[1].expired):
            del self._tickets[ticket_id]
            entry = None
        if entry is None or entry[0] != namespace:
            raise APIError(404, f"no announcement {ticket_id} of yours is pending (claimed, expired or unknown)",
                           param="ticket", code="announcement_not_found")
        del self._tickets[ticket_id]
        return self.engine.cancel_announcement(entry[1])

    # ------------------------------------------------------------------------------------------ lifecycle
    def begin_drain(self) -> None:
        """Stop accepting requests (SIGTERM); in-flight ones go on."""
        if not self.draining:
            log.info("draining: new requests get 503; %d in flight", len(self.inflight))
        self.draining = True

    async def shutdown(self) -> None:
        """Cancel what is still running, then (when the app owns it) close the engine: flush write-back, release
        the cache directory's lock."""
        self.begin_drain()
        for handle in list(self.inflight):
            handle.cancel()
        self.inflight.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.owns_engine:
            await asyncio.to_thread(self.engine.close)
            log.info("engine closed: write-back flushed, cache directory released")
