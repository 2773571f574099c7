"""The retrieval hook announces in the answering LLM's reuse mode (issue 48): a ``PCRLLM(reuse="blend")`` query's
retrieval puts the documents' position-independent chains into the engine's prefetch window besides the exact
prefix, also on an engine whose default is exact; an exact LLM's does not, also on a blend engine. A retrieval
that shows no LLM announces to every live LLM's engine in the mode of the LLMs on it; over ``base_url=`` the
server's board gets the same, from a sync and an async query."""

from __future__ import annotations

import asyncio
import time

import pytest
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.llms.pcr import PCRLLM, install_retrieval_hook, retrieval_hook, uninstall_retrieval_hook

from pcr_rag.server import ServerThread

QUESTION = "How do pathlib paths join?"
TOP_K = 2


class Probe(BaseNodePostprocessor):
    """After retrieval, before the LLM call: what the engine's prefetch window holds."""

    seen: list = []

    def _postprocess_nodes(self, nodes, query_bundle=None):
        self.seen.append(self.__dict__["_engine"].window_snapshot())
        return nodes


def probe_for(engine) -> Probe:
    probe = Probe(seen=[])
    object.__setattr__(probe, "_engine", engine)
    return probe


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


@pytest.mark.parametrize("default, reuse, blended", [("exact", "blend", True), ("exact", "exact", False),
                                                     ("exact", None, False), ("blend", None, True),
                                                     ("blend", "exact", False)])
def test_the_answering_llm_s_reuse_decides_what_its_retrieval_prefetches(engine_factory, index, default, reuse,
                                                                         blended) -> None:
    with engine_factory(reuse=default) as engine:
        tickets = record_tickets(engine)
        probe = probe_for(engine)
        llm = PCRLLM(engine=engine, max_new_tokens=3, reuse=reuse)
        qe = index.as_query_engine(llm=llm, similarity_top_k=TOP_K, node_postprocessors=[probe])
        qe.query(QUESTION)
        (window,) = probe.seen
        assert len(window) == 1 + (TOP_K if blended else 0)  # the exact prefix, then one chain per document
        (ticket,) = tickets
        assert len(ticket.chains) == (TOP_K if blended else 0) and ticket.claimed
        assert engine.stats().requests["blended_requests"] == (1 if blended else 0)  # the call ran in that mode


def test_a_retrieval_without_an_llm_announces_each_engine_in_the_mode_of_the_llms_on_it(engine_factory,
                                                                                         index) -> None:
    """Two LLMs on one engine that differ: blend wins (the wider prefetch); exact and the engine's default
    (exact): no chains. A bare retriever call shows no LLM, so every live LLM's engine gets it."""
    with engine_factory() as mixed, engine_factory() as plain:
        llms = [PCRLLM(engine=mixed, reuse="exact"), PCRLLM(engine=mixed, reuse="blend"),
                PCRLLM(engine=plain, reuse="exact"), PCRLLM(engine=plain)]
        engines, modes = retrieval_hook().live_engines_with_reuse()
        assert (modes[id(mixed)], modes[id(plain)]) == ("blend", None)
        mixed_tickets, plain_tickets = record_tickets(mixed), record_tickets(plain)
        index.as_retriever(similarity_top_k=TOP_K).retrieve(QUESTION)
        assert [len(t.chains) for t in mixed_tickets] == [TOP_K]
        assert [len(t.chains) for t in plain_tickets] == [0]
        assert len(mixed.window_snapshot()) == 1 + TOP_K and len(plain.window_snapshot()) == 1
        # a bare retrieval's announcement waits for a later call as an orphan: withdraw it, leave no state behind
        uninstall_retrieval_hook()
        install_retrieval_hook()
        assert retrieval_hook().tracked_sizes()["orphans"] == 0 and mixed.window_snapshot() == []
        del llms


def test_over_base_url_sync_and_async_queries_announce_the_llm_s_mode(engine_factory, index) -> None:
    with engine_factory(max_model_len=2048) as engine, ServerThread(engine) as url:
        tickets = record_tickets(engine)
        blend = index.as_query_engine(llm=PCRLLM(base_url=url, max_new_tokens=3, reuse="blend"),
                                      similarity_top_k=TOP_K)
        exact = index.as_query_engine(llm=PCRLLM(base_url=url, max_new_tokens=3), similarity_top_k=TOP_K)
        blend.query(QUESTION)
        exact.query(QUESTION)
        asyncio.run(blend.aquery(QUESTION))  # on the event loop: announced from a task (HTTPEngine.announce_task)
        deadline = time.monotonic() + 10
        while len(tickets) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [len(t.chains) for t in tickets] == [TOP_K, 0, TOP_K]
        assert engine.stats().requests["blended_requests"] == 2
