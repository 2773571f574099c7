"""The package's import contracts (pyproject.toml [tool.importlinter]: layers, no circles, a thin client, no
deprecated names inside) hold, and each catches the change it is there for: an arrow back up, a circle, torch in
the client. Each mutation runs the real linter on a copy of the package with one import added."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache", "--no-logo"]


def _lint(cwd: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    args = [a for c in contracts for a in ("--contract", c)]
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([*LINT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_import_contracts():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """A copy of the package's sources and the contracts, ahead of the installed package on sys.path."""
    root = tmp_path_factory.mktemp("contracts")
    shutil.copytree(ROOT / "pcr_rag", root / "pcr_rag", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("pcr_rag/cache/keys.py", "import pcr_rag.engine", "layers"),  # an arrow back up
    ("pcr_rag/model/hub.py", "from pcr_rag.sched import scheduler", "layers"),
    ("pcr_rag/cache/tiers/remote_store.py", "import pcr_rag.cache.tiers.remote_cluster", "no-circles"),
    ("pcr_rag/client/wire.py", "import torch", "thin-client"),
    ("pcr_rag/client/http.py", "from pcr_rag.cache import keys", "thin-client"),
    ("pcr_rag/engine.py", "import pcr_rag.client.http", "engine-client-independent"),
    ("pcr_rag/server/app.py", "import pcr_rag.runtime.model", "no-deprecated-names"),
])
def test_a_contract_breaks_when_its_import_is_added(copy, module, line, contract):
    path = copy / module
    original = path.read_text()
    try:
        path.write_text(original + f"\n{line}  # added by the test\n")
        run = _lint(copy, contract)
        assert run.returncode == 1, run.stdout + run.stderr
        assert "1 broken" in run.stdout
    finally:
        path.write_text(original)
    assert _lint(copy, contract).returncode == 0  # the copy itself keeps it
