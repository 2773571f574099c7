"""The design studies in ``benchmarks/`` are scripts, not package modules: their tests import them as the
``benchmarks`` namespace package from the repository root, which this puts on ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
