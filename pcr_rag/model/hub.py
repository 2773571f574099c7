"""Hugging Face repo ids ("HuggingFaceTB/SmolLM2-135M-Instruct") resolved to a local snapshot directory.

The local HF cache is always looked at first (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``, read when a model loads, so a changed environment counts): a repo there loads with no
network, whatever the settings, from the snapshot ``refs/main`` (or ``revision``) names.

A repo that is not cached is downloaded only when the caller allows it (``EngineConfig.allow_download=True``,
``pcr-rag serve --allow-download``): pcr-rag contacts no model hub by default. ``HF_HUB_OFFLINE=1`` (or
``TRANSFORMERS_OFFLINE=1``) in the environment forbids it even then, as it does for transformers and vLLM.
Offline is asked per call (``local_files_only=True``): pcr-rag changes no environment variable and no
huggingface_hub setting, so the application's own hub users (an embedding model, a reranker) download as before.
A download fetches the files a transformers model directory needs (configs, safetensors weights, tokenizer files,
chat templates), not every file of the repo.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from pcr_rag.errors import PCRError

log = logging.getLogger(__name__)

#: What a download fetches: enough for ``from_pretrained`` of a safetensors model and its tokenizer.
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*")
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _user_offline() -> bool:
    """Whether the environment forbids downloads now (the variables as huggingface_hub reads them)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in _OFFLINE_VARIABLES)


class HubModelError(PCRError, ValueError):
    """A Hugging Face repo id could not be resolved to a local model directory; the message says what to do."""


class ModelNotCachedError(HubModelError, FileNotFoundError):
    """The repo is not in the local HF cache and downloading was not allowed (or failed)."""


def looks_like_repo_id(text: str) -> bool:
    """Whether ``text`` has the shape of a Hugging Face repo id (``org/name``, or a bare legacy ``name``), with
    none of the sequences the hub refuses (``--``, ``..``)."""
    return bool(_REPO_ID.match(text)) and "--" not in text and ".." not in text and not text.endswith(".git")


def hub_cache_dir() -> Path:
    """The HF hub cache directory, from the environment now: ``$HF_HUB_CACHE``, ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (huggingface_hub's own rule, which it reads only once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_repo(repo_id: str, *, revision: str | None = None, allow_download: bool = False) -> Path:
    """The local snapshot directory of ``repo_id`` (see the module docstring for where it comes from).

    Raises:
        ModelNotCachedError: not cached and a download was not allowed, forbidden by ``HF_HUB_OFFLINE=1`` or
            failed; the message names the cache searched and the options.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    cache = hub_cache_dir()
    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
        log.info("model %s: local HF cache snapshot %s", repo_id, path)
        return path
    except (LocalEntryNotFoundError, FileNotFoundError, OfflineModeIsEnabled):
        pass
    where = f"not in the local Hugging Face cache ({cache})"
    if not allow_download:
        raise ModelNotCachedError(
            f"model {repo_id!r} is {where}, and pcr-rag never downloads from a model hub unless allowed: pass "
            f"allow_download=True (EngineConfig / PCREngine(allow_download=True), `pcr-rag serve --allow-download`), "
            f"or fetch it first with `hf download {repo_id}` (set HF_HOME to use another cache)")
    if _user_offline():
        raise ModelNotCachedError(
            f"model {repo_id!r} is {where}; allow_download=True, but HF_HUB_OFFLINE=1 is set in the environment, "
            f"which forbids downloads: unset it, or fetch the model where the network is reachable")
    log.info("model %s: downloading from the Hugging Face hub into %s", repo_id, cache)
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=False,
                                      allow_patterns=list(DOWNLOAD_PATTERNS)))
    except (HfHubHTTPError, OfflineModeIsEnabled, OSError) as exc:
        raise ModelNotCachedError(f"model {repo_id!r} is {where}, and downloading it failed: "
                                  f"{type(exc).__name__}: {exc}") from exc

