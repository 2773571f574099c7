"""The examples never rot: scripts run on a tiny random model (fast), notebooks on the real default model (slow)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from pcr_rag import EngineConfig
from pcr_rag.testing import save_tiny_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str, *, always_load: bool = False) -> ModuleType:
    """The example as a module. ``always_load``: its engines load every cached chunk (``load_planner=
    "always-load"``): on the tiny test model computing beats any read, so the measured planner would rightly skip
    the SSD tier that an example about the cache directory shows (on the default model it loads)."""
    spec = importlib.util.spec_from_file_location(f"pcr_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if always_load:
        module.EngineConfig = functools.partial(EngineConfig, load_planner="always-load")
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
    first, second = load_example("persistent_cache", always_load=True).main(tiny_dir, str(tmp_path / "kv"))
    assert first["computed"] == first["prompt_tokens"]
    # a restarted engine starts with an empty DRAM tier: everything it reuses came off the SSD, either read on
    # demand or prefetched into DRAM while the request waited in the queue
    assert second["from_ssd"] + second["from_dram"] > 0 and second["computed"] < first["computed"]
    assert second["from_dram"] == 0 or second["prefetched_chunks"] > 0
    assert second["answer"] == first["answer"]


def test_concurrent_prefetch_example(tiny_dir, tmp_path) -> None:
    summary = load_example("concurrent_prefetch", always_load=True).main(tiny_dir, str(tmp_path / "kv"))
    on, off = summary["prefetch on"], summary["prefetch off"]
    assert on["answers"] == off["answers"]
    # after the restart everything reused comes from the cache directory, in DRAM (prefetched) or read from SSD
    assert on["from_dram"] + on["from_ssd"] == off["from_dram"] + off["from_ssd"] > 0


def test_examples_read_their_documents_from_files() -> None:
    """What users copy loads a folder of files: no example builds its data with the package's internal helpers."""
    internal = ("pcr_rag.rag.corpus", "pcr_rag.testing", "pcr_rag.rag.demo", "stdlib_corpus", "split_passages")
    offenders = [(p.name, name) for p in sorted(EXAMPLES.glob("*.py")) + sorted(EXAMPLES.glob("*.ipynb"))
                 for name in internal if name in p.read_text(encoding="utf-8")]
    assert offenders == []
    assert sorted(p.name for p in (EXAMPLES / "data").glob("*.txt")), "the default folder ships with the examples"


NOTEBOOKS = sorted(p.name for p in EXAMPLES.glob("*.ipynb"))


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_saved_notebook_was_executed_from_its_current_cells_and_data(notebook: str) -> None:
    """Fast: the outputs saved in the notebook were produced by `make notebooks` from exactly these code cells and
    these data files (a hash over both, written when it executed), every cell ran, none failed, and they include
    the answers and the chart. Editing a cell or a file under examples/data without re-running it fails here."""
    import nbformat

    runner = load_example("execute_notebooks")
    nb = nbformat.read(EXAMPLES / notebook, as_version=4)
    assert nb.metadata.get("pcr_rag", {}).get("inputs_sha256") == runner.inputs_sha256(nb), (
        f"{notebook}'s saved outputs are stale: run `make notebooks`")
    code = _code_cells(nb)
    assert "%pip install" in code[0].source, "the first code cell installs what the notebook needs"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "every cell ran, in order, once"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    answers = [c for c in code if runner.DETERMINISTIC_TAG in c.metadata.get("tags", [])]
    assert answers and all(runner.text_outputs(c) for c in answers)
    assert "answers identical with the cache on and off: True" in "".join(runner.text_outputs(answers[-1]))
    assert any("image/png" in o.get("data", {}) for o in code[-1].outputs), "the reuse-by-tier / TTFT chart"


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_reexecutes_to_its_saved_answers(notebook: str, monkeypatch) -> None:
    """Slow: the notebook runs top to bottom on the default model now, and every cell tagged ``answers`` prints
    exactly what is saved (the answers' text, same-answer checks: the engine decodes greedily from a fresh cache,
    and those cells print no timings). With the fast test above, the saved answers are the current code's and
    model's on this kind of host; charts and timings are not compared."""
    import copy
    import os

    import nbformat

    # the kernel imports pcr_rag from this checkout even where the package is not pip-installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLES.parent),
                                                                   os.environ.get("PYTHONPATH")])))
    runner = load_example("execute_notebooks")
    saved = nbformat.read(EXAMPLES / notebook, as_version=4)
    fresh = runner.execute(copy.deepcopy(saved))
    assert not [o for c in _code_cells(fresh) for o in c.outputs if o.output_type == "error"]
    saved_on, here = saved.metadata.get("pcr_rag", {}).get("host_kind"), runner.host_kind()
    if saved_on != here:
        pytest.skip(f"{notebook} ran without an error; its answers were saved on a {saved_on} host and this is "
                    f"a {here} one, where a greedy token may differ: run `make notebooks` here to compare")
    pairs = [(s, f) for s, f in zip(_code_cells(saved), _code_cells(fresh))
             if runner.DETERMINISTIC_TAG in s.metadata.get("tags", [])]
    assert pairs
    for s, f in pairs:
        assert runner.text_outputs(f) == runner.text_outputs(s), f"cell changed output:\n{s.source}"
