"""Handing retrieved documents from a framework's retriever to the engine request that uses them.

A retrieval hook calls `PCREngine.announce(documents)` (the request enters the prefetch window) and keeps the
returned ticket; when the LLM call comes, `request_documents(prompt, announced)` says which documents to pass
with the rendered prompt. The engine claims a ticket when a request brings exactly the announced documents; when
a template, a node postprocessor or a response mode dropped or reordered some of them, the documents actually
present (in prompt order) are passed instead, so every present document still gets its own token run, and the
ticket is released explicitly (its prefetch has already happened; it must not linger in the window).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["documents_in_prompt", "release_ticket", "request_documents"]


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


def release_ticket(engine: Any, ticket: Any) -> None:
    """Withdraw an announcement nobody will claim (idempotent; a claimed or expired ticket is left alone)."""
    if ticket is None or getattr(ticket, "claimed", False) or getattr(ticket, "expired", False):
        return
    try:
        engine.cancel_announcement(ticket)
    except Exception:  # withdrawing is an optimisation; the ticket would expire anyway
        logger.exception("withdrawing an announcement failed")
