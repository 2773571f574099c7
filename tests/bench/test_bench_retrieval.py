"""Real retrieval (Chroma + packaged MiniLM) for benchmark topics."""

from __future__ import annotations

import pytest

from pcr_rag.bench.retrieval import STDLIB_QUESTIONS, load_questions, retrieve_topics
from pcr_rag.corpus import CorpusDocument


def test_retrieve_topics_ranks_the_relevant_passage_first():
    passages = [
        CorpusDocument("json", "json", "json.loads parses a JSON document from a string into Python objects."),
        CorpusDocument("gzip", "gzip", "gzip.open reads and writes gzip-compressed files."),
        CorpusDocument("uuid", "uuid", "uuid.uuid4 generates a random UUID."),
        CorpusDocument("heapq", "heapq", "heapq.nsmallest returns the n smallest elements of an iterable."),
    ]
    topics = retrieve_topics(passages, ["How do I create a random UUID?", "Parse JSON text"], top_k=2)
    assert [q for q, _ in topics] == ["How do I create a random UUID?", "Parse JSON text"]
    assert topics[0][1][0] == "uuid" and topics[1][1][0] == "json"
    assert all(len(ids) == 2 and len(set(ids)) == 2 for _, ids in topics)
    with pytest.raises(ValueError):
        retrieve_topics(passages, ["q"], top_k=5)


def test_load_questions(tmp_path):
    assert load_questions(None) == list(STDLIB_QUESTIONS)
    f = tmp_path / "q.txt"
    f.write_text("# comment\nFirst?\n\n  Second?  \n")
    assert load_questions(f) == ["First?", "Second?"]
    with pytest.raises(FileNotFoundError):
        load_questions(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n# only comments\n")
    with pytest.raises(ValueError):
        load_questions(tmp_path / "empty.txt")
