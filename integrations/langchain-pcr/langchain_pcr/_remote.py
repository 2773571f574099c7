"""``base_url`` mode: a `ChatPCR` / `PCRLLM` whose calls and retrieval announcements go to a `pcr-rag serve` server.

The model then holds a `pcr_rag.client.http.HTTPEngine` instead of a local `PCREngine`; everything else (the retrieval
hook's announcements, documents found in the prompt, sampling keywords, timeouts, usage and response metadata)
works as with a local engine, so several worker processes share one engine and one KV cache.
"""

from __future__ import annotations

import os
from typing import Any

from langchain_pcr._common import EngineHolder
from pcr_rag.client.http import HTTPEngine
from pcr_rag.engine_api import Engine

__all__ = ["API_KEY_ENV", "RemoteEngineHolder", "engine_holder"]

API_KEY_ENV = "PCR_RAG_API_KEY"


class RemoteEngineHolder(EngineHolder):
    """An `EngineHolder` whose engine is an `HTTPEngine` (built at once: no model loads in this process)."""

    def __init__(self, owner: Any, engine: HTTPEngine) -> None:
        super().__init__(owner)
        self._engine: Engine = engine  # mypy checks here that an HTTPEngine is an Engine

    def get(self) -> Engine:
        return self._engine


def engine_holder(owner: Any) -> EngineHolder:
    """The holder for a model wrapper: remote when ``owner.base_url`` is set, else the local, lazy one.

    Raises:
        ValueError: ``base_url`` together with ``engine``, ``tokenizer``, ``config``, a model object or a
            ``chat_template`` text (those configure a local engine; the server has its own).
    """
    if owner.base_url is None:
        return EngineHolder(owner)
    clash = [k for k in ("engine", "tokenizer", "config") if getattr(owner, k) is not None]
    if owner.model is not None and not isinstance(owner.model, str):
        clash.append("model (an object)")
    if isinstance(getattr(owner, "chat_template", None), str):  # ChatPCR's template; PCRLLM's is a bool
        clash.append("chat_template (a template: the server renders with its own, pcr-rag serve --chat-template)")
    if clash:
        raise ValueError(f"pass either base_url= (a pcr-rag server) or {clash} (a local engine), not both")
    secret = owner.api_key
    key = secret.get_secret_value() if secret is not None else os.environ.get(API_KEY_ENV)
    return RemoteEngineHolder(owner, HTTPEngine(owner.base_url, api_key=key, model=owner.model))
