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


class _Board:
    def __init__(self) -> None:
        self.cancelled = []

    def cancel(self, ticket) -> bool:
        self.cancelled.append(ticket)
        return True


class _Ticket:
    def __init__(self, claimed: bool = False, expired: bool = False) -> None:
        self.claimed, self.expired = claimed, expired


class _Engine:
    def __init__(self) -> None:
        self.board = _Board()


def test_release_ticket_withdraws_only_live_unclaimed_tickets() -> None:
    engine = _Engine()
    live, claimed, expired = _Ticket(), _Ticket(claimed=True), _Ticket(expired=True)
    for t in (live, claimed, expired, None):
        release_ticket(engine, t)
    assert engine.board.cancelled == [live]
