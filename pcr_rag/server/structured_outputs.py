"""vLLM's ``structured_outputs`` request field, and its older top-level ``guided_*`` fields, as the engine's
`ResponseFormat`: the same grammar-constrained decoding as ``response_format`` (`pcr_rag.model.grammar`).

``structured_outputs`` holds exactly one constraint:

- ``json``: a JSON schema (an object, or its JSON text);
- ``regex``: a regular expression (llguidance's regex syntax: Rust's ``regex`` crate, no look-around);
- ``choice``: a list of strings; the answer is exactly one of them;
- ``grammar``: a context-free grammar, in GBNF (llama.cpp's, the EBNF vLLM documents: ``root ::= ...``) or in
  Lark (llguidance's dialect: ``start: ...``); GBNF is converted to Lark by llguidance's own ``any_to_lark``;
- ``json_object: true``: any JSON object.

Options: ``disable_fallback`` and ``disable_any_whitespace`` are accepted as they are already true here (a format
llguidance cannot compile is a 400, never a fallback; JSON is always written without free whitespace);
``disable_additional_properties: true`` closes the schema's objects (``additionalProperties: false``).
``whitespace_pattern`` and ``structural_tag`` are refused (400), as is any other key: nothing is ignored.

The older fields ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar`` (vLLM before
``structured_outputs``) map to the same constraints.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pcr_rag.errors import InvalidRequestError
from pcr_rag.response_format import ResponseFormat
from pcr_rag.structured import close_objects

__all__ = ["CONSTRAINTS", "LEGACY_FIELDS", "choice_format", "structured_outputs_format"]

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
#: options that change nothing here (see the module docstring), and the one that does
_NOOP_OPTIONS = ("disable_fallback", "disable_any_whitespace")
_REFUSED = {
    "whitespace_pattern": "whitespace_pattern is not supported (JSON is written with ', ' and ': ' only); remove it",
    "structural_tag": "structural_tag is not supported; send json, regex, choice or grammar",
}
#: vLLM's older top-level request fields -> the ``structured_outputs`` key each stands for
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def choice_format(options: Sequence[str]) -> ResponseFormat:
    """A format whose only answers are the strings of ``options`` (a Lark alternation of string literals)."""
    if isinstance(options, str) or not isinstance(options, Sequence) or not options:
        raise InvalidRequestError("choice must be a non-empty list of strings, e.g. ['yes', 'no']")
    for i, option in enumerate(options):
        if not isinstance(option, str):
            raise InvalidRequestError(f"choice[{i}] must be a string, got {type(option).__name__}")
    alternatives = " | ".join(json.dumps(option, ensure_ascii=False) for option in dict.fromkeys(options))
    return ResponseFormat("grammar", f"start: {alternatives}\n")


def structured_outputs_format(value: Any) -> ResponseFormat:
    """``structured_outputs`` as a `ResponseFormat`; `InvalidRequestError` (its message opens with the key at
    fault) for anything it cannot honour, before any compute."""
    if not isinstance(value, Mapping):
        raise InvalidRequestError("structured_outputs must be an object such as {'choice': ['yes', 'no']}")
    for key in value:
        if key in _REFUSED and value[key] not in (None, ""):
            raise InvalidRequestError(_REFUSED[key])
        if key not in (*CONSTRAINTS, *_NOOP_OPTIONS, *_REFUSED, "disable_additional_properties"):
            raise InvalidRequestError(f"structured_outputs.{key} is not a structured-outputs key; send one of "
                                      f"{', '.join(CONSTRAINTS)}")
    for key in (*_NOOP_OPTIONS, "disable_additional_properties"):
        if not isinstance(value.get(key, False), bool):
            raise InvalidRequestError(f"structured_outputs.{key} must be true or false")
    given = [key for key in CONSTRAINTS if value.get(key) not in (None, False)]
    if len(given) != 1:
        found = f"got {', '.join(given)}" if given else "got none"
        raise InvalidRequestError(f"structured_outputs needs exactly one of {', '.join(CONSTRAINTS)} ({found})")
    (key,) = given
    return _format(key, value[key], close=bool(value.get("disable_additional_properties")))


def _format(key: str, spec: Any, *, close: bool = False) -> ResponseFormat:
    try:
        if key == "choice":
            return choice_format(spec)
        if key == "json_object":
            if spec is not True:
                raise InvalidRequestError("must be true")
            return ResponseFormat("json_object")
        if key == "json":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as exc:
                    raise InvalidRequestError(f"is not valid JSON: {exc}") from None
            if not isinstance(spec, Mapping):
                raise InvalidRequestError("must be a JSON schema (an object, or its JSON text)")
            return ResponseFormat.json_schema(close_objects(dict(spec)) if close else spec)
        if not isinstance(spec, str):
            raise InvalidRequestError(f"must be a string, got {type(spec).__name__}")
        return ResponseFormat(key, spec)  # regex / grammar (Lark or GBNF)
    except InvalidRequestError as exc:
        message = str(exc)
        raise type(exc)(message if message.startswith(key) else f"{key}: {message}") from None
