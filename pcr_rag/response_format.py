"""What a request's output must match: `ResponseFormat` (frozen, hashable), validated before it travels.

A format is a JSON schema, any JSON object, a regex or a grammar: Lark (llguidance's dialect, which also takes
``%json {schema}`` rules; told by its ``start:`` rule) or GBNF (llama.cpp's, the EBNF vLLM documents for
``structured_outputs.grammar``; told by ``root ::=``), which llguidance's own ``any_to_lark`` converts to Lark.
`ResponseFormat.of` accepts the OpenAI-style dicts (``{"type": "json_schema", "json_schema": {"schema": ...}}``,
``{"type": "json_object"}``), ``{"type": "regex", "regex": ...}``, ``{"type": "grammar", "grammar": ...}``, a bare
JSON-schema dict or a Pydantic model class. Construction validates the grammar with the library (no tokenizer
needed), so a schema it rejects raises `InvalidRequestError` before any compute. A base module: the engine, the
server and the thin HTTP client share it; compiling against a vocabulary and matching are `pcr_rag.model.grammar`'s.

Library: llguidance (Rust, no Python dependencies). Against xgrammar it compiles faster, its per-token mask is a
negligible share of a decode step for both, and its wheel is smaller with no dependencies, where xgrammar pulls
apache-tvm-ffi and triton (which does nothing on a CPU) (see
docs/measurements-history.md#figures-moved-from-code-comments). llguidance also rejects what it cannot enforce
(``uniqueItems``, look-around in a
``pattern``) where xgrammar ignores it and lets invalid output through.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from pcr_rag.errors import InvalidRequestError

log = logging.getLogger(__name__)

__all__ = ["FormatKind", "GrammarError", "ResponseFormat"]

FormatKind = Literal["json_schema", "json_object", "regex", "grammar"]
FORMAT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar")

# JSON is generated in the layout models see most (Python's json.dumps default): ", " and ": ", no other
# whitespace, so a small model cannot drift into endless newlines between tokens.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
VALIDATED_GRAMMARS = 1024  # digests of valid grammars remembered process-wide (32 bytes each)


class GrammarError(InvalidRequestError):
    """A response format the grammar library rejects (bad schema, unsupported keyword, bad regex), or a token the
    grammar did not allow. Raised before any compute for the former."""


# ---------------------------------------------------------------------------------------------------- formats
@dataclass(frozen=True)
class ResponseFormat:
    """What the output must match. ``source``: the JSON schema as JSON text (property order kept), the regex or
    the Lark grammar; "" for ``json_object``. Validated on construction (`GrammarError`)."""

    kind: FormatKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in FORMAT_KINDS:
            raise InvalidRequestError(f"response format kind must be one of {FORMAT_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise InvalidRequestError(f"response format source must be a str, got {type(self.source).__name__}")
        if self.kind != "json_object" and not self.source.strip():
            raise InvalidRequestError(f"a {self.kind} response format needs a non-empty source")
        _check_grammar(self.grammar)

    @property
    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this format."""
        return _grammar_text(self.kind, self.source)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema of a json_schema format (``{"type": "object"}`` for json_object), else None."""
        if self.kind == "json_schema":
            return json.loads(self.source)
        return {"type": "object"} if self.kind == "json_object" else None

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``response_format`` object of this format (vLLM's ``regex`` / ``grammar`` types for the
        others): what a client sends so a server builds the same grammar. ``ResponseFormat.of`` of it is equal to
        ``self`` (the schema's JSON text, property order included, round-trips)."""
        if self.kind == "json_object":
            return {"type": "json_object"}
        if self.kind == "json_schema":
            return {"type": "json_schema", "json_schema": {"name": "response", "schema": json.loads(self.source)}}
        return {"type": self.kind, self.kind: self.source}

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> ResponseFormat:
        """A JSON-schema format from a dict or its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, Mapping):
            raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        try:
            source = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"the JSON schema cannot be serialized to JSON: {exc}") from None
        return cls("json_schema", source)

    @classmethod
    def of(cls, value: Any) -> ResponseFormat:
        """Normalize a user value (see the module docstring) into a `ResponseFormat`."""
        if isinstance(value, ResponseFormat):
            return value
        if isinstance(value, str):
            if value in ("json", "json_object"):
                return cls("json_object")
            raise InvalidRequestError(
                f"response_format={value!r} is ambiguous; pass 'json', a JSON-schema dict, or "
                f"{{'type': 'regex', 'regex': ...}} / {{'type': 'grammar', 'grammar': ...}}")
        if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a Pydantic model class
            return cls.json_schema(value.model_json_schema())
        if not isinstance(value, Mapping):
            raise InvalidRequestError(f"response_format must be a dict, a str or a ResponseFormat, got "
                                      f"{type(value).__name__}")
        kind = value.get("type")
        if kind == "json_object":
            return cls("json_object")
        if kind == "json_schema":
            inner = value.get("json_schema", value)
            schema = inner.get("schema") if isinstance(inner, Mapping) else None
            if schema is None:
                raise InvalidRequestError("a json_schema response format needs the schema: "
                                          "{'type': 'json_schema', 'json_schema': {'schema': {...}}}")
            return cls.json_schema(schema)
        if kind in ("regex", "grammar"):
            source = value.get(kind)
            if not isinstance(source, str):
                raise InvalidRequestError(f"a {kind} response format needs a str under {kind!r}: "
                                          f"{{'type': {kind!r}, {kind!r}: ...}}")
            return cls(kind, source)
        return cls.json_schema(value)  # a bare JSON schema ({"type": "object", "properties": ...})


def _grammar_text(kind: str, source: str) -> str:
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(source)  # Lark (a ``start:`` rule) stays as it is; GBNF (``root ::= ...``) is converted
    except Exception as exc:  # noqa: BLE001 - the converter raises its own error types (and bare ones)
        raise GrammarError(f"the grammar is neither Lark (llguidance's dialect, with a 'start:' rule) nor GBNF "
                           f"(llama.cpp's / vLLM's EBNF, with a 'root ::=' rule): {exc}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


class _Validated:
    """Digests of grammars known to be valid, the most recent ``capacity`` of them: a server sees the same schema
    on request after request, and validating it again costs as much as the first time. Only a grammar a
    `GrammarCompiler` compiled for an admitted request is remembered (`add`), so a request refused for its model,
    length or a full queue leaves nothing behind; and only a 32-byte digest is kept, never the grammar, so the
    set's memory is bounded whatever the formats' sizes. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def digest(grammar: str) -> bytes:
        return hashlib.blake2b(grammar.encode("utf-8", "surrogatepass"), digest_size=32).digest()

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            if digest in self._digests:
                self._digests.move_to_end(digest)
                return True
            return False

    def add(self, digest: bytes) -> None:
        with self._lock:
            self._digests[digest] = None
            self._digests.move_to_end(digest)
            while len(self._digests) > self.capacity:
                self._digests.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._digests)


_VALIDATED = _Validated(VALIDATED_GRAMMARS)


def remember_valid(grammar: str) -> None:
    """Spare later constructions of ``grammar``'s format the validation: called by `GrammarCompiler` once it
    compiled ``grammar`` for an admitted request."""
    _VALIDATED.add(_Validated.digest(grammar))


def _check_grammar(grammar: str) -> None:
    """Validate without a tokenizer; a grammar a compiler already compiled (`_VALIDATED`) is not checked again."""
    if _Validated.digest(grammar) in _VALIDATED:
        return
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"the response format was rejected by the grammar compiler: {one_line(messages)}; "
                           f"fix the schema/grammar or drop the unsupported keyword")
    for warning in messages:
        log.warning("response format: %s", warning)


def one_line(messages: Iterable[str], limit: int = 400) -> str:
    """The library's (possibly multi-line, caret-diagrammed) messages on one line."""
    lines = [ln.strip() for m in messages for ln in m.splitlines()]
    text = " ".join(ln for ln in lines if ln and set(ln) != {"^"})
    return (text[: limit - 3] + "...") if len(text) > limit else (text or "unknown error")
