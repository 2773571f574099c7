"""The LangChain retrieval hook on a real PCREngine (tiny random Llama): announce, run-tree lookup, claim, cleanup."""

from __future__ import annotations

import asyncio
import gc

import pytest
from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_pcr import (
    ChatPCR,
    PCRRetrievalCallback,
    install_global_retrieval_hook,
    uninstall_global_retrieval_hook,
)

PASSAGES = {
    "pathlib": "pathlib offers classes for filesystem paths. Path objects join with the slash operator.",
    "json": "json encodes Python objects as JSON text. json.dumps returns a str and json.loads parses one.",
    "heapq": "heapq implements a binary heap on a plain list. heappush and heappop keep the smallest first.",
}


class KeywordRetriever(BaseRetriever):
    """Returns the passages whose key occurs in the query (in a fixed order)."""

    passages: dict[str, str]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=text, metadata={"key": key})
                for key, text in self.passages.items() if key in query.lower()]


PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")]
)


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def rag_chain(llm, probe=None):
    retriever = KeywordRetriever(passages=PASSAGES)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT
    if probe is not None:
        chain = chain | RunnableLambda(probe)
    return chain | llm


def test_announce_enters_window_before_the_llm_call_and_is_claimed(engine) -> None:
    llm = ChatPCR(engine=engine)
    hook = PCRRetrievalCallback(llm)
    seen = {}

    def probe(value):  # runs after retrieval, before the model
        stats = engine.stats().prefetch
        seen["pending"] = stats["pending_announcements"]
        seen["window"] = engine.window_snapshot()
        return value

    msg = rag_chain(llm, probe).invoke("what does pathlib and json do?", config={"callbacks": [hook]})
    assert seen["pending"] == 1
    assert len(seen["window"]) == 1 and len(seen["window"][0]) > 0  # its chunk keys are in the prefetch window
    assert msg.response_metadata["documents_announced"] is True
    assert msg.response_metadata["documents_found"] == 2
    assert msg.response_metadata["announcement_claimed"] is True
    prefetch = engine.stats().prefetch
    assert (prefetch["announced"], prefetch["claimed"], prefetch["pending_announcements"]) == (1, 1, 0)
    assert hook.tracked_sizes() == {"open_runs": 0, "trees": 0, "announcements": 0}


def test_second_query_reuses_the_leading_documents(engine) -> None:
    llm = ChatPCR(engine=engine)
    hook = PCRRetrievalCallback(llm)
    chain = rag_chain(llm)
    first = chain.invoke("pathlib and json?", config={"callbacks": [hook]})
    second = chain.invoke("tell me about pathlib or json", config={"callbacks": [hook]})
    assert first.response_metadata["reused_tokens"] < second.response_metadata["reused_tokens"]
    assert second.usage_metadata["input_token_details"]["cache_read"] == second.response_metadata["reused_tokens"]
    assert engine.stats().prefetch["claimed"] == 2


def test_parallel_branches_and_concurrent_chains_each_get_their_own_documents(engine) -> None:
    """abatch runs chains concurrently; each model run must find the retrieval of its own run tree."""
    llm = ChatPCR(engine=engine)
    hook = PCRRetrievalCallback(llm)
    questions = ["pathlib?", "json?", "heapq?", "pathlib and heapq?"]
    msgs = asyncio.run(rag_chain(llm).abatch(questions, config={"callbacks": [hook]}))
    found = [m.response_metadata["documents_found"] for m in msgs]
    assert found == [1, 1, 1, 2]
    assert all(m.response_metadata["announcement_claimed"] for m in msgs)
    prefetch = engine.stats().prefetch
    assert prefetch["claimed"] == 4 and prefetch["pending_announcements"] == 0
    assert hook.tracked_sizes()["trees"] == 0


def test_global_hook_reaches_runs_without_config(engine) -> None:
    llm = ChatPCR(engine=engine)
    hook = install_global_retrieval_hook(llm)
    try:
        msg = rag_chain(llm).invoke("json?")
        assert msg.response_metadata["announcement_claimed"] is True
        assert hook.announced == 1
    finally:
        uninstall_global_retrieval_hook()
    msg = rag_chain(llm).invoke("json?")
    assert msg.response_metadata["documents_announced"] is False
    assert hook.announced == 1


def test_no_state_left_behind_across_many_runs(engine) -> None:
    llm = ChatPCR(engine=engine, max_tokens=1)
    hook = PCRRetrievalCallback(llm)
    chain = rag_chain(llm)
    for i in range(12):
        chain.invoke(["pathlib?", "json?", "heapq?"][i % 3], config={"callbacks": [hook]})
    gc.collect()
    assert hook.tracked_sizes() == {"open_runs": 0, "trees": 0, "announcements": 0}
    assert engine.stats().prefetch["pending_announcements"] == 0


