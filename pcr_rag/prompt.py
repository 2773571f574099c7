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
- Sharing scopes (`Doc`): ``SegmentedPrompt.private_from`` is the first segment that holds anything private; a
  namespaced request's text is private from the first character that is not provably shared. A segment is shared
  only when every character of it is a shared document located in the order given, the template part (below) or
  whitespace; so the query, the text between documents, unmarked documents and every user or assistant turn are
  private. The template part is the text before the first document that the engine renders without any user or
  assistant text (the chat template, the system turn, the engine's own instruction: ``template_end``, proven by
  rendering the same request with a marker in place of its first non-system turn); it is shared only when
  ``system_prompt_scope`` is "shared", and only in front of a shared document: a namespaced request without one
  is private from its first segment on (its keys are those of before scopes existed, and nothing of it is reused
  across namespaces). A document that is private (marked so, or unmarked in a namespaced request), and in a
  namespaced request any document not located in the order given, makes everything from its first occurrence in
  the text on private (`_private_start`); a document marked private that the text does not hold verbatim cannot be
  placed, so the request is refused (`InvalidRequestError`). In a request without a namespace (the engine-wide
  namespace, the shared pool) only the text from a document marked "private" on is private.
- Per-request state is per namespace (`PromptContext`): pieces are tokenized through a byte-bounded cache keyed by
  namespace and text, and the flat layout is learned per namespace; a request's new entries and layout are kept
  only once the engine accepted it (`PromptBuilder.accept`), so a rejected request leaves nothing behind and one
  tenant's texts never make another tenant's requests faster.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pcr_rag.errors import InvalidRequestError, PromptTooLongError

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTION = "Answer the question using the documents below."
DEFAULT_SEPARATOR = "\n\n"
#: Stands for the request text when a template is rendered to find where that text starts (`template_end`).
_MARKER = "\x00PCR_DOCS\x00"
#: Chat roles whose turns are system text (shared when ``system_prompt_scope`` is "shared"); every other turn is
#: user or assistant text, never shared across namespaces.
SYSTEM_ROLES = frozenset({"system", "developer"})
_PROBE_DOCUMENT = "a"  # a one-letter document: how a layout's cuts fit around text that starts and ends a word
SCOPES = ("shared", "private")
DEFAULT_TOKEN_CACHE_BYTES = 64 * 1024 * 1024
#: Bytes an entry of the token cache costs besides its text and ids (the LRU's link, the key tuple); an upper
#: estimate, so the budget bounds the memory held.
_ENTRY_OVERHEAD = 200
_INT_BYTES = 32  # a token id above 256 is its own int object (28 bytes, in a 32-byte block)


@dataclass(frozen=True)
class Doc:
    """A retrieved document and its sharing scope; accepted wherever a document string is.

    ``scope``: "shared" (a public corpus document: its KV may be reused by requests of every namespace, as long as
    everything before it is shared too), "private" (its KV, and everything after it in a prompt, is reused only
    within the request's namespace), or None (the request's default: private in a request with a namespace,
    shared in one without, i.e. today's behaviour either way)."""

    text: str
    scope: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise InvalidRequestError(f"Doc.text must be a str, got {type(self.text).__name__}")
        _check_scope(self.scope, "Doc.scope")


def _check_scope(scope: object, what: str) -> None:
    if scope is not None and scope not in SCOPES:
        raise InvalidRequestError(f"{what} must be 'shared', 'private' or None, got {scope!r}")


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
        private_from: the first segment that holds anything private (see the module docstring); the chunk plan
            switches to the tenant's root there (`pcr_rag.cache.keys.plan_chunks`). None: every segment is shared.
        document_segments: the segments that hold exactly one document and the text before it back to the
            previous document's end (its lead or separator), in order: what blend mode reuses in any position.
    """

    text: str
    segments: tuple[tuple[int, ...], ...]
    documents_found: int
    cuts_adjusted: int = 0
    private_from: int | None = None
    document_segments: tuple[int, ...] = ()

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
    document (what `PromptBuilder.predict_prefix` segments and `pcr_rag.reorder` walks). ``template_chars``: how
    many leading characters of ``head`` are template or system text (`SegmentedPrompt` sharing scopes); the rest
    of the head is request text (a user turn, a raw prompt), private in a namespaced request."""

    head: str
    separator: str
    template_chars: int = 0

    @property
    def head_is_template(self) -> bool:
        """Whether the head holds no request text (past ``template_chars`` only whitespace, if anything)."""
        rest = self.head[self.template_chars:]
        return not rest or rest.isspace()


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


