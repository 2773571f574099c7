"""`PCRLLM`: a LangChain text-completion LLM on a local transformers model served by the PCR engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from langchain_pcr._common import (
    PROVIDER,
    PCRModelParams,
    RequestDocuments,
    generation_info,
    model_display_name,
    resolve_documents,
    usage_metadata,
)

logger = logging.getLogger(__name__)

__all__ = ["PCRLLM"]

_CALL_KWARGS = frozenset({"documents", "max_tokens", "max_new_tokens", "temperature", "top_p", "seed", "timeout"})


class PCRLLM(PCRModelParams, LLM):
    """Text-completion LLM served by a `pcr_rag.PCREngine` (cached document KV reused across requests).

    With ``chat_template=True`` (default) the prompt is sent as one user turn of the model's chat template (right
    for instruct models such as the default one); ``chat_template=False`` continues the raw text. Documents from a
    `PCRRetrievalCallback` announcement, or passed as ``invoke(prompt, documents=[...])``, are located in the prompt
    and cached as their own token runs.

    Key init args: as `ChatPCR` (model, engine, config, max_tokens, temperature, top_p, seed, stop, timeout), plus
    ``chat_template`` and ``system`` (a system turn when ``chat_template`` is on).

    Usage per generation is in ``generation_info["usage_metadata"]`` and summed in ``llm_output["token_usage"]``.
    """

    chat_template: bool = True
    system: str | None = None
    streaming: bool = False


    @property
    def _llm_type(self) -> str:
        return "pcr"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "chat_template": self.chat_template,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider=PROVIDER, ls_model_name=self.model_name, ls_model_type="llm",
                                 ls_temperature=kwargs.get("temperature", self.temperature))
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if isinstance(max_tokens, int):
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    def get_engine(self) -> Any:
        """The `PCREngine` behind this model (loads the model on first call)."""
        return self._holder.get()

    # ------------------------------------------------------------------------------------------ requests
    def _request(self, prompt: str, stop: list[str] | None, run_manager: Any,
                 kwargs: dict[str, Any]) -> tuple[Any, RequestDocuments, dict[str, Any]]:
        unknown = set(kwargs) - _CALL_KWARGS
        if unknown:
            raise TypeError(f"PCRLLM got unexpected keyword argument(s) {sorted(unknown)}; "
                            f"supported per call: {sorted(_CALL_KWARGS)}")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("PCRLLM received an empty prompt; pass a non-empty question")
        engine = self._holder.get()
        docs = resolve_documents(engine, prompt, run_manager, kwargs.get("documents"))
        args = {
            "chat": self.chat_template,
            "system": self.system,
            "max_new_tokens": kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_tokens)),
            "temperature": kwargs.get("temperature", self.temperature),
            "top_p": kwargs.get("top_p", self.top_p),
            "seed": kwargs.get("seed", self.seed),
            "stop": list(stop) if stop is not None else self.stop,
        }
        return engine, docs, args

    def _generation(self, result: Any, engine: Any, docs: RequestDocuments) -> Generation:
        info = generation_info(result, model_display_name(self.model, engine), docs)
        info["usage_metadata"] = dict(usage_metadata(result))
        return Generation(text=result.text, generation_info=info)

    def _result(self, generations: list[Generation]) -> LLMResult:
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0}
        for g in generations:
            u = (g.generation_info or {}).get("usage_metadata", {})
            usage["prompt_tokens"] += u.get("input_tokens", 0)
            usage["completion_tokens"] += u.get("output_tokens", 0)
            usage["total_tokens"] += u.get("total_tokens", 0)
            usage["cached_tokens"] += u.get("input_token_details", {}).get("cache_read", 0)
        return LLMResult(generations=[[g] for g in generations],
                         llm_output={"token_usage": usage, "model_name": self.model_name})

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        timeout = kwargs.pop("timeout", self.timeout)
        out = []
        for prompt in prompts:
            engine, docs, args = self._request(prompt, stop, run_manager, kwargs)
            result = engine.generate_prompt(prompt, docs.documents, timeout=timeout, **args)
            out.append(self._generation(result, engine, docs))
        return self._result(out)

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        timeout = kwargs.pop("timeout", self.timeout)
        requests = [self._request(p, stop, run_manager, kwargs) for p in prompts]
        # all prompts enter the engine's waiting queue at once (the prefetcher sees them all)
        results = await asyncio.wait_for(
            asyncio.gather(*(engine.agenerate_prompt(p, docs.documents, **args)
                             for p, (engine, docs, args) in zip(prompts, requests))),
            timeout,
        )
        return self._result([self._generation(r, e, d) for r, (e, d, _a) in zip(results, requests)])

    def _call(self, prompt: str, stop: list[str] | None = None,
              run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> str:
        return self._generate([prompt], stop, run_manager, **kwargs).generations[0][0].text

    def _final_chunk(self, result: Any, engine: Any, docs: RequestDocuments) -> GenerationChunk:
        info = generation_info(result, model_display_name(self.model, engine), docs)
        info["usage_metadata"] = dict(usage_metadata(result))
        return GenerationChunk(text="", generation_info=info)

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        kwargs.pop("timeout", None)
        engine, docs, args = self._request(prompt, stop, run_manager, kwargs)
        stream = engine.stream_prompt(prompt, docs.documents, **args)
        try:
            for piece in stream:
                if piece.is_final:
                    yield self._final_chunk(piece.result, engine, docs)
                    return
                if not piece.text:
                    continue
                chunk = GenerationChunk(text=piece.text)
                if run_manager is not None:
                    run_manager.on_llm_new_token(piece.text, chunk=chunk)
                yield chunk
        finally:
            stream.close()

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        kwargs.pop("timeout", None)
        engine, docs, args = self._request(prompt, stop, run_manager, kwargs)
        agen = engine.astream_prompt(prompt, docs.documents, **args)
        try:
            async for piece in agen:
                if piece.is_final:
                    yield self._final_chunk(piece.result, engine, docs)
                    return
                if not piece.text:
                    continue
                chunk = GenerationChunk(text=piece.text)
                if run_manager is not None:
                    await run_manager.on_llm_new_token(piece.text, chunk=chunk)
                yield chunk
        finally:
            await agen.aclose()
