"""`PCRLLM`: a LlamaIndex `FunctionCallingLLM` on a local transformers model served by the PCR engine (KV-cache reuse)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from contextlib import aclosing, closing
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt
from llama_index.llms.pcr._remote import remote_engine
from llama_index.llms.pcr.hook import install_retrieval_hook, retrieval_hook
from llama_index.llms.pcr.reorder import cache_aware_documents
from llama_index.llms.pcr.structured import (
    GrammarProgram,
    assistant_message,
    history_turn,
    tool_choice_of,
    tool_selections,
    tool_specs,
)

from pcr_rag.engine_api import Engine
from pcr_rag.errors import InvalidRequestError
from pcr_rag.handle import RequestHandle
from pcr_rag.model.provenance import DEFAULT_MODEL
from pcr_rag.prompt import Doc
from pcr_rag.request import ChatPrompt, FlatPrompt, GenerationResult, Prompt, SamplingParams, StreamChunk
from pcr_rag.response_format import ResponseFormat
from pcr_rag.structured import (
    ToolSpec,
    add_instruction,
    schema_instruction,
    template_renders_tool_calls,
    tool_call_format,
    tools_instruction,
)

if TYPE_CHECKING:
    from llama_index.core.prompts.base import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

logger = logging.getLogger(__name__)

__all__ = ["PCRLLM", "PCRRequestError"]

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=BaseModel)
dispatcher = get_dispatcher(__name__)


class PCRRequestError(RuntimeError):
    """A request PCRLLM cannot serve: empty query or prompt, a prompt longer than the context window, ...

    Deliberately not a ValueError: LlamaIndex's refine-based synthesizers (compact, refine) catch ValueError and
    TypeError from the LLM as "structured response errors" and answer "Empty Response"; this error reaches the
    caller of ``query()`` like a provider's bad-request error does. The engine's error is its ``__cause__``.
    """


def _translate_errors(func: F) -> F:
    """Re-raise the engine's `InvalidRequestError` as `PCRRequestError` (sync and async methods).

    The wrapper must not carry ``__wrapped__``: LlamaIndex's ``llm_*_callback`` decorators take a function with
    that attribute for one they already wrapped and would then skip their instrumentation events."""
    if inspect.iscoroutinefunction(func):
        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return await func(*args, **kwargs)
            except InvalidRequestError as exc:
                raise PCRRequestError(str(exc)) from exc

        wrapper: Any = awrapper
    else:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except InvalidRequestError as exc:
                raise PCRRequestError(str(exc)) from exc

    functools.update_wrapper(wrapper, func)
    del wrapper.__wrapped__
    return wrapper

# Serialises first loads (`PCRLLM.engine`): two threads' first calls on one LLM load its engine once. One lock for
# all LLMs costs nothing: `shared_engine` serialises engine creation process-wide anyway.
_LOAD_LOCK = threading.Lock()


def _given_model_name(model: Any) -> str:
    """A name for the model before it loads: the alias or path given, a model object's ``name_or_path``."""
    if model is None:
        return DEFAULT_MODEL
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    config = getattr(model, "config", None)
    return str(getattr(config, "name_or_path", "") or type(model).__name__)


_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}


def _engine_side() -> tuple[Any, Any, Any]:
    """``(EngineConfig, with_chat_template, shared_engine)``: the engine-side names, imported only when the model
    runs in this process. ``base_url=`` never gets here, so the thin client (pcr-rag without its 'engine' extra)
    imports no torch; without the extra a local PCRLLM says what to install."""
    try:
        from pcr_rag.config import EngineConfig, with_chat_template
        from pcr_rag.shared import shared_engine
    except ModuleNotFoundError as exc:
        from pcr_rag.errors import engine_not_installed

        raise engine_not_installed(exc) from exc
    return EngineConfig, with_chat_template, shared_engine


