"""`PCRModelParams`: the fields, request submission and stream loops shared by `ChatPCR` and `PCRLLM`."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing, closing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal
from uuid import UUID

from langchain_core.language_models import LangSmithParams
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from langchain_pcr._common import PROVIDER, EngineHolder, RequestDocuments, model_display_name
from langchain_pcr._remote import engine_holder
from langchain_pcr._stream_run import take_started_run
from langchain_pcr._tracing import run_span
from langchain_pcr.callbacks import resolve_documents
from pcr_rag.client.http import HTTPEngine
from pcr_rag.engine_api import Engine
from pcr_rag.handle import RequestHandle
from pcr_rag.request import GenerationResult, Prompt, SamplingParams, StreamChunk

__all__ = ["ModelCall", "PCRModelParams"]


@dataclass(frozen=True)
class ModelCall:
    """One submitted model call: the engine, the request's handle, and the documents passed with it.

    ``trace_run``: the LangChain run whose OpenInference span is made current (`run_span`) while the handle is
    consumed, so an `HTTPEngine`'s HTTP call (it starts when the handle is first awaited or iterated, not at
    submit) carries that span as ``traceparent``. None for a local engine: its request's spans start at submit,
    under the same span, and consuming its handle sends nothing.
    """

    engine: Engine
    handle: RequestHandle
    documents: RequestDocuments
    trace_run: UUID | None = None

    def result(self) -> GenerationResult:
        """The handle's `GenerationResult` (a remote call goes out under the run's span)."""
        with run_span(self.trace_run):
            return self.handle.result()

    async def aresult(self) -> GenerationResult:
        """`result` for asyncio."""
        with run_span(self.trace_run):
            return await self.handle.aresult()

    def pieces(self) -> Iterator[StreamChunk]:
        """The handle's stream, each step (the first sends a remote call) under the run's span."""
        if self.trace_run is None:
            yield from self.handle
            return
        steps = iter(self.handle)
        while True:
            with run_span(self.trace_run):  # attached and detached within one step: never across a yield
                piece = next(steps, None)
            if piece is None:
                return
            yield piece

    async def apieces(self) -> AsyncGenerator[StreamChunk, None]:
        """`pieces` for asyncio."""
        if self.trace_run is None:
            async for piece in self.handle:
                yield piece
            return
        steps = aiter(self.handle)
        while True:
            try:
                with run_span(self.trace_run):  # within one step, as in `pieces`
                    piece = await anext(steps)
            except StopAsyncIteration:
                return
            yield piece


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
    # "exact" or "blend" for every call (None: the engine's EngineConfig.reuse, or the server's with base_url);
    # blend is opt-in and approximate (pcr_rag.sched.blend)
    reuse: Literal["exact", "blend"] | None = None
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

    def get_engine(self) -> Engine:
        """The engine behind this model: a `PCREngine` (loads the model on first call), or an `HTTPEngine` with
        ``base_url=``."""
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
            "reuse": self.reuse,
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
        """Validate the per-call ``kwargs`` (sampling keywords, ``documents``, ``timeout``, ``reuse``), resolve the
        documents found in ``text`` and submit ``make_prompt(documents)`` with this model's sampling defaults. A
        ``reuse`` of None falls back to this model's ``reuse`` (then to the engine's or server's default)."""
        kwargs = dict(kwargs)
        explicit = kwargs.pop("documents", None)
        timeout = kwargs.pop("timeout", None) or self.timeout
        reuse = kwargs.pop("reuse", None) or self.reuse
        defaults = SamplingParams(self.max_tokens, self.temperature, self.top_p, tuple(self.stop or ()), self.seed)
        params = SamplingParams.from_kwargs(defaults, stop=stop, **kwargs)
        engine = self._holder.get()
        # ChatPCR.stream's run comes without a run manager: the run it recorded (`langchain_pcr._stream_run`) stands
        # in for it, so a stream finds the announcement and joins the trace as ``invoke`` does
        run = run_manager if run_manager is not None else take_started_run()
        docs = resolve_documents(engine, text, run, explicit)
        run_id = getattr(run, "run_id", None)
        with run_span(run_id):  # an OpenInference trace: the request under its model
            handle = engine.submit(make_prompt(docs.documents), params, timeout=timeout, reuse=reuse)
        return ModelCall(engine, handle, docs, run_id if isinstance(engine, HTTPEngine) else None)

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
            for piece in call.pieces():
                chunk = self._chunk(piece, call)
                if chunk is not None and run_manager is not None and not piece.is_final:
                    run_manager.on_llm_new_token(piece.text, chunk=chunk)
                if chunk is not None:
                    yield chunk

    async def _astream_call(self, call: ModelCall, run_manager: Any) -> AsyncIterator[Any]:
        """The one async stream loop (as `_stream_call`)."""
        async with aclosing(call.handle), aclosing(call.apieces()) as pieces:
            async for piece in pieces:
                chunk = self._chunk(piece, call)
                if chunk is not None and run_manager is not None and not piece.is_final:
                    await run_manager.on_llm_new_token(piece.text, chunk=chunk)
                if chunk is not None:
                    yield chunk
