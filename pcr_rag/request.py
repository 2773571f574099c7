"""What a caller asks the engine for, and what comes back.

A request is a prompt, one of three frozen kinds, plus `SamplingParams`:

- `RagPrompt(query, documents, system)`: the engine lays out ``[system][doc 1]...[doc k][question]``;
- `FlatPrompt(text, documents, chat, system)`: a framework's rendered prompt that holds the documents verbatim;
- `ChatPrompt(messages, documents)`: a conversation rendered with the model's chat template.

Both are validated when constructed, so bad input fails before any compute. ``PCREngine.submit(prompt, params)``
enqueues the request and returns a `RequestHandle`: ``.result()``, iteration over `StreamChunk`s (sync and async),
``await handle`` and ``.cancel()`` (`pcr_rag.handle`). Every public generate/stream method of the engine is a
wrapper over ``submit``.

A base module: it imports only other base modules (errors, metrics, prompt, response_format), so the engine, the
server and the thin HTTP client share it without pulling in the model or the scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pcr_rag.errors import InvalidRequestError
from pcr_rag.metrics import RequestMetrics
from pcr_rag.prompt import (
    Doc,
    PromptBuilder,
    PromptContext,
    SegmentedPrompt,
    check_template_kwargs,
    split_documents,
)
from pcr_rag.response_format import ResponseFormat

log = logging.getLogger(__name__)

__all__ = [
    "ChatPrompt",
    "FlatPrompt",
    "GenerationResult",
    "Prompt",
    "RagPrompt",
    "SamplingParams",
    "StreamChunk",
    "TokenLogprob",
    "TopLogprob",
    "chat_logprobs",
    "completion_logprobs",
]


# ---------------------------------------------------------------------------------------------------- prompts
def _check_system(system: object) -> None:
    if system is not None and not isinstance(system, str):
        raise InvalidRequestError(f"system must be a str or None, got {type(system).__name__}")


def _set_documents(prompt: Any) -> tuple[str, ...]:
    """Normalize a prompt's ``documents`` (str or `Doc` each) and ``scopes`` (a parallel sequence of "shared" /
    "private" / None, or empty) in place: ``documents`` becomes the texts and ``scopes`` one entry per document
    (all None when no document has a scope: the request's default, see `Doc`)."""
    docs, scopes = split_documents(prompt.documents, prompt.scopes or None)
    object.__setattr__(prompt, "documents", docs)
    object.__setattr__(prompt, "scopes", scopes if any(sc is not None for sc in scopes) else ())
    return docs


def _docs(prompt: Any) -> tuple[Doc, ...]:
    scopes = prompt.scopes or (None,) * len(prompt.documents)
    return tuple(Doc(text, scope) for text, scope in zip(prompt.documents, scopes))


@dataclass(frozen=True)
class RagPrompt:
    """A question over documents, laid out by the engine: ``[system][doc 1]...[doc k][system_tail][question]``;
    each document is cached as its own token run. ``documents`` may be any sequence of str or `Doc` (stored as a
    tuple of str; the scopes go to ``scopes``, see `_set_documents`).

    ``system_tail``: the per-request part of the instructions (a date, a user profile), placed after the documents
    instead of before them, so that it does not end every document's cached prefix. It changes the prompt (the
    model reads the documents before it), so it is the caller's choice; it is computed on every request, like the
    question."""

    query: str
    documents: tuple[str, ...] = ()
    system: str | None = None
    scopes: tuple[str | None, ...] = ()
    system_tail: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.query, str):
            raise InvalidRequestError(f"query must be a str, got {type(self.query).__name__}")
        docs = _set_documents(self)
        if not self.query.strip() and not any(d.strip() for d in docs):
            raise InvalidRequestError("empty request: pass a non-empty query or at least one document")
        _check_system(self.system)
        if self.system_tail is not None and not isinstance(self.system_tail, str):
            raise InvalidRequestError(f"system_tail must be a str or None, got {type(self.system_tail).__name__}")

    @property
    def docs(self) -> tuple[Doc, ...]:
        """The documents with their scopes."""
        return _docs(self)

    def segment(self, builder: PromptBuilder, context: PromptContext | None = None) -> SegmentedPrompt:
        return builder.build_rag(self.query, self.docs, self.system, context=context, system_tail=self.system_tail)


