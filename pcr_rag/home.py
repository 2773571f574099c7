"""Where pcr-rag keeps files outside a project: ``$XDG_CACHE_HOME/pcr-rag``, else ``~/.cache/pcr-rag``.

Read when asked, never at import, so a process (CI, a test) that points ``XDG_CACHE_HOME`` elsewhere moves every
default location with it: the converted models (``models/``) and the KV cache directory (``kv/``). Each also has
its own variable (``PCR_RAG_MODEL_CACHE``, ``PCR_RAG_CACHE_DIR``), which wins.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/pcr-rag`` when the variable is set to an absolute path (the XDG rule), else
    ``~/.cache/pcr-rag``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "pcr-rag"
