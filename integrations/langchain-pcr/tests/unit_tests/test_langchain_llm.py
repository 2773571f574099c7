"""PCRLLM (text completion) and ChatPCR request plumbing on a real PCREngine with a tiny random Llama."""

from __future__ import annotations

import asyncio
import time

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_pcr import PCRLLM, ChatPCR
from langchain_pcr.chat_models import to_chat_turns


def test_llm_invoke_stream_async_and_usage(engine) -> None:
    llm = PCRLLM(engine=engine, max_tokens=5)
    text = llm.invoke("Explain pathlib.")
    assert isinstance(text, str)
    streamed = "".join(llm.stream("Explain pathlib."))
    assert streamed == text  # greedy: the same tokens either way
    assert asyncio.run(llm.ainvoke("Explain pathlib.")) == text

    async def collect():
        return "".join([c async for c in llm.astream("Explain pathlib.")])

    assert asyncio.run(collect()) == text
    result = llm.generate(["Explain pathlib.", "Explain json."])
    usage = result.llm_output["token_usage"]
    assert usage["completion_tokens"] == sum(
        g[0].generation_info["usage_metadata"]["output_tokens"] for g in result.generations)
    assert usage["cached_tokens"] > 0  # the chat-template prefix of the second prompt was reused
    assert result.llm_output["model_name"] == engine.loaded.name


def test_llm_async_batch_matches_sync(engine) -> None:
    llm = PCRLLM(engine=engine, max_tokens=4)
    prompts = ["alpha beta", "gamma delta", "alpha beta"]
    sync = [llm.invoke(p) for p in prompts]
    res = asyncio.run(llm.agenerate(prompts))
    assert [g[0].text for g in res.generations] == sync


def test_explicit_documents_get_their_own_runs(engine) -> None:
    doc = "heapq implements a binary heap on a plain list, smallest item first, always."
    llm = PCRLLM(engine=engine, max_tokens=3)
    first = llm.generate([f"Context: {doc}\nQ: what is heapq?"], documents=[doc]).generations[0][0]
    second = llm.generate([f"Context: {doc}\nQ: is heapq a heap?"], documents=[doc]).generations[0][0]
    assert first.generation_info["documents_found"] == 1
    assert second.generation_info["reused_tokens"] > first.generation_info["reused_tokens"]


def test_stop_sequences_cut_the_answer(engine) -> None:
    llm = ChatPCR(engine=engine, max_tokens=12)
    full = llm.invoke("hello").content
    assert len(full) > 2
    stop = full[1:3]
    cut = llm.invoke("hello", stop=[stop]).content
    assert stop not in cut and full.startswith(cut)
    assert ChatPCR(engine=engine, max_tokens=12, stop=[stop]).invoke("hello").content == cut


def test_chat_streaming_matches_invoke_and_ends_with_usage(engine) -> None:
    llm = ChatPCR(engine=engine, max_tokens=6)
    full = llm.invoke("hello")
    chunks = list(llm.stream("hello"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.content == full.content
    assert chunks[-1].chunk_position == "last"
    assert merged.usage_metadata["output_tokens"] == full.usage_metadata["output_tokens"]


def test_async_invoke_does_not_block_the_event_loop(engine) -> None:
    engine.executor.eos_ids = frozenset()  # long enough that a blocked loop would show
    llm = ChatPCR(engine=engine, max_tokens=64)

    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        t = asyncio.create_task(ticker())
        msg = await llm.ainvoke("hello")
        done.set()
        await t
        return msg, ticks

    msg, ticks = asyncio.run(main())
    assert isinstance(msg, AIMessage) and ticks > 3


def test_unknown_kwargs_and_unsupported_messages() -> None:
    llm = ChatPCR(model="smollm2-135m-instruct")
    with pytest.raises(TypeError, match="unexpected keyword"):
        llm._request([HumanMessage("hi")], None, None, {"bogus": 1})
    assert to_chat_turns([ToolMessage("x", tool_call_id="1", name="f")]) == [
        {"role": "user", "content": "Result of f (call 1): x"}]
    with pytest.raises(ValueError, match="text only"):
        to_chat_turns([HumanMessage(content=[{"type": "image", "url": "http://x"}])])
    assert to_chat_turns([SystemMessage("s"), HumanMessage([{"type": "text", "text": "a"}, "b"])]) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]
    with pytest.raises(ValueError, match="tool_choice"):
        llm.bind_tools([], tool_choice="f")
    assert llm._holder.loaded is None, "validation must not load the model"


def test_timeout_bounds_streams_and_cancels_the_request(engine) -> None:
    engine.executor.eos_ids = frozenset()  # the random tiny model must not stop the long answer early
    chat = ChatPCR(engine=engine, max_tokens=2000, timeout=0.3)
    with pytest.raises(TimeoutError):
        for _ in chat.stream("hello"):
            pass

    async def consume():
        async for _ in PCRLLM(engine=engine, max_tokens=2000).astream("hello", timeout=0.3):
            pass

    with pytest.raises(TimeoutError):
        asyncio.run(consume())
    with pytest.raises(TimeoutError):
        chat.invoke("hello")
    deadline = time.monotonic() + 30
    while engine.stats().requests["requests_cancelled"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().requests["requests_cancelled"] == 3 and engine.stats().cache.pinned_chunks == 0
