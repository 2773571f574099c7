"""Execute the quickstart notebooks and save them with their outputs (what ``make notebooks`` runs).

    python examples/execute_notebooks.py [NOTEBOOK ...]     # default: every examples/*.ipynb

Each notebook runs top to bottom in a fresh kernel from the examples folder (as Jupyter opens it) and is written
back with its outputs, without the per-cell execution timestamps, and with ``metadata.pcr_rag.inputs_sha256``:
the hash of its code cells and of the files under examples/data that it reads (`inputs_sha256`), and
``metadata.pcr_rag.host_kind`` (`host_kind`: CPU kernels, KV dtype, threads). The test
(tests/test_examples.py) recomputes that hash, so a notebook whose cells or data changed after its outputs were
saved fails until ``make notebooks`` runs again, and it re-executes the notebook and compares the outputs of the
cells tagged ``answers`` (deterministic: greedy decoding, a fresh cache, no timings) with the saved ones on a
host of the same kind (elsewhere a greedy token may differ: run ``make notebooks`` there to compare).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent
DATA = EXAMPLES / "data"
#: cells with this tag print only what the engine decides deterministically (answers, equalities): their saved
#: outputs must equal a re-execution's
DETERMINISTIC_TAG = "answers"


def inputs_sha256(nb, data: Path = DATA) -> str:
    """SHA-256 over the notebook's code cells (source and tags, in order) and every file under ``data`` (relative
    path and bytes): what its outputs are a function of, besides the installed code and model."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            h.update(b"\0cell\0" + cell.source.encode() + b"\0tags\0" +
                     ",".join(cell.get("metadata", {}).get("tags", [])).encode())
    for path in sorted(p for p in data.rglob("*") if p.is_file()):
        h.update(b"\0file\0" + path.relative_to(data).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


_HOST_KIND = """
import torch
from pcr_rag.model.model import resolve_dtype
dtype = str(resolve_dtype("auto", torch.device("cpu"))).replace("torch.", "")
print(f"{torch.backends.cpu.get_cpu_capability()}/{dtype}/threads={torch.get_num_threads()}")
"""


def host_kind() -> str:
    """What a greedy answer on the CPU depends on besides the code and the model: torch's CPU kernels, the KV
    dtype the engine picks on this CPU (bf16 where it is native, else float32) and the thread count (the forward's
    plan). Asked of a fresh interpreter with this environment, as a notebook kernel starts (a test process may have
    changed its own thread count). Saved answers are compared only on a host of the same kind."""
    import subprocess

    return subprocess.run([sys.executable, "-c", _HOST_KIND], check=True, capture_output=True, text=True,
                          timeout=300).stdout.strip()


def execute(nb, timeout_s: int = 900):
    """Run ``nb`` in place in a fresh python3 kernel whose working directory is the examples folder."""
    from nbclient import NotebookClient

    # no progress bars in the saved outputs (the kernel inherits this environment)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    return nb


def text_outputs(cell) -> list[str]:
    """A code cell's stdout (all its stream messages joined: how a stream is split into messages depends on
    timing) and then its text/plain results and errors, in order; stderr (progress bars, warnings) and images are
    not compared."""
    stdout = "".join(o.text for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stdout")
    out = [stdout] if stdout else []
    for o in cell.get("outputs", []):
        if o.output_type in ("execute_result", "display_data") and "text/plain" in o.get("data", {}):
            out.append(o.data["text/plain"])
        elif o.output_type == "error":
            out.append(f"{o.ename}: {o.evalue}")
    return out


def save_executed(path: Path) -> None:
    import nbformat

    nb = nbformat.read(path, as_version=4)
    execute(nb)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    if errors:
        raise RuntimeError(f"{path.name}: a cell failed: {errors[0].ename}: {errors[0].evalue}")
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)
    nb.metadata["pcr_rag"] = {"inputs_sha256": inputs_sha256(nb), "host_kind": host_kind()}
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="default: every examples/*.ipynb")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.notebooks] or sorted(EXAMPLES.glob("*.ipynb"))
    for path in paths:
        print(f"executing {path.name} ...", flush=True)
        save_executed(path)
        print(f"saved {path.name} with its outputs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
