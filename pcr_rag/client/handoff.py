"""Handing retrieved documents from a framework's retriever to the engine request that uses them.

A retrieval hook calls `PCREngine.announce(documents)` (the request enters the prefetch window) and keeps the
returned ticket; when the LLM call comes, `request_documents(prompt, announced)` says which documents to pass
with the rendered prompt. The engine claims a ticket when a request brings exactly the announced documents; when
a template, a node postprocessor or a response mode dropped or reordered some of them, the documents actually
present (in prompt order) are passed instead, so every present document still gets its own token run, and the
ticket is released explicitly (its prefetch has already happened; it must not linger in the window).

`Announcement` is what both framework hooks keep per retrieval: the documents, the run or span it came from, and
the ticket each engine returned. An engine here is anything with ``announce`` and ``cancel_announcement`` (a
`PCREngine`, or a client of a remote one).

Reuse mode: a hook announces with the reuse mode of the model that will answer (``PCRLLM(reuse="blend")``,
``ChatPCR(reuse="blend")``), so a blend model's retrieval also prefetches the documents' position-independent
chains (`PCREngine.announce`'s ``reuse``) on an engine whose default is exact. A mode of None sends no ``reuse``
(the engine's or server's default, and what an engine or client that predates blend mode accepts). When the hook
does not know which model answers, it announces to the engines of every live model, each with `announcement_reuse`
of the models using that engine.

Sharing scopes: a framework document's metadata may carry its scope under ``SCOPE_METADATA_KEY`` ("pcr_scope",
configurable in both integrations): "shared" or "private" (`pcr_rag.Doc`). `scope_of` reads it; the
announcement keeps the scopes (``Announcement.scopes``) and `Announcement.with_scopes` turns the documents passed to
an engine into `Doc`s, so the announcement and the model call key them alike. Documents without a scope go as
plain strings (the engine's default; an engine or client that predates scopes sees no change).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pcr_rag.errors import InvalidRequestError
from pcr_rag.prompt import SCOPES, Doc

logger = logging.getLogger(__name__)

__all__ = [
    "SCOPE_METADATA_KEY",
    "Announcement",
    "announcement_reuse",
    "cache_aware_order",
    "documents_in_prompt",
    "release_ticket",
    "request_documents",
    "reuse_argument",
    "scope_of",
]

SCOPE_METADATA_KEY = "pcr_scope"


def scope_of(metadata: Mapping[str, Any] | None, key: str = SCOPE_METADATA_KEY) -> str | None:
    """A framework document's sharing scope from its ``metadata[key]``: "shared", "private" (any case, spaces
    trimmed) or None when absent. Any other value counts as "private" (logged): a typo must not share a
    document."""
    if not metadata or key not in metadata or metadata[key] is None:
        return None
    value = metadata[key]
    scope = value.strip().lower() if isinstance(value, str) else None
    if scope in SCOPES:
        return scope
    logger.warning("document metadata %r=%r is not 'shared' or 'private'; treating the document as private", key,
                   value)
    return "private"


def documents_in_prompt(prompt: str, documents: Sequence[str]) -> tuple[str, ...]:
    """The documents that occur verbatim in ``prompt``, ordered by where they occur.

    Each distinct document counts once (its first occurrence); a document whose first occurrence overlaps an
    earlier-starting one is skipped, so the result can be cut out of the prompt left to right.
    """
    spans: list[tuple[int, int, str]] = []
    seen: set[str] = set()
    for doc in documents:
        if not doc or doc in seen:
            continue
        seen.add(doc)
        pos = prompt.find(doc)
        if pos >= 0:
            spans.append((pos, pos + len(doc), doc))
    spans.sort(key=lambda s: (s[0], -(s[1] - s[0])))
    out: list[str] = []
    cursor = 0
    for start, end, doc in spans:
        if start >= cursor:
            out.append(doc)
            cursor = end
    return tuple(out)


def request_documents(prompt: str, announced: Sequence[str]) -> tuple[tuple[str, ...], bool]:
    """(documents to pass with ``prompt``, whether they equal the announced ones so the engine claims the ticket)."""
    announced = tuple(announced)
    present = documents_in_prompt(prompt, announced)
    return present, present == announced


def reuse_argument(mode: str | None) -> dict[str, str]:
    """The keyword arguments that pass reuse ``mode`` to an engine's ``announce`` / ``announce_task``: none for
    None (the engine's default), so engines and clients that predate blend mode keep working."""
    return {} if mode is None else {"reuse": mode}


def release_ticket(engine: Any, ticket: Any) -> None:
    """Withdraw an announcement nobody will claim (idempotent; a claimed or expired ticket is left alone)."""
    if ticket is None or getattr(ticket, "claimed", False) or getattr(ticket, "expired", False):
        return
    try:
        engine.cancel_announcement(ticket)
    except Exception:  # withdrawing is an optimisation; the ticket would expire anyway
        logger.exception("withdrawing an announcement failed")


def announcement_reuse(modes: Iterable[str | None]) -> str | None:
    """The reuse mode to announce with to an engine that the models with reuse ``modes`` use ("exact", "blend", or
    None: the engine's default), when the hook cannot tell which of them answers.

    Two models on one engine that differ get the widest prefetch: "blend" if any of them blends, else None (the
    engine's default) if any leaves the mode to the engine, else "exact"; None too when ``modes`` is empty. An
    announcement only moves KV between tiers ahead of the request and never changes an answer, so the wider mode
    costs at most reads of position-independent chains that an exact call does not use, while a narrower one would
    leave a blend call's chains unprefetched."""
    seen = set(modes)
    if "blend" in seen:
        return "blend"
    if not seen or None in seen:
        return None
    return "exact"


def cache_aware_order(engine: Any, documents: Sequence[str], announcement: Announcement | None = None
                      ) -> tuple[str, ...]:
    """``documents`` in ``engine.order_for_reuse`` order, not counting the chunks ``announcement`` (the retrieval
    being reordered) announced to it. A reorder is an optimisation: when it fails the documents come back as given
    (the error is logged), never an exception."""
    exclude = [announcement.ticket_of(engine)] if announcement is not None else ()
    try:
        return tuple(engine.order_for_reuse(list(documents), exclude=exclude))
    except Exception:  # noqa: BLE001 - never fail a retrieval or a model call for a reorder
        logger.exception("cache-aware ordering failed; keeping the given order")
        return tuple(documents)


@dataclass
class Announcement:
    """What one retrieval returned, as the prompt will show it, and the engine tickets it produced.

    Attributes:
        documents: the retrieved texts in retriever order.
        query: the retriever's query string (None when the framework did not say).
        origin: the retriever's run or span id.
        ancestors: the runs or spans above the retrieval, nearest first; a model call below one of them uses it.
        tickets: ``id(engine) -> (engine, ticket)``; each ticket is claimed by the first model call on its engine.
        created_s: ``time.monotonic()`` when announced.
        scopes: document text -> "shared" / "private", for the documents whose metadata gave a scope (`scope_of`).
        reuse_modes: ``id(engine) -> mode``: the reuse mode announced to each engine ("exact", "blend", or None:
            the engine's default); `reannounce` announces again with the same mode.
    """

    documents: tuple[str, ...]
    query: str | None
    origin: Hashable
    ancestors: tuple[Hashable, ...]
    tickets: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    claimed: set[int] = field(default_factory=set)
    created_s: float = field(default_factory=time.monotonic)
    scopes: dict[str, str] = field(default_factory=dict)
    reuse_modes: dict[int, str | None] = field(default_factory=dict)

    def with_scopes(self, documents: Sequence[str]) -> tuple[str | Doc, ...]:
        """``documents`` as an engine takes them: a `Doc` with its scope where ``scopes`` has one, else the str."""
        return tuple(Doc(d, self.scopes[d]) if d in self.scopes else d for d in documents)

    def announce_to(self, engines: Iterable[Any], reuse: str | None | Mapping[int, str | None] = None) -> None:
        """Announce the documents to each engine and keep its ticket; a failed announce only costs the prefetch.

        ``reuse``: the reuse mode of the model that will answer ("exact", "blend"; None: the engine's default), one
        for every engine or per engine keyed by ``id(engine)`` (an engine missing from the mapping gets None). A
        mode of None sends no ``reuse`` argument, so an engine whose ``announce`` predates blend mode still works."""
        for engine in engines:
            mode = self.reuse_mode(engine, reuse)
            try:
                ticket = engine.announce(list(self.with_scopes(self.documents)), query=self.query or None,
                                         **reuse_argument(mode))
                self.tickets[id(engine)] = (engine, ticket)
            except Exception:  # noqa: BLE001 - never fail the retrieval for a prefetch
                logger.exception("announcing retrieved documents to the PCR engine failed")

    def reuse_mode(self, engine: Any, reuse: str | None | Mapping[int, str | None]) -> str | None:
        """The mode ``reuse`` (as `announce_to` takes it) gives ``engine``, remembered in ``reuse_modes``."""
        mode = reuse.get(id(engine)) if isinstance(reuse, Mapping) else reuse
        self.reuse_modes[id(engine)] = mode
        return mode

    def ticket_of(self, engine: Any) -> Any:
        """The ticket ``engine`` returned for this retrieval (None if it has none), without taking it."""
        entry = self.tickets.get(id(engine))
        return entry[1] if entry is not None else None

    def reannounce(self, documents: Sequence[str]) -> bool:
        """Announce the same documents in another order (a cache-aware reorder of the retrieval): every engine
        whose ticket no model call took yet gets its ticket withdrawn and a new one for ``documents``, so prefetch
        and the prompt agree. False (nothing changed) when the order is the same.

        Raises:
            ValueError: ``documents`` is not a permutation of the announced documents.
        """
        documents = tuple(documents)
        if sorted(documents) != sorted(self.documents):
            raise ValueError("reannounce() takes the announced documents in another order, not other documents")
        if documents == self.documents:
            return False
        self.documents = documents
        for key, (engine, ticket) in list(self.tickets.items()):
            if key in self.claimed:
                continue
            release_ticket(engine, ticket)
            del self.tickets[key]
            self.announce_to([engine], self.reuse_modes.get(key))
        return True

    @property
    def fully_claimed(self) -> bool:
        """True when every engine's ticket was taken (and at least one ticket exists)."""
        return bool(self.tickets) and len(self.claimed) >= len(self.tickets)

    def take_ticket(self, engine: Any) -> Any:
        """The ticket for ``engine``, the first time it is asked for (later model calls, e.g. refine, get None)."""
        key = id(engine)
        entry = self.tickets.get(key)
        if entry is None or key in self.claimed:
            return None
        self.claimed.add(key)
        return entry[1]

    def release_unclaimed(self) -> None:
        """Withdraw every ticket no model call took."""
        for key, (engine, ticket) in self.tickets.items():
            if key not in self.claimed:
                release_ticket(engine, ticket)

    def documents_for(self, engine: Any, prompt: str) -> tuple[str, ...]:
        """The documents to pass with ``prompt`` to ``engine`` (see `request_documents`); takes the engine's ticket
        and withdraws it unless the engine will claim it (exactly the announced documents, in order).

        Raises:
            InvalidRequestError: the retriever was asked an empty query (the ticket is withdrawn first).
        """
        ticket = self.take_ticket(engine)
        if self.query is not None and not self.query.strip():
            release_ticket(engine, ticket)
            raise InvalidRequestError("empty query: the retriever was asked an empty string; pass a non-empty "
                                      "question")
        present, exact = request_documents(prompt, self.documents)
        if not exact:
            release_ticket(engine, ticket)
        return present
