"""PCRLLM as a LlamaIndex LLM on a real PCREngine (tiny random Llama): metadata, completion, chat, async, errors."""

from __future__ import annotations

import asyncio
import time

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.llms.pcr import PCRLLM, PCRRequestError
from llama_index.llms.pcr.base import to_chat_turns


def test_metadata_reports_the_engines_max_model_len(engine) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=7)
    md = llm.metadata
    assert md.context_window == engine.max_model_len == 4096
    assert md.num_output == 7
    assert md.is_chat_model is True and md.is_function_calling_model is True
    assert md.model_name == engine.loaded.name
    assert PCRLLM(engine=engine, is_chat_model=False).metadata.is_chat_model is False


def test_complete_wraps_the_prompt_in_the_chat_template(engine) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=5)
    resp = llm.complete("What is pathlib?")
    expected = engine.generate_messages([{"role": "user", "content": "What is pathlib?"}], max_new_tokens=5)
    assert resp.text == expected.text
    assert resp.raw["prompt_tokens"] == len(expected.prompt_token_ids)
    # formatted=True from LlamaIndex's predict() is wrapped too (the default completion_to_prompt is identity)
    assert llm.complete("What is pathlib?", formatted=True).text == resp.text
    raw = PCRLLM(engine=engine, max_new_tokens=5, chat_template=False).complete("What is pathlib?")
    assert raw.raw["prompt_tokens"] < resp.raw["prompt_tokens"]


def test_stream_and_async_give_the_same_tokens(engine) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=6)
    text = llm.complete("hello").text
    pieces = list(llm.stream_complete("hello"))
    assert pieces[-1].text == text and "".join(p.delta or "" for p in pieces) == text
    assert pieces[-1].raw["completion_tokens"] >= 1

    async def run():
        a = await llm.acomplete("hello")
        gen = await llm.astream_complete("hello")
        pieces = [p async for p in gen]
        chat = await llm.achat([ChatMessage(role=MessageRole.USER, content="hello")])
        cgen = await llm.astream_chat([ChatMessage(role=MessageRole.USER, content="hello")])
        cpieces = [p async for p in cgen]
        return a.text, pieces[-1].text, chat.message.content, cpieces[-1].message.content

    assert asyncio.run(run()) == (text, text, text, text)
    chat = llm.chat([ChatMessage(role=MessageRole.USER, content="hello")])
    assert chat.message.content == text
    assert list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content="hello")]))[-1].message.content == text


def test_acomplete_does_not_block_the_event_loop(engine) -> None:
    engine.executor.eos_ids = frozenset()  # long enough that a blocked loop would show
    llm = PCRLLM(engine=engine, max_new_tokens=64)

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        await llm.acomplete("hello")
        stop.set()
        await task
        return ticks

    assert asyncio.run(main()) > 3


def test_system_prompt_becomes_the_system_turn(engine) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=4, system_prompt="Be brief.")
    got = llm.chat([ChatMessage(role=MessageRole.USER, content="hi")])
    expected = engine.generate_messages([{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "hi"}], max_new_tokens=4)
    assert got.message.content == expected.text


def test_bad_input_raises_clear_errors(engine) -> None:
    llm = PCRLLM(engine=engine)
    with pytest.raises(PCRRequestError, match="empty prompt"):
        llm.complete("  ")
    with pytest.raises(PCRRequestError, match="empty messages"):
        llm.chat([ChatMessage(role=MessageRole.USER, content="")])
    with pytest.raises(TypeError, match="unexpected keyword"):
        llm.complete("hi", bogus=1)
    assert to_chat_turns([ChatMessage(role=MessageRole.TOOL, content="x", additional_kwargs={"tool_call_id": "1"})]) \
        == [{"role": "user", "content": "Result of the tool (call 1): x"}]
    with pytest.raises(ValueError, match="either engine="):
        PCRLLM(engine=engine, model="smollm2-135m-instruct")
    with pytest.raises(PCRRequestError, match="context window") as info:
        llm.complete("pathlib " * 3000)  # ~6000 byte-level tokens > 4096
    assert isinstance(info.value.__cause__, ValueError)  # the engine's PromptTooLongError

    async def astream():
        gen = await llm.astream_complete("pathlib " * 3000)
        async for _ in gen:
            pass

    with pytest.raises(PCRRequestError, match="context window"):
        asyncio.run(astream())


def test_llamaindex_instrumentation_events_fire(engine) -> None:
    """LlamaIndex's llm_*_callback decorators must see our methods as unwrapped, or they skip their events."""
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent

    seen = []

    class Recorder(BaseEventHandler):
        def handle(self, event, **kwargs):
            if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
                seen.append(event.response.raw["prompt_tokens"])

    root = get_dispatcher()
    handler = Recorder()
    root.add_event_handler(handler)
    try:
        llm = PCRLLM(engine=engine, max_new_tokens=2)
        llm.complete("hello")
        llm.chat([ChatMessage(role=MessageRole.USER, content="hello")])
        asyncio.run(llm.achat([ChatMessage(role=MessageRole.USER, content="hello")]))
    finally:
        root.event_handlers = [h for h in root.event_handlers if h is not handler]
    assert len(seen) == 3 and all(n > 0 for n in seen)


def test_timeout_bounds_streams_and_cancels_the_request(engine) -> None:
    engine.executor.eos_ids = frozenset()  # the random tiny model must not stop the long answer early
    llm = PCRLLM(engine=engine, max_new_tokens=2000, timeout=0.3)
    with pytest.raises(TimeoutError):
        for _ in llm.stream_complete("hello"):
            pass

    async def consume():
        gen = await PCRLLM(engine=engine, max_new_tokens=2000).astream_chat(
            [ChatMessage(role=MessageRole.USER, content="hello")], timeout=0.3)
        async for _ in gen:
            pass

    with pytest.raises(TimeoutError):
        asyncio.run(consume())
    with pytest.raises(TimeoutError):
        llm.complete("hello")
    deadline = time.monotonic() + 30
    while engine.stats().requests["requests_cancelled"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().requests["requests_cancelled"] == 3 and engine.stats().cache.pinned_chunks == 0
