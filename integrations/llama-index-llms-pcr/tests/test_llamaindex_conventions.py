"""LlamaIndex conventions kept by PCRLLM: the context window LlamaIndex packs to is the engine's ``max_model_len``,
``raw["usage"]`` has the OpenAI shape that `TokenCountingHandler` reads, ``Settings.tokenizer = llm.tokenize``
counts the engine's tokens, and content the text-only model cannot see (image, audio, video, document blocks) is
refused, never dropped. The same over ``base_url`` is in test_llamaindex_server.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import llama_index.core as li_core
import pytest
from llama_index.core import Settings
from llama_index.core.base.llms.types import (
    AudioBlock,
    CacheControl,
    CachePoint,
    ChatMessage,
    DocumentBlock,
    ImageBlock,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    VideoBlock,
)
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.llms.pcr import PCRLLM, PCRRequestError

LONG = {f"doc{i}": f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(60)) for i in range(8)}


@pytest.fixture
def global_tokenizer() -> Iterator[None]:
    """Restores LlamaIndex's process-wide tokenizer (``Settings.tokenizer`` sets it) after the test, and the node
    parser `Settings` builds on first use with the tokenizer of that moment."""
    saved = li_core.global_tokenizer, Settings._node_parser
    yield
    li_core.global_tokenizer, Settings._node_parser = saved


def test_context_window_is_the_engines_max_model_len(engine_factory) -> None:
    with engine_factory(max_model_len=1024) as engine:
        assert engine.context_window > 1024  # the model's own context is larger: the engine's limit must win
        llm = PCRLLM(engine=engine, max_new_tokens=8)
        assert llm.metadata.context_window == engine.max_model_len == 1024


def test_llamaindex_packs_prompts_the_engine_accepts(engine_factory, index_factory, global_tokenizer) -> None:
    """Eight nodes of ~500 tokens do not fit a 1536-token row: LlamaIndex's compact synthesizer must split them over
    several calls of at most max_model_len tokens (packing to the model's context, 4096, it sent one prompt the
    engine refused)."""
    with engine_factory(max_model_len=1536) as engine:
        llm = PCRLLM(engine=engine, max_new_tokens=8, retrieval_hook=False)
        index = index_factory(LONG)
        Settings.tokenizer = llm.tokenize
        assert sum(engine.count_tokens(text) for text in LONG.values()) > 2 * 1536
        answer = index.as_query_engine(llm=llm, similarity_top_k=8, response_mode="compact").query(
            "Which document lists word3x7?")
        assert isinstance(answer.response, str) and len(answer.source_nodes) == 8
        assert engine.stats().requests["requests_finished"] >= 3  # refined over several prompts, each accepted


def test_raw_usage_has_the_openai_shape_and_token_counting_reads_it(engine) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=5)
    handler = TokenCountingHandler(tokenizer=llm.tokenize)
    llm.callback_manager = CallbackManager([handler])
    messages = [ChatMessage(role=MessageRole.USER, content="What is pathlib?")]
    chat = llm.chat(messages)
    want = engine.generate_messages([{"role": "user", "content": "What is pathlib?"}], max_new_tokens=5)
    usage = chat.raw["usage"]
    assert usage == {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": len(want.token_ids),
                     "total_tokens": len(want.prompt_token_ids) + len(want.token_ids),
                     "prompt_tokens_details": {"cached_tokens": chat.raw["reused_tokens"], "blended_tokens": 0}}
    done = llm.complete("What is pathlib?")
    streamed = list(llm.stream_chat(messages))[-1]
    again = streamed.raw["usage"]
    assert {**again, "prompt_tokens_details": None} == {**usage, "prompt_tokens_details": None}
    assert again["prompt_tokens_details"]["cached_tokens"] == streamed.raw["reused_tokens"] > 0  # a repeat reuses
    assert done.raw["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    # the handler took the engine's counts (chat template included), not its own estimate of the message text
    counts = handler.llm_token_counts
    assert [(c.prompt_token_count, c.completion_token_count) for c in counts] == [
        (usage["prompt_tokens"], usage["completion_tokens"]),
        (done.raw["usage"]["prompt_tokens"], done.raw["usage"]["completion_tokens"]),
        (usage["prompt_tokens"], usage["completion_tokens"])]
    assert handler.total_llm_token_count == sum(c.total_token_count for c in counts)
    assert usage["prompt_tokens"] > handler._token_counter.estimate_tokens_in_messages(messages)


def test_settings_tokenizer_counts_like_the_engine(engine, global_tokenizer) -> None:
    llm = PCRLLM(engine=engine)
    Settings.tokenizer = llm.tokenize
    handler = TokenCountingHandler()  # takes the global tokenizer, as every LlamaIndex component does
    for text in ("pathlib joins paths with the slash operator", "héllo  wörld\n\t日本語", ""):
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert Settings.tokenizer(text) == ids
        assert handler._token_counter.get_string_tokens(text) == engine.count_tokens(text) == len(ids)
        assert llm.count_tokens(text) == len(ids)


@pytest.mark.parametrize("block", [
    ImageBlock(image=b"\x89PNG\r\n\x1a\n"),
    AudioBlock(audio=b"ID3", format="mp3"),
    VideoBlock(video=b"\x00\x00\x00\x18ftypmp42"),
    DocumentBlock(data=b"%PDF-1.4 the contract", title="contract.pdf"),
], ids=lambda b: type(b).__name__)
def test_non_text_blocks_are_refused_not_dropped(engine, block) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=2)
    message = ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="What does this show?"), block])
    with pytest.raises(PCRRequestError, match=f"text-only model.*{type(block).__name__}"):
        llm.chat([message])
    with pytest.raises(PCRRequestError, match="text-only model"):
        list(llm.stream_chat([message]))
    with pytest.raises(PCRRequestError, match="text-only model"):
        asyncio.run(llm.achat([message]))
    assert engine.stats().requests["requests_finished"] == 0  # refused before any compute


def test_text_thinking_and_cache_hint_blocks_are_served(engine) -> None:
    """Blocks without content the model misses: the model's own reasoning (providers do not resend it) and a
    provider's cache hint."""
    llm = PCRLLM(engine=engine, max_new_tokens=3)
    plain = llm.chat([ChatMessage(role=MessageRole.USER, content="hello")])
    blocks = [ThinkingBlock(content="let me think"), TextBlock(text="hello"),
              CachePoint(cache_control=CacheControl(type="ephemeral"))]
    got = llm.chat([ChatMessage(role=MessageRole.USER, blocks=blocks)])
    assert got.message.content == plain.message.content
    assert got.raw["usage"]["prompt_tokens"] == plain.raw["usage"]["prompt_tokens"]
