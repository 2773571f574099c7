"""Per-request instructions after the documents (issue 48 item 3) in LangChain: `rag_prompt` has a ``system_tail``
slot between the context and the question, so a hooked RAG chain reuses its documents across requests whose tails
differ (a per-request system message before them ends their reuse), answers equal a cache-off engine's, the
announcement is claimed, local and ``base_url=`` give the same tokens; without a tail it renders as the plain
template, and documents the chain's formatting changes are handled as without a tail."""

from __future__ import annotations

import uuid
from operator import itemgetter

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_pcr import ChatPCR, PCRRetrievalCallback, rag_prompt

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.server import ServerThread
from pcr_rag.testing import SubmitRecorder

PASSAGES = {
    "pathlib": "pathlib offers classes for filesystem paths. Path objects join with the slash operator. " * 2,
    "json": "json encodes Python objects as JSON text. json.dumps returns a str and json.loads parses one. " * 2,
}
PLAIN = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")])
USERS = ("Today is 2026-12-06. The user is Ana, a data engineer in Lisbon.",
         "Today is 2026-12-07. The user is Bo, a student in Oslo who prefers short answers.")
QUESTION = "what do pathlib and json do?"
CHUNK = 16


class KeywordRetriever(BaseRetriever):
    passages: dict[str, str]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=t) for k, t in self.passages.items() if k in query.lower()]


def chain(llm, prompt=None, fmt=None):
    """question + system_tail -> retrieval -> prompt -> model."""
    fmt = fmt or (lambda docs: "\n\n".join(d.page_content for d in docs))
    context = itemgetter("question") | KeywordRetriever(passages=PASSAGES) | fmt
    return ({"context": context, "question": itemgetter("question"), "system_tail": itemgetter("system_tail")}
            | (prompt or rag_prompt()) | llm)


def config(tmp_path, **overrides) -> EngineConfig:
    return EngineConfig(**{"cache_dir": tmp_path / f"kv-{uuid.uuid4().hex[:8]}", "chunk_size": CHUNK,
                           "max_new_tokens": 6, "dram_capacity": "64MiB", "ssd_capacity": "64MiB",
                           "max_model_len": 1024, "dtype": "float32", "announce_ttl_s": 60.0, **overrides})


def test_without_a_tail_it_renders_as_the_plain_template_and_with_one_between_context_and_question() -> None:
    values = {"context": "DOC-A {x} {{y}} <b>&amp;", "question": "why?"}
    assert rag_prompt().invoke(values).to_messages() == PLAIN.invoke(values).to_messages()
    assert rag_prompt().invoke({**values, "system_tail": " \n"}).to_messages() == PLAIN.invoke(values).to_messages()
    human = rag_prompt().invoke({**values, "system_tail": USERS[0]}).to_messages()[-1].content
    assert human == f"Context:\n{values['context']}\n\n{USERS[0]}\n\nQuestion: why?"
    assert rag_prompt(system="Braces {stay}").invoke(values).to_messages()[0].content == "Braces {stay}"
    assert [m.type for m in rag_prompt(system=None).invoke(values).to_messages()] == ["human"]


def test_documents_are_reused_across_tails_and_answers_equal_cache_off(tiny, tmp_path) -> None:
    tokenizer = tiny[1]
    doc_tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in PASSAGES.values())
    per_request_system = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context. {system_tail}"), ("human", "Context:\n{context}\n\nQuestion: {question}")])
    runs: dict[tuple[str, str], list] = {}
    for cache in ("on", "off"):
        for where, prompt in (("tail", None), ("system", per_request_system)):
            with PCREngine(*tiny, config=config(tmp_path, enable_cache=cache == "on")) as engine, \
                    SubmitRecorder(engine) as rec:
                llm = ChatPCR(engine=engine)
                hook = PCRRetrievalCallback(llm)
                msgs = [chain(llm, prompt).invoke({"question": QUESTION, "system_tail": u},
                                                  config={"callbacks": [hook]}) for u in USERS]
                assert all(m.response_metadata["announcement_claimed"] for m in msgs)
                assert all(m.response_metadata["documents_found"] == len(PASSAGES) for m in msgs)
                runs[cache, where] = rec.results()
    for where in ("tail", "system"):
        assert [r.token_ids for r in runs["on", where]] == [r.token_ids for r in runs["off", where]]
    second = runs["on", "tail"][1].metrics
    assert second.reused_tokens >= doc_tokens - CHUNK  # the head and both documents, all but the tail's chunk
    assert runs["on", "system"][1].metrics.reused_tokens < doc_tokens // 2 < second.reused_tokens


def test_base_url_gives_the_local_tokens(tiny, tmp_path) -> None:
    answers = []
    with PCREngine(*tiny, config=config(tmp_path)) as served, ServerThread(served) as url, \
            PCREngine(*tiny, config=config(tmp_path)) as local:
        for llm in (ChatPCR(base_url=url), ChatPCR(engine=local)):
            hook = PCRRetrievalCallback(llm)
            msgs = [chain(llm).invoke({"question": QUESTION, "system_tail": u}, config={"callbacks": [hook]})
                    for u in USERS]
            answers.append([(m.content, m.response_metadata["reused_tokens"],
                             m.response_metadata["announcement_claimed"]) for m in msgs])
    assert answers[0] == answers[1]
    assert answers[0][1][1] > 0 and all(claimed for _, _, claimed in answers[0])


@pytest.mark.parametrize("tail", [USERS[0], ""])
def test_documents_the_formatting_changes_are_handled_as_without_a_tail(engine, tail) -> None:
    """A formatter that rewrites the documents: none is found verbatim, the announcement is withdrawn, the prompt
    is computed as text and answered, tail or no tail."""
    llm = ChatPCR(engine=engine, max_tokens=3)
    hook = PCRRetrievalCallback(llm)
    shout = chain(llm, fmt=lambda docs: "\n\n".join(d.page_content.upper() for d in docs))
    msg = shout.invoke({"question": QUESTION, "system_tail": tail}, config={"callbacks": [hook]})
    meta = msg.response_metadata
    assert (meta["documents_found"], meta["announcement_claimed"], meta["documents"]) == (0, False, 0)
    assert meta["reused_tokens"] == 0 and msg.content is not None
    prefetch = engine.stats().prefetch
    assert (prefetch["claimed"], prefetch["pending_announcements"]) == (0, 0)
