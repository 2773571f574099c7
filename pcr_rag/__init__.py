"""pcr-rag: prefix-tree KV-cache reuse with layer-wise overlap and queue-based prefetch for RAG serving.

Public API::

    from pcr_rag import PCREngine, EngineConfig
    from pcr_rag import RagPrompt, FlatPrompt, ChatPrompt, SamplingParams   # engine.submit(prompt, params)
    from pcr_rag import Doc            # a document with its sharing scope: Doc(text, scope="shared" | "private")

Names are imported lazily, so light modules (``pcr_rag.rag.corpus``, ``pcr_rag.bench.report``, the simulator) do not
pull in torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "EngineConfig": "pcr_rag.config",
    "EngineStats": "pcr_rag.engine",
    "PCREngine": "pcr_rag.engine",
    "ConfigError": "pcr_rag.errors",
    "EngineClosedError": "pcr_rag.errors",
    "InvalidRequestError": "pcr_rag.errors",
    "PCRError": "pcr_rag.errors",
    "PromptTooLongError": "pcr_rag.errors",
    "RequestCancelledError": "pcr_rag.errors",
    "QueueFullError": "pcr_rag.errors",
    "RequestMetrics": "pcr_rag.metrics",
    "Doc": "pcr_rag.prompt",
    "ChatPrompt": "pcr_rag.request",
    "FlatPrompt": "pcr_rag.request",
    "GenerationResult": "pcr_rag.request",
    "RagPrompt": "pcr_rag.request",
    "RequestHandle": "pcr_rag.handle",
    "SamplingParams": "pcr_rag.request",
    "StreamChunk": "pcr_rag.request",
    "Ticket": "pcr_rag.sched.announcements",
    "UnknownModelError": "pcr_rag.model.model",
    "CacheDirLockedError": "pcr_rag.cache.errors",
}

__all__ = [
    "CacheDirLockedError",
    "ChatPrompt",
    "ConfigError",
    "Doc",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "FlatPrompt",
    "GenerationResult",
    "InvalidRequestError",
    "PCREngine",
    "PCRError",
    "PromptTooLongError",
    "QueueFullError",
    "RagPrompt",
    "RequestCancelledError",
    "RequestHandle",
    "RequestMetrics",
    "SamplingParams",
    "StreamChunk",
    "Ticket",
    "UnknownModelError",
]

if TYPE_CHECKING:
    from pcr_rag.cache.errors import CacheDirLockedError
    from pcr_rag.config import EngineConfig
    from pcr_rag.engine import EngineStats, PCREngine
    from pcr_rag.errors import (
        ConfigError,
        EngineClosedError,
        InvalidRequestError,
        PCRError,
        PromptTooLongError,
        QueueFullError,
        RequestCancelledError,
    )
    from pcr_rag.handle import RequestHandle
    from pcr_rag.metrics import RequestMetrics
    from pcr_rag.prompt import Doc
    from pcr_rag.request import (
        ChatPrompt,
        FlatPrompt,
        GenerationResult,
        RagPrompt,
        SamplingParams,
        StreamChunk,
    )
    from pcr_rag.sched.announcements import Ticket


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pcr_rag' has no attribute {name!r}")
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:  # the engine's names without the 'engine' extra: say what to install
        from pcr_rag.errors import engine_not_installed

        raise engine_not_installed(exc) from exc
    value = getattr(imported, name)
    globals()[name] = value
    return value
