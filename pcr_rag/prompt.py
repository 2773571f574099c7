"""Prompt layout: render a RAG request and cut it into per-document token segments.

A request's prompt is ``[prefix][doc 1]...[doc k][rest]``. Each document is tokenized on its own, so its tokens
do not depend on its neighbours; the non-document text between two documents (a separator such as ``"\\n\\n"``)
is prepended to the following document's segment, so a document's segment depends only on the document and the
fixed separator before it, never on the query. The cache engine then cuts every segment into chunks on its own
(`pcr_rag.cache.keys.plan_chunks`), and prefill runs one forward step per chunk.

Invariants:
- ``token_ids == concat(segments)``; segments are never empty.
- Segments depend only on the rendered text and the positions of the documents in it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pcr_rag.errors import InvalidRequestError

DEFAULT_INSTRUCTION = "Answer the question using the documents below."
DEFAULT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class SegmentedPrompt:
    """A prompt cut into token segments.

    Attributes:
        text: the rendered prompt text (chat template applied when used).
        segments: token runs; the prompt's tokens are their concatenation.
        documents_found: how many of the given documents were located in the text (the rest were folded into
            the surrounding text and are still computed correctly, only without their own chunk boundaries).
    """

    text: str
    segments: tuple[tuple[int, ...], ...]
    documents_found: int

    @property
    def token_ids(self) -> list[int]:
        return [t for seg in self.segments for t in seg]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.segments)


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

    def predict_prefix(self, documents: Sequence[str], *, system: str | None = None,
                       prefix: str | None = None, separator: str | None = None,
                       flat: bool = False) -> SegmentedPrompt:
        """The segments up to the end of the last document, before the query is known (for `announce`).

        With ``flat=True`` (a framework renders the prompt) it uses the explicit ``prefix``/``separator`` or the
        layout learned from the last flat prompt; otherwise the engine's own RAG layout.
        """
        if flat:
            head = prefix if prefix is not None else self._learned_prefix
            if head is None:  # nothing learned yet: assume the engine's own layout
                head = self._own_prefix_text(system)
            sep = separator if separator is not None else self._learned_separator
            text = head + sep.join(documents)
        else:
            text = self._own_prefix_text(system) + DEFAULT_SEPARATOR.join(documents)
        return self.segment(text, documents)

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
        """Cut ``text`` around the documents (searched in order from a cursor) and tokenize each piece alone."""
        spans = [s for s in _locate(text, documents) if s is not None]
        pieces: list[str] = []
        cursor = 0
        for i, (start, end) in enumerate(spans):
            if i == 0:
                if start > 0:
                    pieces.append(text[:start])
                pieces.append(text[start:end])
            else:
                pieces.append(text[cursor:end])  # separator travels with the following document
            cursor = end
        if cursor < len(text) or not spans:
            pieces.append(text[cursor:])
        segments: list[tuple[int, ...]] = []
        for j, piece in enumerate(pieces):
            ids = self._tokenize(piece)
            if j == 0 and self._bos_id is not None and not (self._bos_text and piece.startswith(self._bos_text)):
                ids = (self._bos_id, *ids)
            if ids:
                segments.append(ids)
        if not segments:
            raise InvalidRequestError("the prompt is empty after tokenization; pass a query or documents")
        return SegmentedPrompt(text=text, segments=tuple(segments), documents_found=len(spans))

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