@dataclass(frozen=True)
class FlatPrompt:
    """A flat prompt that contains ``documents`` verbatim, in order (a framework's rendered template).

    Documents are located from a moving cursor; one that is not found is computed as part of the surrounding
    text. ``chat=True`` wraps the text as one user turn of the model's chat template (``system`` as the system
    turn); ``chat=False`` continues the raw text. Documents and scopes as for `RagPrompt`."""

    text: str
    documents: tuple[str, ...] = ()
    chat: bool = True
    system: str | None = None
    scopes: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise InvalidRequestError(f"prompt must be a str, got {type(self.text).__name__}")
        if not self.text.strip():
            raise InvalidRequestError("empty prompt: pass the rendered prompt text")
        _set_documents(self)
        _check_system(self.system)

    @property
    def docs(self) -> tuple[Doc, ...]:
        """The documents with their scopes."""
        return _docs(self)

    def segment(self, builder: PromptBuilder, context: PromptContext | None = None) -> SegmentedPrompt:
        return builder.build_flat(self.text, self.docs, chat=self.chat, system=self.system, context=context)


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation (``[{"role": ..., "content": str}, ...]``, copied) rendered with the chat template;
    ``documents`` found in the rendered text get their own token runs. Documents and scopes as for `RagPrompt`.
    ``chat_template_kwargs``: this request's extra template variables (e.g. ``{"enable_thinking": False}``), over
    the engine's ``EngineConfig.chat_template_kwargs`` (`pcr_rag.prompt.check_template_kwargs` validates them)."""

    messages: tuple[Mapping[str, Any], ...]
    documents: tuple[str, ...] = ()
    scopes: tuple[str | None, ...] = ()
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        messages = self.messages
        if isinstance(messages, (str, bytes)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("content"), str) or "role" not in m:
                raise InvalidRequestError(f"message #{i} must be a dict with 'role' and a str 'content'")
        if not any(m["content"].strip() for m in messages):
            raise InvalidRequestError("all messages are empty")
        object.__setattr__(self, "messages", tuple(dict(m) for m in messages))
        _set_documents(self)
        if self.chat_template_kwargs is not None:
            object.__setattr__(self, "chat_template_kwargs", check_template_kwargs(self.chat_template_kwargs))

    @property
    def docs(self) -> tuple[Doc, ...]:
        """The documents with their scopes."""
        return _docs(self)

    def segment(self, builder: PromptBuilder, context: PromptContext | None = None) -> SegmentedPrompt:
        return builder.build_chat(self.messages, self.docs, context=context,
                                  template_kwargs=self.chat_template_kwargs)


Prompt = RagPrompt | FlatPrompt | ChatPrompt
PROMPT_KINDS: tuple[type, ...] = (RagPrompt, FlatPrompt, ChatPrompt)


