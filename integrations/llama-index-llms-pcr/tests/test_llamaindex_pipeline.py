"""Real LlamaIndex pipelines (Chroma + local MiniLM + PCRLLM on a PCREngine): retrieval hook, reuse, fidelity."""

from __future__ import annotations

import asyncio
import tempfile

import pytest
from llama_index.core import Settings
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.llms.pcr import PCRLLM, PCRRequestError, retrieval_hook

from pcr_rag import EngineConfig, PCREngine


class Probe(BaseNodePostprocessor):
    """Runs after retrieval, before the LLM call: records what the engine's prefetch window holds then."""

    seen: list = []

    def _postprocess_nodes(self, nodes, query_bundle=None):
        eng = self.__dict__.get("_engine")
        self.seen.append((eng.stats().prefetch["pending_announcements"], eng.window_snapshot()))
        return nodes


def probe_for(engine) -> Probe:
    p = Probe(seen=[])
    object.__setattr__(p, "_engine", engine)
    return p


def test_retrieval_is_announced_into_the_window_before_the_llm_call(engine, index) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=4)
    probe = probe_for(engine)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2, node_postprocessors=[probe])
    response = qe.query("How do pathlib paths join?")
    pending, window = probe.seen[0]
    assert pending == 1 and len(window) == 1 and len(window[0]) > 0
    assert response.metadata is not None or response.source_nodes
    prefetch = engine.stats().prefetch
    assert (prefetch["announced"], prefetch["claimed"], prefetch["pending_announcements"]) == (1, 1, 0)
    assert retrieval_hook().tracked_sizes() == {"open_spans": 0, "trees": 0, "announcements": 0, "orphans": 0}


@pytest.mark.parametrize("mode, whole", [("compact", True), ("tree_summarize", True), ("refine", False),
                                         ("simple_summarize", False), ("accumulate", False),
                                         ("compact_accumulate", True)])
def test_response_modes(engine, index, mode, whole) -> None:
    """compact / tree_summarize put the retrieved nodes whole into one prompt (the announcement is claimed);
    refine / accumulate send one node per call; simple_summarize renders the node list as a Python list repr."""
    llm = PCRLLM(engine=engine, max_new_tokens=3)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2, response_mode=mode)
    response = qe.query("How do pathlib paths join?")
    assert isinstance(response.response, str) and len(response.source_nodes) == 2
    prefetch = engine.stats().prefetch
    assert prefetch["claimed"] == (1 if whole else 0)
    assert prefetch["pending_announcements"] == 0  # withdrawn when not claimed


def test_streaming_query_claims_the_announcement(engine, index) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=4)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True)
    response = qe.query("How do pathlib paths join?")  # the LLM call is deferred until the generator is consumed
    text = "".join(response.response_gen)
    assert text == index.as_query_engine(llm=llm, similarity_top_k=2).query("How do pathlib paths join?").response
    assert engine.stats().prefetch["claimed"] == 2
    assert retrieval_hook().tracked_sizes()["orphans"] == 0


def test_second_query_reuses_and_answers_equal_cache_off(engine_factory, index) -> None:
    questions = ["How do pathlib paths join?", "How does pathlib read a file?"]
    answers = {}
    for name, overrides in (("on", {}), ("off", {"enable_cache": False})):
        with engine_factory(**overrides) as eng:
            qe = index.as_query_engine(llm=PCRLLM(engine=eng, max_new_tokens=6), similarity_top_k=2)
            responses = [qe.query(q) for q in questions]
            answers[name] = [r.response for r in responses]
            stats = eng.stats().requests
            if name == "on":
                assert [r.source_nodes[0].metadata["module"] for r in responses] == ["pathlib", "pathlib"]
                assert stats["reused_tokens"] > 0 and eng.stats().prefetch["claimed"] == 2
            else:
                assert stats["reused_tokens"] == 0
    assert answers["on"] == answers["off"]


def test_concurrent_aqueries_each_claim_their_own_announcement(engine, index) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=3)
    qe = index.as_query_engine(llm=llm, similarity_top_k=2)
    questions = ["pathlib paths?", "json dumps?", "heapq heappush?", "bisect insertion point?"]

    async def run():
        return await asyncio.gather(*(qe.aquery(q) for q in questions))

    responses = asyncio.run(run())
    assert len(responses) == 4
    prefetch = engine.stats().prefetch
    assert prefetch["announced"] == 4 and prefetch["claimed"] == 4 and prefetch["pending_announcements"] == 0
    assert retrieval_hook().tracked_sizes() == {"open_spans": 0, "trees": 0, "announcements": 0, "orphans": 0}


def test_many_queries_leave_no_state(engine, index) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=1)
    qe = index.as_query_engine(llm=llm, similarity_top_k=1)
    for i in range(10):
        qe.query(["pathlib?", "json?", "heapq?"][i % 3])
    assert retrieval_hook().tracked_sizes() == {"open_spans": 0, "trees": 0, "announcements": 0, "orphans": 0}
    assert engine.stats().prefetch["pending_announcements"] == 0


