"""Cheap construction: `PCRLLM()` loads no model; its first use loads it once (even from several threads at the
same time); ``metadata`` (which LlamaIndex reads when it builds a query engine) is known without loading."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal

import pytest
from llama_index.core import Settings
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.pcr import PCRLLM, PCRReorderPostprocessor
from pydantic import BaseModel, Field

import pcr_rag.shared
from pcr_rag import EngineConfig, PCREngine

QUESTION = [ChatMessage(role=MessageRole.USER, content="hello")]


class Pet(BaseModel):
    """Bounded, so the tiny random model's constrained answer completes within its token budget."""

    name: str = Field(pattern=r"^[a-z]{1,4}$")
    kind: Literal["cat", "dog"]


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


class AddArgs(BaseModel):
    a: int = Field(ge=0, le=9)
    b: int = Field(ge=0, le=9)


class EngineLoads:
    """Stands in for `PCREngine` where `pcr_rag.shared` builds the shared engine: counts the engines built (each
    one loads a model) and builds the real one, after ``delay`` seconds (so concurrent first calls overlap)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.engines: list[PCREngine] = []
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> PCREngine:
        time.sleep(self.delay)
        engine = PCREngine(*args, **kwargs)
        with self._lock:
            self.engines.append(engine)
        return engine


@pytest.fixture
def loads(monkeypatch) -> Iterator[EngineLoads]:
    counter = EngineLoads(delay=0.3)
    monkeypatch.setattr(pcr_rag.shared, "PCREngine", counter)
    yield counter
    for engine in counter.engines:
        engine.close()


@pytest.fixture
def make_llm(tiny, tmp_path) -> Callable[..., PCRLLM]:
    """A PCRLLM on the tiny model (given as an object, so the shared engine is built from it), its own cache."""
    model, tokenizer = tiny

    def make(**kwargs: Any) -> PCRLLM:
        config = EngineConfig(cache_dir=tmp_path / f"kv-{uuid.uuid4().hex[:8]}", chunk_size=16, max_new_tokens=6,
                              dram_capacity="64MiB", ssd_capacity="64MiB")
        return PCRLLM(model=model, tokenizer=tokenizer, config=config, **kwargs)

    return make


def test_default_pcrllm_builds_without_loading_the_model(monkeypatch, tmp_path) -> None:
    def no_load(*args: Any, **kwargs: Any) -> PCREngine:
        raise AssertionError("constructing PCRLLM() loaded the model")

    monkeypatch.setattr(pcr_rag.shared, "PCREngine", no_load)
    start = time.perf_counter()
    llm = PCRLLM(config=EngineConfig(cache_dir=tmp_path / "kv"))
    assert time.perf_counter() - start < 1.0
    assert llm.loaded_engine is None
    # metadata without loading: the default config's max_model_len (4096) fits SmolLM2's context (8192,
    # max_position_embeddings of its config, read from the GGUF header here)
    md = llm.metadata
    assert (md.context_window, md.num_output, md.model_name) == (4096, EngineConfig().max_new_tokens,
                                                                  "smollm2-135m-instruct")
    whole = PCRLLM(config=EngineConfig(cache_dir=tmp_path / "kv2", max_model_len=None), max_new_tokens=9)
    assert (whole.metadata.context_window, whole.metadata.num_output) == (8192, 9)
    PCRReorderPostprocessor(llm)  # checks its target without loading it either
    assert llm.loaded_engine is None and whole.loaded_engine is None


def test_a_bad_chat_template_still_fails_at_construction(tmp_path) -> None:
    from pcr_rag.errors import ConfigError

    with pytest.raises(ConfigError):
        PCRLLM(chat_template="plain", config=EngineConfig(cache_dir=tmp_path, chat_template="{{ other }}"))


CALLS = ("complete", "stream_complete", "chat", "acomplete", "achat", "astream_chat", "structured_predict",
         "chat_with_tools", "count_tokens")


def first_call(llm: PCRLLM, call: str) -> Any:
    """Make the call named ``call``; returns what it answered (text, an object, tool calls, a count)."""
    async def astream() -> Any:
        return [r async for r in await llm.astream_chat(QUESTION)][-1].message.content

    tool = FunctionTool.from_defaults(add, fn_schema=AddArgs)
    calls: dict[str, Callable[[], Any]] = {
        "complete": lambda: llm.complete("hello").text,
        "stream_complete": lambda: list(llm.stream_complete("hello"))[-1].text,
        "chat": lambda: llm.chat(QUESTION).message.content,
        "acomplete": lambda: asyncio.run(llm.acomplete("hello")).text,
        "achat": lambda: asyncio.run(llm.achat(QUESTION)).message.content,
        "astream_chat": lambda: asyncio.run(astream()),
        "structured_predict": lambda: llm.structured_predict(Pet, PromptTemplate("A pet called {n}."), n="rex"),
        "chat_with_tools": lambda: [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(
            llm.chat_with_tools([tool], user_msg="2 + 3?", tool_required=True))],
        "count_tokens": lambda: llm.count_tokens("hello"),
    }
    return calls[call]()


@pytest.mark.parametrize("call", CALLS)
def test_the_first_call_loads_the_model_once(loads, make_llm, call) -> None:
    llm = make_llm(max_new_tokens=120 if call in ("structured_predict", "chat_with_tools") else 6)
    before = llm.metadata
    assert loads.engines == [] and llm.loaded_engine is None
    first = first_call(llm, call)
    assert len(loads.engines) == 1 and llm.loaded_engine is loads.engines[0] is llm.engine
    assert first == first_call(llm, call)  # greedy: the same answer from the loaded engine
    assert len(loads.engines) == 1
    after = llm.metadata  # what was read without loading is what the loaded engine says
    assert (before.context_window, before.num_output) == (after.context_window, after.num_output)
    assert after.context_window == loads.engines[0].max_model_len


def test_concurrent_first_calls_load_once(loads, make_llm) -> None:
    llm = make_llm()
    assert loads.engines == []
    threads = 4
    start = threading.Barrier(threads)
    answers: list[str] = []

    def ask() -> None:
        start.wait()
        answers.append(llm.complete("hello").text)

    workers = [threading.Thread(target=ask) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert len(answers) == threads and len(set(answers)) == 1
    assert len(loads.engines) == 1


def test_two_llms_on_one_model_share_one_lazily_loaded_engine(loads, make_llm) -> None:
    first = make_llm()
    second = PCRLLM(model=first.model, tokenizer=first.tokenizer, config=first.config)
    assert loads.engines == []
    first.complete("hello")
    second.complete("hello")
    assert len(loads.engines) == 1 and first.engine is second.engine


def test_settings_llm_then_a_query_loads_at_the_query(loads, make_llm, index) -> None:
    old = Settings._llm
    try:
        Settings.llm = make_llm()
        engine = index.as_query_engine(similarity_top_k=2)  # reads Settings.llm.metadata: no load yet
        assert loads.engines == []
        response = engine.query("How do pathlib paths join?")
        assert isinstance(response.response, str) and len(response.source_nodes) == 2
        assert len(loads.engines) == 1
        assert loads.engines[0].stats().prefetch["announced"] == 1  # the retrieval hook announced to it
    finally:
        Settings._llm = old


def test_an_engine_passed_in_is_used_as_is(loads, engine) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=3)
    assert llm.loaded_engine is engine and llm.engine is engine
    llm.complete("hello")
    assert loads.engines == []


@pytest.mark.slow
def test_default_model_metadata_before_loading_matches_the_loaded_engine(tmp_path) -> None:
    """The context window read from the GGUF header is the loaded engine's ``max_model_len``: the model's own
    context (``max_model_len=None``) and the default config's cap."""
    for max_model_len in (None, 4096):
        config = EngineConfig(cache_dir=tmp_path / f"kv{max_model_len}", max_model_len=max_model_len, max_active=1,
                              dram_capacity="64MiB", ssd_capacity="64MiB")
        llm = PCRLLM(config=config)
        before = llm.metadata
        assert llm.loaded_engine is None
        with llm.engine as engine:
            after = llm.metadata
            assert before.context_window == after.context_window == engine.max_model_len
            assert (before.num_output, before.model_name) == (after.num_output, after.model_name)