class PCRLLM(FunctionCallingLLM):
    """LlamaIndex LLM served by a `pcr_rag.PCREngine`: retrieved documents' KV is cached and reused.

    Drop it into any pipeline: ``index.as_query_engine(llm=PCRLLM())``. Construction is cheap: no model loads.
    The model loads on the LLM's first use (a call, ``engine``, ``count_tokens``/``tokenize``, or ``metadata``
    when the context window cannot be read from the model's config or GGUF header; see `metadata`), once, even
    when several threads make that first call together. Pass ``engine=`` to use your own `PCREngine`; otherwise
    one engine per model/config is shared by every PCRLLM and LangChain wrapper in the process.

    Retrieval hook: with ``retrieval_hook=True`` (default) constructing a PCRLLM installs a process-wide
    instrumentation handler; when a retriever finishes, the retrieved nodes are announced to the engine (the request
    enters the waiting queue and SSD -> DRAM prefetch starts), and the LLM call that follows in the same query
    passes those node texts with its prompt so each document gets its own cached token run.

    Prompts: ``is_chat_model=True`` (default) makes LlamaIndex's synthesizers call ``chat`` with their chat
    templates (system + user turns), rendered with the model's chat template. ``complete`` sends the prompt as one
    user turn of the chat template (``system_prompt`` as the system turn); with ``formatted=True`` (LlamaIndex's
    ``predict`` when ``is_chat_model=False``) the prompt is still wrapped unless a custom ``completion_to_prompt``
    already formatted it; ``chat_template=False`` continues the raw text instead.

    Args:
        model: None (default model), an alias ("smollm2-135m-instruct", "gemma3-270m"), a local HF model
            directory, or a transformers model object (then ``tokenizer`` too).
        engine: an existing `PCREngine` (then model/tokenizer/config must be left unset).
        config: `pcr_rag.EngineConfig` for the shared engine.
        max_new_tokens: tokens generated at most (also LlamaIndex's ``num_output``); None = the engine's default.
        temperature / top_p / seed: sampling (temperature 0 = greedy). stop: stop strings.
        timeout: seconds a call may take (streams included); the request is then cancelled and `TimeoutError`
            raised.
        chat_template: True wraps ``complete`` prompts in the chat template, False continues the raw text; a str
            (Jinja text, a ``.jinja`` file, or "plain") is also the template of the engine built
            (`pcr_rag.EngineConfig.chat_template`; not with ``engine=``). chat_template_kwargs: extra template
            variables for every chat (e.g. ``{"enable_thinking": False}``).
        reorder: "relevance" (default) keeps the retriever's document order; "cache-aware" announces and prompts
            the documents in the engine's cache-aware order (`llama_index.llms.pcr.reorder`; the answer can differ
            from the relevance-ordered one).
        reuse: "exact" or "blend" for every call (None, the default: the engine's ``EngineConfig.reuse``, or the
            server's with ``base_url``). "blend" is opt-in and approximate: documents after the exact prefix (a
            new order, other documents before them) are placed from their position-independent KV
            (`pcr_rag.sched.blend`), so the answer can differ from an uncached one. A response's ``raw`` reports
            ``blended_tokens`` (also ``raw["usage"]["prompt_tokens_details"]["blended_tokens"]``) and ``reuse``
            (how the call was served).

    Per call: ``documents=[...]``, ``timeout=``, ``reuse=`` and the sampling keywords of `pcr_rag.SamplingParams`
    (``max_new_tokens``/``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``response_format``).

    Structured output and tools run on grammar-constrained decoding (`pcr_rag.structured`), so the format is
    always valid: ``structured_predict`` / ``astructured_predict`` / ``stream_structured_predict`` /
    ``as_structured_llm`` constrain the answer to the output class's JSON schema; the function-calling interface
    (``chat_with_tools`` and its async/stream forms with ``tool_required`` or ``tool_choice``,
    ``get_tool_calls_from_response``) makes `FunctionAgent` work. Schemas and tools are described after the
    conversation (after the documents, whose cached KV stays reusable); one tool call per answer.
    """

    model: Any = Field(default=None, description="model alias, HF directory or model object (None = default)")
    tokenizer: Any = Field(default=None, exclude=True, description="tokenizer for a model object")
    config: Any = Field(default=None, exclude=True, description="pcr_rag.EngineConfig for the shared engine")
    max_new_tokens: int | None = Field(default=None, ge=1,
                                       description="tokens to generate at most (None: the engine's default)")
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None)
    stop: list[str] | None = Field(default=None, description="stop strings")
    timeout: float | None = Field(default=None, gt=0, description="seconds a call may take (None: no limit)")
    chat_template: bool | str = Field(
        default=True, description="wrap complete() prompts in the chat template; a str (Jinja text, a .jinja file, "
                                  "or 'plain') is also the engine's template (EngineConfig.chat_template)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="extra chat-template variables for every chat (ChatPrompt.chat_template_kwargs)")
    is_chat_model: bool = Field(default=True, description="synthesizers use chat() (the model's chat template)")
    retrieval_hook: bool = Field(default=True, description="install the retrieval -> prefetch hook")
    reorder: Literal["relevance", "cache-aware"] = Field(
        default="relevance", description="document order: the retriever's, or cache-aware (llama_index.llms.pcr."
                                         "reorder; the answer can differ from the relevance-ordered one)")
    reuse: Literal["exact", "blend"] | None = Field(
        default=None, description="'exact' or 'blend' for every call (None: the engine's or server's default); "
                                  "blend is opt-in and approximate (pcr_rag.sched.blend)")
    # base_url mode (llama_index.llms.pcr._remote): a pcr-rag server instead of a local engine
    scope_metadata_key: str = Field(default="pcr_scope",
                                    description="node metadata key holding a node's sharing scope ('shared' or "
                                                "'private'; see pcr_rag.Doc)")
    base_url: str | None = Field(default=None, description="a pcr-rag server (pcr-rag serve) to send calls to")
    api_key: str | None = Field(default=None, exclude=True, repr=False, description="the server's API key")

    _engine: Engine | None = PrivateAttr(default=None)  # None until the first use loads it (or engine= / base_url=)
    _engine_config: Any = PrivateAttr(default=None)  # the shared engine's EngineConfig (local mode)
    _context_window: int | None = PrivateAttr(default=None)  # read without loading (see `metadata`)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        if engine is not None:
            clash = [k for k in ("model", "tokenizer", "config") if kwargs.get(k) is not None]
            clash += ["chat_template"] if isinstance(kwargs.get("chat_template"), str) else []
            if clash:
                raise ValueError(f"pass either engine= or {clash} (they configure the engine), not both")
        super().__init__(**kwargs)
        if self.base_url is not None:
            self._engine = remote_engine(self, engine)  # a client: nothing loads in this process
        else:
            self._engine = engine  # None: the shared engine loads on first use (`engine`)
            EngineConfig, with_chat_template, _ = _engine_side()
            template = self.chat_template if isinstance(self.chat_template, str) else None
            self._engine_config = with_chat_template(self.config, template) or EngineConfig()  # checked now
        retrieval_hook().register_llm(self)
        if self.retrieval_hook:
            install_retrieval_hook()

    @classmethod
    def class_name(cls) -> str:
        return "PCRLLM"

    @property
    def engine(self) -> Engine:
        """The engine serving this LLM (a `PCREngine`, or an `HTTPEngine` with ``base_url=``); the first access loads the model (the process-wide shared engine for
        this model/config, `pcr_rag.shared.shared_engine`). Concurrent first accesses load it once."""
        engine = self._engine
        if engine is not None:
            return engine
        with _LOAD_LOCK:
            if self._engine is None:
                shared_engine = _engine_side()[2]
                self._engine = shared_engine(self.model, self.tokenizer, self._engine_config)
            return self._engine

    @property
    def loaded_engine(self) -> Engine | None:
        """The engine if it is already there (``engine=``, ``base_url=`` or a first use), else None; never loads."""
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        """``context_window`` is the engine's ``max_model_len`` (prompt + new tokens of one request), not the
        model's own context: the engine refuses a longer prompt, so LlamaIndex must pack prompts to this size.

        LlamaIndex reads ``metadata`` when it builds a query engine, before any call, so this does not load the
        model when it can help it: until the engine is loaded, ``context_window`` is read from the model's config
        (a model object's, a directory's ``config.json``) or its GGUF header (an alias, a ``.gguf`` file), as
        the engine will compute it (`llama_index.llms.pcr._context`); ``model_name`` is then the alias or path
        given. Only a model known by neither (a Hugging Face repo id) loads here."""
        engine = self._engine
        window = int(engine.max_model_len) if engine is not None else self._unloaded_context_window()
        engine = self._engine  # loaded by _unloaded_context_window when the window was not readable
        config = engine.config if engine is not None else (self._engine_config or _engine_side()[0]())
        return LLMMetadata(
            context_window=window,
            num_output=int(self.max_new_tokens or config.max_new_tokens),
            is_chat_model=self.is_chat_model,
            is_function_calling_model=True,
            model_name=engine.loaded.name if engine is not None else _given_model_name(self.model),
            system_role=MessageRole.SYSTEM,
        )

    def _unloaded_context_window(self) -> int:
        """``max_model_len`` of the engine this LLM will load, read without loading it where possible."""
        if self._context_window is None:
            from llama_index.llms.pcr._context import context_window_without_weights  # gguf: only when read

            self._context_window = context_window_without_weights(self.model, self.tokenizer,
                                                                  self._engine_config or _engine_side()[0]())
        if self._context_window is None:
            logger.info("the context window of %r is known only from the loaded model; loading it now", self.model)
            return int(self.engine.max_model_len)
        return self._context_window

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` under the model's tokenizer (for `Settings.tokenizer`-style budgeting)."""
        return int(self.engine.count_tokens(text))

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` under the engine's tokenizer (no special tokens; the server's ``/tokenize`` with
        ``base_url``). ``Settings.tokenizer = llm.tokenize`` makes LlamaIndex's prompt packing and
        `TokenCountingHandler` count the model's own tokens."""
        return [int(i) for i in self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]]

    # ------------------------------------------------------------------------------------------ requests
    def _submit(self, make_prompt: Callable[[tuple[str, ...], list[str]], Prompt], units: list[str],
                kwargs: dict[str, Any]) -> RequestHandle:
        """Validate the per-call ``kwargs`` (sampling keywords, ``documents``, ``timeout``, ``reuse``), find the
        documents in the text ``units`` (the prompt, or each message's content) and submit ``make_prompt(documents,
        units)`` (units with the documents rearranged when ``reorder="cache-aware"``) with this LLM's sampling
        defaults. A ``reuse`` of None falls back to this LLM's ``reuse`` (then to the engine's default)."""
        kwargs = dict(kwargs)
        explicit = kwargs.pop("documents", None)
        timeout = kwargs.pop("timeout", None) or self.timeout
        reuse = kwargs.pop("reuse", None) or self.reuse
        defaults = SamplingParams(self.max_new_tokens, self.temperature, self.top_p, tuple(self.stop or ()),
                                  self.seed)
        params = SamplingParams.from_kwargs(defaults, **kwargs)
        documents, units = self._documents(units, explicit)
        return self.engine.submit(make_prompt(documents, units), params, timeout=timeout, reuse=reuse)

    def _documents(self, units: list[str], explicit: Sequence[Any] | None) -> tuple[tuple[Any, ...], list[str]]:
        """The documents to pass with a call whose text units are ``units``: explicit ones (str or `pcr_rag.Doc`),
        else the retrieval announcement's that occur in them (`Announcement.documents_for`, with their scopes);
        with ``reorder="cache-aware"`` in cache-aware order, and the units rearranged to it
        (`cache_aware_documents`)."""
        ann = None
        scopes: dict[str, str] = {}
        if explicit is not None:
            if isinstance(explicit, str):
                raise PCRRequestError("documents= must be a list of strings, not a single string; wrap it: [doc]")
            scopes = {d.text: d.scope for d in explicit if isinstance(d, Doc) and d.scope is not None}
            documents = tuple(d.text if isinstance(d, Doc) else d for d in explicit)
        else:
            ann = retrieval_hook().lookup(text="\n".join(units))
            if ann is None:
                return (), units
            documents = ann.documents
        if self.reorder == "cache-aware":
            documents, units = cache_aware_documents(self.engine, units, documents, ann)
        if ann is None:
            return tuple(Doc(d, scopes[d]) if d in scopes else d for d in documents), units
        return ann.with_scopes(ann.documents_for(self.engine, "\n".join(units))), units

    def _submit_completion(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> RequestHandle:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt.strip():
            raise PCRRequestError("PCRLLM received an empty prompt; pass a non-empty query")
        if not self.chat_template:
            chat, system = False, None
            if not formatted:
                prompt = (self.completion_to_prompt or default_completion_to_prompt)(prompt)
        elif formatted:
            # LlamaIndex already ran completion_to_prompt and prepended system_prompt; wrap it in the chat
            # template unless a custom completion_to_prompt did the formatting itself
            chat, system = self.completion_to_prompt is default_completion_to_prompt, None
        else:
            chat, system = True, self.system_prompt
        return self._submit(lambda docs, units: FlatPrompt(units[0], docs, chat, system), [prompt], kwargs)

    def _submit_chat(self, messages: Sequence[ChatMessage],
                     kwargs: dict[str, Any]) -> tuple[RequestHandle, _MakeResponse, tuple[ToolSpec, ...]]:
        """Submit a chat; returns the handle, the response maker and the tools its answer may call.
        ``tools`` (`ToolSpec`s) and ``tool_choice`` come from `_prepare_chat_with_tools`."""
        kwargs = dict(kwargs)
        tools = tuple(kwargs.pop("tools", None) or ())
        choice = kwargs.pop("tool_choice", None) or "auto"
        parallel = bool(kwargs.pop("parallel_tool_calls", False))
        has_tool_turns = any(m.role == MessageRole.TOOL or tool_selections(m) for m in messages)
        native = has_tool_turns and template_renders_tool_calls(self.engine.tokenizer)
        turns = to_chat_turns(messages, native_tools=native)
        if self.system_prompt and not any(t["role"] == "system" for t in turns):
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        if not any(t["content"].strip() for t in turns):
            raise PCRRequestError("PCRLLM received only empty messages; pass a non-empty query")
        if tools:
            turns = add_instruction(turns, tools_instruction(tools, choice, parallel=parallel), self.engine.tokenizer)
            kwargs["response_format"] = tool_call_format(tools, choice, parallel=parallel)
        elif kwargs.get("response_format") is not None:
            fmt = ResponseFormat.of(kwargs["response_format"])
            if fmt.kind == "json_schema" and fmt.schema is not None:  # the model sees the schema; after the documents
                turns = add_instruction(turns, schema_instruction(fmt.schema), self.engine.tokenizer)
            kwargs["response_format"] = fmt
        callable_tools = tools if choice != "none" else ()
        handle = self._submit(
            lambda docs, units: ChatPrompt(tuple({**t, "content": u} for t, u in zip(turns, units)), docs,
                                           chat_template_kwargs=self.chat_template_kwargs),
            [t["content"] for t in turns], kwargs)
        return handle, functools.partial(_chat_response, tools=callable_tools), callable_tools

    # ------------------------------------------------------------------------------------------ responses
    @staticmethod
    def _raw(result: GenerationResult) -> dict[str, Any]:
        """The request's metrics as a response's ``raw`` (and ``additional_kwargs["pcr"]``). ``usage`` has the
        OpenAI shape (``prompt_tokens_details``: ``cached_tokens``, prompt tokens whose KV was reused exactly, and
        ``blended_tokens``, prompt tokens placed by blend mode), as `pcr-rag serve` answers, where LlamaIndex's
        `TokenCountingHandler` reads it; the metrics stay at the top level too, with ``reuse`` (how the call was
        served: "exact" or "blend"). ``computed_tokens + reused_tokens + blended_tokens == prompt_tokens``."""
        m = result.metrics
        completion = len(result.token_ids)
        return {
            "usage": {
                "prompt_tokens": m.prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": m.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": m.reused_tokens, "blended_tokens": m.blended_tokens},
            },
            "finish_reason": result.finish_reason,
            "prompt_tokens": m.prompt_tokens,
            "completion_tokens": completion,
            "computed_tokens": m.computed_tokens,
            "reused_tokens": m.reused_tokens,
            "blended_tokens": m.blended_tokens,
            "reuse": m.reuse,
            "reused_by_tier": dict(m.reused_by_tier),
            "ttft_s": m.ttft_s,
            "e2e_s": m.e2e_s,
            "queue_s": m.queue_s,
            "prefill_s": m.prefill_s,
            "prefill_compute_s": m.prefill_compute_s,
            "prefetch_hit_chunks": m.prefetch_hit_chunks,
            "announcement_claimed": m.announced,
            "documents_found": result.documents_found,
        }

    def _final(self, result: GenerationResult, make: _MakeResponse) -> Any:
        return make(result.text, None, self._raw(result))

    def _responses(self, handle: RequestHandle, make: _MakeResponse,
                   tools: Sequence[ToolSpec] = ()) -> Generator[Any, None, None]:
        """The one sync stream loop (see `_StreamResponses`). Closing the handle is a no-op once finished and
        cancels the request when the consumer stopped early."""
        convert = _StreamResponses(make, self._raw, tools)
        with closing(handle):
            yield from (response for response in map(convert, handle) if response is not None)

    async def _aresponses(self, handle: RequestHandle, make: _MakeResponse,
                          tools: Sequence[ToolSpec] = ()) -> AsyncGenerator[Any, None]:
        """The one async stream loop (as `_responses`)."""
        convert = _StreamResponses(make, self._raw, tools)
        async with aclosing(handle):
            async for piece in handle:
                if (response := convert(piece)) is not None:
                    yield response

    # ------------------------------------------------------------------------------------------ completion
    # Requests are resolved and submitted when the method is called, not on the stream's first item: the query's
    # span (and its announcement) is open now.
    @llm_completion_callback()
    @_translate_errors
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._final(self._submit_completion(prompt, formatted, kwargs).result(), _completion_response)

    @llm_completion_callback()
    @_translate_errors
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._responses(self._submit_completion(prompt, formatted, kwargs), _completion_response)

    @llm_completion_callback()
    @_translate_errors
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._final(await self._submit_completion(prompt, formatted, kwargs), _completion_response)

    @llm_completion_callback()
    @_translate_errors
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        return self._aresponses(self._submit_completion(prompt, formatted, kwargs), _completion_response)

    # ------------------------------------------------------------------------------------------ chat
    @llm_chat_callback()
    @_translate_errors
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        handle, make, _ = self._submit_chat(messages, kwargs)
        return self._final(handle.result(), make)

    @llm_chat_callback()
    @_translate_errors
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._responses(*self._submit_chat(messages, kwargs))

    @llm_chat_callback()
    @_translate_errors
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        handle, make, _ = self._submit_chat(messages, kwargs)
        return self._final(await handle, make)

    @llm_chat_callback()
    @_translate_errors
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return self._aresponses(*self._submit_chat(messages, kwargs))

    # ------------------------------------------------------------------------------------------ function calling
    def _prepare_chat_with_tools(self, tools: Sequence[BaseTool], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 tool_choice: Any = None, **kwargs: Any) -> dict[str, Any]:
        """The `chat` arguments for a call with ``tools``: "any" when ``tool_required``, else ``tool_choice``
        ("auto" by default, "none", or a tool's name). One call per answer unless ``parallel_tool_calls=True`` is
        passed too (then several, one JSON object per line, each a `ToolCallBlock`; LlamaIndex keeps only the first
        unless ``allow_parallel_tool_calls``). ``allow_parallel_tool_calls`` alone does not turn it on: LlamaIndex's
        agents pass True by default, and a small model then repeats its calls turn after turn (the default model's
        agent loop never ended)."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        try:
            specs = tool_specs(tools)
            choice = tool_choice_of(specs, tool_required, tool_choice)
            parallel = bool(kwargs.get("parallel_tool_calls"))
            tool_call_format(specs, choice, parallel=parallel)  # compiles (validates) every schema now
        except InvalidRequestError as exc:  # not a decorator: LlamaIndex reads this method's signature
            raise PCRRequestError(str(exc)) from exc
        return {"messages": messages, "tools": specs, "tool_choice": choice, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        """The tool calls of a `chat_with_tools` answer (its `ToolCallBlock`s)."""
        calls = tool_selections(response.message)
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected a tool call, got text: {(response.message.content or '')[:200]!r}")
        return calls

    # ------------------------------------------------------------------------------------------ structured output
    # On the grammar path (`GrammarProgram`): the answer is constrained to ``output_cls``'s JSON schema.
    # ``as_structured_llm`` wraps ``structured_predict``, so it takes the same path.
    @dispatcher.span
    @_translate_errors
    def structured_predict(self, output_cls: type[M], prompt: BasePromptTemplate,
                           llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> M:
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        result = GrammarProgram(self, output_cls, prompt)(llm_kwargs=llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    @_translate_errors
    async def astructured_predict(self, output_cls: type[M], prompt: BasePromptTemplate,
                                  llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> M:
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        result = await GrammarProgram(self, output_cls, prompt).acall(llm_kwargs=llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    def _structured_stream_call(self, output_cls: type[M], prompt: BasePromptTemplate,
                                llm_kwargs: dict[str, Any] | None = None,
                                **prompt_args: Any) -> Generator[Any, None, None]:
        return GrammarProgram(self, output_cls, prompt).stream_call(llm_kwargs=llm_kwargs, **prompt_args)

    async def _structured_astream_call(self, output_cls: type[M], prompt: BasePromptTemplate,
                                       llm_kwargs: dict[str, Any] | None = None,
                                       **prompt_args: Any) -> AsyncGenerator[Any, None]:
        return await GrammarProgram(self, output_cls, prompt).astream_call(llm_kwargs=llm_kwargs, **prompt_args)


_MakeResponse = Callable[[str, "str | None", "dict[str, Any] | None"], Any]


class _StreamResponses:
    """Engine `StreamChunk`s -> LlamaIndex responses: cumulative ``text`` and the new ``delta`` per token that
    added text (None for one that did not), then a closing response whose ``raw`` holds the request's metrics."""

    def __init__(self, make: _MakeResponse, raw: Callable[[GenerationResult], dict[str, Any]],
                 tools: Sequence[ToolSpec] = ()) -> None:
        self.make = make
        self.raw = raw
        self.text = ""
        self.tools = tools
        self.calling: bool | None = None  # with tools: whether the answer is a call (held back until the end)

    def __call__(self, piece: StreamChunk) -> Any:
        if piece.result is not None:  # the closing chunk (``is_final``)
            return self.make(self.text, "", self.raw(piece.result))
        if not piece.text:
            return None
        self.text += piece.text
        if self.tools:
            if self.calling is None:
                self.calling = self.text.lstrip().startswith("{")
            if self.calling:
                return None
        return self.make(self.text, piece.text, None)