class NothingRetriever(BaseRetriever):
    def _retrieve(self, query_bundle):
        return []


def test_retriever_returning_nothing_gives_llamaindex_empty_response(engine) -> None:
    llm = PCRLLM(engine=engine, max_new_tokens=3)
    qe = RetrieverQueryEngine.from_args(NothingRetriever(), llm=llm)
    response = qe.query("anything?")
    assert str(response) == "Empty Response"
    assert engine.stats().prefetch["announced"] == 0 and engine.stats().requests["requests_finished"] == 0


def test_empty_query_raises_through_the_query_engine(engine, index) -> None:
    """Not a ValueError: compact/refine would swallow that into "Empty Response" (see PCRRequestError)."""
    qe = index.as_query_engine(llm=PCRLLM(engine=engine, max_new_tokens=3), similarity_top_k=1)
    with pytest.raises(PCRRequestError, match="empty query"):
        qe.query("")
    assert engine.stats().prefetch["pending_announcements"] == 0


def test_document_longer_than_the_context(engine, index_factory) -> None:
    # ~33k characters: the default node parser cuts it into ~1024-tiktoken-token nodes (~3.5k tiny-model tokens)
    big = {"big": "pathlib joins paths with the slash operator. " * 700}
    index = index_factory(big)
    llm = PCRLLM(engine=engine, max_new_tokens=3)
    qe = index.as_query_engine(llm=llm, similarity_top_k=3)
    # LlamaIndex's default tokenizer (tiktoken) undercounts this model's tokens, so compact packs three nodes
    # into one prompt that is far longer than the 4096-token window: a clear error, not a silent truncation
    with pytest.raises(PCRRequestError, match="context window"):
        qe.query("How do paths join?")
    # counting with the model's own tokenizer, LlamaIndex splits the document to fit and the query succeeds
    old = Settings._tokenizer
    Settings.tokenizer = llm.tokenize
    try:
        qe = index.as_query_engine(llm=llm, similarity_top_k=3)
        assert isinstance(qe.query("How do paths join?").response, str)
        assert engine.stats().requests["requests_finished"] >= 3  # packed into several prompts that fit
    finally:
        Settings._tokenizer = old


@pytest.mark.slow
def test_default_model_pipeline_reuses_and_matches_cache_off(index) -> None:
    questions = ["How do pathlib paths join?", "How does pathlib read a file?"]
    answers = {}
    for name, enable in (("on", True), ("off", False)):
        cfg = EngineConfig(cache_dir=tempfile.mkdtemp(), chunk_size=32, enable_cache=enable,
                           dram_capacity="256MiB", ssd_capacity="256MiB")
        with PCREngine(config=cfg) as eng:
            qe = index.as_query_engine(llm=PCRLLM(engine=eng, max_new_tokens=16), similarity_top_k=2)
            answers[name] = [qe.query(q).response for q in questions]
            if enable:
                assert eng.stats().requests["reused_tokens"] > 0
    assert answers["on"] == answers["off"]
    assert all(a.strip() for a in answers["on"])


class ScopedRetriever(BaseRetriever):
    """Returns two fixed nodes, the first marked shared under ``key`` (excluded from the LLM's view)."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self._key = key

    def _retrieve(self, query_bundle):
        from llama_index.core.schema import NodeWithScore, TextNode

        first = TextNode(text=PASSAGE_A, metadata={self._key: "shared"}, excluded_llm_metadata_keys=[self._key])
        return [NodeWithScore(node=first, score=1.0), NodeWithScore(node=TextNode(text=PASSAGE_B), score=0.5)]


PASSAGE_A = "pathlib offers classes for filesystem paths. Path objects join parts with the slash operator."
PASSAGE_B = "json encodes Python objects as JSON text. json.dumps returns a str, json.loads parses one back."


@pytest.mark.parametrize("key", ["pcr_scope", "visibility"])
def test_node_metadata_scope_reaches_the_engine_and_the_announcement(engine, key) -> None:
    """A node's metadata scope (under the LLM's ``scope_metadata_key``) is passed with it as a `pcr_rag.Doc`, and
    the announcement carries it too, so the call still claims it."""
    from pcr_rag.testing import SubmitRecorder

    llm = PCRLLM(engine=engine, max_new_tokens=3, scope_metadata_key=key)
    qe = RetrieverQueryEngine.from_args(ScopedRetriever(key), llm=llm)
    with SubmitRecorder(engine) as rec:
        qe.query("How do paths join?")
    (prompt,) = rec.prompts
    assert prompt.documents == (PASSAGE_A, PASSAGE_B)
    assert prompt.scopes == ("shared", None)
    assert engine.stats().prefetch["claimed"] == 1
    default_key = PCRLLM(engine=engine, max_new_tokens=3)
    with SubmitRecorder(engine) as rec:
        RetrieverQueryEngine.from_args(ScopedRetriever(key), llm=default_key).query("How do paths join?")
    assert rec.prompts[0].scopes == (("shared", None) if key == "pcr_scope" else ())
