"""One translation: a validated request body (`pcr_rag.server.schemas`) -> the engine call's inputs.

`translate_chat` (``/v1/chat/completions``) and `translate_completion` (``/v1/completions``) each turn one body into
a `GenerationRequest`: the engine's prompt (`ChatPrompt`, `FlatPrompt` or `RagPrompt`), its `SamplingParams`, the
other `PCREngine.submit` arguments (``reuse``; the namespace is the tenant's, not the body's) and what the answer
needs (``n``, streaming, tools, the body's ignored fields). Anything that cannot be honoured is an `APIError`
(400) naming the field (``param``) and saying what to send instead, raised before anything reaches the engine. The
caller parses the JSON (`pcr_rag.server.schemas.parse_body`) and checks the model's name first, so a body for
another model never compiles a grammar. The general pieces the translation uses stay where the engine and the
integrations use them too: `pcr_rag.prompt` (documents, template variables), `pcr_rag.structured` (tools),
`pcr_rag.request` (prompts, `SamplingParams.from_kwargs`).

Sampling: the OpenAI names map through `SamplingParams.from_kwargs` (``max_tokens`` / ``max_completion_tokens``,
``temperature`` (below `GREEDY_BELOW`: greedy, as vLLM), ``top_p``, ``stop``, ``seed``, ``presence_penalty``,
``frequency_penalty``, and vLLM's ``top_k``, ``repetition_penalty``, ``min_p``, ``min_tokens`` and ``ignore_eos``);
a value the engine refuses is a 400 naming the field. Logprobs: chat takes ``logprobs: bool`` and ``top_logprobs``;
the legacy completions endpoint's ``logprobs: int`` is the number of alternatives (the sampled token's logprob plus
that many). Options with no equivalent here (``logit_bias``, legacy ``functions``, ...) are rejected when set to
anything but their neutral value (`_NEUTRAL`). The output constraint is one of ``response_format``,
``structured_outputs`` (`pcr_rag.server.structured_outputs`) or the older ``guided_*`` fields, as the engine's own
``response_format`` (no instruction is added to the prompt); a format the grammar library rejects is a 400 naming
the field. ``n`` (1 to `MAX_CHOICES`): choice ``i`` samples with the seed ``seed + i`` (wrapped into the signed
64-bit range, `GenerationRequest.choice_params`).

Prompts: a chat's messages become chat-template turns (`chat_turns`: tool history as `tool_history_turns`, natively
when the template renders tool calls), its tools the instruction after the conversation and the answer's grammar
(`pcr_rag.structured.with_tools`, as LangChain's `ChatPCR`). A completion's prompt is a `FlatPrompt` (the caller's
text, holding the documents verbatim; ``chat_template: true`` wraps it as one user turn), or with ``layout: "rag"``
a `RagPrompt` (the question, laid out by the engine as ``[system + instruction][docs][system_tail][question]``).
``system_tail`` has a place only in the latter; sent with a chat or a flat prompt it is a 400 (never dropped).
``prompt_chars``: the prompt's text fields stripped and summed, the character bound's measure
(`pcr_rag.server.prompt_bound`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from pcr_rag.errors import InvalidRequestError
from pcr_rag.limits import DEFAULT_LIMITS, RequestLimits
from pcr_rag.prompt import Doc, check_template_kwargs, split_documents
from pcr_rag.request import GREEDY_BELOW, ChatPrompt, FlatPrompt, RagPrompt, SamplingParams
from pcr_rag.response_format import ResponseFormat
from pcr_rag.server.errors import APIError
from pcr_rag.server.schemas import (
    CHAT_ROLES,
    MAX_CHOICES,
    SEED_MIN,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DocumentIn,
    NamedToolChoice,
    TokenizeRequest,
    json_type,
    short,
)
from pcr_rag.server.structured_outputs import LEGACY_FIELDS, structured_outputs_format
from pcr_rag.structured import (
    NONE,
    ToolCall,
    ToolSpec,
    normalize_tool_choice,
    template_renders_tool_calls,
    tool_history_turns,
    with_tools,
)

__all__ = [
    "GenerationRequest",
    "chat_turns",
    "ignored_fields",
    "request_documents",
    "tokenize_text",
    "translate_chat",
    "translate_completion",
]

Kind = Literal["chat", "completion"]
GenerationBody = ChatCompletionRequest | CompletionRequest

# OpenAI options this server cannot honour, and the values that mean "off" (accepted silently).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none"),
    "logit_bias": (None, {}), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""),
}
_WHAT_TO_DO = {
    "functions": "legacy function calling is not supported; send 'tools' instead",
    "function_call": "legacy function calling is not supported; send 'tool_choice' instead",
    "logit_bias": "logit_bias is not supported; remove it",
    "audio": "audio output is not supported; remove 'audio'",
    "modalities": "only text output is supported; send modalities=['text'] or leave it out",
    "prediction": "predicted outputs are not supported; remove 'prediction'",
    "best_of": "best_of > 1 is not supported; send separate requests",
    "echo": "echo is not supported; prepend the prompt to the completion yourself",
    "suffix": "suffix (insertion) is not supported; remove it",
}


@dataclass(frozen=True)
class GenerationRequest:
    """A translated, valid request: the engine call's inputs and how to answer.

    The engine call: one `PCREngine.submit` of ``prompt`` per choice, choice ``i`` with ``choice_params[i]``
    (``choice_params[0]`` is ``params``, the request's own sampling; choice ``i`` seeds ``seed + i``, wrapped into
    the signed 64-bit range, vLLM's rule; without a seed each choice draws a fresh one), with ``reuse``; the
    namespace is the caller's tenant's. ``prompt_chars``: the prompt's text fields stripped and summed (the character
    bound's measure, `pcr_rag.server.prompt_bound`), ``prompt_param`` the body field that holds them (what a
    too-long prompt's 400 names). The answer: ``kind``, ``stream``, ``include_usage``, ``return_token_ids``,
    ``tools`` and the body's ``ignored`` fields."""

    kind: Kind
    model: str
    prompt: ChatPrompt | FlatPrompt | RagPrompt
    params: SamplingParams
    choice_params: tuple[SamplingParams, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    prompt_chars: int = 0
    prompt_param: str = "messages"
    tools: tuple[ToolSpec, ...] = ()  # what an answer may call (empty: plain text, e.g. tool_choice "none")
    ignored: tuple[str, ...] = ()  # the body's fields this server does not know (`ignored_fields`)
    reuse: str | None = None  # "exact", "blend", or None: the engine's default (`PCREngine.submit`'s ``reuse``)

    @property
    def n(self) -> int:
        """The number of choices."""
        return len(self.choice_params)


# ------------------------------------------------------------------------------------------------ the two bodies
def translate_chat(body: ChatCompletionRequest, tokenizer: Any,
                   limits: RequestLimits = DEFAULT_LIMITS) -> GenerationRequest:
    """A `/v1/chat/completions` body -> `GenerationRequest`; `APIError` (400) on anything invalid. ``tokenizer``:
    the engine's (its chat template decides how tool turns and the tools' instruction are rendered). ``limits``
    bound the stop strings, response format and tools before any of them is validated."""
    _check_unsupported(body)
    _check_bounds(body, limits)
    if body.system_tail is not None:
        raise APIError.bad_request(
            "'system_tail' needs a layout the server chooses, and a chat's messages are laid out by the caller: put "
            "the per-request text into the messages after the documents yourself, or send the question to "
            "/v1/completions with \"layout\": \"rag\" and this system_tail", param="system_tail")
    if body.tools:
        _bounded(limits.check_tools, _json_size([t.model_dump() for t in body.tools]), "tools")
    max_tokens = _max_tokens(body, "max_tokens", "max_completion_tokens")
    response_format, format_param = _output_format(body)
    docs = request_documents(body.documents, body.scopes)
    turns = chat_turns(body.messages, tokenizer)
    if not any(t["content"].strip() for t in turns):
        raise APIError.bad_request("all messages are empty; send a non-empty question", param="messages")
    tools, choice = _tools(body)
    if tools and response_format is not None:
        raise APIError.bad_request(f"send either 'tools' or '{format_param}', not both", param=format_param)
    try:
        turns, tool_format = with_tools(turns, tools, choice, tokenizer, parallel=bool(body.parallel_tool_calls))
    except InvalidRequestError as exc:  # a parameters schema the grammar library rejects
        raise APIError.bad_request(f"tools: {exc}", param="tools") from None
    chars = sum(len(t["content"].strip()) for t in turns)
    try:
        template_kwargs = check_template_kwargs(body.chat_template_kwargs) if body.chat_template_kwargs else None
    except InvalidRequestError as exc:
        raise APIError.bad_request(str(exc), param="chat_template_kwargs") from None
    try:
        prompt = ChatPrompt(tuple(turns), docs, chat_template_kwargs=template_kwargs)
    except InvalidRequestError as exc:
        raise APIError.bad_request(str(exc), param="messages") from None
    callable_tools = tools if choice != NONE else ()
    logprobs = {"logprobs": body.logprobs, "top_logprobs": body.top_logprobs}
    return _generation_request("chat", body, prompt, max_tokens, chars, tool_format or response_format,
                               callable_tools, logprobs)


def translate_completion(body: CompletionRequest, limits: RequestLimits = DEFAULT_LIMITS) -> GenerationRequest:
    """A `/v1/completions` body -> `GenerationRequest`; `APIError` (400) on anything invalid. ``limits`` as for
    `translate_chat`. The prompt is a `FlatPrompt` (the caller's text), or with ``layout: "rag"`` a `RagPrompt`
    (the question, laid out by the engine with ``system`` and ``system_tail``)."""
    _check_unsupported(body)
    _check_bounds(body, limits)
    text = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    rag = body.layout == "rag"
    chat = bool(body.chat_template)
    if rag and body.chat_template is False:
        raise APIError.bad_request("layout 'rag' renders the model's chat template (as PCREngine.generate); leave "
                                   "'chat_template' out or send true, or send layout 'flat' with the rendered text",
                                   param="chat_template")
    if body.system is not None and not (chat or rag):
        raise APIError.bad_request("'system' needs 'chat_template': true (a raw prompt has no system turn); "
                                   "put the system text into the prompt instead", param="system")
    if body.system_tail is not None and not rag:
        raise APIError.bad_request(
            "'system_tail' needs \"layout\": \"rag\" (the prompt is then the question, and the server places the "
            "tail after the documents); a flat prompt is laid out by the caller: put the per-request text after the "
            "documents in it yourself", param="system_tail")
    max_tokens = _max_tokens(body, "max_tokens")
    response_format, _ = _output_format(body)
    docs = request_documents(body.documents, body.scopes)
    chars = len(text.strip()) + len((body.system or "").strip())
    prompt: RagPrompt | FlatPrompt
    try:
        if rag:  # the documents and the tail are text of their own here, not part of the prompt's
            chars += len((body.system_tail or "").strip()) + sum(len(d.text.strip()) for d in docs)
            prompt = RagPrompt(text, docs, body.system, system_tail=body.system_tail)
        else:
            prompt = FlatPrompt(text, docs, chat, body.system)
    except InvalidRequestError as exc:
        raise APIError.bad_request(str(exc), param="prompt") from None
    # legacy semantics: logprobs=n returns the sampled token's logprob and the n most likely alternatives
    logprobs = {} if body.logprobs is None else {"logprobs": True, "top_logprobs": body.logprobs}
    return _generation_request("completion", body, prompt, max_tokens, chars, response_format, logprobs=logprobs)


def _generation_request(kind: Kind, body: GenerationBody, prompt: ChatPrompt | FlatPrompt | RagPrompt,
                        max_tokens: int | None, chars: int, response_format: ResponseFormat | None = None,
                        tools: tuple[ToolSpec, ...] = (),
                        logprobs: dict[str, Any] | None = None) -> GenerationRequest:
    """What both bodies share: ``n``, streaming, and the sampling fields as `SamplingParams`."""
    n = 1 if body.n is None else body.n
    if n > MAX_CHOICES:
        raise APIError.bad_request(f"n={n} is more than this server's {MAX_CHOICES} choices per request; send "
                                   f"several requests (with different seeds when sampling)", param="n")
    stream = bool(body.stream)
    include_usage = False
    if body.stream_options is not None:
        if not stream:
            raise APIError.bad_request("'stream_options' is only allowed with 'stream': true",
                                       param="stream_options")
        include_usage = bool(body.stream_options.include_usage)
    stop = body.stop
    if isinstance(stop, list):
        stop = [s for s in stop if s]
    temperature = body.temperature
    if temperature is not None and temperature < GREEDY_BELOW:
        temperature = 0.0
    try:
        params = SamplingParams.from_kwargs(
            max_tokens=max_tokens, temperature=temperature, top_p=body.top_p, stop=stop or None, seed=body.seed,
            response_format=response_format, top_k=body.top_k, repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, min_p=body.min_p,
            min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, **(logprobs or {}))
    except InvalidRequestError as exc:  # the models' bounds come first; what is left is the engine's word
        raise APIError.bad_request(str(exc), param=_sampling_param(str(exc), kind)) from None
    return GenerationRequest(kind=kind, model=body.model, prompt=prompt, params=params,
                             choice_params=_choice_params(params, n),
                             stream=stream, include_usage=include_usage,
                             return_token_ids=bool(body.return_token_ids), prompt_chars=chars,
                             prompt_param="messages" if kind == "chat" else "prompt", tools=tools,
                             ignored=ignored_fields(body), reuse=body.reuse)


def _choice_params(params: SamplingParams, n: int) -> tuple[SamplingParams, ...]:
    """Each of ``n`` choices' sampling: the request's, with the seed ``seed + i`` for choice ``i``, wrapped into the
    signed 64-bit range (vLLM's rule); without a seed each choice draws a fresh one."""
    if params.seed is None:
        return (params,) * n
    seed = params.seed
    return (params, *(dataclasses.replace(params, seed=(seed + i - SEED_MIN) % 2**64 + SEED_MIN)
                      for i in range(1, n)))


def _sampling_param(message: str, kind: Kind) -> str | None:
    """The request field a `SamplingParams` error is about: its messages open with the field's name (``top_k must
    be ...``, ``top_logprobs needs ...``), named here as the wire names it (``max_new_tokens`` is ``max_tokens``;
    the completions endpoint's ``logprobs`` carries both logprob fields)."""
    name = message.split(" ", 1)[0].split("=", 1)[0]
    if name not in SamplingParams.names():
        return None
    if name == "max_new_tokens":
        return "max_tokens"
    if kind == "completion" and name == "top_logprobs":
        return "logprobs"
    return name


def _max_tokens(body: GenerationBody, *names: str) -> int | None:
    values = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    if len(set(values.values())) > 1:
        raise APIError.bad_request(f"{' and '.join(values)} disagree ({values}); send one of them",
                                   param=names[0])
    return next(iter(values.values()), None)


def _check_unsupported(body: GenerationBody) -> None:
    for name, neutral in _NEUTRAL.items():
        if name not in type(body).model_fields:
            continue
        value = getattr(body, name)
        if value not in neutral:
            raise APIError.bad_request(f"{name}={short(value)}: {_WHAT_TO_DO[name]}", param=name)


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _bounded(check: Callable[[Any], None], value: Any, param: str) -> None:
    try:
        check(value)
    except InvalidRequestError as exc:
        raise APIError.bad_request(str(exc), param=param) from None


def _check_bounds(body: GenerationBody, limits: RequestLimits) -> None:
    """400 when the stop strings or the response format are over ``limits`` (before either is used)."""
    if body.stop is not None:
        stops = [body.stop] if isinstance(body.stop, str) else [s for s in body.stop if s]
        _bounded(limits.check_stop, stops, "stop")
    for name in ("response_format", "structured_outputs", *LEGACY_FIELDS):
        if getattr(body, name) is not None:
            _bounded(limits.check_format, json.dumps(getattr(body, name), separators=(",", ":"),
                                                     ensure_ascii=False), name)


def _output_format(body: GenerationBody) -> tuple[ResponseFormat | None, str]:
    """The request's output constraint and the field that gave it: ``response_format``, ``structured_outputs`` or
    one of the older ``guided_*`` fields (at most one of them; a 400 naming the field for two, or for a format the
    grammar library rejects)."""
    given = [name for name in ("response_format", "structured_outputs", *LEGACY_FIELDS)
             if getattr(body, name) is not None
             and not (name == "response_format" and body.response_format.get("type") == "text")]
    if len(given) > 1:
        raise APIError.bad_request(f"send one of {', '.join(given)}: each constrains the whole output",
                                   param=given[1])
    if not given:
        return None, "response_format"
    (name,) = given
    if name == "response_format":
        return _response_format(body.response_format), name
    try:
        if name == "structured_outputs":
            return structured_outputs_format(body.structured_outputs), name
        return structured_outputs_format({LEGACY_FIELDS[name]: getattr(body, name)}), name
    except InvalidRequestError as exc:
        raise APIError.bad_request(f"{name}: {exc}", param=name) from None


def _response_format(fmt: dict[str, Any] | None) -> ResponseFormat | None:
    """The ``response_format`` -> the engine's `ResponseFormat` (None: free text); a 400 on what the grammar
    library rejects, before any compute."""
    if fmt is None or fmt.get("type") == "text":
        return None
    try:
        return ResponseFormat.of(fmt)
    except InvalidRequestError as exc:
        raise APIError.bad_request(f"response_format: {exc}", param="response_format") from None


# ------------------------------------------------------------------------------------------------ tools
def _tools(body: ChatCompletionRequest) -> tuple[tuple[ToolSpec, ...], str]:
    """The request's tools and its normalized tool choice (`normalize_tool_choice`: "auto", "any", "none" or a
    tool's name); 400 naming ``tools`` / ``tool_choice``."""
    try:
        tools = tuple(ToolSpec.from_openai(t.model_dump()) for t in body.tools or ())
    except InvalidRequestError as exc:
        raise APIError.bad_request(f"tools: {exc}", param="tools") from None
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError.bad_request(f"tools: two tools share a name ({', '.join(names)}); give each its own",
                                   param="tools")
    raw = body.tool_choice
    if isinstance(raw, NamedToolChoice):
        raw = raw.model_dump()
    if not tools and raw not in (None, "auto", "none"):
        raise APIError.bad_request(f"tool_choice={short(raw)} needs 'tools'", param="tool_choice")
    try:
        return tools, normalize_tool_choice(raw, names)
    except InvalidRequestError as exc:
        raise APIError.bad_request(str(exc), param="tool_choice") from None


# ------------------------------------------------------------------------------------------------ shared parts
def request_documents(documents: list[str | DocumentIn] | None, scopes: list[str | None] | None) -> tuple[Doc, ...]:
    """The body's ``documents`` (texts or ``{text, scope}`` objects) and ``scopes`` as `pcr_rag.Doc`; a 400 naming
    ``scopes`` when the list does not fit the documents or disagrees with an object's own scope."""
    given = [d if isinstance(d, str) else Doc(d.text, d.scope) for d in documents or ()]
    if scopes is not None and documents is None:
        raise APIError.bad_request("'scopes' without 'documents': send one scope per document", param="scopes")
    try:
        texts, found = split_documents(given, scopes)
    except InvalidRequestError as exc:
        raise APIError.bad_request(str(exc), param="scopes" if scopes is not None else "documents") from None
    return tuple(Doc(text, scope) for text, scope in zip(texts, found))


def chat_turns(messages: list[ChatMessage], tokenizer: Any) -> list[dict[str, Any]]:
    """The messages as chat-template turns, rendered as the LangChain model renders the same history
    (``to_chat_turns``): assistant tool calls and tool results through `tool_history_turns`, natively when the
    conversation has tool turns and the template renders them itself; a result without a ``name`` takes the name
    of the call its ``tool_call_id`` names."""
    has_tool_turns = any(m.role == "tool" or m.tool_calls for m in messages)
    native = has_tool_turns and template_renders_tool_calls(tokenizer)
    names: dict[str, str] = {}
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            calls = [ToolCall(c.function.name, _arguments(c.function.arguments, i, j), c.id)
                     for j, c in enumerate(m.tool_calls)]
            names.update((c.id, c.name) for c in calls)
            turns.append(tool_history_turns("assistant", _message_text(m), tool_calls=calls, native=native))
        elif m.role == "tool":
            turns.append(tool_history_turns("tool", _message_text(m), tool_name=m.name or names.get(m.tool_call_id or ""),
                                            tool_call_id=m.tool_call_id, native=native))
        else:
            turns.append({"role": CHAT_ROLES[m.role], "content": _message_text(m)})
    return turns


def _arguments(text: str, message: int, call: int) -> dict[str, Any]:
    """A history call's arguments (JSON text) as the dict the template and the call format render."""
    param = f"messages[{message}].tool_calls[{call}].function.arguments"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise APIError.bad_request(f"{param} is not valid JSON; send the call's arguments as a JSON object's text",
                                   param=param) from None
    if not isinstance(value, dict):
        raise APIError.bad_request(f"{param} must be a JSON object's text, got {json_type(value)}", param=param)
    return value


def _message_text(message: ChatMessage) -> str:
    """A message's text: its content, or its text parts joined (none: empty)."""
    if message.content is None:
        return ""
    return message.content if isinstance(message.content, str) else "".join(p.text for p in message.content)


def ignored_fields(body: BaseModel, limit: int = 20) -> tuple[str, ...]:
    """The fields of ``body`` that no model declares, as paths (``foo``, ``messages[1].refusal``), at most
    ``limit`` of them; a null one counts as absent (OpenAI clients send ``"refusal": null`` and the like).
    Each name is the client's text: `pcr_rag.server.disclosure` shows only the header-safe ones."""
    out: list[str] = []

    def walk(value: Any, path: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(value, BaseModel):
            for name, extra in (value.model_extra or {}).items():
                if extra is not None and len(out) < limit:
                    out.append(f"{path}.{name}" if path else name)
            for name in type(value).model_fields:
                walk(getattr(value, name), f"{path}.{name}" if path else name)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]")

    walk(body, "")
    return tuple(out)


def tokenize_text(body: TokenizeRequest, render: Callable[[list[dict[str, Any]], dict[str, Any] | None], str],
                  tokenizer: Any) -> tuple[str, int]:
    """The text `/tokenize` tokenizes and its characters (the prompt's, or the messages' contents, stripped and
    summed): a ``prompt`` as it is, ``messages`` through ``render`` (the engine's chat rendering, with the
    request's ``chat_template_kwargs``, as `translate_chat` renders them); a 400 naming the field for what cannot
    be honoured."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError.bad_request("send either 'prompt' or 'messages'", param="prompt")
    if body.prompt is not None:
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
            if getattr(body, name) is not None:
                raise APIError.bad_request(f"'{name}' applies to 'messages' only", param=name)
        return body.prompt, len(body.prompt.strip())
    if body.add_generation_prompt is False:
        raise APIError.bad_request("add_generation_prompt=false is not supported: the engine always renders the "
                                   "generation prompt after the messages", param="add_generation_prompt")
    if body.continue_final_message:
        raise APIError.bad_request("continue_final_message is not supported: the engine answers after the last "
                                   "message", param="continue_final_message")
    assert body.messages is not None
    turns = chat_turns(body.messages, tokenizer)
    try:
        kwargs = check_template_kwargs(body.chat_template_kwargs) if body.chat_template_kwargs else None
        return render(turns, kwargs), sum(len(t["content"].strip()) for t in turns)
    except InvalidRequestError as exc:
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(exc) else "messages"
        raise APIError.bad_request(str(exc), param=param) from None
