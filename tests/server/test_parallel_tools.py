"""``parallel_tool_calls: true``: one answer holds several calls (one JSON object per line, at most
`MAX_PARALLEL_CALLS`, enforced by the grammar), in the server (whole and streamed, each call under its own
``index``), in `ChatPCR.bind_tools(parallel_tool_calls=True)` and in LlamaIndex's ``chat_with_tools(...,
parallel_tool_calls=True)``; the same calls everywhere. Without it an answer holds one call, as before."""

import json
from typing import Literal

import openai
import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langchain_pcr import ChatPCR

from pcr_rag.server.tools import ToolCallStream, answer_message
from pcr_rag.structured import MAX_PARALLEL_CALLS, ToolSpec, call_spans, parse_tool_calls, tool_call_format

# a short tool and prompt: the tiny model's character-level tokens keep several calls inside max_model_len
HOSTS = ["a", "b", "c", "d", "e", "f"]
PING = {"type": "function", "function": {
    "name": "ping", "description": "Ping a host.",
    "parameters": {"type": "object", "properties": {"h": {"enum": HOSTS}}, "required": ["h"]}}}
MESSAGES = [{"role": "system", "content": "Use the tools when they help."},
            {"role": "user", "content": "Ping hosts a and b."}]
MAX_TOKENS = 320
SAMPLING = {"temperature": 1.0, "seed": 3}  # greedy, the random model repeats one call (repeats are left out)


def ping(h: Literal["a", "b", "c", "d", "e", "f"]) -> str:
    """Ping a host."""
    return h


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def _create(client, engine, **more):
    return client.chat.completions.create(model=engine.loaded.name, messages=MESSAGES, tools=[PING],
                                          tool_choice="required", max_tokens=MAX_TOKENS, **SAMPLING, **more)


def test_one_answer_holds_several_calls_as_the_local_chat_model(client, engine, reference) -> None:
    r = _create(client, engine, parallel_tool_calls=True)
    choice = r.choices[0]
    calls = _calls(choice.message)
    assert 2 <= len(calls) <= MAX_PARALLEL_CALLS and choice.finish_reason == "tool_calls"
    assert all(name == "ping" and args["h"] in HOSTS for name, args in calls)
    assert len({c.id for c in choice.message.tool_calls}) == len(calls)
    local = ChatPCR(engine=reference, max_tokens=MAX_TOKENS, **SAMPLING).bind_tools([PING], tool_choice="any",
                                                                       parallel_tool_calls=True)
    ai = local.invoke([SystemMessage(content=MESSAGES[0]["content"]), HumanMessage(content=MESSAGES[1]["content"])])
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == calls and not ai.invalid_tool_calls
    single = _create(client, engine, parallel_tool_calls=False)
    assert len(_calls(single.choices[0].message)) == 1
    unset = _create(client, engine)  # OpenAI's default is true; here, as before the field was honoured: one call
    assert len(_calls(unset.choices[0].message)) == 1


