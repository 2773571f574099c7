"""One `PCREngine` per (model, tokenizer, config) per process, shared by every framework wrapper.

The LlamaIndex `PCRLLM`, the LangChain `PCRLLM` / `ChatPCR` and the demo all get their engine here unless the
user passes a `PCREngine` of their own, so two wrappers over the same model share one KV cache (and one cache
directory: an engine holds a lock on its `cache_dir`, so two engines cannot share one directory anyway).

Invariants: at most one engine per key; at most one engine per cache directory (a second key on a directory that
is already in use raises `SharedEngineConflictError`); engines are closed at interpreter exit (which flushes the
SSD write-back).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["SharedEngineConflictError", "close_shared_engines", "engine_key", "shared_engine", "shared_engines"]


class SharedEngineConflictError(ConfigError):
    """Two different model/config pairs want the same cache directory."""


@dataclasses.dataclass
class _Entry:
    engine: PCREngine
    model: Any  # kept so that id()-based keys of model objects stay valid
    tokenizer: Any


_lock = threading.Lock()
_engines: dict[tuple[str, str, str], _Entry] = {}


def _object_key(obj: Any) -> str:
    if obj is None:
        return "default"
    if isinstance(obj, (str, Path)):
        text = str(obj)
        path = Path(text).expanduser()
        return f"path:{path.resolve()}" if path.exists() else f"name:{text}"
    return f"object:{type(obj).__qualname__}:{id(obj)}"


def _config_key(config: EngineConfig) -> str:
    fields = dataclasses.asdict(config)
    return repr(sorted((name, repr(value)) for name, value in fields.items()))


def engine_key(model: Any = None, tokenizer: Any = None, config: EngineConfig | None = None) -> tuple[str, str, str]:
    """The registry key: model identity (alias, resolved path or object id), tokenizer identity, config fields."""
    return (_object_key(model), _object_key(tokenizer), _config_key(config or EngineConfig()))


def shared_engine(model: Any = None, tokenizer: Any = None, config: EngineConfig | None = None) -> PCREngine:
    """The process-wide engine for this model/tokenizer/config, created (model loaded) on first request.

    Args:
        model / tokenizer: as for `PCREngine` (None = the default model; an alias; an HF directory; an object).
        config: `EngineConfig`; None = defaults. Equal configs (field by field) share one engine.
    Raises:
        SharedEngineConflictError: another shared engine with a different model/config uses the same cache_dir.
    """
    config = config or EngineConfig()
    key = engine_key(model, tokenizer, config)
    with _lock:
        entry = _engines.get(key)
        if entry is not None and not _is_closed(entry.engine):
            return entry.engine
        cache_dir = Path(str(config.cache_dir)).resolve()
        for other_key, other in _engines.items():
            if other_key != key and not _is_closed(other.engine) and _cache_dir_of(other.engine) == cache_dir:
                raise SharedEngineConflictError(
                    f"cache_dir {cache_dir} is already used by a shared engine for model {other_key[0]!r} with a "
                    f"different configuration; give this model its own EngineConfig(cache_dir=...), or pass the "
                    f"existing engine explicitly (engine=...)"
                )
        logger.info("creating shared PCREngine for model %s (cache_dir %s)", key[0], cache_dir)
        engine = PCREngine(model=model, tokenizer=tokenizer, config=config)
        _engines[key] = _Entry(engine=engine, model=model, tokenizer=tokenizer)
        return engine


def shared_engines() -> list[PCREngine]:
    """The open shared engines (for stats and tests)."""
    with _lock:
        return [e.engine for e in _engines.values() if not _is_closed(e.engine)]


def close_shared_engines() -> None:
    """Close every shared engine (flushes SSD write-back, releases cache-dir locks); later calls create new ones."""
    with _lock:
        entries = list(_engines.values())
        _engines.clear()
    for entry in entries:
        try:
            entry.engine.close()
        except Exception:  # closing at exit must not mask the real error
            logger.exception("closing a shared PCREngine failed")


def _cache_dir_of(engine: PCREngine) -> Path:
    return Path(str(engine.config.cache_dir)).resolve()


def _is_closed(engine: PCREngine) -> bool:
    return engine.closed


atexit.register(close_shared_engines)
