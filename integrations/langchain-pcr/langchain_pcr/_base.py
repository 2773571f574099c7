"""`PCRModelParams`: the fields, request submission and stream loops shared by `ChatPCR` and `PCRLLM`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from langchain_pcr._common import EngineHolder, RequestDocuments, model_display_name
from langchain_pcr.callbacks import resolve_documents
from pcr_rag.requests import GenerationResult, Prompt, RequestHandle, SamplingParams

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

    _holder: EngineHolder = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _check_engine_args(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("engine") is not None:
            clash = [k for k in ("model", "tokenizer", "config") if values.get(k) is not None]
            if clash:
                raise ValueError(f"pass either engine= or {clash} (they configure the engine), not both")
        return values

    def model_post_init(self, context: Any, /) -> None:
        super().model_post_init(context)
        self._holder = EngineHolder(self)

    @property
    def model_name(self) -> str:
        return model_display_name(self.model, self._holder.loaded)

    def get_engine(self) -> Any:
        """The `PCREngine` behind this model (loads the model on first call)."""
        return self._holder.get()

    # ------------------------------------------------------------------------------------------ requests
    def _submit(self, make_prompt: Callable[[tuple[str, ...]], Prompt], text: str, stop: list[str] | None,
                run_manager: Any, kwargs: dict[str, Any]) -> ModelCall:
        """Validate the per-call ``kwargs`` (sampling keywords, ``documents``, ``timeout``), resolve the documents
        found in ``text`` and submit ``make_prompt(documents)`` with this model's sampling defaults."""
        kwargs = dict(kwargs)
        explicit = kwargs.pop("documents", None)
        timeout = kwargs.pop("timeout", None) or self.timeout
        defaults = SamplingParams(self.max_tokens, self.temperature, self.top_p, self.stop or (), self.seed)
        params = SamplingParams.from_kwargs(defaults, stop=stop, **kwargs)
        engine = self._holder.get()
        docs = resolve_documents(engine, text, run_manager, explicit)
        return ModelCall(engine, engine.submit(make_prompt(docs.documents), params, timeout=timeout), docs)

    def _text_chunk(self, text: str) -> Any:
        raise NotImplementedError

    def _final_chunk(self, result: GenerationResult, call: ModelCall) -> Any:
        raise NotImplementedError

    def _stream_call(self, call: ModelCall, run_manager: Any) -> Iterator[Any]:
        """The one sync stream loop: a chunk per token that added text, then the closing chunk with the usage."""
        try:
            for piece in call.handle:
                if piece.is_final:
                    yield self._final_chunk(piece.result, call)
                    return
                if piece.text:
                    chunk = self._text_chunk(piece.text)
                    if run_manager is not None:
                        run_manager.on_llm_new_token(piece.text, chunk=chunk)
                    yield chunk
        finally:
            call.handle.close()  # no-op when finished; cancels the request when the consumer stopped early

    async def _astream_call(self, call: ModelCall, run_manager: Any) -> AsyncIterator[Any]:
        """The one async stream loop (as `_stream_call`)."""
        try:
            async for piece in call.handle:
                if piece.is_final:
                    yield self._final_chunk(piece.result, call)
                    return
                if piece.text:
                    chunk = self._text_chunk(piece.text)
                    if run_manager is not None:
                        await run_manager.on_llm_new_token(piece.text, chunk=chunk)
                    yield chunk
        finally:
            await call.handle.aclose()