def _document_segments(text: str, bounds: Sequence[tuple[Sequence[int], tuple[int, int]]],
                       spans: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Indexes of the segments (``bounds``: ids and character range each) that hold exactly one located document
    (``spans``, in order): a segment that starts at or before the document, after the previous document's start,
    and ends where the document ends or inside the whitespace it ends with (cuts go before trailing whitespace)."""
    found: list[int] = []
    for j, (start, end) in enumerate(spans):
        floor = spans[j - 1][0] + 1 if j else 0
        for i, (_, (a, b)) in enumerate(bounds):
            if floor <= a <= start < b <= end and not text[b:end].strip():
                found.append(i)
                break
    return tuple(found)


def split_documents(documents: object, scopes: object = None) -> tuple[tuple[str, ...], tuple[str | None, ...]]:
    """(texts, scopes) of a request's documents: each one a str or a `Doc`; ``scopes`` (optional) a parallel
    sequence of "shared" / "private" / None. A single string is rejected, not split into characters; a `Doc`
    whose scope disagrees with its ``scopes`` entry is rejected."""
    if documents is None:
        documents = ()
    if isinstance(documents, (str, bytes, Doc)):
        raise InvalidRequestError("documents must be a sequence of strings, not a single string; wrap it: [doc]")
    try:
        docs = tuple(documents)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequestError(
            f"documents must be a sequence of strings, got {type(documents).__name__}"
        ) from None
    given: tuple[object, ...] = ()
    if scopes is not None:
        if isinstance(scopes, (str, bytes)):
            raise InvalidRequestError("scopes must be a sequence with one scope per document, not a single string")
        try:
            given = tuple(scopes)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidRequestError(f"scopes must be a sequence, got {type(scopes).__name__}") from None
        if len(given) != len(docs):
            raise InvalidRequestError(f"scopes has {len(given)} entries for {len(docs)} documents; pass one scope "
                                      f"per document ('shared', 'private' or None)")
    texts: list[str] = []
    out: list[str | None] = []
    for i, doc in enumerate(docs):
        scope = given[i] if given else None
        _check_scope(scope, f"scopes[{i}]")
        if isinstance(doc, Doc):
            if scope is not None and doc.scope is not None and scope != doc.scope:
                raise InvalidRequestError(f"document #{i} is a Doc with scope {doc.scope!r} but scopes[{i}] is "
                                          f"{scope!r}; give one of them")
            texts.append(doc.text)
            out.append(doc.scope if doc.scope is not None else scope)  # type: ignore[arg-type]
        elif isinstance(doc, str):
            texts.append(doc)
            out.append(scope)  # type: ignore[arg-type]
        else:
            raise InvalidRequestError(
                f"document #{i} is a {type(doc).__name__}, not a str or Doc; pass the document text "
                f"(e.g. node.get_content() or doc.page_content)"
            )
    return tuple(texts), tuple(out)


def validate_documents(documents: object) -> tuple[str, ...]:
    """The texts of a request's documents (each a str or a `Doc`; see `split_documents`)."""
    return split_documents(documents)[0]


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of input text one token can stand for, or None when it cannot be bounded.

    The longest token string of the vocabulary (added tokens included) bounds it when the tokenizer never shrinks
    text before matching tokens: no normalizer, or only ones that keep or grow every character (replacing a
    string by one at least as long, prepending, lowercasing, NFD); pre-tokenizers that keep every character
    (byte-level, metaspace, splits that do not remove); a BPE model with no fused unknown token. A byte-level
    token string has one character per byte, so it is never shorter than the text it stands for. Anything else
    (NFC/NFKC, strip accents, whitespace-removing pre-tokenizers, slow tokenizers) gets None: no bound, rather
    than one that could reject a prompt that fits."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - an unusual tokenizer: no bound
        log.debug("max_token_chars: the tokenizer cannot be inspected; no character bound", exc_info=True)
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and model.get("fuse_unk")
                                      and not model.get("byte_fallback")):
        return None
    if not (_keeps_characters(spec.get("normalizer"), _SAFE_NORMALIZERS)
            and _keeps_characters(spec.get("pre_tokenizer"), _SAFE_PRE_TOKENIZERS)):
        return None
    longest = max((len(token) for token in vocab), default=0)
    return longest or None


_SAFE_NORMALIZERS = frozenset({"Prepend", "Replace", "Lowercase", "NFD"})
_SAFE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})


def _keeps_characters(part: Any, safe: frozenset[str]) -> bool:
    """Whether a tokenizer's normalizer or pre-tokenizer (its JSON spec) never drops or merges input characters."""
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        inner = part.get("normalizers") or part.get("pretokenizers") or []
        return all(_keeps_characters(p, safe) for p in inner)
    if kind not in safe:
        return False
    if kind == "Replace":
        pattern = part.get("pattern") or {}
        return "String" in pattern and len(part.get("content", "")) >= len(pattern["String"])
    if kind == "Split":
        return part.get("behavior") != "Removed"
    return True


