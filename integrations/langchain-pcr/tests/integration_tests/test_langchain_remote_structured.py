"""`ChatPCR(base_url=...)` keeps structured output and tool calls: the grammar travels with the request, so the
server's answer is the local engine's, token for token (before, the HTTP client dropped ``response_format`` and
the answer came back unconstrained)."""

from __future__ import annotations

import uuid

import pytest
from langchain_pcr import ChatPCR
from pydantic import BaseModel, Field

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.server import ServerThread


class Verdict(BaseModel):
    """Whether the context answers the question."""

    answer: str = Field(max_length=10)
    ok: bool


def config(tmp_path, name: str) -> EngineConfig:
    return EngineConfig(cache_dir=tmp_path / f"{name}-{uuid.uuid4().hex[:6]}", chunk_size=16, max_new_tokens=40,
                        dram_capacity="64MiB", ssd_capacity="64MiB", max_active=4, max_model_len=1024,
                        dtype="float32")


@pytest.fixture
def pair(tiny, tmp_path):
    """(ChatPCR over HTTP, ChatPCR on a local engine with the same weights)."""
    model, tokenizer = tiny
    with PCREngine(model, tokenizer, config=config(tmp_path, "served")) as engine, \
            PCREngine(model, tokenizer, config=config(tmp_path, "local")) as local, ServerThread(engine) as url:
        yield ChatPCR(base_url=url, max_tokens=40), ChatPCR(engine=local, max_tokens=40)


QUESTION = [("system", "Answer in JSON."), ("human", "Does pathlib join paths with a slash?")]


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_structured_output_over_http_equals_local(pair, method) -> None:
    remote, local = pair
    want = local.with_structured_output(Verdict if method == "json_schema" else {"type": "object"},
                                        method=method, include_raw=True).invoke(QUESTION)
    got = remote.with_structured_output(Verdict if method == "json_schema" else {"type": "object"},
                                        method=method, include_raw=True).invoke(QUESTION)
    assert got["raw"].content == want["raw"].content
    assert got["raw"].content.lstrip().startswith("{")


def test_bind_tools_over_http_equals_local(pair) -> None:
    remote, local = pair

    def lookup(module: str) -> str:
        """Look a stdlib module up."""
        return module

    want = local.bind_tools([lookup], tool_choice="lookup").invoke(QUESTION, max_tokens=200)
    got = remote.bind_tools([lookup], tool_choice="lookup").invoke(QUESTION, max_tokens=200)
    assert got.content == want.content and got.content.startswith('{"name": "lookup"')
    assert [(c["name"], c["args"]) for c in got.tool_calls] == [(c["name"], c["args"]) for c in want.tool_calls]
