"""Module names that moved, each kept as a deprecated alias for one release (issue 51's regrouping).

`MOVED` maps an old dotted name to the module that now holds its code. The old file is a two-line shim that calls
`alias_module(__name__)`: the import warns once (`DeprecationWarning`, naming the new module) and then yields the
new module object itself, so ``from pcr_rag.runtime.model import load_model`` and ``import pcr_rag.runtime.model``
keep working and patching either name patches the one module. A module split in several (`SPLIT`) keeps a shim
that warns and re-exports the new modules' public names. Nothing inside pcr-rag imports an old name (an
import-linter contract, ``make lint``).
"""

from __future__ import annotations

import importlib
import sys
import warnings

# the release after which the aliases go; one place, so the warning and the docs say the same
REMOVED_IN = "0.2.0"

MOVED: dict[str, str] = {
    **{f"pcr_rag.runtime.{name}": f"pcr_rag.sched.{name}" for name in (
        "admission", "announcements", "batch", "blend", "blend_gate", "gc_pauses", "prefetcher", "runner",
        "scheduler", "step_budget", "transfer")},
    **{f"pcr_rag.runtime.{name}": f"pcr_rag.model.{name}" for name in (
        "attention_probe", "detokenize", "forward", "grammar", "hub", "kernel_probe", "kv_arena", "model",
        "model_cache", "provenance", "rope_shift", "sampling", "tile_probe", "weights")},
    # "remote" now means only the KV store tier (pcr_rag.cache.tiers.remote*); the HTTP client is pcr_rag.client
    "pcr_rag.remote": "pcr_rag.client.http",
    "pcr_rag.remote_wire": "pcr_rag.client.wire",
    "pcr_rag.routing": "pcr_rag.client.routing",
    "pcr_rag.handoff": "pcr_rag.client.handoff",
    "pcr_rag.cache.engine": "pcr_rag.cache.manager",
    "pcr_rag.cache.engine_lock": "pcr_rag.cache.lock",
    # the command line in pcr_rag.cli, the RAG pipeline in pcr_rag.rag
    "pcr_rag.cache_cli": "pcr_rag.cli.cache",
    "pcr_rag.generate_cli": "pcr_rag.cli.generate",
    "pcr_rag.size_cli": "pcr_rag.cli.size",
    "pcr_rag.sizing": "pcr_rag.cli.sizing",
    "pcr_rag.demo": "pcr_rag.rag.demo",
    "pcr_rag.corpus": "pcr_rag.rag.corpus",
    "pcr_rag.embeddings": "pcr_rag.rag.embeddings",
}

# modules split in several: the old name re-exports the public names of the new ones
SPLIT: dict[str, tuple[str, ...]] = {
    "pcr_rag.requests": ("pcr_rag.request", "pcr_rag.handle", "pcr_rag.sched.request_state"),
}

# classes renamed so that each word has one meaning: "remote" is the KV store tier, an engine is what serves the
# `pcr_rag.engine_api.Engine` surface ("module.OldName" -> "module.NewName"; the old name is a module attribute
# that warns)
RENAMED: dict[str, str] = {
    "pcr_rag.client.http.RemoteEngine": "pcr_rag.client.http.HTTPEngine",
    "pcr_rag.cache.CacheEngine": "pcr_rag.cache.manager.CacheManager",
    "pcr_rag.cache.manager.CacheEngine": "pcr_rag.cache.manager.CacheManager",
}


def renamed(module: str, name: str) -> object:
    """The object ``module.name`` was renamed to (`RENAMED`), with a `DeprecationWarning`; `AttributeError` when
    ``module.name`` was never a name: for a module's ``__getattr__``."""
    new = RENAMED.get(f"{module}.{name}")
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_module, new_name = new.rsplit(".", 1)
    warnings.warn(f"{module}.{name} is renamed {new}; the old name is removed in pcr-rag {REMOVED_IN}",
                  DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new_module), new_name)


def warn_split(old: str) -> None:
    """Warn that ``old`` was split (`SPLIT`); its shim then re-exports the new modules' public names."""
    warnings.warn(f"{old} was split into {', '.join(SPLIT[old])}; the old name is removed in pcr-rag {REMOVED_IN}",
                  DeprecationWarning, stacklevel=3)


def alias_module(old: str) -> None:
    """Replace the shim module ``old`` in `sys.modules` by the module it moved to, with a `DeprecationWarning`.

    The import system reads the module back from `sys.modules` after running the shim, so the importer gets the
    new module object (one module, two names)."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; the old name is removed in pcr-rag {REMOVED_IN}", DeprecationWarning,
                  stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
