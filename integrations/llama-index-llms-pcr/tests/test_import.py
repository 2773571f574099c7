"""The package imports, exports its classes with LlamaIndex's base types, and its [tool.llamahub] metadata names
an importable path and classes that it exports."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_public_classes_have_llamaindex_base_types() -> None:
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.llms.function_calling import FunctionCallingLLM
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.llms.pcr import PCRLLM, MiniLMEmbedding, PCRReorderPostprocessor

    assert issubclass(PCRLLM, FunctionCallingLLM)
    assert issubclass(MiniLMEmbedding, BaseEmbedding)
    assert issubclass(PCRReorderPostprocessor, BaseNodePostprocessor)
    assert PCRLLM.class_name() == "PCRLLM"


def test_llamahub_metadata_names_what_the_package_exports() -> None:
    meta = tomllib.loads(PYPROJECT.read_text())["tool"]["llamahub"]
    assert meta["contains_example"] is False
    module = importlib.import_module(meta["import_path"])
    authors = meta["class_authors"]
    assert set(authors) <= set(module.__all__) and all(isinstance(getattr(module, c), type) for c in authors)
    assert {"PCRLLM", "MiniLMEmbedding", "PCRReorderPostprocessor"} <= set(authors)
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_typed_marker_is_shipped() -> None:
    import llama_index.llms.pcr as pkg

    assert (Path(pkg.__file__).parent / "py.typed").is_file()
    assert "py.typed" in tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"][
        "llama_index.llms.pcr"]
