"""`PCRLLM`: a LangChain text-completion LLM on a local transformers model served by the PCR engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from langchain_pcr._base import ModelCall, PCRModelParams
from langchain_pcr._common import generation_info, model_display_name, usage_metadata
from pcr_rag.request import FlatPrompt, GenerationResult

logger = logging.getLogger(__name__)

__all__ = ["PCRLLM"]


class PCRLLM(PCRModelParams, LLM):
    """Text-completion LLM served by a `pcr_rag.PCREngine` (cached document KV reused across requests).

    With ``chat_template=True`` (default) the prompt is sent as one user turn of the model's chat template (right
    for instruct models such as the default one); ``chat_template=False`` continues the raw text. Documents from a
    `PCRRetrievalCallback` announcement, or passed as ``invoke(prompt, documents=[...])``, are located in the prompt
    and cached as their own token runs.

    Key init args: as `ChatPCR` (model, engine, config, max_tokens, temperature, top_p, seed, stop, timeout, reuse), plus
    ``chat_template`` and ``system`` (a system turn when ``chat_template`` is on).

    Usage per generation is in ``generation_info["usage_metadata"]`` and summed in ``llm_output["token_usage"]``
    (``cached_tokens``: reused exactly; ``blended_tokens``: placed by blend mode, see ``reuse``).
    """

    chat_template: bool = True
    system: str | None = None
    streaming: bool = False
    _ls_model_type: ClassVar[Literal["chat", "llm"]] = "llm"

    @property
    def _llm_type(self) -> str:
        return "pcr"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**super()._identifying_params, "chat_template": self.chat_template}

    # ------------------------------------------------------------------------------------------ requests
    def _request(self, prompt: str, stop: list[str] | None, run_manager: Any, kwargs: dict[str, Any]) -> ModelCall:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("PCRLLM received an empty prompt; pass a non-empty question")
        return self._submit(lambda docs: FlatPrompt(prompt, docs, self.chat_template, self.system), prompt, stop,
                            run_manager, kwargs)

    def _generation(self, result: GenerationResult, call: ModelCall) -> Generation:
        info = generation_info(result, model_display_name(self.model, call.engine), call.documents)
        info["usage_metadata"] = dict(usage_metadata(result))
        return Generation(text=result.text, generation_info=info)

    def _result(self, generations: list[Generation]) -> LLMResult:
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0,
                 "blended_tokens": 0}
        for g in generations:  # each made by `_generation`, with its usage
            u = (g.generation_info or {}).get("usage_metadata")
            if u is None:
                continue
            usage["prompt_tokens"] += u["input_tokens"]
            usage["completion_tokens"] += u["output_tokens"]
            usage["total_tokens"] += u["total_tokens"]
            usage["cached_tokens"] += u["input_token_details"]["cache_read"]
            usage["blended_tokens"] += u["input_token_details"].get("blended", 0)
        return LLMResult(generations=[[g] for g in generations],
                         llm_output={"token_usage": usage, "model_name": self.model_name})

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        # all prompts enter the engine's waiting queue at once (the prefetcher sees them all)
        calls = [self._request(p, stop, run_manager, kwargs) for p in prompts]
        return self._result([self._generation(c.result(), c) for c in calls])

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        calls = [self._request(p, stop, run_manager, kwargs) for p in prompts]
        results = await asyncio.gather(*(c.aresult() for c in calls))
        return self._result([self._generation(r, c) for r, c in zip(results, calls)])

    def _call(self, prompt: str, stop: list[str] | None = None,
              run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> str:
        return self._generate([prompt], stop, run_manager, **kwargs).generations[0][0].text

    def _text_chunk(self, text: str) -> GenerationChunk:
        return GenerationChunk(text=text)

    def _final_chunk(self, result: GenerationResult, call: ModelCall) -> GenerationChunk:
        return GenerationChunk(text="", generation_info=self._generation(result, call).generation_info)

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        return self._stream_call(self._request(prompt, stop, run_manager, kwargs), run_manager)

    def _astream(self, prompt: str, stop: list[str] | None = None,
                 run_manager: AsyncCallbackManagerForLLMRun | None = None,
                 **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        return self._astream_call(self._request(prompt, stop, run_manager, kwargs), run_manager)
