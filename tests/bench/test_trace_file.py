"""Trace files for `pcr-rag bench --trace`: both formats parse, a malformed line is named in the error, synthetic
text is deterministic and of its length, and the shipped example trace is the generator's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pcr_rag.bench.trace_example import example_rag_trace
from pcr_rag.bench.trace_file import (
    MOONCAKE_BLOCK_TOKENS,
    SyntheticText,
    TraceFormatError,
    TraceSegment,
    parse_trace,
    read_trace,
)
from pcr_rag.testing import tiny_tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / "example_rag.jsonl"


def _line(**obj) -> str:
    return json.dumps(obj)


def test_rag_trace_parses_in_timestamp_order():
    lines = [
        _line(timestamp=500, segments=[{"kind": "passage", "id": 7, "tokens": 30},
                                       {"kind": "question", "id": "q1", "tokens": 5}], output_length=9),
        "",
        _line(timestamp=100, segments=[{"kind": "system", "id": "s", "tokens": 20},
                                       {"kind": "system", "id": "u1", "tokens": 8, "volatile": True},
                                       {"kind": "passage", "id": "p", "tokens": 30},
                                       {"kind": "history", "id": "h", "tokens": 12},
                                       {"kind": "question", "id": "q0", "tokens": 5}]),
    ]
    trace = parse_trace(lines, source="t.jsonl")
    assert trace.format == "rag" and trace.position_independent
    first, second = trace.requests
    assert (first.line, first.timestamp_ms, first.output_length) == (3, 100.0, None)
    assert [s.kind for s in first.segments] == ["system", "system", "passage", "history", "question"]
    assert first.segments[1].volatile and not first.segments[0].volatile
    assert first.trace_tokens == 75 and first.question == TraceSegment("question", "q0", 5)
    assert second.line == 1 and second.segments[0] == TraceSegment("passage", "7", 30)  # an integer id is a string
    assert trace.arrivals_s(2.0) == [0.0, 0.2] and trace.arrivals_s(float("inf")) == [0.0, 0.0]
    assert trace.scaled(0.5).requests[0].segments[0].tokens == 10 and trace.head(1).requests == (first,)


def test_mooncake_trace_blocks():
    lines = [_line(timestamp=0, input_length=2 * MOONCAKE_BLOCK_TOKENS + 100, output_length=30, hash_ids=[1, 2, 3]),
             _line(timestamp=40, input_length=MOONCAKE_BLOCK_TOKENS * 2 + 7, output_length=3, hash_ids=[1, 9])]
    trace = parse_trace(lines)
    assert trace.format == "mooncake" and not trace.position_independent
    a, b = trace.requests
    assert [(s.kind, s.id, s.tokens) for s in a.segments] == [("block", "1", 512), ("block", "2", 512),
                                                              ("block", "3", 100)]
    # input beyond the hashed blocks is the request's own block
    assert [(s.id, s.tokens) for s in b.segments] == [("1", 512), ("9", 512), ("line-2-rest", 7)]
    assert a.output_length == 30 and a.question is None


@pytest.mark.parametrize(("bad", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (_line(timestamp=0, prompt="x"), "neither a RAG trace request"),
    (_line(segments=[{"kind": "passage", "id": "p", "tokens": 3}]), "missing 'timestamp'"),
    (_line(timestamp=-1, segments=[{"kind": "passage", "id": "p", "tokens": 3}]), "'timestamp' must be"),
    (_line(timestamp=0, segments=[]), "'segments' must be a non-empty list"),
    (_line(timestamp=0, segments=[{"kind": "doc", "id": "p", "tokens": 3}]), "segment 0: 'kind' must be one of"),
    (_line(timestamp=0, segments=[{"kind": "passage", "id": "p", "tokens": 0}]), "'tokens' must be an integer"),
    (_line(timestamp=0, segments=[{"kind": "passage", "id": "", "tokens": 3}]), "'id' must be"),
    (_line(timestamp=0, segments=[{"kind": "passage", "id": "p", "tokens": 3},
                                  {"kind": "system", "id": "s", "tokens": 3}]), "segment 1: a system segment after"),
    (_line(timestamp=0, segments=[{"kind": "question", "id": "a", "tokens": 3},
                                  {"kind": "question", "id": "b", "tokens": 3}]), "at most one question"),
    (_line(timestamp=0, segments=[{"kind": "passage", "id": "p", "tokens": 3, "volatile": True}]),
     "only a system part can be volatile"),
    (_line(timestamp=0, input_length=100, hash_ids=[1, 2]), "need an input_length above 512"),
    (_line(timestamp=0, input_length=100, hash_ids=[]), "'hash_ids' must be a non-empty list"),
    (_line(timestamp=0, input_length=100, hash_ids=[1]), "a mooncake request in a rag trace"),
])
def test_a_malformed_line_is_named(tmp_path, bad, message):
    good = _line(timestamp=0, segments=[{"kind": "passage", "id": "p", "tokens": 3}])
    if "hash_ids" in bad and "rag trace" not in message:  # a Mooncake line after a Mooncake line
        good = _line(timestamp=0, input_length=10, hash_ids=[1])
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{good}\n\n{bad}\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=message) as err:
        read_trace(path)
    assert f"{path}, line 3" in str(err.value)  # the blank line counts: the line number is the file's


def test_empty_or_missing_trace_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(TraceFormatError, match="holds no requests"):
        read_trace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceFormatError, match="cannot read trace file"):
        read_trace(tmp_path / "absent.jsonl")


def test_synthetic_text_is_deterministic_distinct_and_of_its_length():
    tok = tiny_tokenizer()
    one, two = SyntheticText(tok), SyntheticText(tok)
    segs = [TraceSegment("passage", "p1", n) for n in (1, 2, 7, 40, 300)]
    texts = [one.text(s) for s in segs]
    for seg, text in zip(segs, texts, strict=True):
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == seg.tokens
        assert two.text(seg) == text and one.text(seg) == text  # same identity, same text, in any instance
        assert text == text.strip()  # starts and ends with a word: the prompt builder cuts it cleanly
    others = [one.text(TraceSegment("passage", f"p{i}", 40)) for i in range(2, 30)]
    assert len(set(others) | {texts[3]}) == 29  # different ids, different texts
    assert one.text(TraceSegment("history", "p1", 40)) != texts[3]  # the kind is part of the identity
    # one-token texts collide often: re-drawn until distinct (p1's one-token text holds one of the pool's words)
    tiny = [one.text(TraceSegment("question", f"q{i}", 1)) for i in range(len(one.words) - 1)]
    assert len(set(tiny) | {texts[0]}) == len(one.words)
    stats = one.stats()
    assert stats.exact == stats.segments and stats.max_abs_error == 0 and stats.requested == stats.produced


def test_synthetic_text_says_how_close_when_words_cost_two_tokens():
    tok = tiny_tokenizer()
    two_token_words = ("ab", "ce")  # each costs two tokens in the tiny vocabulary, after a space or not
    assert all(len(tok(s, add_special_tokens=False)["input_ids"]) == 2 for w in two_token_words for s in (w, " " + w))
    text = SyntheticText(tok, words=two_token_words)
    for n in (6, 7):
        count = len(tok(text.text(TraceSegment("passage", "x", n)), add_special_tokens=False)["input_ids"])
        assert abs(count - n) <= 1 and count % 2 == 0
    stats = text.stats()
    assert (stats.segments, stats.exact, stats.max_abs_error, stats.total_abs_error) == (2, 1, 1, 1)


def test_example_trace_is_the_generators_output():
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    assert lines == [json.dumps(r) for r in example_rag_trace()]
    trace = read_trace(EXAMPLE)
    assert trace.format == "rag" and len(trace.requests) == 40
    for r in trace.requests:  # a per-request system part before the passages
        kinds = [(s.kind, s.volatile) for s in r.segments]
        assert kinds[:3] == [("system", False), ("system", True), ("passage", False)]
    assert len({r.segments[1].id for r in trace.requests}) == 40
    orders = {tuple(s.id for s in r.segments if s.kind == "passage") for r in trace.requests}
    pairs = {(a, b) for o in orders for a, b in zip(o, o[1:])}
    assert any((b, a) in pairs for a, b in pairs)  # passages come back in new orders
    assert any(s.kind == "history" for r in trace.requests for s in r.segments)