def _completion_response(text: str, delta: str | None, raw: dict[str, Any] | None) -> CompletionResponse:
    extra = {"pcr": raw} if raw is not None else {}
    return CompletionResponse(text=text, delta=delta, raw=raw, additional_kwargs=extra)


def _chat_response(text: str, delta: str | None, raw: dict[str, Any] | None,
                   tools: Sequence[ToolSpec] = ()) -> ChatResponse:
    """A chat response; the closing one (``raw`` set) carries the answer's tool call, if any."""
    extra = {"pcr": raw} if raw is not None else {}
    message = (assistant_message(text, tools, raw) if raw is not None
               else ChatMessage(role=MessageRole.ASSISTANT, content=text))
    return ChatResponse(message=message, delta=delta, raw=raw, additional_kwargs=extra)


# Blocks a text-only chat turn can carry: text, tool calls, the model's own reasoning (not sent back, as providers
# do) and a provider's cache hint (no content). Any other block (image, audio, video, document, citation) holds
# content the model cannot see, so a message with one is refused rather than silently cut to its text.
_TEXT_ONLY_BLOCKS = (TextBlock, ToolCallBlock, ThinkingBlock, CachePoint)


def _check_text_only(message: ChatMessage) -> None:
    for block in message.blocks:
        if not isinstance(block, _TEXT_ONLY_BLOCKS):
            raise PCRRequestError(
                f"PCRLLM serves a text-only model: a {message.role.value!r} message holds a {type(block).__name__}, "
                f"whose content the model cannot see; pass text only (TextBlock), e.g. extract the document's "
                f"text or describe the image in words first")


def to_chat_turns(messages: Sequence[ChatMessage], *, native_tools: bool = False) -> list[dict[str, Any]]:
    """LlamaIndex chat messages -> [{"role", "content", ...}] for the chat template (text only: a message with an
    image, audio, video, document or citation block raises `PCRRequestError`). Tool calls and tool results become
    turns as `pcr_rag.structured.tool_history_turns` describes (``native_tools``: the template renders them
    itself)."""
    turns: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for m in messages:
        _check_text_only(m)
        role = _ROLES.get(m.role)
        tool_turn = history_turn(m, role or "", names, native_tools)
        if tool_turn is not None:
            turns.append(tool_turn)
            continue
        if role is None:
            raise PCRRequestError(f"PCRLLM does not support {m.role.value!r} messages")
        turns.append({"role": role, "content": m.content or ""})
    return turns
