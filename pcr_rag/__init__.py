"""pcr-rag: prefix-tree KV-cache reuse with layer-wise overlap and queue-based prefetch for RAG serving.

Public API::

    from pcr_rag import PCREngine, EngineConfig
"""

from pcr_rag.config import EngineConfig
from pcr_rag.engine import EngineStats, GenerationResult, PCREngine, StreamChunk, TokenStream
from pcr_rag.errors import (
    ConfigError,
    EngineClosedError,
    InvalidRequestError,
    PCRError,
    PromptTooLongError,
    RequestCancelledError,
)
from pcr_rag.metrics import RequestMetrics
from pcr_rag.runtime.scheduler import QueueFullError, Ticket

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "EngineClosedError",
    "EngineConfig",
    "EngineStats",
    "GenerationResult",
    "InvalidRequestError",
    "PCREngine",
    "PCRError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestCancelledError",
    "RequestMetrics",
    "StreamChunk",
    "Ticket",
    "TokenStream",
]
