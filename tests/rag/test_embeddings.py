"""The packaged MiniLM encoder (transformers, no download) and its Chroma embedding function."""

from __future__ import annotations

import math

import pytest

from pcr_rag.rag.embeddings import MINILM_DIM, chroma_embedding_function, shared_encoder


def test_vectors_are_unit_length_deterministic_and_meaningful() -> None:
    enc = shared_encoder()
    a, b, c = enc.encode(["How do I sort a list?", "Sorting a Python list", "The weather is sunny today"])
    assert len(a) == MINILM_DIM
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-5 for v in (a, b, c))
    cos = lambda u, v: sum(x * y for x, y in zip(u, v))  # noqa: E731
    assert cos(a, b) > cos(a, c) + 0.2
    assert enc.encode_one("How do I sort a list?") == pytest.approx(a, abs=1e-6)
    assert enc.encode([]) == []


def test_bad_input_is_rejected() -> None:
    with pytest.raises(TypeError, match="single string"):
        shared_encoder().encode("text")
    with pytest.raises(TypeError, match="strings"):
        shared_encoder().encode(["ok", 3])


def test_chroma_function_round_trips_its_config() -> None:
    fn = chroma_embedding_function()
    vectors = fn(["hello", "world"])
    assert len(vectors) == 2 and len(vectors[0]) == MINILM_DIM
    rebuilt = type(fn).build_from_config(fn.get_config())
    assert type(fn).name() == "pcr-rag-minilm" and rebuilt.get_config() == fn.get_config()


def test_chroma_client_with_empty_path_persists_nothing(tmp_path, monkeypatch) -> None:
    from pcr_rag.rag.embeddings import chroma_client

    monkeypatch.chdir(tmp_path)
    col = chroma_client("").get_or_create_collection("empty-path-check")
    col.add(ids=["a", "b"], embeddings=[[0.1, 0.2], [0.3, 0.4]], documents=["x", "y"])
    assert col.count() == 2
    assert list(tmp_path.iterdir()) == []  # nothing written into the working directory
