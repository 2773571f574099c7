"""Module names that moved, each kept as a deprecated alias for one release (issue 51's regrouping).

`MOVED` maps an old dotted name to the module that now holds its code. The old file is a two-line shim that calls
`alias_module(__name__)`: the import warns once (`DeprecationWarning`, naming the new module) and then yields the
new module object itself, so ``from pcr_rag.runtime.model import load_model`` and ``import pcr_rag.runtime.model``
keep working and patching either name patches the one module. Nothing inside pcr-rag imports an old name (an
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
}


def alias_module(old: str) -> None:
    """Replace the shim module ``old`` in `sys.modules` by the module it moved to, with a `DeprecationWarning`.

    The import system reads the module back from `sys.modules` after running the shim, so the importer gets the
    new module object (one module, two names)."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; the old name is removed in pcr-rag {REMOVED_IN}", DeprecationWarning,
                  stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
