"""Unit tests of the bounds behind issue 47 item 3: `RequestLimits`, the announcement board's per-tenant and total
bounds and its indexes, the stop matcher's window, and the grammar caches' byte bounds."""

from __future__ import annotations

import time

import pytest

from pcr_rag import EngineConfig, InvalidRequestError, response_format
from pcr_rag.limits import RequestLimits
from pcr_rag.model.grammar import GrammarCompiler
from pcr_rag.response_format import ResponseFormat
from pcr_rag.sched.announcements import AnnouncementBoard
from pcr_rag.sched.runner import _find_stop
from pcr_rag.testing import tiny_model


# ------------------------------------------------------------------------------------------------ limits
def test_limits_refuse_too_many_or_too_long_stops_and_big_formats() -> None:
    limits = RequestLimits(max_stop_sequences=2, max_stop_bytes=4, max_format_bytes=10, max_tools_bytes=10)
    limits.check_stop(("ab", "\u20ac"))  # 3 bytes
    with pytest.raises(InvalidRequestError, match="3 sequences"):
        limits.check_stop(("a", "b", "c"))
    with pytest.raises(InvalidRequestError, match="6 bytes"):
        limits.check_stop(("\u20ac\u20ac",))
    with pytest.raises(InvalidRequestError, match="11 bytes"):
        limits.check_format("x" * 11)
    with pytest.raises(InvalidRequestError, match="tools take 11 bytes"):
        limits.check_tools(11)
    with pytest.raises(ValueError, match="max_stop_bytes"):
        RequestLimits(max_stop_bytes=0)


def test_the_engine_config_carries_the_limits() -> None:
    cfg = EngineConfig(max_stop_sequences=4, max_stop_bytes=64, max_format_bytes=1024, max_tools_bytes=2048)
    assert cfg.request_limits == RequestLimits(4, 64, 1024, 2048)
    with pytest.raises(ValueError, match="max_announcements"):
        EngineConfig(max_announcements=0)


def test_a_stop_string_is_found_across_tokens_and_only_in_the_new_tail() -> None:
    assert _find_stop("hello wor", ("world",), 9) is None
    assert _find_stop("hello world", ("world",), 9) == 6  # completed by the new characters
    assert _find_stop("ab STOP cd STOP", ("STOP",), 13) == 11  # the earlier one was searched before
    assert _find_stop("xyz", ("", "z"), 2) == 2


def test_stop_matching_costs_the_new_characters_not_the_output() -> None:
    """With the bounds, a token's check looks at most at max_stop_bytes characters per stop string, however long
    the answer; a long answer costs no more per token than a short one."""
    stops = tuple(f"{i:03d}" + "q" * 200 for i in range(16))
    short, long = "a" * 1_000, "a" * 2_000_000

    def per_call(text: str) -> float:
        t0 = time.perf_counter()
        for _ in range(200):
            _find_stop(text, stops, len(text) - 1)
        return time.perf_counter() - t0

    per_call(short)
    assert per_call(long) < 20 * per_call(short) + 0.05


# ------------------------------------------------------------------------------------------------ the board
def test_one_namespace_holds_at_most_its_share_and_never_evicts_another() -> None:
    board = AnnouncementBoard(60.0, max_pending=16, max_per_namespace=4)
    quiet = [board.add((f"quiet {i}",), [b"k"], namespace="quiet") for i in range(3)]
    noisy = [board.add((f"noisy {i}",), [b"k"], namespace="noisy") for i in range(1500)]
    assert board.pending("noisy") == 4 and board.pending("quiet") == 3 and len(board) == 7
    assert all(not t.expired for t in quiet) and all(t.expired for t in noisy[:-4])
    assert board.evicted == 1496
    assert board.claim(("quiet 1",), "quiet") is quiet[1] and quiet[1].claimed
    assert board.claim(("quiet 1",), "noisy") is None  # another tenant's documents are not its own


def test_the_total_bound_evicts_the_oldest_ticket() -> None:
    board = AnnouncementBoard(60.0, max_pending=3, max_per_namespace=3)
    tickets = [board.add((f"d{i}",), [b"k"], namespace=f"t{i}") for i in range(5)]
    assert len(board) == 3 and [t.expired for t in tickets] == [True, True, False, False, False]


def test_claim_takes_the_oldest_matching_ticket_and_cancel_and_expiry_keep_the_indexes() -> None:
    now = [0.0]
    board = AnnouncementBoard(10.0, clock=lambda: now[0])
    a = board.add(("doc",), [b"k1"], namespace="n")
    b = board.add(("doc",), [b"k2"], namespace="n")
    assert board.claim(("doc",), "n") is a
    assert board.cancel(b) and b.expired and not board.cancel(b)
    assert board.claim(("doc",), "n") is None and len(board) == 0 and board.pending("n") == 0
    board.add(("old",), [b"k3"], namespace="n")
    now[0] = 5.0
    fresh = board.add(("new",), [b"k4"], namespace="m")
    now[0] = 10.0
    assert board.expire() == 1 and board.claim(("old",), "n") is None
    assert board.keys(10) == [(b"k4",)] and board.claim(("new",), "m") is fresh


# ------------------------------------------------------------------------------------------------ grammars
@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=0)


def _schema_format(properties: int, tag: str) -> ResponseFormat:
    return ResponseFormat.json_schema({"type": "object", "properties": {
        f"{tag}_{i}": {"type": "integer"} for i in range(properties)}})


def test_the_compiled_cache_is_bounded_in_bytes(tiny) -> None:
    _, tok = tiny
    formats = [_schema_format(30, f"f{i}") for i in range(8)]
    cost = len(formats[0].source) + len(formats[0].grammar)  # what one of them is charged (ASCII text)
    bound = 3 * cost + cost // 2
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id], cache_size=64, cache_bytes=bound)
    for fmt in formats:
        compiler.matcher(fmt)
        assert compiler.cached_bytes <= bound
    assert len(compiler) == 3 and formats[-1] in compiler._compiled  # the most recent ones
    huge = _schema_format(2_000, "huge")
    compiler.matcher(huge)  # compiled for its request, too big to keep
    assert huge not in compiler._compiled and compiler.cached_bytes <= bound


def test_only_a_compiled_grammar_is_remembered_as_valid(tiny, monkeypatch) -> None:
    _, tok = tiny
    validated = response_format._Validated(8)
    monkeypatch.setattr(response_format, "_VALIDATED", validated)
    fmt = _schema_format(3, "only")
    assert len(validated) == 0  # constructing (validating) a format remembers nothing
    GrammarCompiler(tok, len(tok), [tok.eos_token_id]).matcher(fmt)
    assert len(validated) == 1
    calls = []
    real = response_format.llguidance.LLMatcher.validate_grammar_with_warnings
    monkeypatch.setattr(response_format, "llguidance", _Counting(real, calls))
    ResponseFormat(fmt.kind, fmt.source)  # known valid: not validated again
    assert calls == []


class _Counting:
    """Stands in for the llguidance module: counts tokenizer-free validations."""

    def __init__(self, real, calls) -> None:
        self._real, self._calls = real, calls
        outer = self

        class LLMatcher:
            @staticmethod
            def validate_grammar_with_warnings(*args):
                outer._calls.append(args)
                return outer._real(*args)

            grammar_from_json_schema = staticmethod(response_format.llguidance.LLMatcher.grammar_from_json_schema)

        self.LLMatcher = LLMatcher
