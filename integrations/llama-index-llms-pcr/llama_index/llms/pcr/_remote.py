"""``base_url`` mode: a `PCRLLM` whose calls and retrieval announcements go to a `pcr-rag serve` server.

`PCRLLM(base_url=...)` holds a `pcr_rag.client.http.HTTPEngine` instead of a local `PCREngine`; the retrieval hook
announces to it, documents are found in the prompt and passed with the call, and ``metadata`` / ``count_tokens``
ask the server, so several worker processes share one engine and one KV cache.
"""

from __future__ import annotations

import os
from typing import Any

from pcr_rag.client.http import HTTPEngine

__all__ = ["API_KEY_ENV", "remote_engine"]

API_KEY_ENV = "PCR_RAG_API_KEY"


def remote_engine(llm: Any, engine: Any = None) -> HTTPEngine:
    """The `HTTPEngine` for ``llm.base_url`` (key: ``llm.api_key``, else ``$PCR_RAG_API_KEY``).

    Raises:
        ValueError: ``base_url`` together with ``engine``, ``tokenizer``, ``config``, a model object or a
            ``chat_template`` text (those configure a local engine; the server has its own).
    """
    clash = [k for k, v in (("engine", engine), ("tokenizer", llm.tokenizer), ("config", llm.config)) if v is not None]
    if llm.model is not None and not isinstance(llm.model, str):
        clash.append("model (an object)")
    if isinstance(llm.chat_template, str):  # a template (a bool only says whether complete() uses one)
        clash.append("chat_template (a template: the server renders with its own, pcr-rag serve --chat-template)")
    if clash:
        raise ValueError(f"pass either base_url= (a pcr-rag server) or {clash} (a local engine), not both")
    key = llm.api_key or os.environ.get(API_KEY_ENV)
    return HTTPEngine(llm.base_url, api_key=key, model=llm.model)
