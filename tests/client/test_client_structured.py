"""Structured output travels over HTTP: `HTTPEngine` sends the request's ``response_format`` so the server builds
the same grammar, and the answer equals the local engine's token for token (it was silently dropped before)."""

from __future__ import annotations

import json

import pytest

from pcr_rag.client.http import HTTPEngine
from pcr_rag.request import ChatPrompt, SamplingParams
from pcr_rag.response_format import ResponseFormat

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                           "ok": {"type": "boolean"}}, "required": ["answer", "ok"]}


@pytest.fixture(scope="module")
def remote(base_url):
    with HTTPEngine(base_url) as r:
        yield r


@pytest.mark.parametrize("fmt", [
    ResponseFormat.json_schema(SCHEMA), ResponseFormat("json_object"), ResponseFormat("regex", "[a-c]{3,6}"),
], ids=["json_schema", "json_object", "regex"])
def test_response_format_round_trips_through_openai_shape(fmt) -> None:
    assert ResponseFormat.of(fmt.to_openai()) == fmt


@pytest.mark.parametrize("fmt", [ResponseFormat.json_schema(SCHEMA), ResponseFormat("regex", "[a-c]{3,6}")],
                         ids=["json_schema", "regex"])
def test_remote_structured_output_equals_the_local_engine(remote, reference, h, fmt) -> None:
    prompt = ChatPrompt(h.rag_messages(h.DOCS[:2]), h.DOCS[:2])
    params = SamplingParams(max_new_tokens=24, response_format=fmt)
    want = reference.submit(prompt, params).result()
    got = remote.submit(prompt, params).result()
    assert got.token_ids == want.token_ids and got.text == want.text
    free = reference.submit(prompt, SamplingParams(max_new_tokens=24)).result()
    assert free.token_ids != want.token_ids, "the tiny model's free answer must differ, or this proves nothing"
    if fmt.kind == "json_schema" and got.finish_reason == "stop":
        assert set(json.loads(got.text)) == {"answer", "ok"}
