"""Cache-aware document order for LangChain retriever output: the `PCRReorder` transformer / runnable.

Retrievers return documents in relevance order. The PCR cache reuses a prompt's longest cached *prefix*, so two
questions that retrieve the same documents in a different order share little. `PCRReorder` puts the documents
whose KV is cached (or announced) first, in their cached order (`PCREngine.order_for_reuse`); relevance order
decides among the rest, so with nothing cached nothing moves. Opt-in, placed right after the retriever:

    chain = (
        {"context": retriever | PCRReorder(llm) | format_docs, "question": RunnablePassthrough()}
        | prompt | llm | StrOutputParser()
    )

As a runnable it also finds the retrieval's announcement (a `PCRRetrievalCallback` in the run's callbacks) and
re-makes it in the new order (`Announcement.reannounce`), so prefetch and the prompt agree and the model call
claims it. ``transform_documents`` (the `BaseDocumentTransformer` interface) only reorders.

Trade-off: a different order is a different prompt. Reuse stays exact for that prompt, but the answer can differ
from the answer to the relevance-ordered prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForChainRun, CallbackManagerForChainRun
from langchain_core.documents import BaseDocumentTransformer, Document
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import ConfigDict

from langchain_pcr._common import announce_targets
from langchain_pcr.callbacks import find_announcement
from pcr_rag.client.handoff import cache_aware_order
from pcr_rag.reorder import apply_order

__all__ = ["PCRReorder"]


class PCRReorder(RunnableSerializable[Sequence[Document], list[Document]], BaseDocumentTransformer):
    """Reorders retrieved documents for KV-cache reuse; opt-in (see the module docstring).

    Args:
        target: the `ChatPCR` / `PCRLLM` that will answer (its engine), or a `PCREngine`.
    """

    target: Any = None
    model_config = ConfigDict(arbitrary_types_allowed=True)

    def __init__(self, target: Any = None, **kwargs: Any) -> None:
        if target is None:
            raise TypeError("PCRReorder needs the ChatPCR / PCRLLM (or PCREngine) whose cache decides the order")
        # ``target`` is this class's field; mypy checks against the parent's synthesized pydantic __init__
        super().__init__(target=target, **kwargs)  # type: ignore[call-arg]

    def _engine(self) -> Any:
        engine = announce_targets(self.target)[0]
        if not hasattr(engine, "order_for_reuse"):
            raise TypeError(f"PCRReorder target {type(self.target).__name__} has no engine with order_for_reuse")
        return engine

    # ------------------------------------------------------------------------------------ transformer
    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        """``documents`` in cache-aware order (no announcement is touched)."""
        return self._reorder(documents, None)

    async def atransform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        return self._reorder(documents, None)

    # ------------------------------------------------------------------------------------ runnable
    def invoke(self, input: Sequence[Document], config: RunnableConfig | None = None,  # noqa: A002
               **kwargs: Any) -> list[Document]:
        return self._call_with_config(self._run, input, config)

    async def ainvoke(self, input: Sequence[Document], config: RunnableConfig | None = None,  # noqa: A002
                      **kwargs: Any) -> list[Document]:
        return await self._acall_with_config(self._arun, input, config)

    def _run(self, documents: Sequence[Document], run_manager: CallbackManagerForChainRun) -> list[Document]:
        return self._reorder(documents, run_manager)

    async def _arun(self, documents: Sequence[Document],
                    run_manager: AsyncCallbackManagerForChainRun) -> list[Document]:
        return self._reorder(documents, run_manager)  # a cheap walk: no thread hop needed

    def _reorder(self, documents: Sequence[Document], run_manager: Any) -> list[Document]:
        if isinstance(documents, (Document, str, bytes)) or not isinstance(documents, Sequence):
            raise TypeError(f"PCRReorder takes a list of Documents (a retriever's output), got "
                            f"{type(documents).__name__}")
        items = [d for d in documents if isinstance(d, Document) and d.page_content]
        rest = [d for d in documents if not (isinstance(d, Document) and d.page_content)]
        texts = [d.page_content for d in items]
        if len(texts) < 2:
            return list(documents)
        engine = self._engine()
        ann = find_announcement(run_manager)
        if ann is not None and sorted(ann.documents) != sorted(texts):
            ann = None  # another retrieval's announcement
        order = cache_aware_order(engine, texts, ann)
        if ann is not None:
            ann.reannounce(order)
        return apply_order(items, texts, order) + rest
