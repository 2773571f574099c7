"""One behaviour on every path: a retriever -> prompt -> `ChatPCR` chain with `PCRRetrievalCallback` sends the same
documents, claims the announcement and gives the same tokens whether it is called with ``invoke``, ``ainvoke``,
``stream`` or ``astream``, on a local engine and over ``base_url=`` (a real in-process server).

LangChain's chat-model ``stream`` / ``astream`` pass no run manager to ``_stream`` / ``_astream``; the model finds
the announcement through the run `ChatPCR.stream` records (`langchain_pcr._stream_run`)."""

from __future__ import annotations

import asyncio
import operator
import uuid
from functools import reduce

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from langchain_pcr import (
    ChatPCR,
    PCRRetrievalCallback,
    install_global_retrieval_hook,
    uninstall_global_retrieval_hook,
)

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.server import ServerThread
from pcr_rag.testing import SubmitRecorder

PASSAGES = {
    "pathlib": "pathlib offers classes for filesystem paths. Path objects join with the slash operator.",
    "json": "json encodes Python objects as JSON text. json.dumps returns a str and json.loads parses one.",
    "heapq": "heapq implements a binary heap on a plain list. heappush and heappop keep the smallest first.",
}
PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")])
QUESTION = "what do pathlib and json do?"
MODES = ("invoke", "stream", "ainvoke", "astream")


class KeywordRetriever(BaseRetriever):
    """The passages whose key occurs in the query, in a fixed order."""

    passages: dict[str, str]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=t) for k, t in self.passages.items() if k in query.lower()]


def rag_chain(llm: ChatPCR):
    context = KeywordRetriever(passages=PASSAGES) | (lambda docs: "\n\n".join(d.page_content for d in docs))
    return {"context": context, "question": RunnablePassthrough()} | PROMPT | llm


def call(chain, config: dict, mode: str) -> AIMessage:
    """The chain's answer through ``mode``; a stream's chunks added up (their metadata comes with the last one)."""
    if mode == "invoke":
        return chain.invoke(QUESTION, config=config)
    if mode == "ainvoke":
        return asyncio.run(chain.ainvoke(QUESTION, config=config))
    if mode == "stream":
        chunks = list(chain.stream(QUESTION, config=config))
    else:
        async def drain() -> list:
            return [chunk async for chunk in chain.astream(QUESTION, config=config)]
        chunks = asyncio.run(drain())
    assert len(chunks) > 1, "the answer streamed"
    return reduce(operator.add, chunks)


def run_every_path(llm: ChatPCR, engine: PCREngine) -> dict[str, tuple]:
    """For each mode: the engine's request (documents, prompt ids, answer ids) and the answer's metadata; checks
    that every call claimed its announcement and that the hook kept no state."""
    hook = PCRRetrievalCallback(llm)
    seen: dict[str, tuple] = {}
    claims: dict[str, tuple] = {}
    for mode in MODES:
        with SubmitRecorder(engine) as rec:
            msg = call(rag_chain(llm), {"callbacks": [hook]}, mode)
        (prompt,) = rec.prompts
        (result,) = rec.results()
        meta = msg.response_metadata
        claims[mode] = (meta["documents_announced"], meta["announcement_claimed"], meta["documents_found"])
        seen[mode] = (tuple(prompt.documents), result.prompt_token_ids, result.token_ids, msg.content,
                      msg.usage_metadata["input_tokens"], msg.usage_metadata["output_tokens"])
    assert claims == dict.fromkeys(MODES, (True, True, 2))  # (announced, claimed, documents found)
    prefetch = engine.stats().prefetch
    assert (prefetch["announced"], prefetch["claimed"], prefetch["pending_announcements"]) == (4, 4, 0)
    assert hook.tracked_sizes() == {"open_runs": 0, "trees": 0, "announcements": 0}
    return seen


def assert_one_behaviour(seen: dict[str, tuple]) -> None:
    documents, _, answer_ids, content, _, n_out = seen["invoke"]
    assert documents == (PASSAGES["pathlib"], PASSAGES["json"])
    assert answer_ids and content and n_out == len(answer_ids)
    for mode in MODES[1:]:
        assert seen[mode] == seen["invoke"], f"{mode} differs from invoke"


def test_local_engine_every_path_claims_the_announcement(engine) -> None:
    assert_one_behaviour(run_every_path(ChatPCR(engine=engine, max_tokens=6), engine))


def test_global_hook_reaches_streams(engine) -> None:
    """A stream finds the announcement of the hook `install_global_retrieval_hook` attached (no per-call config)."""
    llm = ChatPCR(engine=engine, max_tokens=6)
    hook = install_global_retrieval_hook(llm)
    try:
        msgs = [call(rag_chain(llm), {}, mode) for mode in ("stream", "astream")]
    finally:
        uninstall_global_retrieval_hook()
    assert [m.response_metadata["announcement_claimed"] for m in msgs] == [True, True]
    assert [m.response_metadata["documents_found"] for m in msgs] == [2, 2]
    assert hook.announced == 2


def test_concurrent_astreams_each_claim_their_own_announcement(engine) -> None:
    """Streams running at once in one event loop (a task each) find the retrieval of their own run tree: the run
    each one records lives in its task's context."""
    llm = ChatPCR(engine=engine, max_tokens=6)
    hook = PCRRetrievalCallback(llm)
    questions = ["pathlib?", "json?", "heapq?", "pathlib and heapq?"]

    async def one(question: str) -> AIMessage:
        chunks = [c async for c in rag_chain(llm).astream(question, config={"callbacks": [hook]})]
        return reduce(operator.add, chunks)

    async def every() -> list[AIMessage]:
        return await asyncio.gather(*(one(q) for q in questions))

    msgs = asyncio.run(every())
    assert [m.response_metadata["documents_found"] for m in msgs] == [1, 1, 1, 2]
    assert all(m.response_metadata["announcement_claimed"] is True for m in msgs)
    prefetch = engine.stats().prefetch
    assert (prefetch["claimed"], prefetch["pending_announcements"]) == (4, 0)
    assert hook.tracked_sizes() == {"open_runs": 0, "trees": 0, "announcements": 0}


def config(tmp_path, name: str) -> EngineConfig:
    return EngineConfig(cache_dir=tmp_path / f"{name}-{uuid.uuid4().hex[:6]}", chunk_size=16, max_new_tokens=6,
                        dram_capacity="64MiB", ssd_capacity="64MiB", max_model_len=1024, dtype="float32",
                        announce_ttl_s=60.0)


def test_base_url_every_path_claims_the_announcement_and_matches_local(tiny, tmp_path) -> None:
    model, tokenizer = tiny
    with PCREngine(model, tokenizer, config=config(tmp_path, "served")) as served, ServerThread(served) as url:
        remote = run_every_path(ChatPCR(base_url=url, max_tokens=6), served)
    assert_one_behaviour(remote)
    with PCREngine(model, tokenizer, config=config(tmp_path, "reference")) as reference:
        local = run_every_path(ChatPCR(engine=reference, max_tokens=6), reference)
    assert local == remote  # the server's answers are the local engine's, token for token
