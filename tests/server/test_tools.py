"""Tool calling over HTTP: the official clients (openai, langchain_openai, LlamaIndex's OpenAILike) against a live
server on the tiny model get OpenAI-shaped ``tool_calls``, constrained by the engine's grammar, and exactly the call
(or text) a local `ChatPCR` on the same weights produces: the server builds the same prompt (the tools' instruction
after the conversation, tool turns rendered alike) and the same grammar."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI
from langchain_pcr import ChatPCR
from pydantic import BaseModel

MAX_TOKENS = 96
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
CHOICES = {"required": ("required", "any"), "named": ({"type": "function", "function": {"name": "get_time"}},
                                                      "get_time"),
           "auto": ("auto", "auto"), "none": ("none", "none")}


def messages(h) -> list[dict]:
    return [{"role": "system", "content": "Use the tools when they help."},
            {"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def local(reference) -> ChatPCR:
    return ChatPCR(engine=reference, max_tokens=MAX_TOKENS)


def lc_messages(turns: list[dict]) -> list:
    kinds = {"system": SystemMessage, "user": HumanMessage}
    return [kinds[t["role"]](content=t["content"]) for t in turns]


def call_of(message) -> tuple[str, dict] | None:
    calls = message.tool_calls or []
    assert len(calls) <= 1
    return (calls[0].function.name, json.loads(calls[0].function.arguments)) if calls else None


def local_call(ai: AIMessage) -> tuple[str, dict] | None:
    assert not ai.invalid_tool_calls
    return (ai.tool_calls[0]["name"], ai.tool_calls[0]["args"]) if ai.tool_calls else None


@pytest.mark.parametrize("kind", list(CHOICES))
def test_each_tool_choice_matches_the_local_chat_model(client, engine, local, h, kind) -> None:
    wire, local_choice = CHOICES[kind]
    r = client.chat.completions.create(model=engine.loaded.name, messages=messages(h), tools=TOOLS,
                                       tool_choice=wire, max_tokens=MAX_TOKENS, parallel_tool_calls=False)
    choice = r.choices[0]
    want = local.bind_tools(TOOLS, tool_choice=local_choice).invoke(lc_messages(messages(h)))
    assert call_of(choice.message) == local_call(want)
    if kind in ("required", "named"):
        call = choice.message.tool_calls[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == ("get_time" if kind == "named" else call.function.name)
        args = json.loads(call.function.arguments)
        schema = next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"]["parameters"]
        assert set(args) == set(schema["required"])  # the grammar held the random model to the schema
        assert all(args[k] in schema["properties"][k]["enum"] for k in args)
    elif kind == "none":
        assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
        assert choice.message.content == want.content
    else:
        assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
        if not choice.message.tool_calls:
            assert choice.message.content == want.content
    assert r.usage.completion_tokens == want.usage_metadata["output_tokens"]


@pytest.mark.parametrize("kind", ["required", "auto"])
def test_streamed_tool_call_deltas_reassemble_the_non_streamed_call(client, engine, h, kind) -> None:
    wire = CHOICES[kind][0]
    whole = client.chat.completions.create(model=engine.loaded.name, messages=messages(h), tools=TOOLS,
                                           tool_choice=wire, max_tokens=MAX_TOKENS)
    stream = client.chat.completions.create(model=engine.loaded.name, messages=messages(h), tools=TOOLS,
                                            tool_choice=wire, max_tokens=MAX_TOKENS, stream=True)
    content, name, call_id, args, finish, arg_deltas, firsts = "", None, None, "", None, 0, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            assert tc.index == 0
            if tc.id is not None:  # the first delta: id, type, name, empty arguments
                firsts.append(tc)
                assert tc.type == "function" and tc.function.arguments == ""
                name, call_id = tc.function.name, tc.id
            else:
                assert tc.function.name is None
            if tc.function.arguments:
                arg_deltas += 1
            args += tc.function.arguments or ""
        if chunk.choices[0].finish_reason is not None:
            finish = chunk.choices[0].finish_reason
    assert finish == whole.choices[0].finish_reason
    message = whole.choices[0].message
    if message.tool_calls:
        assert len(firsts) == 1 and call_id.startswith("call_")
        assert (name, args) == (message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)
        assert arg_deltas > 1, "the arguments must grow over several deltas"
        assert content == "" and finish == "tool_calls"
    else:
        assert content == message.content and not firsts


def test_tool_results_in_the_history_render_as_the_local_model_renders_them(base_url, engine, local, h) -> None:
    history = [SystemMessage(content="Use the tools when they help."),
               HumanMessage(content="What is the weather in Paris, in celsius?"),
               AIMessage(content="", tool_calls=[{"name": "get_weather", "args": {"city": "Paris", "unit": "c"},
                                                  "id": "call_abc123"}]),
               ToolMessage(content="18 degrees and sunny", tool_call_id="call_abc123"),
               HumanMessage(content="And the time in CET?")]
    remote = ChatOpenAI(base_url=base_url + "/v1", api_key="unused", model=engine.loaded.name,
                        max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    for choice, local_choice in (("auto", "auto"), ("required", "any"), ("none", "none")):
        got = remote.bind_tools(TOOLS, tool_choice=choice).invoke(history)
        want = local.bind_tools(TOOLS, tool_choice=local_choice).invoke(history)
        assert local_call(got) == local_call(want)
        assert got.content == want.content
        assert got.usage_metadata["input_tokens"] == want.usage_metadata["input_tokens"]


def test_chat_openai_bind_tools_gives_the_local_tool_call(base_url, engine, local, h) -> None:
    remote = ChatOpenAI(base_url=base_url + "/v1", api_key="unused", model=engine.loaded.name,
                        max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    question = [HumanMessage(content="What is the weather in Oslo, in fahrenheit?")]
    got = remote.bind_tools(TOOLS, tool_choice="get_weather").invoke(question)
    want = local.bind_tools(TOOLS, tool_choice="get_weather").invoke(question)
    assert got.tool_calls and local_call(got) == local_call(want)
    assert got.tool_calls[0]["id"].startswith("call_")
    assert got.response_metadata["finish_reason"] == "tool_calls"
    streamed = None
    for chunk in remote.bind_tools(TOOLS, tool_choice="get_weather").stream(question):
        streamed = chunk if streamed is None else streamed + chunk
    assert local_call(streamed) == local_call(want)


seen: list[tuple[str, str]] = []


class WeatherArgs(BaseModel):
    city: Literal["Paris", "Oslo", "Rome"]
    unit: Literal["c", "f"]


def get_weather(city: str, unit: str) -> str:
    """The weather in a city."""
    seen.append((city, unit))
    return f"18 {unit} in {city}"


def test_llama_index_openai_like_calls_the_function(base_url, engine) -> None:
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai_like import OpenAILike

    seen.clear()
    tool = FunctionTool.from_defaults(fn=get_weather, fn_schema=WeatherArgs)
    llm = OpenAILike(model=engine.loaded.name, api_base=base_url + "/v1", api_key="unused",
                     is_chat_model=True, is_function_calling_model=True, max_tokens=MAX_TOKENS,
                     context_window=engine.max_model_len, max_retries=0)
    response = llm.chat_with_tools([tool], user_msg="Weather in Rome?", tool_required=True)
    calls = llm.get_tool_calls_from_response(response, error_on_no_tool_call=True)
    assert [c.tool_name for c in calls] == ["get_weather"]
    assert set(calls[0].tool_kwargs) == {"city", "unit"}
    output = llm.predict_and_call([tool], user_msg="Weather in Rome?", tool_required=True)
    assert seen and output.sources[0].tool_name == "get_weather"
    assert output.response == f"18 {seen[-1][1]} in {seen[-1][0]}"


def test_bad_tool_requests_are_400s_naming_the_field(base_url, engine, h) -> None:
    post = httpx.Client(base_url=base_url).post

    def chat(**extra):
        return post("/v1/chat/completions", json={"model": engine.loaded.name, "messages": messages(h),
                                                  "max_tokens": 4, **extra})

    def param(r, status=400):
        assert r.status_code == status, r.text
        return r.json()["error"]["param"]

    assert param(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})) == "tool_choice"
    assert param(chat(tool_choice="required")) == "tool_choice"
    assert param(chat(tools=[WEATHER, WEATHER])) == "tools"
    assert param(chat(tools=[{"type": "function"}])) == "tools[0].function"
    bad_name = {"type": "function", "function": {"name": "has space", "parameters": {}}}
    assert param(chat(tools=[bad_name])).startswith("tools")
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
    assert param(chat(tools=[bad_schema])) == "tools"
    assert param(chat(tools=TOOLS, response_format={"type": "json_object"})) == "response_format"
    assert param(chat(tool_choice="sometimes")).startswith("tool_choice")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    turns = [*messages(h), {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert param(chat(messages=[*turns, {"role": "tool", "content": "ok"}])).startswith("messages")
    assert param(chat(messages=[messages(h)[1], {"role": "user", "content": "x", "tool_calls": [call]}])).startswith(
        "messages")
    assert param(chat(messages=[messages(h)[1], {"role": "function", "content": "x", "name": "f"}])).startswith(
        "messages")
    not_object = {**call, "function": {"name": "get_weather", "arguments": "[1, 2]"}}
    assert param(chat(messages=[*messages(h), {"role": "assistant", "tool_calls": [not_object]},
                                {"role": "tool", "content": "ok", "tool_call_id": "call_1"}])) == \
        "messages[2].tool_calls[0].function.arguments"
    # a history call whose arguments nest past the JSON decoder's recursion limit: a 400, not a 500
    deep = {**call, "function": {"name": "get_weather", "arguments": "[" * 5_000 + "]" * 5_000}}
    r = chat(messages=[*messages(h), {"role": "assistant", "tool_calls": [deep]},
                       {"role": "tool", "content": "ok", "tool_call_id": "call_1"}])
    assert param(r) == "messages[2].tool_calls[0].function.arguments"
    assert chat(messages=[*turns, {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}],
                tools=TOOLS).status_code == 200


def test_documents_stay_reused_whatever_the_tools(client, engine, h) -> None:
    """The tools' instruction comes after the conversation, so the documents' cached KV serves a request with other
    tools (or none)."""
    docs = [d + " (tools)" for d in h.DOCS]
    body = {"model": engine.loaded.name, "messages": h.rag_messages(docs), "max_tokens": 4,
            "extra_body": {"documents": docs}}
    first = client.chat.completions.create(**body, tools=TOOLS, tool_choice="auto")
    other = client.chat.completions.create(**body, tools=[CLOCK], tool_choice="required")
    plain = client.chat.completions.create(**body)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    doc_tokens = sum(len(engine.tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs)
    for r in (other, plain):
        assert r.usage.model_extra["pcr"]["documents_found"] == 3
        assert r.usage.prompt_tokens_details.cached_tokens >= doc_tokens - 16 * len(docs)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_argument_deltas_concatenate_to_the_call_whatever_the_pieces(step) -> None:
    """Braces and escaped quotes inside strings do not end the arguments early; the closing brace of the call is
    never sent; a call cut before its name is complete comes back as text, as the non-streamed answer does."""
    from pcr_rag.server.tools import ToolCallStream, answer_message
    from pcr_rag.structured import ToolSpec

    tools = [ToolSpec.from_openai(t) for t in TOOLS]
    text = '{"name": "get_weather", "arguments": {"city": "P}a{r\\"is", "unit": {"nested": [1, "}"]}}}'
    stream, deltas = ToolCallStream(tools), []
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i:i + step])
    last, finish = stream.finish(text, "stop")
    deltas += last
    whole = answer_message(text, "stop", tools)
    assert finish == whole.finish_reason == "tool_calls" and whole.content is None
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas)
    assert args == whole.tool_calls[0]["function"]["arguments"] == text[len('{"name": "get_weather", "arguments": '):-1]
    cut = text[:12]
    stream = ToolCallStream(tools)
    assert stream.feed(cut) == []
    assert stream.finish(cut, "length") == ([{"content": cut}], "length")
    assert answer_message(cut, "length", tools).content == cut
    assert ToolCallStream(tools).feed("plain") == [{"content": "plain"}]
