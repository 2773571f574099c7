"""The package imports, exports its classes with LangChain's base types, and its version is the pyproject's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_public_names_import_with_langchain_base_types() -> None:
    import langchain_pcr
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.embeddings import Embeddings
    from langchain_core.language_models import BaseChatModel, BaseLLM
    from langchain_core.runnables import Runnable

    assert sorted(langchain_pcr.__all__) == sorted(
        ["PCRLLM", "ChatPCR", "MiniLMEmbeddings", "PCRReorder", "PCRRetrievalCallback", "get_global_retrieval_hook",
         "install_global_retrieval_hook", "rag_prompt", "uninstall_global_retrieval_hook"])
    assert issubclass(langchain_pcr.ChatPCR, BaseChatModel)
    assert issubclass(langchain_pcr.PCRLLM, BaseLLM)
    assert issubclass(langchain_pcr.MiniLMEmbeddings, Embeddings)
    assert issubclass(langchain_pcr.PCRRetrievalCallback, BaseCallbackHandler)
    assert issubclass(langchain_pcr.PCRReorder, Runnable)
    for name in langchain_pcr.__all__:
        assert callable(getattr(langchain_pcr, name))


def test_version_and_typed_marker() -> None:
    import langchain_pcr

    project = tomllib.loads(PYPROJECT.read_text())
    assert langchain_pcr.__version__ == project["project"]["version"]
    assert (Path(langchain_pcr.__file__).parent / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["langchain_pcr"]
