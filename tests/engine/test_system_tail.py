"""A per-request part of the instructions (a date, a user profile) before the documents ends every document's
cached prefix; as ``system_tail`` it goes after them (issue 48 item 3): the documents are reused across requests
whose tails differ, the answers equal a cache-off engine's for the same prompt, and an announcement made before
the tail is known is still claimed."""

from __future__ import annotations

import pytest

from pcr_rag.errors import InvalidRequestError
from pcr_rag.request import RagPrompt

DOC_A = "Kafka stores ordered records in partitions that consumers read at their own pace. " * 5
DOC_B = "Gradient descent follows the negative gradient to reduce the loss function step by step. " * 5
BASE = "Answer from the documents."
USERS = ("Today is 2026-12-06. The user is Ana, a data engineer in Lisbon.",
         "Today is 2026-12-07. The user is Bo, a student in Oslo who prefers short answers.")
QUESTION = "what do the documents say?"


def test_the_tail_sits_between_the_documents_and_the_question(tiny_engine, tmp_path):
    with tiny_engine(tmp_path / "c") as eng:
        text = eng.builder.rag_user_text(QUESTION, [DOC_A, DOC_B], USERS[0])
        assert text.index(DOC_B) < text.index(USERS[0]) < text.index(f"Question: {QUESTION}")
        assert eng.builder.rag_user_text(QUESTION, [DOC_A], "  ") == eng.builder.rag_user_text(QUESTION, [DOC_A])
        assert eng.builder.rag_user_text(QUESTION, [], USERS[0]).startswith(USERS[0])
        with pytest.raises(InvalidRequestError, match="system_tail"):
            RagPrompt(QUESTION, [DOC_A], BASE, system_tail=3)
        assert eng.stats().requests["requests_finished"] == 0


def test_documents_are_reused_across_tails_and_answers_equal_cache_off(tiny_engine, tmp_path):
    docs = [DOC_A, DOC_B]
    with tiny_engine(tmp_path / "off", enable_cache=False) as off:
        want = {u: off.generate(QUESTION, docs, system=BASE, system_tail=u) for u in USERS}
        want_head = {u: off.generate(QUESTION, docs, system=f"{BASE} {u}") for u in USERS}
    with tiny_engine(tmp_path / "head") as eng:  # the per-request part before the documents
        head = {u: eng.generate(QUESTION, docs, system=f"{BASE} {u}") for u in USERS}
    with tiny_engine(tmp_path / "tail") as eng:  # ... and after them
        tail = {u: eng.generate(QUESTION, docs, system=BASE, system_tail=u) for u in USERS}
        doc_tokens = sum(len(eng.tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs)
    for u in USERS:
        assert tail[u].token_ids == want[u].token_ids and head[u].token_ids == want_head[u].token_ids
    second = USERS[1]
    # before the documents, the second user's part ends the match inside the head: the documents are computed
    assert head[second].metrics.reused_tokens < doc_tokens // 2
    # after them, the second request reuses the head and both documents (all but the chunk the tail cuts into)
    assert tail[second].metrics.reused_tokens >= doc_tokens - 16
    assert tail[second].metrics.reused_tokens > head[second].metrics.reused_tokens + doc_tokens // 2


def test_an_announcement_without_the_tail_is_claimed_by_the_request_with_it(tiny_engine, tmp_path):
    with tiny_engine(tmp_path / "c") as eng:
        ticket = eng.announce([DOC_A, DOC_B], QUESTION, system=BASE)
        res = eng.generate(QUESTION, [DOC_A, DOC_B], system=BASE, system_tail=USERS[0])
        assert ticket.keys and res.metrics.announced
