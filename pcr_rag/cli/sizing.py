"""How much DRAM and SSD a model and a corpus need: KV bytes per token, chunk and document from the model's config
(no weights loaded), and the cache capacity that serves a target hit rate when documents are read with Zipf-skewed
popularity (`pcr-rag size`).

KV geometry: layers x 2 (K and V) x KV heads x head dim x the KV dtype's bytes per token (`KVGeometry`), read from
``config.json`` (a local model directory, a Hugging Face repo id's snapshot, or only its ``config.json`` fetched
with ``allow_download``) or from a GGUF file's metadata (a known alias or a ``.gguf`` path; an alias already
converted by the model cache reads its ``config.json``). The KV dtype is the model's compute dtype, as in the engine
(``"auto"``: bfloat16 on CUDA and on CPUs with native bf16, else float32).

Hit rate vs capacity: documents are drawn independently with the simulator's and bench's Zipf law
(`pcr_rag.bench.workload.zipf_weights`: ``P(rank r) ∝ r^-s``). A cache holding ``C`` documents' KV serves
    - under LRU, Che's approximation: with the characteristic time ``T`` solving ``sum_i (1 - exp(-p_i T)) = C``,
      the hit rate is ``sum_i p_i (1 - exp(-p_i T))`` (accurate for independent requests over many documents);
    - at best (the ``C`` most popular documents pinned, the bound no policy beats), ``sum_{i <= C} p_i``.
A document's KV is one cacheable unit here: exact for the first retrieved document after a shared system prompt
and for fixed retrieval lists (count each distinct list as a document); a later document in a top-k prompt is
reused only behind the same documents (the chunk keys chain), so for free-form top-k retrieval run the trace-driven
simulator (`pcr-rag simulate`) on your workload. Tiers are inclusive (DRAM write-back goes to SSD), so the SSD needs
the capacity of the total hit rate and DRAM the capacity of the part served from memory.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pcr_rag.bench.workload import zipf_weights
from pcr_rag.errors import PCRError
from pcr_rag.model.hub import looks_like_repo_id, resolve_repo
from pcr_rag.model.model import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    KVGeometry,
    UnknownModelError,
    kv_geometry,
    resolve_device,
    resolve_dtype,
)
from pcr_rag.model.model_cache import GGUFSource, ModelCache

__all__ = ["CacheNeed", "SizingError", "kv_size", "lru_hit_rate", "model_config", "need_for_hit_rate"]

HIT_RATES = (0.5, 0.8, 0.9, 0.95, 0.99)  # the rows `pcr-rag size` prints besides the target


class SizingError(PCRError, ValueError):
    """Bad sizing input (documents, tokens, Zipf exponent, hit rate)."""


# ------------------------------------------------------------------------------------------------ geometry
def model_config(model: str | None, *, model_cache_dir: str | os.PathLike | None = None,
                 allow_download: bool = False) -> tuple[Any, str]:
    """(transformers config, display name) of ``model`` without loading weights: a known alias, a ``.gguf`` file,
    a local model directory, or a Hugging Face repo id (its cached snapshot; with ``allow_download`` only its
    ``config.json`` is fetched when not cached)."""
    from transformers import AutoConfig

    text = os.fspath(model if model is not None else DEFAULT_MODEL)
    alias = text.strip().lower()
    if alias in KNOWN_MODELS:
        spec = KNOWN_MODELS[alias]
        source = spec.locate()
        cache = ModelCache(model_cache_dir)
        entry = cache.lookup(spec.alias, source)
        if entry is not None:
            return AutoConfig.from_pretrained(entry, local_files_only=True), spec.alias
        return _gguf_config(source), spec.alias
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_config(GGUFSource(path.name, (path.resolve(),))), path.stem
    if path.is_dir():
        if (path / "config.json").is_file():
            return AutoConfig.from_pretrained(path, local_files_only=True), path.resolve().name
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_config(GGUFSource(ggufs[0].name, (ggufs[0].resolve(),))), ggufs[0].stem
        raise UnknownModelError(f"{path} holds no config.json and {len(ggufs)} .gguf files; pass a model directory, "
                                f"one .gguf file or a known alias")
    if not path.exists() and looks_like_repo_id(text.strip()):
        repo = text.strip()
        try:
            snapshot = resolve_repo(repo, allow_download=False)
            return AutoConfig.from_pretrained(snapshot, local_files_only=True), repo
        except FileNotFoundError:
            if not allow_download:
                raise UnknownModelError(f"{repo!r} is not in the local Hugging Face cache; pass --allow-download to "
                                        f"fetch its config.json (no weights), or a local directory") from None
        from huggingface_hub import hf_hub_download

        config_file = hf_hub_download(repo, "config.json")
        return AutoConfig.from_pretrained(Path(config_file).parent, local_files_only=True), repo
    raise UnknownModelError(f"unknown model {text!r}: pass a known alias ({', '.join(KNOWN_MODELS)}), a local model "
                            f"directory, a .gguf file or a Hugging Face repo id")


def _gguf_config(source: GGUFSource) -> Any:
    """The config transformers reads from a GGUF file's metadata (parts joined in a scratch directory first)."""
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory(prefix="pcr-size-") as scratch, source.materialize(Path(scratch)) as gguf:
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)