@dataclass(eq=False)
class PromptContext:
    """One request's view of a `PromptBuilder`: its namespace and its prompt bound.

    ``namespace``: the tenant ("" = the engine-wide namespace); pieces are looked up in that namespace's part of
    the token cache only, and the flat layout learned is that namespace's. ``max_prompt_tokens`` (None = no
    bound): the prompt tokens the request may have; a rendered text longer than
    `PromptBuilder.max_prompt_chars` of it raises `PromptTooLongError` before it is tokenized
    (``max_new_tokens``, ``max_model_len`` and ``limit`` word the error). New token-cache entries and the layout
    a request teaches wait in the context until `PromptBuilder.accept` keeps them."""

    namespace: str = ""
    max_prompt_tokens: int | None = None
    max_new_tokens: int = 0
    max_model_len: int = 0
    limit: str = "the model's context window"
    pending: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)
    layout: DocumentLayout | None = None


class _ByteLRU:
    """An LRU of values whose cost in bytes the caller states; holds at most ``max_bytes`` (an entry larger than
    that is not kept). Not thread-safe (the builder's lock guards it)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()

    def get(self, key: Hashable) -> Any:
        hit = self._items.get(key)
        if hit is None:
            return None
        self._items.move_to_end(key)
        return hit[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        if nbytes > self.max_bytes:
            return
        self._items[key] = (value, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, (_, freed) = self._items.popitem(last=False)
            self.bytes -= freed

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


def _tokens_bytes(text: str, ids: tuple[int, ...]) -> int:
    return sys.getsizeof(text) + sys.getsizeof(ids) + _INT_BYTES * len(ids) + _ENTRY_OVERHEAD


def _layout_bytes(layout: DocumentLayout) -> int:
    return sys.getsizeof(layout.head) + sys.getsizeof(layout.separator) + _ENTRY_OVERHEAD


class ChatTemplateMissingError(InvalidRequestError):
    """A chat had to be rendered, but the model has no chat template and plain-text prompts were not asked for."""


#: ``apply_chat_template`` arguments the engine sets itself; ``chat_template_kwargs`` may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
    "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "chat_template", "tools", "documents"})


def check_template_kwargs(kwargs: object, what: str = "chat_template_kwargs") -> dict[str, Any]:
    """``kwargs`` as a dict of extra variables for the chat template (e.g. ``{"enable_thinking": False}``).

    Raises:
        InvalidRequestError: not a mapping with str keys, or a key the engine sets itself
            (`RESERVED_TEMPLATE_KWARGS`), or a value that is not JSON-like (str, number, bool, None, list, dict).
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequestError(f"{what} must be a dict with str keys, got {type(kwargs).__name__}")
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequestError(f"{what} may not set {reserved}: the engine sets them itself")
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{what} values must be JSON-like (str, number, bool, None, list, dict): "
                                  f"{exc}") from exc
    return dict(kwargs)


