"""Prompt layout: render a RAG request and cut it into per-document token segments.

A request's prompt is ``[prefix][doc 1][sep + doc 2]...[sep + doc k][rest]``: the non-document text between two
documents (a separator such as ``"\\n\\n"``) travels with the following document, so a document's segment depends
only on the document and the fixed separator before it, never on what follows (the next document or the query).
The cache engine then cuts every segment into chunks on its own (`pcr_rag.cache.keys.plan_chunks`).

Token ids never depend on whether the documents are known. The ids fed to the model are always those of the whole
prompt tokenized at once. Cuts go where tokenizers do not merge text across them: at the start of the whitespace
run before a document (the whitespace travels with the document: ``"Context:" | " The ..."``) and before a
document's trailing whitespace. Each piece is tokenized on its own (a popular document's tokens are computed once,
and its run is the same in every prompt), and the concatenation is checked against the whole prompt's ids; a cut
where they still differ moves (to the document's exact edge, then past the whitespace after it) or is dropped (its
two pieces merge). Knowing the documents therefore only decides where chunks start, never which ids exist.

Invariants:
- ``token_ids == concat(segments) == whole-prompt ids`` (``[BOS] + tokenize(text)`` when the tokenizer adds a
  BOS by default and the text does not start with it); segments are never empty.
- Segments depend only on the rendered text and the positions of the documents in it.
- A document that starts and ends with non-whitespace gets the segment ``tokenize(lead + document)`` (``lead``:
  the whitespace before it, and in later positions the separator) whenever its cuts need no adjustment (the
  default layouts of the engine, LlamaIndex and LangChain; see docs/DESIGN.md): the same in every position with
  the same lead, and independent of the text after it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pcr_rag.errors import InvalidRequestError

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTION = "Answer the question using the documents below."
DEFAULT_SEPARATOR = "\n\n"
_PROBE_DOCUMENT = "a"  # a one-letter document: how a layout's cuts fit around text that starts and ends a word


@dataclass(frozen=True)
class SegmentedPrompt:
    """A prompt cut into token segments.

    Attributes:
        text: the rendered prompt text (chat template applied when used).
        segments: token runs; the prompt's tokens are their concatenation (equal to the whole text's tokens).
        documents_found: how many of the given documents were located in the text (the rest were folded into
            the surrounding text and are still computed correctly, only without their own chunk boundaries).
        cuts_adjusted: document cuts that could not stay at their canonical place (the start of the whitespace
            run before them) because the tokenizer merges text across it: moved, or dropped (two segments merged).
            0 on the default layouts.
    """

    text: str
    segments: tuple[tuple[int, ...], ...]
    documents_found: int
    cuts_adjusted: int = 0

    @property
    def token_ids(self) -> list[int]:
        return [t for seg in self.segments for t in seg]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)


@dataclass(frozen=True)
class DocumentLayout:
    """Where the documents of a prompt go: ``head`` is the text before the first document, ``separator`` the
    text between two documents. ``head + separator.join(documents)`` is the prompt up to the end of the last
    document (what `PromptBuilder.predict_prefix` segments and `pcr_rag.reorder` walks)."""

    head: str
    separator: str


@dataclass(frozen=True)
class DocumentPieces:
    """How `PromptBuilder.segment` cuts a layout's documents (`PromptBuilder.document_pieces`): the head's own
    piece is ``head``; a document's piece is ``first_lead + document + trail`` in the first position and
    ``lead + document + trail`` after another document (``first_lead`` is the whitespace at the end of the
    layout's head, ``lead + trail`` is the layout's separator). A document's trailing whitespace goes to the
    next piece, as the canonical cut puts it."""

    head: str
    first_lead: str
    lead: str
    trail: str

    def piece(self, document: str, previous: str | None = None) -> str:
        """The piece of ``document`` placed right after ``previous`` (None: first in the prompt)."""
        core = document.rstrip()
        lead = self.first_lead if previous is None else previous[len(previous.rstrip()):] + self.lead
        return lead + core + self.trail


def validate_documents(documents: object) -> tuple[str, ...]:
    """Documents must be a sequence of strings (a single string is rejected, not split into characters)."""
    if documents is None:
        return ()
    if isinstance(documents, (str, bytes)):
        raise InvalidRequestError("documents must be a sequence of strings, not a single string; wrap it: [doc]")
    try:
        docs = tuple(documents)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequestError(
            f"documents must be a sequence of strings, got {type(documents).__name__}"
        ) from None
    for i, doc in enumerate(docs):
        if not isinstance(doc, str):
            raise InvalidRequestError(
                f"document #{i} is a {type(doc).__name__}, not a str; pass the document text "
                f"(e.g. node.get_content() or doc.page_content)"
            )
    return docs


class PromptBuilder:
    """Renders requests with the tokenizer's chat template (when it has one) and segments them.

    Thread-safe. Keeps a small LRU of tokenized segments, since popular documents come back again and again.
    """

    def __init__(self, tokenizer, *, instruction: str = DEFAULT_INSTRUCTION, token_cache_size: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.instruction = instruction
        self._has_template = bool(getattr(tokenizer, "chat_template", None))
        self._bos_id = self._leading_bos(tokenizer)
        self._bos_text = tokenizer.bos_token if getattr(tokenizer, "bos_token", None) else None
        self._lock = threading.Lock()
        self._token_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._token_cache_size = token_cache_size
        self._pieces: OrderedDict[DocumentLayout, DocumentPieces] = OrderedDict()
        # Layout learned from the last flat prompt that contained documents: (text before doc 1, separator).
        self._learned_prefix: str | None = None
        self._learned_separator: str = DEFAULT_SEPARATOR

    @staticmethod
    def _leading_bos(tokenizer) -> int | None:
        """The BOS id the tokenizer prepends by default, or None when it adds none."""
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            return None
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
        return bos if ids and ids[0] == bos else None

    @property
    def has_chat_template(self) -> bool:
        return self._has_template

    # ----------------------------------------------------------------------------------------------- rendering
    def render_chat(self, user: str, system: str | None = None) -> str:
        """One user turn (plus optional system turn), with the generation prompt appended."""
        if not self._has_template:
            head = f"{system}\n\n" if system else ""
            return f"{head}{user}\n"
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self.render_messages(messages)

    def render_messages(self, messages: Sequence[dict[str, str]]) -> str:
        """A whole conversation rendered with the chat template (generation prompt appended)."""
        if not self._has_template:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + "\nassistant:"
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):  # some tokenizers return a list for a single conversation
            text = text[0]
        return text

    def rag_user_text(self, query: str, documents: Sequence[str]) -> str:
        if not documents:
            return query
        body = DEFAULT_SEPARATOR.join(documents)
        return f"{self.instruction}{DEFAULT_SEPARATOR}{body}{DEFAULT_SEPARATOR}Question: {query}"

    # ---------------------------------------------------------------------------------------------- segmenting
    def build_rag(self, query: str, documents: Sequence[str], system: str | None = None) -> SegmentedPrompt:
        """[system + instruction][doc 1]..[doc k][question], rendered as one user turn."""
        text = self.render_chat(self.rag_user_text(query, documents), system)
        return self.segment(text, documents)

    def build_flat(self, prompt: str, documents: Sequence[str], *, chat: bool = True,
                   system: str | None = None) -> SegmentedPrompt:
        """A prompt that contains the documents verbatim, in order (e.g. rendered by a framework's template)."""
        text = self.render_chat(prompt, system) if chat else prompt
        seg = self.segment(text, documents)
        if seg.documents_found:
            self._learn_layout(text, documents)
        return seg

    def build_chat(self, messages: Sequence[dict[str, str]], documents: Sequence[str]) -> SegmentedPrompt:
        """A conversation rendered with the chat template; the documents found in it get their own runs (and
        teach the builder the framework's layout, as `build_flat`)."""
        text = self.render_messages(messages)
        seg = self.segment(text, documents)
        if seg.documents_found:
            self._learn_layout(text, documents)
        return seg

    def predict_prefix(self, documents: Sequence[str], *, system: str | None = None,
                       prefix: str | None = None, separator: str | None = None,
                       flat: bool = False) -> SegmentedPrompt:
        """The segments up to the end of the last document, before the query is known (for `announce`).

        With ``flat=True`` (a framework renders the prompt) it uses the explicit ``prefix``/``separator`` or the
        layout learned from the last flat prompt; otherwise the engine's own RAG layout (see `layout`).
        """
        lay = self.layout(system=system, prefix=prefix, separator=separator, flat=flat)
        # the last document's trailing whitespace goes with the text after it (the canonical cut), unknown here
        docs = [*documents[:-1], documents[-1].rstrip()] if documents else []
        return self.segment(lay.head + lay.separator.join(docs), docs)

    def layout(self, *, system: str | None = None, prefix: str | None = None, separator: str | None = None,
               flat: bool = False) -> DocumentLayout:
        """The document layout a request will have: with ``flat=True`` the explicit ``prefix``/``separator`` or
        the layout learned from the last flat prompt that held documents (the engine's own head until one was
        seen); otherwise the engine's own RAG layout (`build_rag`)."""
        if not flat:
            return DocumentLayout(self._own_prefix_text(system), DEFAULT_SEPARATOR)
        with self._lock:
            learned_head, learned_sep = self._learned_prefix, self._learned_separator
        head = prefix if prefix is not None else learned_head
        if head is None:  # nothing learned yet: assume the engine's own layout
            head = self._own_prefix_text(system)
        return DocumentLayout(head, separator if separator is not None else learned_sep)

    def document_pieces(self, layout: DocumentLayout) -> DocumentPieces:
        """How `segment` cuts documents in ``layout``, learned once per layout by segmenting a probe (three
        one-letter documents). Exact for documents that start and end with non-whitespace (the cut fitting looks
        only at the characters around a cut); for others the pieces are a prediction (`pcr_rag.reorder` uses
        them to walk the cache; the request itself is always segmented from its real text)."""
        with self._lock:
            hit = self._pieces.get(layout)
            if hit is not None:
                return hit
        pieces = self._probe_pieces(layout)
        with self._lock:
            self._pieces[layout] = pieces
            if len(self._pieces) > 64:
                self._pieces.popitem(last=False)
        return pieces

    def _probe_pieces(self, layout: DocumentLayout) -> DocumentPieces:
        head, sep = layout.head, layout.separator
        naive = DocumentPieces(head, "", sep, "")
        probe = _PROBE_DOCUMENT
        text = head + sep.join((probe,) * 3)
        starts = [len(head) + i * (len(probe) + len(sep)) for i in range(3)]
        ends = [start + len(probe) for start in starts]
        cuts = ([starts[0]] if starts[0] > 0 else []) + ends[:2]
        fitted, _ = self._fit_cuts(text, cuts)
        if len(fitted) != len(cuts):  # a cut was dropped: documents get no runs of their own in this layout
            return naive
        first_cut = fitted[0] if starts[0] > 0 else 0
        trails = {c - e for c, e in zip(fitted[-2:], ends)}
        if len(trails) != 1 or first_cut > starts[0] or min(trails) < 0:
            return naive
        trail = sep[: trails.pop()]
        return DocumentPieces(head[:first_cut], head[first_cut:], sep[len(trail):], trail)

    @property
    def learned_flat_layout(self) -> bool:
        """True once a flat prompt with documents taught the builder a framework's layout."""
        with self._lock:
            return self._learned_prefix is not None

    def _own_prefix_text(self, system: str | None) -> str:
        marker = "\x00PCR_DOCS\x00"
        rendered = self.render_chat(self.rag_user_text("q", [marker]), system)
        return rendered[: rendered.index(marker)]

    def _learn_layout(self, text: str, documents: Sequence[str]) -> None:
        spans = _locate(text, documents)
        found = [s for s in spans if s is not None]
        if not found:
            return
        prefix = text[: found[0][0]]
        sep = text[found[0][1]: found[1][0]] if len(found) > 1 else self._learned_separator
        with self._lock:
            self._learned_prefix, self._learned_separator = prefix, sep

    def segment(self, text: str, documents: Sequence[str]) -> SegmentedPrompt:
        """Cut ``text`` around the documents (searched in order from a cursor): ``[prefix][doc 1][sep + doc 2]
        ...[rest]``. Each piece is tokenized on its own; cuts the tokenizer would merge across are moved or
        dropped until the pieces' ids are exactly the whole text's ids (see the module docstring)."""
        spans = [s for s in _locate(text, documents) if s is not None]
        cuts: list[int] = []
        for i, (start, end) in enumerate(spans):
            # doc 1 starts a piece; every document ends one (the next piece starts with the separator)
            for c in ((start, end) if i == 0 else (end,)):
                if 0 < c < len(text) and (not cuts or c > cuts[-1]):
                    cuts.append(c)
        segments, adjusted = self._fit(text, cuts)
        if not segments:
            raise InvalidRequestError("the prompt is empty after tokenization; pass a query or documents")
        if adjusted:
            log.debug("segment: %d of %d document cuts adjusted to keep the whole prompt's tokenization",
                      adjusted, len(cuts))
        return SegmentedPrompt(text=text, segments=segments, documents_found=len(spans), cuts_adjusted=adjusted)

    def tokenize_piece(self, text: str, *, first: bool) -> tuple[int, ...]:
        """The ids of one piece of a prompt, tokenized on its own (cached); the prompt's first piece gets the BOS
        the tokenizer adds by default unless it already starts with the BOS text."""
        ids = self._tokenize(text)
        if first and self._bos_id is not None and not (self._bos_text and text.startswith(self._bos_text)):
            ids = (self._bos_id, *ids)
        return ids

    def _fit(self, text: str, cuts: list[int]) -> tuple[tuple[tuple[int, ...], ...], int]:
        """Segments of ``text`` cut at ``cuts`` (strictly increasing, inside the text) whose concatenation is the
        whole text's ids, and how many cuts had to move or go (see `_fit_cuts`)."""
        fitted, adjusted = self._fit_cuts(text, cuts)
        bounds = [0, *fitted, len(text)]
        pieces = (self.tokenize_piece(text[a:b], first=(i == 0)) for i, (a, b) in enumerate(zip(bounds, bounds[1:])))
        return tuple(p for p in pieces if p), adjusted

    def _fit_cuts(self, text: str, cuts: list[int]) -> tuple[list[int], int]:
        """Where to cut ``text`` near the intended ``cuts`` (document edges; strictly increasing, inside the text)
        so that the pieces' ids are exactly the whole text's ids; and how many cuts had to leave their canonical
        place (moved or dropped).

        Canonical place: the start of the whitespace run that ends at the intended cut. Whitespace before a
        document travels with it (``"Context:" | " The ..."``, ``"below." | "\\n\\nThe ..."``) and a document's
        trailing whitespace with the next piece: byte-level BPE and SentencePiece tokenizers do not merge a word
        with the whitespace after it, so the place is safe there, and it depends only on the characters, never on
        the tokenizer's merges (`document_pieces` can predict it). A cut whose pieces still tokenize differently
        from the whole text tries its intended place, then past the whitespace run after it, and is dropped (its
        two pieces merge) when none works. With no cut left the single piece is the whole text, so the loop
        always ends exact.
        """
        placed: list[int] = []
        options: list[list[int]] = []  # per placed cut: its other places, in order of preference
        dropped = 0
        for cut in cuts:
            places = list(dict.fromkeys((_whitespace_start(text, cut), cut, _whitespace_end(text, cut))))
            fits = [p for p in places if 0 < p < len(text) and (not placed or p > placed[-1])]
            if not fits:
                dropped += 1
                continue
            placed.append(fits[0])
            options.append(fits[1:])
        if not placed:
            return [], dropped
        whole = self._whole_ids(text)
        adjusted = [False] * len(placed)
        for _ in range(sum(len(o) for o in options) + len(placed) + 1):
            bounds = [0, *placed, len(text)]
            pieces = [self.tokenize_piece(text[a:b], first=(i == 0)) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
            diverged = _first_divergence(pieces, whole)
            if diverged is None:
                return placed, dropped + sum(adjusted)
            fault = self._faulty_cut(text, bounds, *diverged)
            lo, hi = bounds[fault], bounds[fault + 2]
            while options[fault] and not lo < options[fault][0] < hi:
                options[fault].pop(0)
            if options[fault]:
                placed[fault] = options[fault].pop(0)
                adjusted[fault] = True
            else:
                del placed[fault], options[fault], adjusted[fault]
                dropped += 1
        raise AssertionError("unreachable: with every cut dropped the prompt is one piece")  # pragma: no cover

    def _faulty_cut(self, text: str, bounds: Sequence[int], piece: int, at_start: bool) -> int:
        """The cut to blame for a divergence in piece ``piece`` (``at_start``: at its first token): of the cuts
        around the piece (the one before first when ``at_start``), the first whose two neighbouring pieces tokenize
        differently apart than together; when both are fine alone (an interaction of three pieces), the nearer."""
        around = [k for k in ((piece - 1, piece) if at_start else (piece, piece - 1)) if 0 <= k < len(bounds) - 2]
        for k in around:
            left, right = text[bounds[k]:bounds[k + 1]], text[bounds[k + 1]:bounds[k + 2]]
            first = k == 0
            if (self.tokenize_piece(left, first=first) + self.tokenize_piece(right, first=False)
                    != self.tokenize_piece(left + right, first=first)):
                return k
        return around[0]

    def _whole_ids(self, text: str) -> tuple[int, ...]:
        """The whole text's ids (the BOS rule of a first piece), not kept in the piece cache (it holds the query)."""
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self._bos_id is not None and not (self._bos_text and text.startswith(self._bos_text)):
            ids = (self._bos_id, *ids)
        return ids

    def _tokenize(self, text: str) -> tuple[int, ...]:
        if not text:
            return ()
        with self._lock:
            hit = self._token_cache.get(text)
            if hit is not None:
                self._token_cache.move_to_end(text)
                return hit
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        with self._lock:
            self._token_cache[text] = ids
            if len(self._token_cache) > self._token_cache_size:
                self._token_cache.popitem(last=False)
        return ids


def _first_divergence(pieces: Sequence[Sequence[int]], whole: Sequence[int]) -> tuple[int, bool] | None:
    """Where the pieces' ids first stop being the whole text's ids: (piece index, whether at its first token), or
    None when they are equal."""
    offset = 0
    for i, piece in enumerate(pieces):
        n = len(piece)
        if tuple(piece) != tuple(whole[offset: offset + n]):
            return i, bool(n) and (offset >= len(whole) or piece[0] != whole[offset])
        offset += n
    if offset != len(whole):  # the pieces' ids are a strict prefix of the whole ids
        return len(pieces) - 1, False
    return None


def _whitespace_start(text: str, pos: int) -> int:
    """The start of the whitespace run that ends at ``pos`` (``pos`` itself when none does)."""
    while pos > 0 and text[pos - 1].isspace():
        pos -= 1
    return pos


def _whitespace_end(text: str, pos: int) -> int:
    """The end of the whitespace run that starts at ``pos`` (``pos`` itself when none does)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _locate(text: str, documents: Sequence[str]) -> list[tuple[int, int] | None]:
    """Each document's (start, end) in ``text``, searched in order from a moving cursor; None if not found."""
    out: list[tuple[int, int] | None] = []
    cursor = 0
    for doc in documents:
        if not doc:
            out.append(None)
            continue
        pos = text.find(doc, cursor)
        if pos < 0:
            out.append(None)
            continue
        out.append((pos, pos + len(doc)))
        cursor = pos + len(doc)
    return out
