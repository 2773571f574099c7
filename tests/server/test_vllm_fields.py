"""vLLM's request fields over HTTP, through the official openai SDK: ``structured_outputs`` (json, regex, choice,
grammar in GBNF or Lark, json_object) and the older ``guided_*`` fields constrain the answer exactly as the local
engine's `ResponseFormat`; ``min_p``, ``min_tokens`` and ``ignore_eos`` give the local engine's tokens; a field the
server does not know is named in the ``X-PCR-Ignored-Fields`` header and a warning line, never dropped silently;
what langchain-openai and LlamaIndex's OpenAILike send is all known."""

from __future__ import annotations

import json
import logging
import re

import httpx
import openai
import pytest

from pcr_rag.request import ChatPrompt, FlatPrompt, SamplingParams
from pcr_rag.response_format import ResponseFormat
from pcr_rag.server.disclosure import IGNORED_HEADER
from pcr_rag.server.structured_outputs import choice_format

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
GBNF = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"\n'
LARK = 'start: "The answer is " answer "."\nanswer: "yes" | "no"\n'


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _chat(client, engine, h, extra: dict, **more):
    more.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=engine.loaded.name, messages=h.rag_messages(),
                                          extra_body={"documents": list(h.DOCS), **extra}, **more)


def _local(reference, h, params: SamplingParams, chat: bool = True):
    prompt = (ChatPrompt(h.rag_messages(), h.DOCS) if chat
              else FlatPrompt(h.rag_messages()[1]["content"], h.DOCS, chat=False))
    return reference.submit(prompt, params).result(timeout=120)


# ------------------------------------------------------------------------------------------ structured outputs
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_choice_is_answered_with_one_of_the_choices(seed, client, engine, reference, h) -> None:
    """The done-when of issue 50: ``structured_outputs: {"choice": ["yes", "no"]}`` gets "yes" or "no", sampled
    or greedy, chat or completions, and the local engine's answer token for token."""
    extra = {"structured_outputs": {"choice": ["yes", "no"]}}
    r = _chat(client, engine, h, extra, temperature=1.5, seed=seed)
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    want = _local(reference, h, SamplingParams(max_new_tokens=24, temperature=1.5, seed=seed,
                                               response_format=choice_format(["yes", "no"])))
    assert r.choices[0].message.content == want.text
    c = client.completions.create(model=engine.loaded.name, prompt="Is the sky blue? Answer:", max_tokens=8,
                                  temperature=1.5, seed=seed, extra_body=extra)
    assert c.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-c]"}}, lambda t: re.fullmatch("[0-9]{3}-[a-c]", t)),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: json.loads(t)["answer"] in ("yes", "no")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, lambda t: json.loads(t)["answer"] in ("yes", "no")),
    ({"structured_outputs": {"grammar": GBNF}}, lambda t: t in ("The answer is yes.", "The answer is no.")),
    ({"structured_outputs": {"grammar": LARK}}, lambda t: t in ("The answer is yes.", "The answer is no.")),
    ({"structured_outputs": {"json_object": True}}, lambda t: t.startswith("{")),
    ({"structured_outputs": {"choice": ["red", "green", "blue"], "disable_fallback": True,
                             "disable_any_whitespace": True}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_regex": "[xyz]{4}"}, lambda t: re.fullmatch("[xyz]{4}", t)),
    ({"guided_json": SCHEMA}, lambda t: json.loads(t)["answer"] in ("yes", "no")),
    ({"guided_grammar": GBNF}, lambda t: t in ("The answer is yes.", "The answer is no.")),
])
def test_each_structured_output_constrains_the_answer(extra, check, client, engine, h) -> None:
    r = _chat(client, engine, h, extra, max_tokens=40, temperature=1.0, seed=5)
    assert check(r.choices[0].message.content), r.choices[0].message.content


def test_a_gbnf_grammar_answers_as_its_lark_translation(client, engine, reference, h) -> None:
    """vLLM documents GBNF (EBNF) grammars; llguidance's converter turns them into the Lark the engine runs."""
    gbnf = _chat(client, engine, h, {"structured_outputs": {"grammar": GBNF}}, temperature=1.0, seed=9)
    lark = _local(reference, h, SamplingParams(max_new_tokens=24, temperature=1.0, seed=9,
                                               response_format=ResponseFormat("grammar", LARK)))
    assert gbnf.choices[0].message.content == lark.text


def test_disable_additional_properties_closes_the_schema(client, engine, reference, h) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = _chat(client, engine, h, {"structured_outputs": {"json": schema, "disable_additional_properties": True}},
              max_tokens=40)
    closed = {**schema, "additionalProperties": False}
    want = _local(reference, h, SamplingParams(max_new_tokens=40, response_format=closed))
    assert r.choices[0].message.content == want.text and set(json.loads(want.text)) == {"a"}


