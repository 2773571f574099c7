"""`PCRModelParams`: the fields, request submission and stream loops shared by `ChatPCR` and `PCRLLM`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from langchain_core.language_models import LangSmithParams
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from langchain_pcr._common import PROVIDER, EngineHolder, RequestDocuments, model_display_name
from langchain_pcr._remote import engine_holder
from langchain_pcr._tracing import run_span
from langchain_pcr.callbacks import resolve_documents
from pcr_rag.requests import GenerationResult, Prompt, RequestHandle, SamplingParams, StreamChunk

if TYPE_CHECKING:
    from pcr_rag.engine import PCREngine

__all__ = ["ModelCall", "PCRModelParams"]


@dataclass(frozen=True)
class ModelCall:
    """One submitted model call: the engine, the request's handle, and the documents passed with it."""

    engine: PCREngine
    handle: RequestHandle
    documents: RequestDocuments


class PCRModelParams(BaseModel):
    """Fields and engine wiring shared by `ChatPCR` and `PCRLLM` (mixed in before the LangChain base class)."""

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True, protected_namespaces=())

    model: Any = None
    tokenizer: Any = Field(default=None, exclude=True)
    engine: Any = Field(default=None, exclude=True)
    config: Any = Field(default=None, exclude=True)
    max_tokens: int | None = Field(default=None, alias="max_new_tokens", ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    timeout: float | None = Field(default=None, gt=0)
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat-template variables (ChatPrompt's)
    # base_url mode (langchain_pcr._remote): a pcr-rag server instead of a local engine
    base_url: str | None = None
    api_key: SecretStr | None = Field(default=None, exclude=True)

    _holder: EngineHolder = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _check_engine_args(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("engine") is not None:
            clash = [k for k in ("model", "tokenizer", "config") if values.get(k) is not None]
            clash += ["chat_template"] if isinstance(values.get("chat_template"), str) else []
            if clash:
                raise ValueError(f"pass either engine= or {clash} (they configure the engine), not both")
        return values

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        self._holder = engine_holder(self)

    @property
    def model_name(self) -> str:
        return model_display_name(self.model, self._holder.loaded)

    def get_engine(self) -> Any:
        """The `PCREngine` behind this model (loads the model on first call)."""
        return self._holder.get()

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` under the engine's tokenizer (no special tokens; the server's ``/tokenize`` with
        ``base_url``), so `get_num_tokens` and `get_num_tokens_from_messages` count the model's own tokens instead
        of LangChain's GPT-2 fallback. A ``custom_get_token_ids`` the caller set wins, as in LangChain."""
        custom = getattr(self, "custom_get_token_ids", None)
        if custom is not None:
            return list(custom(text))
        ids = self._holder.get().tokenizer(text, add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]

    def get_num_tokens(self, text: str) -> int:
        """Tokens of ``text`` under the engine's tokenizer (`get_token_ids`)."""
        return len(self.get_token_ids(text))

    # ------------------------------------------------------------------------------------------ metadata
    _ls_model_type: ClassVar[Literal["chat", "llm"]]

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER,
            ls_model_name=kwargs["model"] if isinstance(kwargs.get("model"), str) else self.model_name,
            ls_model_type=self._ls_model_type,
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if isinstance(max_tokens, int):
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    # ------------------------------------------------------------------------------------------ requests
    def _submit(self, make_prompt: Callable[[tuple[str, ...]], Prompt], text: str, stop: list[str] | None,
                run_manager: Any, kwargs: dict[str, Any]) -> ModelCall:
        """Validate the per-call ``kwargs`` (sampling keywords, ``documents``, ``timeout``), resolve the documents
        found in ``text`` and submit ``make_prompt(documents)`` with this model's sampling defaults."""
        kwargs = dict(kwargs)
        explicit = kwargs.pop("documents", None)
        timeout = kwargs.pop("timeout", None) or self.timeout
        defaults = SamplingParams(self.max_tokens, self.temperature, self.top_p, tuple(self.stop or ()), self.seed)
        params = SamplingParams.from_kwargs(defaults, stop=stop, **kwargs)
        engine = self._holder.get()
        docs = resolve_documents(engine, text, run_manager, explicit)
        with run_span(getattr(run_manager, "run_id", None)):  # an OpenInference trace: the request under its model
            return ModelCall(engine, engine.submit(make_prompt(docs.documents), params, timeout=timeout), docs)

    def _text_chunk(self, text: str) -> Any:
        raise NotImplementedError

    def _final_chunk(self, result: GenerationResult, call: ModelCall) -> Any:
        raise NotImplementedError

    def _chunk(self, piece: StreamChunk, call: ModelCall) -> Any:
        """The LangChain chunk for one engine `StreamChunk`: a text chunk, the closing chunk with the usage, or
        None for a token that added no text yet."""
        if piece.result is not None:  # the closing chunk (``is_final``)
            return self._final_chunk(piece.result, call)
        return self._text_chunk(piece.text) if piece.text else None

    def _stream_call(self, call: ModelCall, run_manager: Any) -> Iterator[Any]:
        """The one sync stream loop. Closing the handle is a no-op once finished and cancels the request when the
        consumer stopped early."""
        with closing(call.handle):
            for piece in call.handle:
                chunk = self._chunk(piece, call)
                if chunk is not None and run_manager is not None and not piece.is_final:
                    run_manager.on_llm_new_token(piece.text, chunk=chunk)
                if chunk is not None:
                    yield chunk

    async def _astream_call(self, call: ModelCall, run_manager: Any) -> AsyncIterator[Any]:
        """The one async stream loop (as `_stream_call`)."""
        async with aclosing(call.handle):
            async for piece in call.handle:
                chunk = self._chunk(piece, call)
                if chunk is not None and run_manager is not None and not piece.is_final:
                    await run_manager.on_llm_new_token(piece.text, chunk=chunk)
                if chunk is not None:
                    yield chunk