def kv_size(config: Any, dtype: str = "auto", device: str = "cpu") -> KVGeometry:
    """The KV geometry of ``config`` at the dtype the engine would compute in (``dtype`` as `EngineConfig.dtype`)."""
    return kv_geometry(config, resolve_dtype(dtype, resolve_device(device)))


# ------------------------------------------------------------------------------------------------ hit rates
def _check(documents: int, zipf: float, hit_rate: float | None = None) -> None:
    if not isinstance(documents, int) or isinstance(documents, bool) or documents < 1:
        raise SizingError(f"documents must be an integer >= 1, got {documents!r}")
    if not (isinstance(zipf, (int, float)) and math.isfinite(zipf) and zipf >= 0):
        raise SizingError(f"the Zipf exponent must be a finite number >= 0 (0 = uniform), got {zipf!r}")
    if hit_rate is not None and not (isinstance(hit_rate, (int, float)) and 0 < hit_rate < 1):
        raise SizingError(f"the hit rate must be in (0, 1), e.g. 0.9, got {hit_rate!r}")


def _che(p: np.ndarray, t: float) -> tuple[float, float]:
    """(documents held, hit rate) of an LRU cache whose characteristic time is ``t`` requests."""
    held = -np.expm1(-p * t)
    return float(held.sum()), float((p * held).sum())


def lru_hit_rate(documents: int, zipf: float, capacity_documents: float) -> float:
    """Che's approximation of an LRU cache's hit rate holding ``capacity_documents`` of ``documents`` Zipf-popular
    documents (see the module docstring)."""
    _check(documents, zipf)
    if capacity_documents >= documents:
        return 1.0
    if capacity_documents <= 0:
        return 0.0
    p = zipf_weights(documents, zipf)
    lo, hi = 0.0, 1.0
    while _che(p, hi)[0] < capacity_documents:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if _che(p, mid)[0] < capacity_documents else (lo, mid)
    return _che(p, hi)[1]


@dataclass(frozen=True)
class CacheNeed:
    """Documents' KV a cache must hold to serve ``hit_rate`` of document reads: under LRU (``lru_documents``, Che's
    approximation) and at best (``ideal_documents``: the most popular ones pinned). Bytes: times the document's."""

    hit_rate: float
    lru_documents: int
    ideal_documents: int
    document_bytes: int

    @property
    def lru_bytes(self) -> int:
        return self.lru_documents * self.document_bytes

    @property
    def ideal_bytes(self) -> int:
        return self.ideal_documents * self.document_bytes


def need_for_hit_rate(documents: int, zipf: float, hit_rate: float, document_bytes: int) -> CacheNeed:
    """The `CacheNeed` for ``hit_rate`` over ``documents`` Zipf-``zipf`` documents of ``document_bytes`` each."""
    _check(documents, zipf, hit_rate)
    p = zipf_weights(documents, zipf)
    ideal = int(np.searchsorted(np.cumsum(p), hit_rate * (1 - 1e-12))) + 1
    lo, hi = 0.0, 1.0
    while _che(p, hi)[1] < hit_rate:
        hi *= 2.0
        if hi > 1e18:  # unreachable for hit_rate < 1; guards a degenerate float case
            break
    for _ in range(100):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if _che(p, mid)[1] < hit_rate else (lo, mid)
    lru = min(documents, math.ceil(_che(p, hi)[0] - 1e-9))
    return CacheNeed(hit_rate, lru, min(documents, ideal), document_bytes)
