"""Blend mode through `PCRLLM` (issue 48): ``reuse=`` as a field and per call, with a local engine and with
``base_url=`` (a real `pcr-rag serve`), and the raw usage reporting ``blended_tokens`` and ``reuse`` the same way
on both paths, token for token."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.llms import ChatMessage
from llama_index.llms.pcr import PCRLLM, PCRRequestError
from pydantic import ValidationError

from pcr_rag.server import ServerThread

DOCS = (
    "Kafka stores ordered records in partitions that consumers read at their own pace. " * 3,
    "Gradient descent follows the negative gradient to reduce the loss function step by step. " * 3,
    "The Rhine rises in the Swiss Alps and flows north to the North Sea through six countries. " * 3,
)


def ask(order: tuple[int, ...]) -> tuple[list[ChatMessage], list[str]]:
    docs = [DOCS[i] for i in order]
    return ([ChatMessage(role="system", content="Answer from the context."),
             ChatMessage(role="user", content="Context:\n" + "\n\n".join(docs) + "\n\nQuestion: what do they say?")],
            docs)


def report(raw: dict) -> tuple:
    """What a response reports about reuse, checked for consistency: the usage's details equal the top level, and
    computed + reused + blended tokens make the prompt."""
    details = raw["usage"]["prompt_tokens_details"]
    assert details == {"cached_tokens": raw["reused_tokens"], "blended_tokens": raw["blended_tokens"]}
    assert raw["computed_tokens"] + raw["reused_tokens"] + raw["blended_tokens"] == raw["prompt_tokens"]
    return raw["reuse"], raw["blended_tokens"], raw["reused_tokens"], raw["prompt_tokens"]


@pytest.fixture
def served(engine_factory):
    """(server engine, base URL, reference engine with the same weights), each on a fresh cache."""
    with engine_factory(max_model_len=2048) as engine, engine_factory(max_model_len=2048) as reference, \
            ServerThread(engine) as url:
        yield engine, url, reference


def test_reuse_field_and_per_call_report_blended_tokens_locally_and_over_http(served) -> None:
    engine, url, reference = served
    remote = PCRLLM(base_url=url, max_new_tokens=5, reuse="blend", retrieval_hook=False)
    local = PCRLLM(engine=reference, max_new_tokens=5, reuse="blend", retrieval_hook=False)
    # (order, per-call reuse, how the call is made): the field's blend, then per-call overrides both ways
    steps = [((0, 1, 2), None, "chat"), ((2, 0, 1), None, "stream_chat"), ((1, 2, 0), "exact", "chat"),
             ((0, 2, 1), "blend", "achat"), ((2, 1, 0), None, "complete")]
    reports = []
    for order, reuse, how in steps:
        messages, docs = ask(order)
        per_call = {} if reuse is None else {"reuse": reuse}
        answers = []
        for llm in (local, remote):
            if how == "chat":
                response = llm.chat(messages, documents=docs, **per_call)
            elif how == "achat":
                response = asyncio.run(llm.achat(messages, documents=docs, **per_call))
            elif how == "stream_chat":
                response = list(llm.stream_chat(messages, documents=docs, **per_call))[-1]
            else:
                response = llm.complete(messages[1].content, documents=docs, **per_call)
            text = response.text if how == "complete" else response.message.content
            answers.append((text, report(response.raw)))
            assert response.additional_kwargs["pcr"] == response.raw
        assert answers[0] == answers[1], (order, how)  # one behaviour, every path
        reports.append(answers[0][1])
    assert [r[0] for r in reports] == ["blend", "blend", "exact", "blend", "blend"]
    assert reports[2][1] == 0                    # reuse="exact" per call overrides the field
    assert all(r[1] > 0 for r in reports[1:] if r[0] == "blend")  # documents seen before: placed
    exact = PCRLLM(base_url=url, max_new_tokens=5, retrieval_hook=False)  # None: the server's default, exact
    messages, docs = ask((1, 0, 2))
    assert report(exact.chat(messages, documents=docs).raw)[:2] == ("exact", 0)
    assert engine.stats().requests["blended_requests"] == reference.stats().requests["blended_requests"] == 4


def test_a_bad_reuse_is_refused_before_any_request(served) -> None:
    engine, url, reference = served
    with pytest.raises(ValidationError, match="reuse"):
        PCRLLM(base_url=url, reuse="fuzzy")
    messages, docs = ask((0, 1, 2))
    for llm in (PCRLLM(base_url=url, retrieval_hook=False), PCRLLM(engine=reference, retrieval_hook=False)):
        with pytest.raises(PCRRequestError, match="reuse"):
            llm.chat(messages, documents=docs, reuse="approximate")
    assert engine.stats().requests["requests_finished"] == reference.stats().requests["requests_finished"] == 0
