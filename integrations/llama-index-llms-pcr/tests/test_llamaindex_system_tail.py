"""Per-request instructions after the documents (issue 48 item 3) in LlamaIndex: `PCR_TEXT_QA_TEMPLATE` /
`PCR_SUMMARY_TEMPLATE` put a ``{system_tail}`` slot after the context, so a query engine's documents are reused
across requests whose tails differ (a per-request ``system_prompt`` before them ends their reuse), answers equal a
cache-off engine's, the retrieval's announcement is claimed; without a tail the templates render as LlamaIndex's
defaults, and documents a template does not show are handled as without a tail."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.llms import ChatMessage, MockLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.prompts.default_prompt_selectors import (
    DEFAULT_TEXT_QA_PROMPT_SEL,
    DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
)
from llama_index.llms.pcr import (
    PCR_SUMMARY_TEMPLATE,
    PCR_TEXT_QA_TEMPLATE,
    PCRLLM,
    install_retrieval_hook,
    retrieval_hook,
    system_tail,
    uninstall_retrieval_hook,
    with_system_tail,
)

from pcr_rag.testing import SubmitRecorder

USERS = ("Today is 2026-12-06. The user is Ana, a data engineer in Lisbon.",
         "Today is 2026-12-07. The user is Bo, a student in Oslo who prefers short answers.")
QUESTION = "How do pathlib paths join?"
CHUNK = 16  # the fixtures' chunk_size


@pytest.mark.parametrize("ours, theirs", [(PCR_TEXT_QA_TEMPLATE, DEFAULT_TEXT_QA_PROMPT_SEL),
                                          (PCR_SUMMARY_TEMPLATE, DEFAULT_TREE_SUMMARIZE_PROMPT_SEL)])
def test_without_a_tail_the_templates_render_as_llamaindex_defaults_and_with_one_after_the_context(
        ours, theirs) -> None:
    args = {"context_str": "DOC-A\n\nDOC-B", "query_str": "what?"}
    for chat in (False, True):  # the completion form, and the chat form a chat model selects
        llm = MockLLM()
        llm.__dict__["is_chat_model"] = chat  # MockLLM's metadata reads it; the selector asks the metadata
        assert ours.select(llm).format_messages(**args) == theirs.select(llm).format_messages(**args)
        with system_tail(USERS[0]):
            user = ours.select(llm).format_messages(**args)[-1].content
        assert user.index("DOC-B") < user.index(USERS[0]) < user.index("Query: what?")
        assert ours.select(llm).format_messages(**args, system_tail="  ") == theirs.select(llm).format_messages(
            **args)  # a blank tail renders as nothing


def test_the_slot_takes_an_argument_first_then_the_innermost_block() -> None:
    args = {"context_str": "C", "query_str": "q"}
    with system_tail("outer"):
        with system_tail("inner"):
            assert "inner\nGiven" in PCR_TEXT_QA_TEMPLATE.format(**args)
        assert "outer\nGiven" in PCR_TEXT_QA_TEMPLATE.format(**args)
        assert "mine\nGiven" in PCR_TEXT_QA_TEMPLATE.partial_format(system_tail="mine").format(**args)
    assert PCR_TEXT_QA_TEMPLATE.format(**args) == DEFAULT_TEXT_QA_PROMPT_SEL.format(**args)
    custom = with_system_tail(PromptTemplate("{context_str}\n\n{system_tail}Q: {query_str}"))
    with system_tail("T"):
        assert custom.format(**args) == "C\n\nT\nQ: q"
    with pytest.raises(ValueError, match="system_tail"):
        with_system_tail(PromptTemplate("{context_str} {query_str}"))
    with pytest.raises(TypeError, match="str"), system_tail(3):  # type: ignore[arg-type]
        pass


def test_documents_are_reused_across_tails_and_answers_equal_cache_off(engine_factory, index, tiny) -> None:
    """The same two queries, one tail each: in the template's slot the second reuses the documents; in a
    per-request ``system_prompt`` (before them) it does not. Every answer equals the cache-off engine's."""
    # from a clean hook: what earlier tests' ended queries left unclaimed waits up to ORPHAN_TTL_S as orphans, and
    # this test counts only its own
    uninstall_retrieval_hook()
    install_retrieval_hook()
    runs: dict[tuple[str, str], list] = {}
    for cache in ("on", "off"):
        for where in ("tail", "system_prompt"):
            with engine_factory(**({} if cache == "on" else {"enable_cache": False})) as eng, \
                    SubmitRecorder(eng) as rec:
                for user in USERS:
                    if where == "tail":
                        llm = PCRLLM(engine=eng, max_new_tokens=6)
                        qe = index.as_query_engine(llm=llm, similarity_top_k=2,
                                                   text_qa_template=PCR_TEXT_QA_TEMPLATE)
                        with system_tail(user):
                            response = qe.query(QUESTION)
                    else:
                        llm = PCRLLM(engine=eng, max_new_tokens=6, system_prompt=user)
                        response = index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
                    assert isinstance(response.response, str)
                results = rec.results()
                runs[cache, where] = results
                if cache == "on":
                    assert eng.stats().prefetch["claimed"] == 2  # every announcement found its documents
            assert retrieval_hook().tracked_sizes()["orphans"] == 0
    for where in ("tail", "system_prompt"):
        assert [r.token_ids for r in runs["on", where]] == [r.token_ids for r in runs["off", where]]
    tail_first, tail_second = runs["on", "tail"]
    head_second = runs["on", "system_prompt"][1]
    assert tail_second.documents_found == head_second.documents_found == 2
    tokenizer = tiny[1]
    doc_tokens = sum(len(tokenizer(node.get_content(), add_special_tokens=False)["input_ids"])
                     for node in index.as_retriever(similarity_top_k=2).retrieve(QUESTION))
    # after the documents, the second user's tail leaves the head and both documents reused (all but the chunk
    # the tail cuts into)
    assert tail_second.metrics.reused_tokens >= doc_tokens - CHUNK
    assert tail_second.metrics.computed_tokens < tail_first.metrics.computed_tokens
    # before them (the system turn), it ends the match in the head: the documents are computed again
    assert head_second.metrics.reused_tokens < doc_tokens // 2 < tail_second.metrics.reused_tokens


