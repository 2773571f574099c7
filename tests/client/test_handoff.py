"""Retrieved documents -> the documents passed with a prompt, and ticket withdrawal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pcr_rag.client.handoff import (
    Announcement,
    cache_aware_order,
    documents_in_prompt,
    release_ticket,
    request_documents,
    scope_of,
)
from pcr_rag.errors import InvalidRequestError
from pcr_rag.prompt import Doc


def test_documents_are_returned_in_prompt_order() -> None:
    prompt = "ctx: BBB then AAA end"
    assert documents_in_prompt(prompt, ["AAA", "BBB"]) == ("BBB", "AAA")


def test_missing_duplicate_empty_and_overlapping_documents_are_skipped() -> None:
    prompt = "xx alpha beta gamma yy"
    assert documents_in_prompt(prompt, ["alpha beta", "beta gamma", "zzz", "", "alpha beta"]) == ("alpha beta",)
    assert documents_in_prompt(prompt, ["gamma", "alpha"]) == ("alpha", "gamma")


def test_request_documents_says_when_the_announcement_can_be_claimed() -> None:
    assert request_documents("a: D1 b: D2", ["D1", "D2"]) == (("D1", "D2"), True)
    assert request_documents("a: D2 b: D1", ["D1", "D2"]) == (("D2", "D1"), False)
    assert request_documents("a: D1", ["D1", "D2"]) == (("D1",), False)


def test_release_ticket_withdraws_only_live_unclaimed_tickets(tmp_path) -> None:
    from pcr_rag import EngineConfig, PCREngine
    from pcr_rag.testing import tiny_model

    model, tok = tiny_model("llama", num_layers=2)
    cfg = EngineConfig(cache_dir=tmp_path, chunk_size=16, max_new_tokens=2, device="cpu")
    with PCREngine(model, tok, cfg) as engine:
        live = engine.announce(["a live document that nobody claims"])
        claimed = engine.announce(["a document the next request claims"])
        engine.generate("q", ["a document the next request claims"])
        assert claimed.claimed and engine.stats().prefetch["pending_announcements"] == 1
        for t in (claimed, live, None):
            release_ticket(engine, t)
        assert live.expired and engine.stats().prefetch["pending_announcements"] == 0
        release_ticket(engine, live)  # idempotent
        assert engine.window_snapshot() == []


class _RecordingEngine:
    """An engine double for the announcement unit tests: records announce / cancel_announcement calls."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.announced: list[tuple[list[str], str | None]] = []
        self.withdrawn: list[object] = []

    def announce(self, documents, query=None):
        if self.fail:
            raise OSError("engine unreachable")
        self.announced.append((documents, query))
        return SimpleNamespace(claimed=False, expired=False, id=len(self.announced))

    def cancel_announcement(self, ticket) -> bool:
        self.withdrawn.append(ticket)
        return True


def test_announcement_hands_each_engine_its_ticket_once() -> None:
    good, broken = _RecordingEngine(), _RecordingEngine(fail=True)
    ann = Announcement(documents=("D1", "D2"), query="q?", origin="span-1", ancestors=("query-span",))
    ann.announce_to([good, broken])  # a failing engine costs its prefetch only
    assert good.announced == [(["D1", "D2"], "q?")] and set(ann.tickets) == {id(good)}
    assert ann.documents_for(good, "ctx D1 D2 question") == ("D1", "D2")  # exact: the engine claims it
    assert good.withdrawn == [] and ann.fully_claimed
    assert ann.take_ticket(good) is None  # a later call on the same engine (e.g. refine) gets no ticket


def test_announcement_withdraws_tickets_it_cannot_hand_over() -> None:
    engine, other = _RecordingEngine(), _RecordingEngine()
    ann = Announcement(documents=("D1", "D2"), query="q?", origin="run", ancestors=())
    ann.announce_to([engine, other])
    assert ann.documents_for(engine, "only D2 made it") == ("D2",)  # not exact: withdrawn, present docs passed
    assert len(engine.withdrawn) == 1 and not ann.fully_claimed
    ann.release_unclaimed()
    assert len(other.withdrawn) == 1 and len(engine.withdrawn) == 1


def test_announcement_of_an_empty_query_is_rejected_and_withdrawn() -> None:
    engine = _RecordingEngine()
    ann = Announcement(documents=("D1",), query="  ", origin="run", ancestors=())
    ann.announce_to([engine])
    with pytest.raises(InvalidRequestError, match="empty query"):
        ann.documents_for(engine, "D1")
    assert len(engine.withdrawn) == 1


class _OrderingEngine(_RecordingEngine):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail_order = fail
        self.excluded: list = []

    def order_for_reuse(self, documents, *, exclude=()):
        self.excluded.append(list(exclude))
        if self.fail_order:
            raise RuntimeError("boom")
        return list(reversed(documents))


def test_cache_aware_order_excludes_the_retrievals_own_ticket_and_never_raises(caplog) -> None:
    engine = _OrderingEngine()
    ann = Announcement(documents=("D1", "D2"), query="q?", origin="run", ancestors=())
    ann.announce_to([engine])
    assert cache_aware_order(engine, ["D1", "D2"], ann) == ("D2", "D1")
    assert engine.excluded == [[ann.ticket_of(engine)]]  # its own announced chunks do not count
    assert cache_aware_order(engine, ["D1", "D2"]) == ("D2", "D1") and engine.excluded[-1] == []
    broken = _OrderingEngine(fail=True)
    with caplog.at_level("ERROR"):
        assert cache_aware_order(broken, ["D1", "D2"], ann) == ("D1", "D2")  # a failed reorder keeps the order
    assert "cache-aware ordering failed" in caplog.text


def test_scope_of_reads_the_metadata_key_and_a_typo_is_private(caplog) -> None:
    assert scope_of({"pcr_scope": "shared"}) == "shared"
    assert scope_of({"pcr_scope": " Private "}) == "private"
    assert scope_of({"visibility": "shared"}, "visibility") == "shared"
    assert scope_of({"visibility": "shared"}) is None and scope_of(None) is None and scope_of({"pcr_scope": None}) is None
    with caplog.at_level("WARNING"):
        assert scope_of({"pcr_scope": "public"}) == "private"  # never share by mistake
        assert scope_of({"pcr_scope": 1}) == "private"
    assert "treating the document as private" in caplog.text


def test_announcement_passes_scoped_documents_as_docs() -> None:
    engine = _RecordingEngine()
    ann = Announcement(documents=("D1", "D2"), query="q?", origin="run", ancestors=(), scopes={"D2": "shared"})
    ann.announce_to([engine])
    assert engine.announced == [(["D1", Doc("D2", "shared")], "q?")]
    assert ann.with_scopes(ann.documents_for(engine, "ctx D1 D2")) == ("D1", Doc("D2", "shared"))
    plain = _RecordingEngine()
    Announcement(documents=("D1",), query="q?", origin="run", ancestors=()).announce_to([plain])
    assert plain.announced == [(["D1"], "q?")]  # no scope: plain strings, as before
