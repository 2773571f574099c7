"""LlamaIndex against a real `pcr-rag serve` (in-process uvicorn on loopback): `OpenAILike` answers a RAG query,
and `PCRLLM(base_url=...)` behaves as with a local engine, its retrieval hook announcing to the server."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core import Settings
from llama_index.core.base.llms.types import ImageBlock, TextBlock
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.llms import ChatMessage
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.llms.openai_like import OpenAILike
from llama_index.llms.pcr import PCRLLM, PCRRequestError

from pcr_rag.server import ServerThread


class Probe(BaseNodePostprocessor):
    """After retrieval, before the LLM call: what the server engine's prefetch window holds."""

    seen: list = []

    def _postprocess_nodes(self, nodes, query_bundle=None):
        eng = self.__dict__.get("_engine")
        self.seen.append((eng.stats().prefetch["pending_announcements"], eng.window_snapshot()))
        return nodes


@pytest.fixture
def served(engine_factory):
    """(server engine, base URL, reference engine with the same weights)."""
    with engine_factory(max_model_len=2048, max_active=4) as engine, \
            engine_factory(max_model_len=2048, max_active=4) as reference, ServerThread(engine) as url:
        yield engine, url, reference


def test_openai_like_runs_a_rag_query(served, index) -> None:
    engine, url, _ = served
    llm = OpenAILike(model=engine.loaded.name, api_base=url + "/v1", api_key="unused", is_chat_model=True,
                     context_window=2048, max_tokens=6, temperature=0.0, max_retries=0)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2)
    first = qe.query("How do pathlib paths join?")
    again = qe.query("How do pathlib paths join?")
    assert isinstance(first.response, str) and len(first.source_nodes) == 2
    assert again.response == first.response
    stats = engine.stats().requests
    assert stats["requests_finished"] == 2 and stats["reused_tokens"] > 0  # the repeated prompt reused its KV
    reply = llm.chat([ChatMessage(role="user", content="pathlib?")])
    assert reply.raw.usage.prompt_tokens_details.cached_tokens >= 0


def test_pcr_llm_base_url_matches_local_and_announces(served, index) -> None:
    engine, url, reference = served
    remote = PCRLLM(base_url=url, max_new_tokens=6)
    local = PCRLLM(engine=reference, max_new_tokens=6)
    probe = Probe(seen=[])
    object.__setattr__(probe, "_engine", engine)
    answer = index.as_query_engine(llm=remote, similarity_top_k=2, node_postprocessors=[probe]).query(
        "How do pathlib paths join?")
    pending, window = probe.seen[0]
    assert pending == 1 and len(window) == 1 and len(window[0]) > 0  # announced to the server before the call
    prefetch = engine.stats().prefetch
    assert (prefetch["announced"], prefetch["claimed"], prefetch["pending_announcements"]) == (1, 1, 0)
    want = index.as_query_engine(llm=local, similarity_top_k=2).query("How do pathlib paths join?")
    assert answer.response == want.response
    streamed = index.as_query_engine(llm=remote, similarity_top_k=2, streaming=True).query(
        "How do pathlib paths join?")
    assert "".join(streamed.response_gen) == answer.response
    assert asyncio.run(index.as_query_engine(llm=remote, similarity_top_k=2).aquery(
        "How do pathlib paths join?")).response == answer.response
    meta = remote.metadata
    assert meta.model_name == engine.loaded.name and meta.num_output == 6
    assert remote.count_tokens("pathlib joins") == reference.count_tokens("pathlib joins")
    raw = remote.complete("Q: what is json?").raw
    assert raw["prompt_tokens"] > 0 and set(raw["reused_by_tier"]) == {"device", "dram", "ssd", "remote"}
    with pytest.raises(PCRRequestError, match="exceeds"):
        remote.complete("x " * 1500, max_new_tokens=1000)
    with pytest.raises(ValueError, match="base_url"):
        PCRLLM(base_url=url, engine=reference)


def test_pcr_llm_base_url_keeps_llamaindex_conventions(served) -> None:
    """Over HTTP as locally: the context window is the server engine's max_model_len (2048, the model's is 4096),
    ``raw["usage"]`` feeds `TokenCountingHandler`, ``llm.tokenize`` is the server's tokenizer, and an image block
    is refused before any request is sent."""
    import llama_index.core as li_core

    engine, url, reference = served
    remote = PCRLLM(base_url=url, max_new_tokens=4)
    assert remote.metadata.context_window == engine.max_model_len == 2048 < engine.context_window
    text = "pathlib joins paths, héllo wörld"
    assert remote.tokenize(text) == reference.tokenizer(text, add_special_tokens=False)["input_ids"]
    saved = li_core.global_tokenizer, Settings._node_parser
    try:
        Settings.tokenizer = remote.tokenize
        assert TokenCountingHandler()._token_counter.get_string_tokens(text) == reference.count_tokens(text)
    finally:
        li_core.global_tokenizer, Settings._node_parser = saved
    handler = TokenCountingHandler(tokenizer=remote.tokenize)
    remote.callback_manager = CallbackManager([handler])
    got = remote.chat([ChatMessage(role="user", content="What is json?")])
    want = reference.generate_messages([{"role": "user", "content": "What is json?"}], max_new_tokens=4)
    assert got.raw["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert got.raw["usage"]["completion_tokens"] == len(want.token_ids)
    assert [(c.prompt_token_count, c.completion_token_count) for c in handler.llm_token_counts] == [
        (len(want.prompt_token_ids), len(want.token_ids))]
    before = engine.stats().requests["requests_finished"]
    image = ChatMessage(role="user", blocks=[TextBlock(text="what is this?"), ImageBlock(image=b"\x89PNG\r\n")])
    with pytest.raises(PCRRequestError, match="text-only model.*ImageBlock"):
        remote.chat([image])
    assert engine.stats().requests["requests_finished"] == before