def test_bounded_state_when_runs_never_end(engine) -> None:
    hook = PCRRetrievalCallback(engine, max_open_runs=8, max_trees=2)
    import uuid

    for _ in range(50):
        hook.on_chain_start({}, {}, run_id=uuid.uuid4(), parent_run_id=None)
    assert hook.tracked_sizes()["open_runs"] == 8
    roots = [uuid.uuid4() for _ in range(4)]
    for root in roots:
        hook.on_chain_start({}, {}, run_id=root, parent_run_id=None)
        rid = uuid.uuid4()
        hook.on_retriever_start({}, "q", run_id=rid, parent_run_id=root)
        hook.on_retriever_end([Document(page_content=PASSAGES["json"])], run_id=rid, parent_run_id=root)
    assert hook.tracked_sizes()["trees"] == 2
    # evicted trees withdrew their tickets: only the two live trees' announcements stay pending
    assert engine.stats().prefetch["pending_announcements"] == 2


def test_bare_retriever_call_does_not_leave_an_announcement(engine) -> None:
    hook = PCRRetrievalCallback(engine)
    docs = KeywordRetriever(passages=PASSAGES).invoke("json?", config={"callbacks": [hook]})
    assert len(docs) == 1
    assert engine.stats().prefetch["pending_announcements"] == 0


def test_retriever_returning_nothing_still_answers(engine) -> None:
    llm = ChatPCR(engine=engine)
    hook = PCRRetrievalCallback(llm)
    msg = rag_chain(llm).invoke("nothing matches here", config={"callbacks": [hook]})
    assert isinstance(msg.content, str)
    assert hook.announced == 0 and msg.response_metadata["documents_announced"] is False


def test_empty_query_is_rejected(engine) -> None:
    llm = ChatPCR(engine=engine)
    hook = PCRRetrievalCallback(llm)
    # a retriever that matches anything (the empty key is in every query), so the empty query gets documents
    chain = {"context": KeywordRetriever(passages={"": PASSAGES["json"]}) | format_docs,
             "question": RunnablePassthrough()} | PROMPT | llm
    with pytest.raises(ValueError, match="empty query"):
        chain.invoke("", config={"callbacks": [hook]})
    assert engine.stats().prefetch["pending_announcements"] == 0
    with pytest.raises(ValueError, match="empty"):
        llm.invoke("")
    with pytest.raises(ValueError, match="empty"):
        llm.invoke([("human", "   ")])


def test_document_longer_than_context_raises_a_clear_value_error(engine) -> None:
    errors = []

    class Recorder(BaseCallbackHandler):
        def on_llm_error(self, error, **kwargs):
            errors.append(error)

    llm = ChatPCR(engine=engine)
    huge = "pathlib " * 3000  # ~6000 byte-level tokens > the tiny model's 4096-token window
    with pytest.raises(ValueError, match="context window") as info:
        llm.invoke([("human", f"Context: {huge}\nQuestion: what?")], config={"callbacks": [Recorder()]})
    assert "exceeds" in str(info.value)
    assert errors and errors[0] is info.value  # LangChain saw it as an LLM error (on_llm_error)


class ScopedRetriever(BaseRetriever):
    """Returns every passage, the first one with a sharing scope under ``key`` in its metadata."""

    passages: dict[str, str]
    key: str = "pcr_scope"

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        texts = list(self.passages.values())
        return [Document(page_content=texts[0], metadata={self.key: "shared"}),
                *(Document(page_content=t, metadata={}) for t in texts[1:])]


@pytest.mark.parametrize("key", ["pcr_scope", "visibility"])
def test_metadata_scope_reaches_the_engine_and_the_announcement(engine, key) -> None:
    """A retrieved Document's metadata scope (under the configured key) goes with it to the model call, as a
    `pcr_rag.Doc`, and the announcement carries it too, so the call still claims it."""
    from pcr_rag.testing import SubmitRecorder

    llm = ChatPCR(engine=engine)
    hook = PCRRetrievalCallback(llm, scope_metadata_key=key)
    retriever = ScopedRetriever(passages=PASSAGES, key=key)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm
    with SubmitRecorder(engine) as rec:
        msg = chain.invoke("what do they do?", config={"callbacks": [hook]})
    (prompt,) = rec.prompts
    assert prompt.documents == tuple(PASSAGES.values())
    assert prompt.scopes == ("shared", None, None)
    assert msg.response_metadata["announcement_claimed"] is True
    other = PCRRetrievalCallback(llm, scope_metadata_key="something_else")
    with SubmitRecorder(engine) as rec:
        chain.invoke("what do they do?", config={"callbacks": [other]})
    assert rec.prompts[0].scopes == ()  # the key is not the configured one: no scope
