"""Blend mode through `ChatPCR` and `PCRLLM` (issue 48): ``reuse=`` as a field and per call, with a local engine
and with ``base_url=`` (a real `pcr-rag serve`); ``usage_metadata`` reports exact reuse as ``cache_read`` and
blended tokens as ``blended``, ``response_metadata`` has ``blended_tokens`` and ``reuse``, the same on both paths,
token for token."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_pcr import PCRLLM, ChatPCR
from pydantic import ValidationError

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.errors import InvalidRequestError
from pcr_rag.server import ServerThread

DOCS = (
    "Kafka stores ordered records in partitions that consumers read at their own pace. " * 3,
    "Gradient descent follows the negative gradient to reduce the loss function step by step. " * 3,
    "The Rhine rises in the Swiss Alps and flows north to the North Sea through six countries. " * 3,
)


def ask(order: tuple[int, ...]) -> tuple[list, list[str]]:
    docs = [DOCS[i] for i in order]
    return ([SystemMessage("Answer from the context."),
             HumanMessage("Context:\n" + "\n\n".join(docs) + "\n\nQuestion: what do they say?")], docs)


def report(message) -> tuple:
    """(reuse, blended, cached, prompt) of an answer, checked for consistency between ``usage_metadata`` and
    ``response_metadata`` and for computed + reused + blended == prompt."""
    usage, meta = message.usage_metadata, message.response_metadata
    details = usage["input_token_details"]
    assert details == {"cache_read": meta["reused_tokens"], "blended": meta["blended_tokens"]}
    assert usage["input_tokens"] == meta["prompt_tokens"]
    assert meta["computed_tokens"] + meta["reused_tokens"] + meta["blended_tokens"] == meta["prompt_tokens"]
    return meta["reuse"], meta["blended_tokens"], meta["reused_tokens"], meta["prompt_tokens"]


def config(tmp_path, name: str) -> EngineConfig:
    return EngineConfig(cache_dir=tmp_path / f"{name}-{uuid.uuid4().hex[:6]}", chunk_size=16, max_new_tokens=6,
                        dram_capacity="64MiB", ssd_capacity="64MiB", max_active=4, max_model_len=1024,
                        dtype="float32")


@pytest.fixture
def served(tiny, tmp_path):
    """(server engine, base URL, reference engine with the same weights), each on a fresh cache."""
    model, tokenizer = tiny
    with PCREngine(model, tokenizer, config=config(tmp_path, "served")) as engine, \
            PCREngine(model, tokenizer, config=config(tmp_path, "reference")) as reference, \
            ServerThread(engine) as url:
        yield engine, url, reference


def test_chat_pcr_reuse_field_and_per_call_report_blended_tokens_locally_and_over_http(served) -> None:
    engine, url, reference = served
    remote = ChatPCR(base_url=url, max_tokens=5, reuse="blend")
    local = ChatPCR(engine=reference, max_tokens=5, reuse="blend")
    steps = [((0, 1, 2), None, "invoke"), ((2, 0, 1), None, "stream"), ((1, 2, 0), "exact", "invoke"),
             ((0, 2, 1), "blend", "ainvoke")]
    reports = []
    for order, reuse, how in steps:
        messages, docs = ask(order)
        kwargs = {"documents": docs, **({} if reuse is None else {"reuse": reuse})}
        answers = []
        for llm in (local, remote):
            if how == "invoke":
                message = llm.invoke(messages, **kwargs)
            elif how == "ainvoke":
                message = asyncio.run(llm.ainvoke(messages, **kwargs))
            else:
                chunks = list(llm.stream(messages, **kwargs))
                message = chunks[0]
                for chunk in chunks[1:]:
                    message = message + chunk
                assert chunks[-1].usage_metadata is not None  # the closing chunk carries the usage
            answers.append((message.content, report(message)))
        assert answers[0] == answers[1], (order, how)  # one behaviour, every path
        reports.append(answers[0][1])
    assert [r[0] for r in reports] == ["blend", "blend", "exact", "blend"]
    assert reports[2][1] == 0                     # reuse="exact" per call overrides the field
    assert all(r[1] > 0 for r in reports[1:] if r[0] == "blend")  # documents seen before: placed
    messages, docs = ask((1, 0, 2))
    default = ChatPCR(base_url=url, max_tokens=5).invoke(messages, documents=docs)  # None: the server's default
    assert report(default)[:2] == ("exact", 0)
    assert engine.stats().requests["blended_requests"] == reference.stats().requests["blended_requests"] == 3


def test_pcr_llm_reuse_sums_blended_tokens_in_llm_output(served) -> None:
    _, url, reference = served
    prompts = [ask(order)[0][1].content for order in ((0, 1, 2), (2, 0, 1))]
    outputs = []
    for llm in (PCRLLM(engine=reference, max_tokens=5, reuse="blend"), PCRLLM(base_url=url, max_tokens=5,
                                                                               reuse="blend")):
        result = llm.generate(prompts[:1], documents=ask((0, 1, 2))[1])
        again = llm.generate(prompts[1:], documents=ask((2, 0, 1))[1])
        exact = llm.generate(prompts[1:], documents=ask((2, 0, 1))[1], reuse="exact")
        info = again.generations[0][0].generation_info
        assert info["reuse"] == "blend" and info["usage_metadata"]["input_token_details"]["blended"] > 0
        assert again.llm_output["token_usage"]["blended_tokens"] == info["blended_tokens"] > 0
        assert exact.llm_output["token_usage"]["blended_tokens"] == 0
        outputs.append([r.generations[0][0].text for r in (result, again, exact)])
    assert outputs[0] == outputs[1]


def test_a_bad_reuse_is_refused_before_any_request(served) -> None:
    engine, url, reference = served
    with pytest.raises(ValidationError, match="reuse"):
        ChatPCR(base_url=url, reuse="fuzzy")
    messages, docs = ask((0, 1, 2))
    for llm in (ChatPCR(base_url=url), ChatPCR(engine=reference)):
        with pytest.raises(InvalidRequestError, match="reuse"):
            llm.invoke(messages, documents=docs, reuse="approximate")
    assert engine.stats().requests["requests_finished"] == reference.stats().requests["requests_finished"] == 0
