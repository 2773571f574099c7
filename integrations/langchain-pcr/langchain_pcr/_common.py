"""Pieces shared by the retrieval hook and the models: engine resolution, announce targets, response metadata.

Module order (no cycles): ``_common`` (this) <- ``callbacks`` (the retrieval hook) <- ``_base`` (the models'
shared fields, submission and stream loops) <- ``chat_models`` / ``llms``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from langchain_core.messages.ai import InputTokenDetails, UsageMetadata

from pcr_rag.client.handoff import announcement_reuse
from pcr_rag.engine_api import Engine
from pcr_rag.request import GenerationResult

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
PROVIDER = "pcr"

__all__ = [
    "DEFAULT_MODEL_NAME",
    "EngineHolder",
    "RequestDocuments",
    "announce_plan",
    "announce_targets",
    "generation_info",
    "live_models_reuse",
    "model_display_name",
    "usage_metadata",
]

# Every ChatPCR / PCRLLM alive in the process (weakly): a hook without an explicit target announces to their engines.
_LIVE_MODELS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # pydantic: unhashable
_LIVE_LOCK = threading.Lock()


class EngineHolder:
    """Lazily resolves a model wrapper's `Engine`: the user's engine, else the process-wide shared `PCREngine`.

    Construction is free (no model load); the engine (and the model) load on first use. Thread-safe.
    """

    def __init__(self, owner: Any) -> None:
        self._owner = weakref.ref(owner)
        self._engine: Engine | None = None
        self._lock = threading.Lock()
        with _LIVE_LOCK:
            _LIVE_MODELS[id(owner)] = owner

    @property
    def loaded(self) -> Engine | None:
        """The engine if it was already resolved (never loads a model)."""
        return self._engine

    def get(self) -> Engine:
        if self._engine is not None:
            return self._engine
        owner = self._owner()
        if owner is None:  # pragma: no cover - the owner calls us
            raise RuntimeError("the model wrapper was garbage-collected")
        with self._lock:
            if self._engine is None:
                if owner.engine is not None:
                    self._engine = owner.engine
                else:  # the local engine: torch and transformers (pcr-rag[engine]) load here, never for base_url=
                    try:
                        from pcr_rag.config import with_chat_template
                        from pcr_rag.shared import shared_engine
                    except ModuleNotFoundError as exc:
                        from pcr_rag.errors import engine_not_installed

                        raise engine_not_installed(exc) from exc

                    template = getattr(owner, "chat_template", None)  # ChatPCR's str; PCRLLM's is a bool
                    config = with_chat_template(owner.config, template if isinstance(template, str) else None)
                    self._engine = shared_engine(owner.model, owner.tokenizer, config)
        return self._engine


def announce_targets(target: Any) -> list[Engine]:
    """The engines a retrieval hook announces to (distinct, in a stable order).

    ``target``: a model wrapper (its engine, loaded if needed), an engine (anything with ``announce``), or None
    (the already-loaded engines of every live `ChatPCR` / `PCRLLM`).
    """
    return announce_plan(target)[0]


def announce_plan(target: Any) -> tuple[list[Engine], dict[int, str | None]]:
    """(`announce_targets`, ``id(engine) ->`` the reuse mode to announce to it: "exact", "blend", or None for the
    engine's or server's default).

    A model wrapper target announces in its own ``reuse``. An engine target, or None (every live model's engine),
    announces to each engine in the mode of the live models using it: `pcr_rag.client.handoff.announcement_reuse` of
    their ``reuse``, so when two live models on one engine differ the wider prefetch wins ("blend" if either
    blends, else the engine's default if either leaves the mode to it, else "exact"); an engine no live model
    uses gets None. The mode is the model's field: a per-call ``reuse=`` comes after the retrieval.
    """
    if target is not None:
        holder = getattr(target, "_holder", None)
        if isinstance(holder, EngineHolder):
            engine = holder.get()
            return [engine], {id(engine): getattr(target, "reuse", None)}
        if hasattr(target, "announce"):
            return [target], {id(target): live_models_reuse().get(id(target))}
        raise TypeError(
            f"retrieval hook target must be a ChatPCR, a PCRLLM or a PCREngine, got {type(target).__name__}"
        )
    engines: dict[int, Engine] = {}
    for _, engine in _live_models():
        engines.setdefault(id(engine), engine)
    return list(engines.values()), live_models_reuse()


def _live_models() -> list[tuple[Any, Engine]]:
    """(model, its open engine) for every live `ChatPCR` / `PCRLLM` whose engine is loaded (never loads one)."""
    with _LIVE_LOCK:
        models = list(_LIVE_MODELS.values())
    out: list[tuple[Any, Engine]] = []
    for model in models:
        holder = getattr(model, "_holder", None)
        engine = holder.loaded if isinstance(holder, EngineHolder) else None
        if engine is not None and not engine.closed:
            out.append((model, engine))
    return out


def live_models_reuse() -> dict[int, str | None]:
    """``id(engine) ->`` `announcement_reuse` of the ``reuse`` of the live models whose loaded engine it is."""
    modes: dict[int, list[str | None]] = {}
    for model, engine in _live_models():
        modes.setdefault(id(engine), []).append(getattr(model, "reuse", None))
    return {key: announcement_reuse(found) for key, found in modes.items()}


@dataclass(frozen=True)
class RequestDocuments:
    """The documents to pass with a request (str, or `pcr_rag.Doc` with a sharing scope), and whether they came
    from an announcement."""

    documents: tuple[Any, ...]
    announced: bool


def model_display_name(model: Any, engine: Engine | None = None) -> str:
    """A string naming the model: the loaded model's name, else the alias/path, else the default alias."""
    if engine is not None:
        loaded = getattr(engine, "loaded", None)
        name = getattr(loaded, "name", None)
        if isinstance(name, str) and name:
            return name
    if model is None:
        return DEFAULT_MODEL_NAME
    if isinstance(model, str):
        return model
    config = getattr(model, "config", None)
    name = getattr(config, "name_or_path", None) or getattr(config, "model_type", None)
    return str(name) if name else type(model).__name__


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    """LangChain usage: prompt tokens in, generated tokens out; in ``input_token_details``, the prompt tokens
    reused exactly (cached) as ``cache_read`` and those placed by blend mode (approximate KV,
    `pcr_rag.sched.blend`; 0 for a call served exactly) as ``blended``, a provider key `InputTokenDetails`
    allows. The two never overlap: ``cache_read + blended <= input_tokens``."""
    m = result.metrics
    n_in = int(m.prompt_tokens)
    n_out = len(result.token_ids)
    details = InputTokenDetails(cache_read=int(m.reused_tokens))
    details["blended"] = int(m.blended_tokens)  # type: ignore[typeddict-unknown-key]
    return UsageMetadata(
        input_tokens=n_in,
        output_tokens=n_out,
        total_tokens=n_in + n_out,
        input_token_details=details,
    )


def generation_info(result: GenerationResult, model_name: str, documents: RequestDocuments) -> dict[str, Any]:
    """Response metadata: finish reason, model name and the PCR metrics of the request (seconds, tokens), with
    ``blended_tokens`` and ``reuse`` (how it was served: "exact" or "blend")."""
    m = result.metrics
    return {
        "model_name": model_name,
        "model_provider": PROVIDER,
        "finish_reason": result.finish_reason,
        "ttft_s": m.ttft_s,
        "e2e_s": m.e2e_s,
        "queue_s": m.queue_s,
        "prefill_s": m.prefill_s,
        "prefill_compute_s": m.prefill_compute_s,
        "prompt_tokens": m.prompt_tokens,
        "computed_tokens": m.computed_tokens,
        "reused_tokens": m.reused_tokens,
        "blended_tokens": m.blended_tokens,
        "reuse": m.reuse,
        "reused_by_tier": dict(m.reused_by_tier),
        "documents": len(documents.documents),
        "documents_found": result.documents_found,
        "documents_announced": documents.announced,
        "announcement_claimed": m.announced,
        "prefetch_hit_chunks": m.prefetch_hit_chunks,
    }
