"""The examples never rot: scripts run on a tiny random model (fast), notebooks on the real default model (slow)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from pcr_rag.testing import save_tiny_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"pcr_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama"))


def test_llamaindex_query_engine_example(tiny_dir, tmp_path) -> None:
    out = load_example("llamaindex_query_engine").main(tiny_dir, str(tmp_path / "kv"))
    assert len(out) == 2 and all(len(o["sources"]) == 2 for o in out)
    # the shipped folder's bisect note answers both questions (MiniLM retrieval is real even on the tiny model)
    assert [o["sources"][0] for o in out] == ["bisect.txt", "bisect.txt"]
    # the second prompt starts with the same system prompt and document: its KV is reused
    assert out[1]["reused_tokens"] > out[0]["reused_tokens"] == 0


@pytest.fixture
def user_folder(tmp_path) -> Path:
    """A user's folder: notes in a subfolder, a Markdown file, and a file neither loader should read."""
    folder = tmp_path / "my-notes"
    (folder / "garden").mkdir(parents=True)
    (folder / "garden" / "tomatoes.txt").write_text(
        "Tomatoes need six hours of sun a day and deep watering twice a week; stake them when they flower.")
    (folder / "bikes.md").write_text("# Bicycle chains\n\nClean and oil a bicycle chain every 300 kilometres.")
    (folder / "tea.txt").write_text("Green tea brews at 80 degrees for two minutes; black tea at 95 for four.")
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n not text")
    return folder


def test_llamaindex_example_indexes_the_users_folder(tiny_dir, tmp_path, user_folder) -> None:
    example = load_example("llamaindex_query_engine")
    assert sorted(d.metadata["file_name"] for d in example.load_folder(user_folder)) == [
        "bikes.md", "tea.txt", "tomatoes.txt"]  # recursive, .txt and .md only
    out = example.main(tiny_dir, str(tmp_path / "kv"), user_folder,
                       ["How often should I oil my bicycle chain?", "How much sun do tomatoes need?"])
    assert [o["sources"][0] for o in out] == ["bikes.md", "tomatoes.txt"]


def test_langchain_lcel_example(tiny_dir, tmp_path) -> None:
    out = load_example("langchain_lcel_rag").main(tiny_dir, str(tmp_path / "kv"))
    assert all(m["announcement_claimed"] for m in out)
    assert out[1]["reused_tokens"] > 0


def test_langchain_example_indexes_the_users_folder(tiny_dir, tmp_path, user_folder) -> None:
    example = load_example("langchain_lcel_rag")
    docs = example.load_folder(user_folder)
    assert sorted(Path(d.metadata["source"]).name for d in docs) == ["bikes.md", "tea.txt", "tomatoes.txt"]
    out = example.main(tiny_dir, str(tmp_path / "kv"), user_folder,
                       ["How hot should the water be for green tea?", "How long does green tea brew?"])
    assert all(m["announcement_claimed"] for m in out) and out[1]["reused_tokens"] > 0


def test_persistent_cache_example(tiny_dir, tmp_path) -> None:
    first, second = load_example("persistent_cache").main(tiny_dir, str(tmp_path / "kv"))
    assert first["computed"] == first["prompt_tokens"]
    # a restarted engine starts with an empty DRAM tier: everything it reuses came off the SSD, either read on
    # demand or prefetched into DRAM while the request waited in the queue
    assert second["from_ssd"] + second["from_dram"] > 0 and second["computed"] < first["computed"]
    assert second["from_dram"] == 0 or second["prefetched_chunks"] > 0
    assert second["answer"] == first["answer"]


def test_concurrent_prefetch_example(tiny_dir, tmp_path) -> None:
    summary = load_example("concurrent_prefetch").main(tiny_dir, str(tmp_path / "kv"))
    on, off = summary["prefetch on"], summary["prefetch off"]
    assert on["answers"] == off["answers"]
    # after the restart everything reused comes from the cache directory, in DRAM (prefetched) or read from SSD
    assert on["from_dram"] + on["from_ssd"] == off["from_dram"] + off["from_ssd"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("notebook", sorted(p.name for p in EXAMPLES.glob("*.ipynb")))
def test_notebook_executes(notebook: str, tmp_path, monkeypatch) -> None:
    import os

    import nbformat
    from nbclient import NotebookClient

    # the kernel imports pcr_rag from this checkout even where the package is not pip-installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLES.parent),
                                                                   os.environ.get("PYTHONPATH")])))

    nb = nbformat.read(EXAMPLES / notebook, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert params, f"{notebook} needs a cell tagged 'parameters'"
    params[0].source = f"MODEL = None\nCACHE_DIR = {str(tmp_path / 'kv')!r}"
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
