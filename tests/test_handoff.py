"""Retrieved documents -> the documents passed with a prompt, and ticket withdrawal."""

from __future__ import annotations

from pcr_rag.handoff import documents_in_prompt, release_ticket, request_documents


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