# ---------------------------------------------------------------------------------------------------- sampling
_NAME_ALIASES = {"max_tokens": "max_new_tokens"}  # the OpenAI / LangChain spelling


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request. Validated on construction (`InvalidRequestError`).

    max_new_tokens: tokens generated at most; None = the engine's ``EngineConfig.max_new_tokens``.
    temperature: 0 = greedy (deterministic); > 0 samples. top_p: nucleus mass in (0, 1].
    stop: strings that end generation (not included in the text); a single str or any sequence is accepted.
    seed: the sampling seed when temperature > 0 (None = a fresh one per request): a signed 64-bit int,
        ``-2**63 <= seed < 2**63`` (vLLM's bound; every seed in it seeds the sampler's generator).
    response_format: what the output must match (grammar-constrained decoding, `pcr_rag.model.grammar`): a
        `ResponseFormat`, a JSON-schema dict or Pydantic model class, ``"json"`` (any JSON object), or the dicts
        ``{"type": "json_schema", "json_schema": {"schema": ...}}``, ``{"type": "json_object"}``,
        ``{"type": "regex", "regex": ...}``, ``{"type": "grammar", "grammar": <Lark>}``; stored as a
        `ResponseFormat`. A format the grammar library rejects raises `InvalidRequestError` here.
    top_k: sample among the k most likely tokens only; 0 or -1 = all (vLLM's convention; -1 is stored as 0).
    repetition_penalty: in [0.01, 100] (vLLM takes any > 0, but a tiny one overflows the logits); every token of
        the prompt or the answer so far has its logit divided by it when positive, multiplied by it when negative
        (HF / vLLM); 1 = off, > 1 discourages repeats.
    presence_penalty / frequency_penalty: in [-2, 2] (OpenAI's range and formula): a generated token's logit
        loses ``presence_penalty`` once it appeared and ``frequency_penalty`` per time it appeared.
    logprobs: return each generated token's logprob (`GenerationResult.logprobs`, `StreamChunk.logprobs`).
    top_logprobs: 0..20 most likely alternatives per token with their logprobs (OpenAI's bound); needs logprobs.
    min_p: in [0, 1] (vLLM's): when sampling, a token whose probability (after temperature) is below ``min_p``
        times the most likely token's is left out; 0 = off.
    min_tokens: the answer has at least this many tokens (vLLM's): until then end-of-sequence is masked (unless a
        grammar allows nothing else) and stop strings are not looked for; at most ``max_new_tokens``.
    ignore_eos: end-of-sequence does not end the answer (vLLM's, for fixed-length runs): the token is kept as
        one of the answer's and decoding goes on until ``max_new_tokens``, a stop string or a grammar's end.

    Penalties apply to greedy decoding too; top_k, top_p and min_p only to sampling. Every option acts on the
    request's own row and tokens, so a request's tokens and logprobs never depend on its batch company. Below
    `GREEDY_BELOW` a temperature decodes greedily (as vLLM: a smaller one would overflow the scaled logits).
    """

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    response_format: ResponseFormat | None = None
    top_k: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise InvalidRequestError(f"max_new_tokens must be a positive int, got {n!r}")
        t = self.temperature
        if not _is_number(t) or not 0 <= t < math.inf:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}")
        check_seed(self.seed)
        _check_penalties_and_logprobs(self)
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        if self.response_format is not None:
            object.__setattr__(self, "response_format", ResponseFormat.of(self.response_format))

    @classmethod
    def names(cls) -> frozenset[str]:
        """Every keyword `from_kwargs` accepts (the fields and their aliases, e.g. ``max_tokens``)."""
        return frozenset(f.name for f in dataclasses.fields(cls)) | frozenset(_NAME_ALIASES)

    @classmethod
    def from_kwargs(cls, defaults: SamplingParams | None = None, /, **kwargs: Any) -> SamplingParams:
        """``defaults`` (or the field defaults) overridden by ``kwargs``; a None value keeps the default.

        Raises:
            TypeError: a keyword that is not a sampling parameter (all unknown ones are listed).
            InvalidRequestError: a bad value, or ``max_tokens`` and ``max_new_tokens`` that disagree.
        """
        unknown = set(kwargs) - cls.names()
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; the sampling parameters are "
                            f"{sorted(cls.names())}")
        given: dict[str, Any] = {}
        for name, value in kwargs.items():
            if value is None:
                continue
            name = _NAME_ALIASES.get(name, name)
            if name in given and given[name] != value:
                raise InvalidRequestError(f"max_tokens={kwargs['max_tokens']!r} and max_new_tokens="
                                          f"{kwargs['max_new_tokens']!r} disagree; pass one of them")
            given[name] = value
        base = defaults if defaults is not None else cls()
        return dataclasses.replace(base, **given) if given else base


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_penalties_and_logprobs(p: SamplingParams) -> None:
    """Validate (and normalize) top_k, the penalties and the logprob fields of ``p`` (ranges as vLLM / OpenAI)."""
    k = p.top_k
    if not isinstance(k, int) or isinstance(k, bool) or k < -1:
        raise InvalidRequestError(f"top_k must be an int >= 1, or 0 / -1 for all tokens, got {k!r}")
    object.__setattr__(p, "top_k", max(0, k))
    r = p.repetition_penalty
    if not _is_number(r) or not REPETITION_PENALTY_MIN <= r <= REPETITION_PENALTY_MAX:
        raise InvalidRequestError(f"repetition_penalty must be a number in [{REPETITION_PENALTY_MIN:g}, "
                                  f"{REPETITION_PENALTY_MAX:g}] (1 = off), got {r!r}")
    object.__setattr__(p, "repetition_penalty", float(r))
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _is_number(v) or not -2 <= v <= 2:
            raise InvalidRequestError(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")
        object.__setattr__(p, name, float(v))
    if not isinstance(p.logprobs, bool):
        raise InvalidRequestError(f"logprobs must be True or False, got {p.logprobs!r}")
    n = p.top_logprobs
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {n!r}")
    if n and not p.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=True (as OpenAI's API)")
    m = p.min_p
    if not _is_number(m) or not 0 <= m <= 1:
        raise InvalidRequestError(f"min_p must be a number in [0, 1] (0 = off), got {m!r}")
    object.__setattr__(p, "min_p", float(m))
    t = p.min_tokens
    if not isinstance(t, int) or isinstance(t, bool) or t < 0:
        raise InvalidRequestError(f"min_tokens must be an int >= 0, got {t!r}")
    if p.max_new_tokens is not None and t > p.max_new_tokens:
        raise InvalidRequestError(f"min_tokens={t} is more than max_new_tokens={p.max_new_tokens}; lower it or "
                                  f"raise max_tokens")
    if not isinstance(p.ignore_eos, bool):
        raise InvalidRequestError(f"ignore_eos must be True or False, got {p.ignore_eos!r}")


GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily (vLLM's _SAMPLING_EPS)
# repetition_penalty's range: vLLM takes any r > 0, but a positive logit divided by a tiny r overflows float32 to
# inf and the sampling softmax to NaN (1e-300 failed the request at decode); nobody means more than 100x either way
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 100.0
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
SEED_MIN, SEED_END = -(2**63), 2**63  # accepted seeds: [SEED_MIN, SEED_END), a signed 64-bit int (as vLLM)


def check_seed(seed: object) -> None:
    """Raise `InvalidRequestError` unless ``seed`` is None or an int (not a bool) in ``[-2**63, 2**63)``: the
    range vLLM's requests accept, inside what ``torch.Generator.manual_seed`` takes, so an accepted seed can never
    fail later, in the middle of a request."""
    if seed is None:
        return
    if not isinstance(seed, int) or isinstance(seed, bool) or not SEED_MIN <= seed < SEED_END:
        raise InvalidRequestError(f"seed must be an int in [-2**63, 2**63) (a signed 64-bit integer) or None, "
                                  f"got {seed!r}")


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    try:
        stops = tuple(stop)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequestError(f"stop must be a string or a sequence of strings, got {stop!r}") from None
    if not all(isinstance(s, str) for s in stops):
        raise InvalidRequestError("stop must be a string or a sequence of strings")
    return stops


# ---------------------------------------------------------------------------------------------------- results
@dataclass
class GenerationResult:
    """A finished request. finish_reason: "stop" (EOS or a stop string) or "length" (max_new_tokens)."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    finish_reason: str
    request_id: int = 0
    documents_found: int = 0
    first_token_logits: Any = None  # the prefill's last-position logits (a CPU tensor), for checks and scoring
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids when params.logprobs, else None


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position: id, text, bytes (exact UTF-8 bytes of the token; a token
    inside a multi-byte character has the bytes of its part and a text with U+FFFD) and natural-log probability."""

    token_id: int
    token: str
    bytes: tuple[int, ...]
    logprob: float

    def as_openai(self) -> dict[str, Any]:
        """``{"token", "logprob", "bytes"}`` as OpenAI's chat API (JSON-safe: see `json_logprob`)."""
        return {"token": self.token, "logprob": json_logprob(self.logprob), "bytes": list(self.bytes)}


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob (the model's distribution after the response format's mask, before penalties
    and temperature: vLLM's default) and its ``top_logprobs`` alternatives, most likely first."""

    token_id: int
    token: str
    bytes: tuple[int, ...]
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()

    def as_openai(self) -> dict[str, Any]:
        """One entry of OpenAI's ``choices[].logprobs.content`` (JSON-safe: see `json_logprob`)."""
        return {"token": self.token, "logprob": json_logprob(self.logprob), "bytes": list(self.bytes),
                "top_logprobs": [t.as_openai() for t in self.top_logprobs]}


LOGPROB_FLOOR = -9999.0  # what a -inf logprob (a token the response format forbids) is sent as, as vLLM does


def json_logprob(logprob: float) -> float:
    """``logprob`` as JSON can carry it: -inf (and NaN, which never occurs) become `LOGPROB_FLOOR`."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat ``choices[].logprobs`` (also a stream chunk's, for its tokens): ``{"content": [...],
    "refusal": None}``."""
    return {"content": [e.as_openai() for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy completions ``choices[].logprobs``: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (one ``{token: logprob}`` dict per token) and ``text_offset`` (each token's character offset
    in the answer, from ``text_offset``; a token inside a multi-byte character counts its U+FFFD text)."""
    offsets, at = [], text_offset
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [json_logprob(e.logprob) for e in entries],
            "top_logprobs": [{t.token: json_logprob(t.logprob) for t in e.top_logprobs} for e in entries],
            "text_offset": offsets}


@dataclass(frozen=True)
class StreamChunk:
    """One generated token as it comes: its id and the text it added (may be "" mid-way through a character), and
    its `TokenLogprob` when the request asked for logprobs.

    The last chunk of every stream is a closing one: ``token_id=-1``, ``text=""``, ``index`` = the number of token
    chunks before it, and ``result`` set to the request's `GenerationResult` (finish reason, counts, metrics)."""

    token_id: int
    text: str
    index: int
    result: GenerationResult | None = None
    logprobs: TokenLogprob | None = None

    @property
    def is_final(self) -> bool:
        return self.result is not None
