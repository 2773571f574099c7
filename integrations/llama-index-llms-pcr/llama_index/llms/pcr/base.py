"""`PCRLLM`: a LlamaIndex `CustomLLM` on a local transformers model served by the PCR engine (KV-cache reuse)."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt
from llama_index.llms.pcr.hook import install_retrieval_hook, retrieval_hook

from pcr_rag.errors import InvalidRequestError
from pcr_rag.handoff import release_ticket, request_documents
from pcr_rag.shared import shared_engine

logger = logging.getLogger(__name__)

__all__ = ["PCRLLM", "PCRRequestError", "live_engines"]

F = TypeVar("F", bound=Callable[..., Any])


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
    return wrapper  # type: ignore[return-value]

# id -> live PCRLLM (weakly; pydantic models are unhashable, so no WeakSet)
_LIVE: weakref.WeakValueDictionary[int, PCRLLM] = weakref.WeakValueDictionary()
_LIVE_LOCK = threading.Lock()

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}


def live_engines() -> list[Any]:
    """The distinct engines of every live `PCRLLM` (where a retrieval that names no LLM is announced)."""
    with _LIVE_LOCK:
        llms = list(_LIVE.values())
    engines: dict[int, Any] = {}
    for llm in llms:
        engine = llm.engine_or_none()
        if engine is not None and not engine.closed:
            engines.setdefault(id(engine), engine)
    return list(engines.values())


class PCRLLM(CustomLLM):
    """LlamaIndex LLM served by a `pcr_rag.PCREngine`: retrieved documents' KV is cached and reused.

    Drop it into any pipeline: ``index.as_query_engine(llm=PCRLLM())``. The model loads when the LLM is
    constructed (or pass ``engine=`` to use your own `PCREngine`; otherwise one engine per model/config is shared
    by every PCRLLM and LangChain wrapper in the process).

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
    chat_template: bool = Field(default=True, description="wrap complete() prompts in the chat template")
    is_chat_model: bool = Field(default=True, description="synthesizers use chat() (the model's chat template)")
    retrieval_hook: bool = Field(default=True, description="install the retrieval -> prefetch hook")

    _engine: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        if engine is not None:
            clash = [k for k in ("model", "tokenizer", "config") if kwargs.get(k) is not None]
            if clash:
                raise ValueError(f"pass either engine= or {clash} (they configure the engine), not both")
        super().__init__(**kwargs)
        self._engine = engine if engine is not None else shared_engine(self.model, self.tokenizer, self.config)
        with _LIVE_LOCK:
            _LIVE[id(self)] = self
        if self.retrieval_hook:
            install_retrieval_hook()

    @classmethod
    def class_name(cls) -> str:
        return "PCRLLM"

    @property
    def engine(self) -> Any:
        """The `PCREngine` serving this LLM."""
        return self._engine

    def engine_or_none(self) -> Any:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        loaded = getattr(self._engine, "loaded", None)
        return LLMMetadata(
            context_window=int(self._engine.context_window),
            num_output=int(self.max_new_tokens or self._engine.config.max_new_tokens),
            is_chat_model=self.is_chat_model,
            is_function_calling_model=False,
            model_name=str(getattr(loaded, "name", None) or self.model or "pcr"),
            system_role=MessageRole.SYSTEM,
        )

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` under the model's tokenizer (for `Settings.tokenizer`-style budgeting)."""
        return self._engine.count_tokens(text)

    def tokenize(self, text: str) -> list[int]:
        """Token ids under the model's tokenizer; ``Settings.tokenizer = llm.tokenize`` makes LlamaIndex's
        prompt packing count the model's own tokens."""
        return list(self._engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------------------------------ requests
    def _sampling(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        allowed = {"max_new_tokens", "max_tokens", "temperature", "top_p", "seed", "stop", "documents"}
        unknown = set(kwargs) - allowed
        if unknown:
            raise TypeError(f"PCRLLM got unexpected keyword argument(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        return {
            "max_new_tokens": kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens)),
            "temperature": kwargs.get("temperature", self.temperature),
            "top_p": kwargs.get("top_p", self.top_p),
            "seed": kwargs.get("seed", self.seed),
            "stop": kwargs.get("stop", self.stop),
        }

    def _documents(self, text: str, explicit: Sequence[str] | None) -> tuple[tuple[str, ...], bool]:
        """(documents to pass, announced?) for a call whose prompt/messages text is ``text``."""
        if explicit is not None:
            if isinstance(explicit, str):
                raise PCRRequestError("documents= must be a list of strings, not a single string; wrap it: [doc]")
            return tuple(explicit), False
        ann = retrieval_hook().lookup(text=text)
        if ann is None:
            return (), False
        if ann.query is not None and not ann.query.strip():
            release_ticket(self._engine, ann.take_ticket(self._engine))
            raise PCRRequestError("empty query: the retriever was asked an empty string; pass a non-empty question")
        present, exact = request_documents(text, ann.documents)
        ticket = ann.take_ticket(self._engine)
        if ticket is not None and not exact:
            release_ticket(self._engine, ticket)
        return present, True

    def _prompt_args(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt.strip():
            raise PCRRequestError("PCRLLM received an empty prompt; pass a non-empty query")
        args = self._sampling(kwargs)
        if not self.chat_template:
            args.update(chat=False, system=None)
            if not formatted:
                prompt = self.completion_to_prompt(prompt)
        elif formatted:
            # LlamaIndex already ran completion_to_prompt and prepended system_prompt; wrap it in the chat
            # template unless a custom completion_to_prompt did the formatting itself
            args.update(chat=self.completion_to_prompt is default_completion_to_prompt, system=None)
        else:
            args.update(chat=True, system=self.system_prompt)
        docs, announced = self._documents(prompt, kwargs.get("documents"))
        args["documents"] = docs
        return prompt, args

    def _chat_args(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[list[dict], dict]:
        turns = to_chat_turns(messages)
        if self.system_prompt and not any(t["role"] == "system" for t in turns):
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        if not any(t["content"].strip() for t in turns):
            raise PCRRequestError("PCRLLM received only empty messages; pass a non-empty query")
        args = self._sampling(kwargs)
        docs, _ = self._documents("\n".join(t["content"] for t in turns), kwargs.get("documents"))
        args["documents"] = docs
        return turns, args

    def _stream_step(self, piece: Any, text: str, make: Any) -> tuple[Any, str, bool]:
        """One engine `StreamChunk` -> (the response to yield or None, the text so far, finished). The closing
        chunk carries the request's metrics as ``raw`` (and ``additional_kwargs["pcr"]``)."""
        if piece.is_final:
            return make(text, "", self._raw(piece.result)), text, True
        if piece.text:
            text += piece.text
            return make(text, piece.text, None), text, False
        return None, text, False

    @staticmethod
    def _raw(result: Any) -> dict[str, Any]:
        m = result.metrics
        return {
            "finish_reason": result.finish_reason,
            "prompt_tokens": m.prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "computed_tokens": m.computed_tokens,
            "reused_tokens": m.reused_tokens,
            "reused_by_tier": dict(m.reused_by_tier),
            "ttft_s": m.ttft_s,
            "e2e_s": m.e2e_s,
            "queue_s": m.queue_s,
            "prefill_s": getattr(m, "prefill_s", None),
            "prefetch_hit_chunks": getattr(m, "prefetch_hit_chunks", 0),
            "announcement_claimed": bool(getattr(m, "announced", False)),
            "documents_found": getattr(result, "documents_found", None),
        }

    def _completion(self, result: Any) -> CompletionResponse:
        raw = self._raw(result)
        return CompletionResponse(text=result.text, raw=raw, additional_kwargs={"pcr": raw})

    # ------------------------------------------------------------------------------------------ completion
    @llm_completion_callback()
    @_translate_errors
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        prompt, args = self._prompt_args(prompt, formatted, kwargs)
        docs = args.pop("documents")
        return self._completion(self._engine.generate_prompt(prompt, docs, **args))

    @llm_completion_callback()
    @_translate_errors
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        # Resolved and submitted now, not on first next(): the query's span (and its announcement) is open now.
        prompt, args = self._prompt_args(prompt, formatted, kwargs)
        docs = args.pop("documents")
        stream = self._engine.stream_prompt(prompt, docs, **args)
        return self._completion_gen(stream)

    def _completion_gen(self, stream: Any) -> CompletionResponseGen:
        text = ""
        try:
            for piece in stream:
                resp, text, done = self._stream_step(piece, text, _completion_chunk)
                if resp is not None:
                    yield resp
                if done:
                    return
        finally:
            stream.close()

    @llm_completion_callback()
    @_translate_errors
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        prompt, args = self._prompt_args(prompt, formatted, kwargs)
        docs = args.pop("documents")
        return self._completion(await self._engine.agenerate_prompt(prompt, docs, **args))

    @llm_completion_callback()
    @_translate_errors
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        prompt, args = self._prompt_args(prompt, formatted, kwargs)
        docs = args.pop("documents")
        agen = self._engine.astream_prompt(prompt, docs, **args)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            try:
                async for piece in _translated(agen):
                    resp, text, done = self._stream_step(piece, text, _completion_chunk)
                    if resp is not None:
                        yield resp
                    if done:
                        return
            finally:
                await agen.aclose()

        return gen()

    # ------------------------------------------------------------------------------------------ chat
    @staticmethod
    def _chat_response(result: Any) -> ChatResponse:
        raw = PCRLLM._raw(result)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text), raw=raw,
                            additional_kwargs={"pcr": raw})

    @llm_chat_callback()
    @_translate_errors
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        turns, args = self._chat_args(messages, kwargs)
        docs = args.pop("documents")
        return self._chat_response(self._engine.generate_messages(turns, docs, **args))

    @llm_chat_callback()
    @_translate_errors
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        turns, args = self._chat_args(messages, kwargs)
        docs = args.pop("documents")
        stream = self._engine.stream_messages(turns, docs, **args)

        def gen() -> ChatResponseGen:
            text = ""
            try:
                for piece in stream:
                    resp, text, done = self._stream_step(piece, text, _chat_chunk)
                    if resp is not None:
                        yield resp
                    if done:
                        return
            finally:
                stream.close()

        return gen()

    @llm_chat_callback()
    @_translate_errors
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        turns, args = self._chat_args(messages, kwargs)
        docs = args.pop("documents")
        return self._chat_response(await self._engine.agenerate_messages(turns, docs, **args))

    @llm_chat_callback()
    @_translate_errors
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        turns, args = self._chat_args(messages, kwargs)
        docs = args.pop("documents")
        agen = self._engine.astream_messages(turns, docs, **args)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            try:
                async for piece in _translated(agen):
                    resp, text, done = self._stream_step(piece, text, _chat_chunk)
                    if resp is not None:
                        yield resp
                    if done:
                        return
            finally:
                await agen.aclose()

        return gen()


def _completion_chunk(text: str, delta: str, raw: dict[str, Any] | None) -> CompletionResponse:
    extra = {"pcr": raw} if raw is not None else {}
    return CompletionResponse(text=text, delta=delta, raw=raw, additional_kwargs=extra)


def _chat_chunk(text: str, delta: str, raw: dict[str, Any] | None) -> ChatResponse:
    extra = {"pcr": raw} if raw is not None else {}
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta, raw=raw,
                        additional_kwargs=extra)


async def _translated(agen: Any) -> Any:
    """The engine's async stream submits on first iteration: translate its request errors there too."""
    try:
        async for item in agen:
            yield item
    except InvalidRequestError as exc:
        raise PCRRequestError(str(exc)) from exc


def to_chat_turns(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex chat messages -> [{"role", "content"}] for the chat template (text only)."""
    turns: list[dict[str, str]] = []
    for m in messages:
        role = _ROLES.get(m.role)
        if role is None:
            raise PCRRequestError(f"PCRLLM does not support {m.role.value!r} messages (no tool/function calling)")
        turns.append({"role": role, "content": m.content or ""})
    return turns