class PromptBuilder:
    """Renders requests with the tokenizer's chat template and segments them.

    A model without a chat template cannot render a chat (`RagPrompt`, `ChatPrompt`, `FlatPrompt(chat=True)`):
    that raises `ChatTemplateMissingError`, naming the ``chat_template`` option, unless ``plain_text`` is set
    (``EngineConfig.chat_template="plain"``): then a chat becomes plain text (``"{system}\n\n{user}\n"`` for one
    turn, ``"role: content"`` lines ending in ``"assistant:"`` for a conversation). A raw `FlatPrompt(chat=False)`
    needs no template. ``chat_template_kwargs`` are extra template variables for every chat (a request's own add
    to them and win).

    Thread-safe. Keeps a byte-bounded LRU (``token_cache_bytes``, counting texts, ids and bookkeeping) of
    tokenized pieces per namespace, since popular documents come back again and again, and the flat layout each
    namespace's prompts taught it. ``system_prompt_scope`` ("shared" or "private") is the scope of a namespaced
    request's head, the text before its first document (system prompt, instruction, template).
    """

    def __init__(self, tokenizer, *, instruction: str = DEFAULT_INSTRUCTION,
                 token_cache_bytes: int = DEFAULT_TOKEN_CACHE_BYTES, system_prompt_scope: str = "shared",
                 plain_text: bool = False, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        if system_prompt_scope not in SCOPES:
            raise ValueError(f"system_prompt_scope must be 'shared' or 'private', got {system_prompt_scope!r}")
        if isinstance(token_cache_bytes, bool) or not isinstance(token_cache_bytes, int) or token_cache_bytes < 0:
            raise ValueError(f"token_cache_bytes must be an int >= 0, got {token_cache_bytes!r}")
        self.tokenizer = tokenizer
        self.instruction = instruction
        self.system_prompt_scope = system_prompt_scope
        self._has_template = not plain_text and bool(getattr(tokenizer, "chat_template", None))
        self.plain_text = plain_text
        self.template_kwargs = check_template_kwargs(chat_template_kwargs)
        self._bos_id = self._leading_bos(tokenizer)
        self._bos_text = tokenizer.bos_token if getattr(tokenizer, "bos_token", None) else None
        self._lock = threading.Lock()
        # ("tok", namespace, text) -> ids; ("layout", namespace) -> the learned flat DocumentLayout;
        # ("pieces", namespace, layout) -> DocumentPieces: one byte budget for all of them
        self._cache = _ByteLRU(token_cache_bytes)
        self._chars_per_token: int | None | bool = False  # False: not computed yet

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

    # ----------------------------------------------------------------------------------------- bounds, cache
    @property
    def chars_per_token(self) -> int | None:
        """`max_token_chars` of the tokenizer (computed once): the most input characters one token covers."""
        if self._chars_per_token is False:
            self._chars_per_token = max_token_chars(self.tokenizer)
        return self._chars_per_token  # type: ignore[return-value]

    def max_prompt_chars(self, max_tokens: int) -> int | None:
        """The longest text (characters) that can tokenize to at most ``max_tokens`` tokens: ``max_tokens`` times
        the longest token (`chars_per_token`); None when the tokenizer gives no such bound. A longer text cannot
        fit, so it is rejected before tokenizing (the engine's request path; the server may call it too); a text
        within it may still be too long, which its token count then tells."""
        per_token = self.chars_per_token
        return None if per_token is None else max(0, max_tokens) * per_token

    def check_chars(self, text: str, context: PromptContext | None) -> None:
        """Raise `PromptTooLongError` when ``text`` is longer than ``context``'s prompt bound allows
        (`max_prompt_chars`), before anything tokenizes it."""
        if context is None or context.max_prompt_tokens is None:
            return
        bound = self.max_prompt_chars(context.max_prompt_tokens)
        if bound is not None and len(text) > bound:
            per_token = self.chars_per_token or 1
            at_least = -(-len(text) // per_token)
            error = PromptTooLongError(at_least, context.max_new_tokens, context.max_model_len, context.limit)
            # the count is a lower bound (no token covers more than per_token characters): say so
            error.args = (str(error).replace(
                f"prompt has {at_least} tokens",
                f"prompt has {len(text)} characters, so at least {at_least} tokens (no token of this tokenizer "
                f"covers more than {per_token} characters),", 1),)
            raise error

    def accept(self, context: PromptContext) -> None:
        """Keep what an accepted request's `PromptContext` gathered: its new token-cache entries and the flat
        layout it taught, in its namespace. A rejected request's context is dropped instead."""
        with self._lock:
            for text, ids in context.pending.items():
                self._cache.put(("tok", context.namespace, text), ids, _tokens_bytes(text, ids))
            if context.layout is not None:
                self._cache.put(("layout", context.namespace), context.layout, _layout_bytes(context.layout))
        context.pending.clear()
        context.layout = None

    @property
    def token_cache_bytes(self) -> int:
        """Bytes the cache holds now (texts, ids, layouts, bookkeeping; at most the budget)."""
        with self._lock:
            return self._cache.bytes

    def is_cached(self, text: str, namespace: str = "") -> bool:
        """Whether ``text``'s ids are in ``namespace``'s part of the token cache."""
        with self._lock:
            return ("tok", namespace, text) in self._cache

    # ----------------------------------------------------------------------------------------------- rendering
    def _check_template(self) -> None:
        if not self._has_template and not self.plain_text:
            raise ChatTemplateMissingError(
                "the model has no chat template, so a chat cannot be rendered; pass one with "
                "chat_template=<Jinja text or .jinja file> (EngineConfig, `pcr-rag serve --chat-template`), or "
                "chat_template='plain' for plain-text prompts (base models); a raw prompt (FlatPrompt(chat=False), "
                "the completions API) needs no template")

    def render_chat(self, user: str, system: str | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        """One user turn (plus optional system turn), with the generation prompt appended."""
        self._check_template()
        if not self._has_template:
            head = f"{system}\n\n" if system else ""
            return f"{head}{user}\n"
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self.render_messages(messages, template_kwargs)

    def render_messages(self, messages: Sequence[dict[str, str]],
                        template_kwargs: dict[str, Any] | None = None) -> str:
        """A whole conversation rendered with the chat template (generation prompt appended), the builder's
        ``chat_template_kwargs`` updated by ``template_kwargs`` passed to it as variables."""
        self._check_template()
        if not self._has_template:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + "\nassistant:"
        extra = {**self.template_kwargs, **check_template_kwargs(template_kwargs)}
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                                      **extra)
        except Exception as exc:  # noqa: BLE001 - the template refused this conversation or these variables
            raise InvalidRequestError(
                f"the chat template cannot render this conversation: {type(exc).__name__}: {exc} (check the roles "
                f"and their order, and chat_template_kwargs: {sorted(extra)})") from exc
        if not isinstance(text, str):  # some tokenizers return a list for a single conversation
            text = text[0]
        return text

    def rag_user_text(self, query: str, documents: Sequence[str | Doc], system_tail: str | None = None) -> str:
        """The user turn of a RAG prompt: the instruction, the documents, ``system_tail`` (when given and not
        blank), the question. Without documents: the tail (if any) and the question."""
        tail = f"{system_tail}{DEFAULT_SEPARATOR}" if system_tail and system_tail.strip() else ""
        if not documents:
            return f"{tail}{query}"
        body = DEFAULT_SEPARATOR.join(validate_documents(documents))
        return f"{self.instruction}{DEFAULT_SEPARATOR}{body}{DEFAULT_SEPARATOR}{tail}Question: {query}"

    # ---------------------------------------------------------------------------------------------- segmenting
    def build_rag(self, query: str, documents: Sequence[str | Doc], system: str | None = None, *,
                  context: PromptContext | None = None, system_tail: str | None = None) -> SegmentedPrompt:
        """[system + instruction][doc 1]..[doc k][system_tail][question], rendered as one user turn (the tail, a
        request's per-request instructions, is computed with the question: see `RagPrompt`)."""
        text = self.render_chat(self.rag_user_text(query, documents, system_tail), system)
        template_end = self.rag_template_end(text, system) if documents else 0
        return self.segment(text, documents, context=context, template_end=template_end)

    def build_flat(self, prompt: str, documents: Sequence[str | Doc], *, chat: bool = True,
                   system: str | None = None, context: PromptContext | None = None) -> SegmentedPrompt:
        """A prompt that contains the documents verbatim, in order (e.g. rendered by a framework's template)."""
        text = self.render_chat(prompt, system) if chat else prompt
        template_end = self.user_template_end(text, system) if chat and documents else 0
        seg = self.segment(text, documents, context=context, template_end=template_end)
        if seg.documents_found:
            self._learn_layout(text, validate_documents(documents), context, template_end)
        return seg

    def build_chat(self, messages: Sequence[dict[str, str]], documents: Sequence[str | Doc], *,
                   context: PromptContext | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> SegmentedPrompt:
        """A conversation rendered with the chat template (``template_kwargs``: the request's own template
        variables); the documents found in it get their own runs (and teach the builder the framework's layout,
        as `build_flat`)."""
        text = self.render_messages(messages, template_kwargs)
        template_end = self.chat_template_end(text, messages, template_kwargs) if documents else 0
        seg = self.segment(text, documents, context=context, template_end=template_end)
        if seg.documents_found:
            self._learn_layout(text, validate_documents(documents), context, template_end)
        return seg

    def predict_prefix(self, documents: Sequence[str | Doc], *, system: str | None = None,
                       prefix: str | None = None, separator: str | None = None,
                       flat: bool = False, context: PromptContext | None = None) -> SegmentedPrompt:
        """The segments up to the end of the last document, before the query is known (for `announce`).

        With ``flat=True`` (a framework renders the prompt) it uses the explicit ``prefix``/``separator`` or the
        layout learned from the last flat prompt of ``context``'s namespace; otherwise the engine's own RAG
        layout (see `layout`).
        """
        namespace = context.namespace if context is not None else ""
        lay = self.layout(system=system, prefix=prefix, separator=separator, flat=flat, namespace=namespace)
        texts, scopes = split_documents(documents)
        # the last document's trailing whitespace goes with the text after it (the canonical cut), unknown here
        docs = [*texts[:-1], texts[-1].rstrip()] if texts else []
        return self.segment(lay.head + lay.separator.join(docs), [Doc(t, sc) for t, sc in zip(docs, scopes)],
                            context=context, template_end=lay.template_chars)

    def layout(self, *, system: str | None = None, prefix: str | None = None, separator: str | None = None,
               flat: bool = False, namespace: str = "") -> DocumentLayout:
        """The document layout a request will have: with ``flat=True`` the explicit ``prefix``/``separator`` or
        the layout learned from ``namespace``'s last flat prompt that held documents (the engine's own head until
        one was seen); otherwise the engine's own RAG layout (`build_rag`)."""
        if not flat:
            own = self._own_prefix_text(system)
            return DocumentLayout(own, DEFAULT_SEPARATOR, len(own))
        with self._lock:
            learned = self._cache.get(("layout", namespace))
        learned_sep = learned.separator if learned is not None else DEFAULT_SEPARATOR
        sep = separator if separator is not None else learned_sep
        if prefix is not None:  # the caller's text: request text, as far as anything can tell
            return DocumentLayout(prefix, sep)
        if learned is not None:
            return DocumentLayout(learned.head, sep, learned.template_chars)
        own = self._own_prefix_text(system)  # nothing learned yet: assume the engine's own layout
        return DocumentLayout(own, sep, len(own))

    def document_pieces(self, layout: DocumentLayout, *, context: PromptContext | None = None) -> DocumentPieces:
        """How `segment` cuts documents in ``layout``, learned once per layout (and namespace) by segmenting a
        probe (three one-letter documents). Exact for documents that start and end with non-whitespace (the cut
        fitting looks only at the characters around a cut); for others the pieces are a prediction
        (`pcr_rag.reorder` uses them to walk the cache; the request itself is always segmented from its real
        text)."""
        key = ("pieces", context.namespace if context is not None else "", layout)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                return hit
        pieces = self._probe_pieces(layout, context)
        with self._lock:
            self._cache.put(key, pieces, _layout_bytes(layout) + sys.getsizeof(pieces.head))
        return pieces

    def _probe_pieces(self, layout: DocumentLayout, context: PromptContext | None) -> DocumentPieces:
        head, sep = layout.head, layout.separator
        naive = DocumentPieces(head, "", sep, "")
        probe = _PROBE_DOCUMENT
        text = head + sep.join((probe,) * 3)
        starts = [len(head) + i * (len(probe) + len(sep)) for i in range(3)]
        ends = [start + len(probe) for start in starts]
        cuts = ([starts[0]] if starts[0] > 0 else []) + ends[:2]
        fitted, _ = self._fit_cuts(text, cuts, context)
        if len(fitted) != len(cuts):  # a cut was dropped: documents get no runs of their own in this layout
            return naive
        first_cut = fitted[0] if starts[0] > 0 else 0
        trails = {c - e for c, e in zip(fitted[-2:], ends)}
        if len(trails) != 1 or first_cut > starts[0] or min(trails) < 0:
            return naive
        trail = sep[: trails.pop()]
        return DocumentPieces(head[:first_cut], head[first_cut:], sep[len(trail):], trail)

    def learned_flat_layout(self, namespace: str = "") -> bool:
        """True once a flat prompt with documents taught the builder a framework's layout in ``namespace``."""
        with self._lock:
            return ("layout", namespace) in self._cache

    def _own_prefix_text(self, system: str | None) -> str:
        rendered = self.render_chat(self.rag_user_text("q", [_MARKER]), system)
        return rendered[: rendered.index(_MARKER)]

    def _learn_layout(self, text: str, documents: Sequence[str], context: PromptContext | None,
                      template_end: int = 0) -> None:
        spans = _locate(text, documents)
        found = [s for s in spans if s is not None]
        if not found:
            return
        namespace = context.namespace if context is not None else ""
        prefix = text[: found[0][0]]
        if len(found) > 1:
            sep = text[found[0][1]: found[1][0]]
        else:
            with self._lock:
                known = self._cache.get(("layout", namespace))
            sep = known.separator if known is not None else DEFAULT_SEPARATOR
        layout = DocumentLayout(prefix, sep, min(template_end, len(prefix)))
        if context is not None:
            context.layout = layout  # kept by `accept`
            return
        with self._lock:
            self._cache.put(("layout", namespace), layout, _layout_bytes(layout))

    @staticmethod
    def _marker_end(text: str, rendered: str) -> int:
        """Where ``rendered`` (the request rendered with `_MARKER` in place of its first request text) puts the
        marker, when ``text`` starts with everything before it (that part then depends on no request text); 0
        otherwise (nothing is proven template)."""
        at = rendered.find(_MARKER)
        return at if at > 0 and text.startswith(rendered[:at]) else 0

    def rag_template_end(self, text: str, system: str | None) -> int:
        """The template part of a `build_rag` text: everything before the first document when it is the engine's
        own rendering of the system turn and instruction (`_own_prefix_text`), else 0."""
        own = self._own_prefix_text(system)
        return len(own) if text.startswith(own) else 0

    def user_template_end(self, text: str, system: str | None) -> int:
        """The template part of ``render_chat(user, system)``: the text before the user turn's content."""
        return self._marker_end(text, self.render_chat(_MARKER, system))

    def chat_template_end(self, text: str, messages: Sequence[dict[str, Any]],
                          template_kwargs: dict[str, Any] | None = None) -> int:
        """The template part of ``render_messages(messages)``: the text before the first non-system turn's content
        (the leading system turns and the template around them), proven by rendering the leading system turns and a
        marker turn of the next turn's role; 0 when the template renders that differently (it then depends on later
        turns, or refuses the probe). A conversation of system turns only is all template."""
        first = next((i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES), None)
        if first is None:
            return len(text)
        probe = [*(dict(m) for m in messages[:first]), {"role": messages[first]["role"], "content": _MARKER}]
        try:
            rendered = self.render_messages(probe, template_kwargs)
        except InvalidRequestError:
            return 0
        return self._marker_end(text, rendered)

    def segment(self, text: str, documents: Sequence[str | Doc], *,
                context: PromptContext | None = None, template_end: int = 0) -> SegmentedPrompt:
        """Cut ``text`` around the documents (searched in order from a cursor): ``[prefix][doc 1][sep + doc 2]
        ...[rest]``. Each piece is tokenized on its own; cuts the tokenizer would merge across are moved or
        dropped until the pieces' ids are exactly the whole text's ids (see the module docstring).

        ``context`` (None: the engine-wide namespace, no bound, cache entries kept at once): its namespace decides
        the sharing scopes (``private_from``) and the token cache used; a text over its bound raises
        `PromptTooLongError` before anything is tokenized. ``template_end``: how many leading characters are
        template or system text (the `*_template_end` methods; 0: none, as for a raw prompt), the most of the text
        before the first document a namespaced request may share.

        Raises:
            InvalidRequestError: a document marked private does not occur in ``text`` (where the private part
                starts cannot be decided).
        """
        self.check_chars(text, context)
        texts, scopes = split_documents(documents)
        namespace = context.namespace if context is not None else ""
        all_spans = _locate(text, texts)
        private_start = _private_start(text, texts, scopes, all_spans, bool(namespace))
        located = [(span, scope) for span, scope in zip(all_spans, scopes) if span is not None]
        spans = [span for span, _ in located]
        cuts: list[int] = []
        for i, (start, end) in enumerate(spans):
            # doc 1 starts a piece; every document ends one (the next piece starts with the separator)
            for c in ((start, end) if i == 0 else (end,)):
                if 0 < c < len(text) and (not cuts or c > cuts[-1]):
                    cuts.append(c)
        bounds, adjusted = self._fit(text, cuts, context)
        segments = tuple(ids for ids, _ in bounds)
        if not segments:
            raise InvalidRequestError("the prompt is empty after tokenization; pass a query or documents")
        if adjusted:
            log.debug("segment: %d of %d document cuts adjusted to keep the whole prompt's tokenization",
                      adjusted, len(cuts))
        private = self._private_test(text, located, bool(namespace), template_end, private_start)
        private_from = next((i for i, (_, (a, b)) in enumerate(bounds) if private(a, b)), None)
        if namespace and private_from:
            # the head is shared only in front of a shared document: alone it would be the one thing a request
            # without shared documents shares, so such a request keeps its own chain (and its keys of before)
            shared_docs = [span for span, scope in located if scope == "shared"]
            end = bounds[private_from - 1][1][1]
            if not any(start < end for start, _ in shared_docs):
                private_from = 0
        return SegmentedPrompt(text=text, segments=segments, documents_found=len(spans), cuts_adjusted=adjusted,
                               private_from=private_from, document_segments=_document_segments(text, bounds, spans))

    def _private_test(self, text: str, located: Sequence[tuple[tuple[int, int], str | None]], namespaced: bool,
                      template_end: int, private_start: int | None):
        """``private(a, b)``: whether the text span [a, b) of a segment holds anything private (module docstring):
        anything at or after ``private_start`` (`_private_start`), and in a namespaced request any character that
        is not whitespace, a shared document located in order, or template text before the first document."""
        if not namespaced:
            return lambda a, b: private_start is not None and b > private_start
        shared = [span for span, scope in located if scope == "shared"]
        head_end = min(template_end, located[0][0][0]) if located else 0
        if head_end > 0 and self.system_prompt_scope == "shared":
            shared.insert(0, (0, head_end))

        def private(a: int, b: int) -> bool:
            if private_start is not None and b > private_start:
                return True
            pos = a
            for s, e in shared:  # in text order: the head, then the documents
                if e <= pos or s >= b:
                    continue
                if s > pos and not text[pos:s].isspace():
                    return True
                pos = max(pos, e)
                if pos >= b:
                    return False
            return pos < b and not text[pos:b].isspace()

        return private

    def tokenize_piece(self, text: str, *, first: bool, context: PromptContext | None = None) -> tuple[int, ...]:
        """The ids of one piece of a prompt, tokenized on its own (cached in ``context``'s namespace); the prompt's
        first piece gets the BOS the tokenizer adds by default unless it already starts with the BOS text."""
        ids = self._tokenize(text, context)
        if first and self._bos_id is not None and not (self._bos_text and text.startswith(self._bos_text)):
            ids = (self._bos_id, *ids)
        return ids

    def _fit(self, text: str, cuts: list[int], context: PromptContext | None
             ) -> tuple[list[tuple[tuple[int, ...], tuple[int, int]]], int]:
        """The non-empty segments of ``text`` cut at ``cuts`` (strictly increasing, inside the text) whose
        concatenation is the whole text's ids, each with its span [start, end) of the text, and how many cuts had
        to move or go (see `_fit_cuts`)."""
        fitted, adjusted = self._fit_cuts(text, cuts, context)
        bounds = [0, *fitted, len(text)]
        pieces = [(self.tokenize_piece(text[a:b], first=(i == 0), context=context), (a, b))
                  for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        return [(ids, span) for ids, span in pieces if ids], adjusted

    def _fit_cuts(self, text: str, cuts: list[int], context: PromptContext | None) -> tuple[list[int], int]:
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
            pieces = [self.tokenize_piece(text[a:b], first=(i == 0), context=context)
                      for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
            diverged = _first_divergence(pieces, whole)
            if diverged is None:
                return placed, dropped + sum(adjusted)
            fault = self._faulty_cut(text, bounds, *diverged, context)
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

    def _faulty_cut(self, text: str, bounds: Sequence[int], piece: int, at_start: bool,
                    context: PromptContext | None) -> int:
        """The cut to blame for a divergence in piece ``piece`` (``at_start``: at its first token): of the cuts
        around the piece (the one before first when ``at_start``), the first whose two neighbouring pieces tokenize
        differently apart than together; when both are fine alone (an interaction of three pieces), the nearer."""
        around = [k for k in ((piece - 1, piece) if at_start else (piece, piece - 1)) if 0 <= k < len(bounds) - 2]
        for k in around:
            left, right = text[bounds[k]:bounds[k + 1]], text[bounds[k + 1]:bounds[k + 2]]
            first = k == 0
            if (self.tokenize_piece(left, first=first, context=context)
                    + self.tokenize_piece(right, first=False, context=context)
                    != self.tokenize_piece(left + right, first=first, context=context)):
                return k
        return around[0]

    def _whole_ids(self, text: str) -> tuple[int, ...]:
        """The whole text's ids (the BOS rule of a first piece), not kept in the piece cache (it holds the query)."""
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self._bos_id is not None and not (self._bos_text and text.startswith(self._bos_text)):
            ids = (self._bos_id, *ids)
        return ids

    def _tokenize(self, text: str, context: PromptContext | None) -> tuple[int, ...]:
        """``text``'s ids from the cache of ``context``'s namespace, else tokenized; a new entry waits in the
        context until the request is accepted (`accept`), or is kept at once without a context."""
        if not text:
            return ()
        namespace = context.namespace if context is not None else ""
        if context is not None:
            hit = context.pending.get(text)
            if hit is not None:
                return hit
        with self._lock:
            hit = self._cache.get(("tok", namespace, text))
        if hit is not None:
            return hit
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if context is not None:
            context.pending[text] = ids
        else:
            with self._lock:
                self._cache.put(("tok", namespace, text), ids, _tokens_bytes(text, ids))
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


def _private_start(text: str, texts: Sequence[str], scopes: Sequence[str | None],
                   spans: Sequence[tuple[int, int] | None], namespaced: bool) -> int | None:
    """The first character from which a document makes the rest of ``text`` private, or None: the first occurrence
    (anywhere, not only after the documents before it) of every private document (marked "private", or unmarked in
    a namespaced request) and, in a namespaced request, of every document not located in the order given
    (``spans[i]`` None). A document that does not occur at all holds nothing to place, except one marked private:
    its text may be in the prompt in another form, so the request is refused rather than shared by a guess."""
    start: int | None = None
    for i, (doc, scope, span) in enumerate(zip(texts, scopes, spans)):
        private = scope == "private" or (namespaced and scope is None)
        if not doc or not (private or (namespaced and span is None)):
            continue
        at = text.find(doc)
        if at < 0:
            if scope == "private":
                raise InvalidRequestError(
                    f"document #{i} is marked private but does not occur verbatim in the prompt, so where the "
                    f"private part starts cannot be decided; pass the document's text exactly as the prompt holds "
                    f"it (or drop it from documents)")
            continue
        start = at if start is None else min(start, at)
    return start


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
