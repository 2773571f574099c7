"""One engine per model/config per process, shared by the LlamaIndex and LangChain wrappers."""

from __future__ import annotations

import pytest
from langchain_pcr import ChatPCR
from llama_index.llms.pcr import PCRLLM

from pcr_rag import EngineConfig
from pcr_rag.shared import SharedEngineConflictError, close_shared_engines, shared_engine, shared_engines
from pcr_rag.testing import tiny_model


@pytest.fixture
def tiny():
    model, tokenizer = tiny_model("llama")
    yield model, tokenizer
    close_shared_engines()


def test_equal_configs_share_one_engine_across_frameworks(tiny, tmp_path) -> None:
    model, tokenizer = tiny
    a = shared_engine(model, tokenizer, EngineConfig(cache_dir=tmp_path / "kv", chunk_size=16))
    b = shared_engine(model, tokenizer, EngineConfig(cache_dir=tmp_path / "kv", chunk_size=16))
    assert a is b
    chat = ChatPCR(model=model, tokenizer=tokenizer, config=EngineConfig(cache_dir=tmp_path / "kv", chunk_size=16))
    llm = PCRLLM(model=model, tokenizer=tokenizer, config=EngineConfig(cache_dir=tmp_path / "kv", chunk_size=16))
    assert chat.get_engine() is a and llm.engine is a
    assert shared_engines() == [a]


def test_a_second_config_on_the_same_cache_dir_is_refused(tiny, tmp_path) -> None:
    model, tokenizer = tiny
    shared_engine(model, tokenizer, EngineConfig(cache_dir=tmp_path / "kv", chunk_size=16))
    with pytest.raises(SharedEngineConflictError, match="cache_dir"):
        shared_engine(model, tokenizer, EngineConfig(cache_dir=tmp_path / "kv", chunk_size=32))
    other = shared_engine(model, tokenizer, EngineConfig(cache_dir=tmp_path / "kv2", chunk_size=32))
    assert len(shared_engines()) == 2 and other in shared_engines()


def test_closed_engines_are_replaced(tiny, tmp_path) -> None:
    model, tokenizer = tiny
    cfg = EngineConfig(cache_dir=tmp_path / "kv", chunk_size=16)
    first = shared_engine(model, tokenizer, cfg)
    close_shared_engines()
    assert shared_engines() == []
    second = shared_engine(model, tokenizer, cfg)
    assert second is not first
    assert second.generate("hi", max_new_tokens=1).metrics.prompt_tokens > 0
