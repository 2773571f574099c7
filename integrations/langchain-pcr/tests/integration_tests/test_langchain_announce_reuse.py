"""`PCRRetrievalCallback` announces in the answering model's reuse mode (issue 48): a ``ChatPCR(reuse="blend")``
chain's retrieval puts the documents' position-independent chains into the engine's prefetch window besides the
exact prefix, also on an engine whose default is exact; an exact model's does not, also on a blend engine. With an
engine or no target, each engine gets the mode of the live models using it (blend wins when they differ); over
``base_url=`` the server's board gets the model's mode."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_pcr import PCRLLM, ChatPCR, PCRRetrievalCallback
from langchain_pcr._common import announce_plan

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.server import ServerThread

PASSAGES = {
    "pathlib": "pathlib offers classes for filesystem paths. Path objects join with the slash operator.",
    "json": "json encodes Python objects as JSON text. json.dumps returns a str and json.loads parses one.",
    "heapq": "heapq implements a binary heap on a plain list. heappush and heappop keep the smallest first.",
}
PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")])
QUESTION = "what do pathlib and json do?"
FOUND = 2  # documents the question retrieves


class KeywordRetriever(BaseRetriever):
    """The passages whose key occurs in the query, in a fixed order."""

    passages: dict[str, str]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=t) for k, t in self.passages.items() if k in query.lower()]


def rag_chain(llm, probe=None):
    chain = {"context": KeywordRetriever(passages=PASSAGES) | (lambda docs: "\n\n".join(d.page_content for d in docs)),
             "question": RunnablePassthrough()} | PROMPT
    if probe is not None:
        chain = chain | RunnableLambda(probe)
    return chain | llm


def record_tickets(engine) -> list:
    """Every ticket ``engine``'s announcement board issues from now on (a spy: the board works as before)."""
    tickets: list = []
    add = engine.board.add

    def recording(*args, **kwargs):
        ticket = add(*args, **kwargs)
        tickets.append(ticket)
        return ticket

    engine.board.add = recording
    return tickets


def config(tmp_path, **overrides) -> EngineConfig:
    return EngineConfig(**{"cache_dir": tmp_path / f"kv-{uuid.uuid4().hex[:8]}", "chunk_size": 16,
                           "max_new_tokens": 4, "dram_capacity": "64MiB", "ssd_capacity": "64MiB",
                           "max_model_len": 1024, "dtype": "float32", "announce_ttl_s": 60.0, **overrides})


@pytest.mark.parametrize("default, reuse, blended", [("exact", "blend", True), ("exact", "exact", False),
                                                     ("exact", None, False), ("blend", None, True),
                                                     ("blend", "exact", False)])
def test_the_answering_model_s_reuse_decides_what_its_retrieval_prefetches(tiny, tmp_path, default, reuse,
                                                                           blended) -> None:
    with PCREngine(*tiny, config=config(tmp_path, reuse=default)) as engine:
        tickets = record_tickets(engine)
        llm = ChatPCR(engine=engine, max_tokens=3, reuse=reuse)
        seen: list = []

        def probe(value):  # after retrieval, before the model
            seen.append(engine.window_snapshot())
            return value

        msg = rag_chain(llm, probe).invoke(QUESTION, config={"callbacks": [PCRRetrievalCallback(llm)]})
        (window,) = seen
        assert len(window) == 1 + (FOUND if blended else 0)  # the exact prefix, then one chain per document
        (ticket,) = tickets
        assert len(ticket.chains) == (FOUND if blended else 0) and ticket.claimed
        assert msg.response_metadata["announcement_claimed"] is True
        assert msg.response_metadata["reuse"] == ("blend" if blended else "exact")


def test_an_engine_or_no_target_announces_in_the_mode_of_the_live_models_on_each_engine(tiny, tmp_path) -> None:
    with PCREngine(*tiny, config=config(tmp_path)) as mixed, PCREngine(*tiny, config=config(tmp_path)) as plain:
        models = [ChatPCR(engine=mixed, reuse="exact"), PCRLLM(engine=mixed, reuse="blend"),
                  ChatPCR(engine=plain, reuse="exact"), ChatPCR(engine=plain)]
        engines, modes = announce_plan(mixed)
        assert engines == [mixed] and modes == {id(mixed): None}  # no live model has loaded it yet
        for model in models:
            model.get_engine()  # loaded: now they count
        assert announce_plan(mixed)[1] == {id(mixed): "blend"}  # the two differ: the wider prefetch
        assert announce_plan(plain)[1] == {id(plain): None}     # exact and the engine's default: the default
        assert announce_plan(models[0])[1] == {id(mixed): "exact"}  # a model target: its own mode
        engines, modes = announce_plan(None)
        assert {id(e) for e in engines} >= {id(mixed), id(plain)}
        assert (modes[id(mixed)], modes[id(plain)]) == ("blend", None)
        mixed_tickets, plain_tickets = record_tickets(mixed), record_tickets(plain)
        retriever = KeywordRetriever(passages=PASSAGES)
        retriever.invoke(QUESTION, config={"callbacks": [PCRRetrievalCallback(mixed)]})
        retriever.invoke(QUESTION, config={"callbacks": [PCRRetrievalCallback()]})  # every live model's engine
        assert [len(t.chains) for t in mixed_tickets] == [FOUND, FOUND]
        assert [len(t.chains) for t in plain_tickets] == [0]
        del models


def test_over_base_url_the_server_gets_the_model_s_mode(tiny, tmp_path) -> None:
    with PCREngine(*tiny, config=config(tmp_path)) as served, ServerThread(served) as url:
        tickets = record_tickets(served)
        blend, exact = ChatPCR(base_url=url, max_tokens=3, reuse="blend"), ChatPCR(base_url=url, max_tokens=3)
        rag_chain(blend).invoke(QUESTION, config={"callbacks": [PCRRetrievalCallback(blend)]})
        rag_chain(exact).invoke(QUESTION, config={"callbacks": [PCRRetrievalCallback(exact)]})
        msg = asyncio.run(rag_chain(blend).ainvoke(QUESTION, config={"callbacks": [PCRRetrievalCallback(blend)]}))
        assert [len(t.chains) for t in tickets] == [FOUND, 0, FOUND]
        assert all(t.claimed for t in tickets) and msg.response_metadata["reuse"] == "blend"
