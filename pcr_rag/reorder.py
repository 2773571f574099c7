"""Cache-aware document order: the order of a retrieval's documents whose chunk chain reuses the most cached KV.

Chunk keys chain (`pcr_rag.cache.keys`), so a prompt reuses only its longest cached *prefix*: two retrievals that
return the same documents in a different order share nothing after the first document that differs. Putting the
documents whose KV is already cached (or announced by a request about to run) first, in the order they were cached
in, turns that into a hit.

`reuse_order` is a greedy walk over the layout's chunk chain: at each position it picks the document whose chunks
extend the matched chain furthest (in tokens), keeping relevance order (the given order) among equals; it stops at
the first position where no document extends the chain and keeps the rest in relevance order. So with nothing
cached it returns the given order, and a chain of fully cached documents is replayed in its cached order.

Trade-off: a different order is a different prompt. Reuse stays exact for that prompt (the KV is that prompt's KV,
bit for bit), but the model's answer can differ from the answer to the relevance-ordered prompt. The order is
therefore opt-in: `PCREngine.order_for_reuse`, the LlamaIndex `PCRReorderPostprocessor` / `PCRLLM(reorder=
"cache-aware")` and the LangChain `PCRReorder` transformer.

Cost: at most ``k (k + 1) / 2`` document runs are chunked and hashed for ``k`` documents, usually far fewer (the
walk stops at the first position nothing extends); each run's token ids come from the prompt builder's cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pcr_rag.cache.keys import plan_chunks

__all__ = ["ReuseOrder", "apply_order", "permute_documents", "reuse_order"]

T = TypeVar("T")


@dataclass(frozen=True)
class ReuseOrder:
    """The result of the walk: ``order`` holds document indices (a permutation of ``range(k)``);
    ``matched_tokens`` counts the tokens of the head and the documents whose chunks were found along the chain;
    ``placed`` how many leading positions the walk decided (the rest keep relevance order)."""

    order: tuple[int, ...]
    matched_tokens: int
    placed: int


def _matched(parent: bytes, run: Sequence[int], chunk_size: int,
             known: Callable[[bytes], bool]) -> tuple[int, bool, bytes]:
    """(tokens of ``run``'s leading chunks that are known, whether all are, the last chunk key of ``run``)."""
    specs = plan_chunks(parent, [run], chunk_size)
    matched = 0
    for spec in specs:
        if not known(spec.key):
            return matched, False, specs[-1].key
        matched += spec.num_tokens
    return matched, True, specs[-1].key if specs else parent


def reuse_order(num_documents: int, head: Sequence[Sequence[int]],
                run_of: Callable[[int, int | None], Sequence[int]],
                root: bytes, chunk_size: int, known: Callable[[bytes], bool]) -> ReuseOrder:
    """The greedy cache-aware order of ``num_documents`` documents.

    Args:
        head: the token segments before the first document (system turn, instruction), chained from ``root``.
        run_of: ``run_of(i, previous)`` is document ``i``'s token segment right after document ``previous``
            (None: in the first position; otherwise with the separator).
        root: the namespace root key; chunk_size: tokens per chunk (as the engine's plans).
        known: whether a chunk key is cached or announced. The walk asks in chain order, so a key is only asked
            when its parent was known.
    """
    identity = tuple(range(num_documents))
    if num_documents < 2:
        return ReuseOrder(identity, 0, 0)
    parent = root
    matched = 0
    for segment in head:
        got, complete, parent = _matched(parent, segment, chunk_size, known)
        matched += got
        if not complete:  # the head itself is not cached: no document chain can be
            return ReuseOrder(identity, matched, 0)
    remaining = list(identity)
    order: list[int] = []
    while remaining:
        best: tuple[int, bool, bytes, int] | None = None  # (tokens, complete, last key, document)
        for doc in remaining:
            got, complete, last = _matched(parent, run_of(doc, order[-1] if order else None), chunk_size, known)
            if got > 0 and (best is None or got > best[0]):
                best = (got, complete, last, doc)
        if best is None:
            break
        got, complete, parent, doc = best
        order.append(doc)
        remaining.remove(doc)
        matched += got
        if not complete:  # the chain breaks inside this document: nothing after it can match
            break
    placed = len(order)
    return ReuseOrder(tuple(order + remaining), matched, placed)


def apply_order(items: Sequence[T], texts: Sequence[str], ordered: Sequence[str]) -> list[T]:
    """``items`` (each with its text in ``texts``) rearranged to follow ``ordered`` (a permutation of ``texts``);
    equal texts keep their relative order. Items whose text is not in ``ordered`` keep their place at the end.

    Raises:
        ValueError: ``texts`` and ``items`` differ in length, or ``ordered`` is not a sub-permutation of them.
    """
    if len(items) != len(texts):
        raise ValueError(f"{len(items)} items but {len(texts)} texts")
    slots: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        slots.setdefault(text, []).append(i)
    taken: list[int] = []
    for text in ordered:
        queue = slots.get(text)
        if not queue:
            raise ValueError("the ordered texts are not a permutation of the items' texts")
        taken.append(queue.pop(0))
    rest = sorted(i for queue in slots.values() for i in queue)
    return [items[i] for i in taken + rest]


def permute_documents(text: str, present: Sequence[str], ordered: Sequence[str]) -> str | None:
    """``text`` with its documents rearranged: ``present`` are documents that occur in ``text`` in this order
    without overlapping (`pcr_rag.client.handoff.documents_in_prompt`), ``ordered`` a permutation of them. Each
    document's slot is refilled with the document at the same index of ``ordered``; the text between documents
    (separators, headers, the question) stays where it is. None when ``text`` does not hold all of ``present`` in
    that order (e.g. they are spread over several chat messages).
    """
    if sorted(present) != sorted(ordered):
        raise ValueError("ordered must be a permutation of present")
    spans: list[tuple[int, int]] = []
    cursor = 0
    for doc in present:
        pos = text.find(doc, cursor)
        if pos < 0 or not doc:
            return None
        spans.append((pos, pos + len(doc)))
        cursor = pos + len(doc)
    out: list[str] = []
    cursor = 0
    for (start, end), doc in zip(spans, ordered):
        out.append(text[cursor:start])
        out.append(doc)
        cursor = end
    out.append(text[cursor:])
    return "".join(out)
