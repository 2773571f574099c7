"""Token counting through the engine's tokenizer: `get_token_ids` / `get_num_tokens` /
`get_num_tokens_from_messages` of ChatPCR and PCRLLM count the model's tokens, never LangChain's GPT-2 fallback
(which warns, and offline counted 0 tokens). The same over ``base_url`` is in test_langchain_server.py."""

from __future__ import annotations

import warnings

import pytest
from langchain_core.language_models import base as lc_base
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, get_buffer_string
from langchain_pcr import PCRLLM, ChatPCR

TEXTS = ("functools.lru_cache memoizes a function with seven words", "héllo  wörld\n\t日本語", "")


@pytest.fixture
def no_gpt2_fallback(monkeypatch):
    """LangChain's GPT-2 fallback fails the test if reached; so does any warning."""
    def fallback(text: str) -> list[int]:
        raise AssertionError("LangChain's GPT-2 fallback tokenizer was used")

    monkeypatch.setattr(lc_base, "_get_token_ids_default_method", fallback)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


@pytest.mark.parametrize("cls", [ChatPCR, PCRLLM])
def test_token_counts_are_the_engines(engine, cls, no_gpt2_fallback) -> None:
    llm = cls(engine=engine)
    for text in TEXTS:
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert llm.get_token_ids(text) == ids
        assert llm.get_num_tokens(text) == engine.count_tokens(text) == len(ids)
    assert llm.get_num_tokens(TEXTS[0]) > 7  # a seven-word sentence is not 0 tokens
    messages = [SystemMessage("Be brief."), HumanMessage("What is heapq?"), AIMessage("A binary heap.")]
    assert llm.get_num_tokens_from_messages(messages) == sum(
        engine.count_tokens(get_buffer_string([m])) for m in messages)


def test_custom_get_token_ids_still_wins(engine, no_gpt2_fallback) -> None:
    llm = ChatPCR(engine=engine, custom_get_token_ids=lambda text: [7] * len(text.split()))
    assert llm.get_token_ids("a b c") == [7, 7, 7] and llm.get_num_tokens("a b c") == 3