@pytest.mark.parametrize("extra, param, message", [
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice must be a non-empty list"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs", "choice[1] must be a string"),
    ({"structured_outputs": {"grammar": "just words"}}, "structured_outputs", "neither Lark"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "json: is not valid JSON"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag is not supported"),
    ({"structured_outputs": {"choice": ["a"], "whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern is not supported"),
    ({"structured_outputs": {"choise": ["a"]}}, "structured_outputs", "structured_outputs.choise is not"),
    ({"structured_outputs": ["a"]}, "structured_outputs", "'structured_outputs'"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "send one of response_format, structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}, "guided_regex", "send one of"),
    ({"min_p": 1.5}, "min_p", "min_p"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens"),
    ({"min_tokens": 30}, "min_tokens", "min_tokens=30 is more than max_new_tokens=24"),
    ({"ignore_eos": "yes"}, "ignore_eos", "ignore_eos"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(extra, param, message, client, engine, h) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, engine, h, extra)
    body = err.value.body
    assert body["param"] == param and message in body["message"], body


def test_structured_outputs_and_tools_exclude_each_other(client, engine, h) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="either 'tools' or 'structured_outputs'"):
        _chat(client, engine, h, {"structured_outputs": {"choice": ["a"]}}, tools=[tool])


# --------------------------------------------------------------------------------------------- sampling fields
@pytest.mark.parametrize("fields", [dict(min_p=0.3, temperature=1.3, seed=4), dict(min_tokens=20),
                                    dict(ignore_eos=True), dict(min_p=0.1, min_tokens=5, ignore_eos=True,
                                                                temperature=0.8, seed=2)])
def test_min_p_min_tokens_and_ignore_eos_answer_as_the_local_engine(fields, client, engine, reference, h) -> None:
    sdk = {k: v for k, v in fields.items() if k in ("temperature", "seed")}
    extra = {k: v for k, v in fields.items() if k not in sdk}
    r = _chat(client, engine, h, {**extra, "return_token_ids": True}, **sdk)
    want = _local(reference, h, SamplingParams(max_new_tokens=24, **fields))
    assert r.choices[0].token_ids == want.token_ids  # type: ignore[attr-defined]
    if fields.get("min_tokens"):
        assert len(want.token_ids) >= fields["min_tokens"]


# ------------------------------------------------------------------------------------------------ unknown fields
def _raw_chat(base_url, engine, h, body: dict, stream: bool = False) -> httpx.Response:
    payload = {"model": engine.loaded.name, "messages": h.rag_messages(), "max_tokens": 4, "stream": stream, **body}
    return httpx.post(base_url + "/v1/chat/completions", json=payload, timeout=60)


def test_unknown_fields_are_named_in_a_header_and_a_warning(base_url, engine, h, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pcr_rag.server")
    messages = h.rag_messages()
    messages[0] = {**messages[0], "refusal": None, "mood": "calm"}  # null: absent; a value: disclosed
    r = _raw_chat(base_url, engine, h, {"messages": messages, "best_guess": 3, "guided_decoding_backend": "x",
                                        "bad name\r\nX-Evil: 1": 1})
    assert r.status_code == 200
    assert r.headers[IGNORED_HEADER] == "best_guess,guided_decoding_backend,messages[0].mood,+1 more"
    assert "X-Evil" not in r.headers
    assert any("ignored unknown request field(s) best_guess,guided_decoding_backend" in rec.getMessage()
               for rec in caplog.records)
    stream = _raw_chat(base_url, engine, h, {"frobnicate": True}, stream=True)
    assert stream.status_code == 200 and stream.headers[IGNORED_HEADER] == "frobnicate"
    completion = httpx.post(base_url + "/v1/completions", timeout=60, json={
        "model": engine.loaded.name, "prompt": "Hi", "max_tokens": 2, "unknown_knob": 0})
    assert completion.headers[IGNORED_HEADER] == "unknown_knob"
    plain = _raw_chat(base_url, engine, h, {})
    assert IGNORED_HEADER not in plain.headers


def test_the_openai_sdk_raw_response_shows_the_header(client, engine, h) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=engine.loaded.name, messages=h.rag_messages(), max_tokens=2, extra_body={"vendor_flag": 1})
    assert raw.headers[IGNORED_HEADER] == "vendor_flag" and raw.parse().choices[0].message is not None


def _header_hook(seen: list[str | None]):
    def hook(response: httpx.Response) -> None:
        if response.request.url.path.endswith(("/chat/completions", "/completions")):
            seen.append(response.headers.get(IGNORED_HEADER))
    return hook


def test_langchain_openai_and_llamaindex_openai_like_send_nothing_unknown(base_url, engine, h) -> None:
    from langchain_openai import ChatOpenAI
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    seen: list[str | None] = []
    tool = {"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                             "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                            "required": ["q"]}}}
    with httpx.Client(event_hooks={"response": [_header_hook(seen)]}) as http:
        lc = ChatOpenAI(base_url=base_url + "/v1", api_key="unused", model=engine.loaded.name, max_tokens=4,
                        temperature=0, http_client=http, max_retries=0)
        assert isinstance(lc.invoke("Say hi").content, str)
        assert "".join(c.content for c in lc.stream("Say hi")) is not None
        lc.bind_tools([tool]).invoke("Look up pathlib")
        li = OpenAILike(api_base=base_url + "/v1", api_key="unused", model=engine.loaded.name, max_tokens=4,
                        is_chat_model=True, http_client=http, max_retries=0)
        assert li.chat([ChatMessage(role="user", content="Say hi")]).message.content is not None
        assert li.complete("Say hi").text is not None
    assert len(seen) >= 5 and seen == [None] * len(seen), seen