def test_streamed_parallel_calls_reassemble_the_whole_answer(client, engine) -> None:
    whole = _calls(_create(client, engine, parallel_tool_calls=True).choices[0].message)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in _create(client, engine, parallel_tool_calls=True, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or ():
            if tc.id is not None:
                assert tc.index not in names and tc.index == len(names)  # each call opens once, in order
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == whole


def test_langchain_openai_gets_several_calls(base_url, engine) -> None:
    llm = ChatOpenAI(base_url=base_url + "/v1", api_key="unused", model=engine.loaded.name, max_tokens=MAX_TOKENS,
                     max_retries=0, **SAMPLING)
    ai = llm.bind_tools([PING], tool_choice="required", parallel_tool_calls=True).invoke(
        [SystemMessage(content=MESSAGES[0]["content"]), HumanMessage(content=MESSAGES[1]["content"])])
    assert len(ai.tool_calls) >= 2 and {c["name"] for c in ai.tool_calls} == {"ping"}


def test_llama_index_function_calling_with_parallel_calls(reference) -> None:
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.pcr import PCRLLM

    llm = PCRLLM(engine=reference, max_new_tokens=MAX_TOKENS, **SAMPLING)
    tool = FunctionTool.from_defaults(fn=ping)
    # min_tokens (vLLM's, a sampling option here too) keeps the random model from ending after its first call
    several = llm.get_tool_calls_from_response(llm.chat_with_tools(
        [tool], user_msg="Ping hosts a and b.", tool_required=True, allow_parallel_tool_calls=True, parallel_tool_calls=True,
        min_tokens=40))
    assert len(several) >= 2 and all(c.tool_name == "ping" and c.tool_kwargs["h"] in HOSTS for c in several)
    one = llm.get_tool_calls_from_response(llm.chat_with_tools([tool], user_msg="Ping hosts a and b.",
                                                               tool_required=True, min_tokens=40,
                                                               allow_parallel_tool_calls=True))
    # an agent's default allow_parallel_tool_calls=True alone keeps one call per answer (see _prepare_chat_with_tools)
    assert len(one) == 1


# ------------------------------------------------------------------------------------------------ units
TOOLS = [ToolSpec("f", "", {"type": "object", "properties": {"x": {"type": "integer"}}}),
         ToolSpec("g", "", {"type": "object", "properties": {"s": {"type": "string"}}})]
TWO = '{"name": "f", "arguments": {"x": 12}}\n{"name": "g", "arguments": {"s": "a}b"}}'


def test_calls_parse_and_a_cut_one_leaves_the_answer_as_text() -> None:
    assert call_spans(TWO) == [(0, 37), (38, len(TWO))]
    assert [(c.name, c.arguments) for c in parse_tool_calls(TWO, TOOLS)] == [("f", {"x": 12}), ("g", {"s": "a}b"})]
    assert parse_tool_calls("plain text", TOOLS) == []
    with pytest.raises(ValueError, match="incomplete"):  # the only call cut short: no call
        parse_tool_calls(TWO[:20], TOOLS)
    cut = answer_message(TWO[:20], "length", TOOLS)
    assert cut.tool_calls == () and cut.content == TWO[:20] and cut.finish_reason == "length"
    # a second call cut short: the complete first one stands, with the engine's finish reason
    assert [c.name for c in parse_tool_calls(TWO[:-3], TOOLS)] == ["f"]
    second_cut = answer_message(TWO[:-3], "length", TOOLS)
    assert [c["function"]["name"] for c in second_cut.tool_calls] == ["f"] and second_cut.finish_reason == "length"
    whole = answer_message(TWO, "stop", TOOLS)
    assert [c["function"]["arguments"] for c in whole.tool_calls] == ['{"x": 12}', '{"s": "a}b"}']


def test_an_exact_repeat_of_a_call_is_left_out_whole_and_streamed() -> None:
    """Small models loop on a call ({"name": "multiply", ...} eight times over); the repeats are dropped alike
    from a finished answer, a stream and the integrations' parse, so a tool runs once per distinct call."""
    again = '{"name": "f", "arguments": {"x": 12}}\n{"name": "f", "arguments": {"x": 12}}\n' + TWO.split("\n")[1]
    assert [(c.name, c.arguments) for c in parse_tool_calls(again, TOOLS)] == [("f", {"x": 12}), ("g", {"s": "a}b"})]
    whole = answer_message(again, "stop", TOOLS)
    assert [c["function"]["name"] for c in whole.tool_calls] == ["f", "g"] and whole.finish_reason == "tool_calls"
    for step in (1, 4, 200):
        stream = ToolCallStream(TOOLS)
        deltas = [d for i in range(0, len(again), step) for d in stream.feed(again[i:i + step])]
        deltas += stream.finish(again, "stop")[0]
        opened = [c for d in deltas for c in d["tool_calls"] if "id" in c]
        assert [(c["index"], c["function"]["name"]) for c in opened] == [(0, "f"), (1, "g")], step


@pytest.mark.parametrize("step", [1, 2, 5, 40])
def test_stream_deltas_of_several_calls_concatenate_whatever_the_pieces(step) -> None:
    stream = ToolCallStream(TOOLS)
    deltas = [d for i in range(0, len(TWO), step) for d in stream.feed(TWO[i:i + step])]
    more, finish = stream.finish(TWO, "stop")
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for delta in deltas + more:
        for call in delta["tool_calls"]:
            if "id" in call:
                names[call["index"]] = call["function"]["name"]
            args[call["index"]] = args.get(call["index"], "") + call["function"]["arguments"]
    assert finish == "tool_calls" and names == {0: "f", 1: "g"} and args == {0: '{"x": 12}', 1: '{"s": "a}b"}'}


def test_the_grammar_ends_the_answer_after_the_last_allowed_call() -> None:
    from pcr_rag.response_format import ResponseFormat

    fmt = tool_call_format(TOOLS, "any", parallel=True)
    assert isinstance(fmt, ResponseFormat) and f"{{0,{MAX_PARALLEL_CALLS - 1}}}" in fmt.source
    assert tool_call_format(TOOLS, "any") == ResponseFormat.json_schema(json.loads(tool_call_format(
        TOOLS, "any").source))  # without parallel: one call, the JSON-schema format of before
