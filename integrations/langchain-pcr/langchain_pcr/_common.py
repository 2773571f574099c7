"""Pieces shared by `ChatPCR` and `PCRLLM`: engine resolution, the model side of the retrieval hook, metadata."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pcr_rag.handoff import release_ticket, request_documents
from pcr_rag.shared import shared_engine

if TYPE_CHECKING:
    from pcr_rag.engine import GenerationResult, PCREngine

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
PROVIDER = "pcr"

__all__ = [
    "DEFAULT_MODEL_NAME",
    "EngineHolder",
    "RequestDocuments",
    "announce_targets",
    "generation_info",
    "model_display_name",
    "release_ticket",
    "resolve_documents",
    "usage_metadata",
]

# Every ChatPCR / PCRLLM alive in the process (weakly): a hook without an explicit target announces to their engines.
_LIVE_MODELS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # pydantic: unhashable
_LIVE_LOCK = threading.Lock()


class EngineHolder:
    """Lazily resolves a model wrapper's engine: the user's `PCREngine`, else the process-wide shared one.

    Construction is free (no model load); the engine (and the model) load on first use. Thread-safe.
    """

    def __init__(self, owner: Any) -> None:
        self._owner = weakref.ref(owner)
        self._engine: PCREngine | None = None
        self._lock = threading.Lock()
        with _LIVE_LOCK:
            _LIVE_MODELS[id(owner)] = owner

    @property
    def loaded(self) -> PCREngine | None:
        """The engine if it was already resolved (never loads a model)."""
        return self._engine

    def get(self) -> PCREngine:
        if self._engine is not None:
            return self._engine
        owner = self._owner()
        if owner is None:  # pragma: no cover - the owner calls us
            raise RuntimeError("the model wrapper was garbage-collected")
        with self._lock:
            if self._engine is None:
                if owner.engine is not None:
                    self._engine = owner.engine
                else:
                    self._engine = shared_engine(owner.model, owner.tokenizer, owner.config)
        return self._engine


def announce_targets(target: Any) -> list[PCREngine]:
    """The engines a retrieval hook announces to (distinct, in a stable order).

    ``target``: a model wrapper (its engine, loaded if needed), an engine (anything with ``announce``), or None
    (the already-loaded engines of every live `ChatPCR` / `PCRLLM`).
    """
    if target is not None:
        holder = getattr(target, "_holder", None)
        if isinstance(holder, EngineHolder):
            return [holder.get()]
        if hasattr(target, "announce"):
            return [target]
        raise TypeError(
            f"retrieval hook target must be a ChatPCR, a PCRLLM or a PCREngine, got {type(target).__name__}"
        )
    with _LIVE_LOCK:
        models = list(_LIVE_MODELS.values())
    engines: dict[int, PCREngine] = {}
    for model in models:
        holder = getattr(model, "_holder", None)
        engine = holder.loaded if isinstance(holder, EngineHolder) else None
        if engine is not None and not engine.closed:
            engines.setdefault(id(engine), engine)
    return list(engines.values())


@dataclass(frozen=True)
class RequestDocuments:
    """The documents to pass with a request, and whether they came from an announcement."""

    documents: tuple[str, ...]
    announced: bool


def resolve_documents(engine: PCREngine, text: str, run_manager: Any, explicit: Sequence[str] | None) -> RequestDocuments:
    """Documents for a model call: explicit ``documents=`` wins; else the announcement found through the run tree.

    ``text`` is the prompt (or the messages' contents) the documents are searched in. An announcement whose
    documents are all present in order is passed unchanged, so the engine claims its ticket; otherwise the present
    documents are passed in prompt order and the ticket is withdrawn.
    """
    if explicit is not None:
        if isinstance(explicit, str):
            raise ValueError("documents= must be a list of strings, not a single string; wrap it: [doc]")
        return RequestDocuments(tuple(explicit), announced=False)
    ann = _find_announcement(run_manager)
    if ann is None:
        return RequestDocuments((), announced=False)
    if ann.query is not None and not ann.query.strip():
        raise ValueError("empty query: the retriever was asked an empty string; pass a non-empty question")
    present, exact = request_documents(text, ann.documents)
    ticket = ann.take_ticket(engine)
    if ticket is not None and not exact:
        release_ticket(engine, ticket)
    return RequestDocuments(present, announced=True)


def _find_announcement(run_manager: Any) -> Any:
    from langchain_pcr.callbacks import PCRRetrievalCallback

    if run_manager is None:
        return None
    handlers = list(getattr(run_manager, "handlers", []) or []) + list(
        getattr(run_manager, "inheritable_handlers", []) or []
    )
    seen: set[int] = set()
    for handler in handlers:
        if isinstance(handler, PCRRetrievalCallback) and id(handler) not in seen:
            seen.add(id(handler))
            ann = handler.lookup(run_manager.run_id, run_manager.parent_run_id)
            if ann is not None:
                return ann
    return None


def model_display_name(model: Any, engine: PCREngine | None = None) -> str:
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
    """LangChain usage: prompt tokens in, generated tokens out; reused (cached) prompt tokens as ``cache_read``."""
    m = result.metrics
    n_in = int(m.prompt_tokens)
    n_out = len(result.token_ids)
    return UsageMetadata(
        input_tokens=n_in,
        output_tokens=n_out,
        total_tokens=n_in + n_out,
        input_token_details=InputTokenDetails(cache_read=int(m.reused_tokens)),
    )


def generation_info(result: GenerationResult, model_name: str, documents: RequestDocuments) -> dict[str, Any]:
    """Response metadata: finish reason, model name and the PCR metrics of the request (seconds, tokens)."""
    m = result.metrics
    return {
        "model_name": model_name,
        "model_provider": PROVIDER,
        "finish_reason": result.finish_reason,
        "ttft_s": m.ttft_s,
        "e2e_s": m.e2e_s,
        "queue_s": m.queue_s,
        "prefill_s": getattr(m, "prefill_s", None),
        "prompt_tokens": m.prompt_tokens,
        "computed_tokens": m.computed_tokens,
        "reused_tokens": m.reused_tokens,
        "reused_by_tier": dict(m.reused_by_tier),
        "documents": len(documents.documents),
        "documents_found": getattr(result, "documents_found", None),
        "documents_announced": documents.announced,
        "announcement_claimed": bool(getattr(m, "announced", False)),
        "prefetch_hit_chunks": getattr(m, "prefetch_hit_chunks", 0),
    }


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
