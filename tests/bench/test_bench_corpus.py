"""Corpus loading (stdlib pydoc, directory, JSONL) and passage splitting."""

from __future__ import annotations

import json

import pytest

from pcr_rag.rag.corpus import (
    CorpusDocument,
    CorpusError,
    CorpusNotFoundError,
    EmptyCorpusError,
    load_corpus,
    split_passages,
    stdlib_corpus,
)


def test_stdlib_corpus_is_deterministic_and_clean(tmp_path):
    docs = stdlib_corpus(["json", "os", "textwrap"])
    again = stdlib_corpus(["json", "os", "textwrap"])
    assert docs == again
    assert [d.doc_id for d in docs] == ["stdlib/json", "stdlib/os", "stdlib/textwrap"]
    os_doc = docs[1].text
    assert "environ(" not in os_doc  # DATA section dropped: no environment values leak
    assert "FILE\n" not in os_doc and "0x7f" not in os_doc
    assert "JSON" in docs[0].text


def test_stdlib_cache_dir_round_trips(tmp_path):
    first = stdlib_corpus(["json", "heapq"], cache_dir=tmp_path)
    assert list(tmp_path.glob("stdlib-corpus-*.jsonl"))
    assert stdlib_corpus(["json", "heapq"], cache_dir=tmp_path) == first


def test_default_corpus_max_docs():
    docs = load_corpus(max_docs=3)
    assert len(docs) == 3
    assert all(d.doc_id.startswith("stdlib/") and d.text.strip() for d in docs)


def test_directory_corpus(tmp_path):
    (tmp_path / "b.md").write_text("# Bee title\n\nsome text\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("alpha text\n")
    (tmp_path / "empty.txt").write_text("   \n")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    docs = load_corpus(tmp_path)
    assert [d.doc_id for d in docs] == ["b.md", "sub/a.txt"]
    assert docs[0].title == "Bee title" and docs[1].title == "a"
    assert load_corpus(tmp_path, max_docs=1)[0].doc_id == "b.md"


def test_jsonl_corpus_and_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "x", "title": "X", "text": "hello"}) + "\n\n"
                    + json.dumps({"text": "no id"}) + "\n")
    docs = load_corpus(path)
    assert docs[0] == CorpusDocument("x", "X", "hello")
    assert docs[1].doc_id == "3" and docs[1].title == "3"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(CorpusError, match="bad.jsonl:1"):
        load_corpus(bad)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n')
    with pytest.raises(CorpusError, match="duplicate id"):
        load_corpus(dup)


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(CorpusNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "d").mkdir()
    with pytest.raises(EmptyCorpusError):
        load_corpus(tmp_path / "d")
    empty = tmp_path / "e.jsonl"
    empty.write_text('{"text": "  "}\n')
    with pytest.raises(EmptyCorpusError):
        load_corpus(empty)
    with pytest.raises(CorpusError):
        load_corpus(max_docs=0)


def test_split_passages_respects_budget_and_keeps_all_text():
    paras = [" ".join(f"w{i}_{j}" for j in range(n)) for i, n in enumerate([40, 70, 10, 500, 30])]
    doc = CorpusDocument("d", "D", "\n\n".join(paras))
    passages = split_passages([doc], tokens_per_passage=100)
    assert all(len(p.text.split()) <= 100 for p in passages)
    assert [p.doc_id for p in passages] == [f"d#{i}" for i in range(len(passages))]
    assert passages[0].title == "D (part 1)"
    # Every word appears exactly once, in order.
    assert " ".join(p.text for p in passages).split() == doc.text.split()
    # Paragraph boundaries are preferred: the first passage is paragraphs 0 (+ nothing else, 40+70 > 100).
    assert passages[0].text == paras[0]


def test_split_passages_with_tokenizer_counts_tokens():
    class CharTok:  # one token per character: a strict budget in "tokens"
        def encode(self, text, add_special_tokens=False):
            return list(text)

    doc = CorpusDocument("d", "D", "aaaa bbbb\n\ncccc dddd eeee\n\nff")
    passages = split_passages([doc], tokens_per_passage=10, tokenizer=CharTok())
    assert all(len(p.text) <= 10 for p in passages)
    assert "".join(p.text.replace("\n", "").replace(" ", "") for p in passages) == "aaaabbbbccccddddeeeeff"


def test_split_stdlib_passages_size():
    passages = split_passages(stdlib_corpus(["json", "heapq"]), tokens_per_passage=300)
    assert len(passages) > 5
    assert max(len(p.text.split()) for p in passages) <= 300