def test_the_tail_reaches_the_prompt_in_async_and_streaming_queries(engine, index) -> None:
    qe = index.as_query_engine(llm=PCRLLM(engine=engine, max_new_tokens=4), similarity_top_k=2,
                               text_qa_template=PCR_TEXT_QA_TEMPLATE)
    stream_qe = index.as_query_engine(llm=PCRLLM(engine=engine, max_new_tokens=4), similarity_top_k=2,
                                      text_qa_template=PCR_TEXT_QA_TEMPLATE, streaming=True)

    async def ask() -> str:
        with system_tail(USERS[1]):
            return (await qe.aquery(QUESTION)).response

    with SubmitRecorder(engine) as rec:
        answer = asyncio.run(ask())
        # a streaming query engine calls the LLM, and so formats the template, when its generator is consumed
        with system_tail(USERS[1]):
            assert "".join(stream_qe.query(QUESTION).response_gen) == answer  # the same prompt either way
        pinned = index.as_query_engine(llm=PCRLLM(engine=engine, max_new_tokens=4), similarity_top_k=2,
                                       text_qa_template=PCR_TEXT_QA_TEMPLATE.partial_format(system_tail=USERS[1]),
                                       streaming=True)
        assert "".join(pinned.query(QUESTION).response_gen) == answer  # a partial_format tail needs no block
    assert len(rec.prompts) == 3
    for prompt in rec.prompts:
        user = prompt.messages[-1]["content"]
        assert user.index(prompt.documents[-1]) < user.index(USERS[1]) < user.index(f"Query: {QUESTION}")
    assert engine.stats().prefetch["claimed"] == 3


def test_documents_the_template_does_not_show_behave_as_without_a_tail(engine) -> None:
    """An explicit document missing from the rendered prompt is computed as text, as without a tail: the call is
    answered, the document is not found, nothing is reused from it."""
    llm = PCRLLM(engine=engine, max_new_tokens=3)
    missing = "heapq implements a binary min-heap on a plain list."
    with system_tail(USERS[0]):
        messages = PCR_TEXT_QA_TEMPLATE.format_messages(llm=llm, context_str="pathlib joins paths.",
                                                        query_str=QUESTION)
    response = llm.chat([ChatMessage(role=m.role, content=m.content) for m in messages], documents=[missing])
    plain = llm.chat([ChatMessage(role=m.role, content=m.content) for m in messages])
    assert response.raw["documents_found"] == 0 and response.message.content == plain.message.content
