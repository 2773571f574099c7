"""Cache-aware document order for LlamaIndex: `PCRReorderPostprocessor` and the ordering `PCRLLM(reorder=
"cache-aware")` applies to its prompts.

Retrievers return nodes in relevance order. The PCR cache reuses a prompt's longest cached *prefix*, so two
queries that retrieve the same nodes in a different order share little. `PCREngine.order_for_reuse` puts the
nodes whose KV is cached (or announced) first, in their cached order; relevance order decides among the rest, so
with nothing cached the order does not change.

Two ways to opt in:

* ``index.as_query_engine(llm=llm, node_postprocessors=[PCRReorderPostprocessor(llm)])``: the nodes are
  reordered before the synthesizer builds the prompt. The retrieval's announcement is re-made in the new order
  (`Announcement.reannounce`), so prefetch and the prompt agree.
* ``PCRLLM(reorder="cache-aware")``: the retrieval hook announces the nodes in cache-aware order, and the LLM
  rearranges the documents inside the prompt it receives to that order (`pcr_rag.reorder.permute_documents`;
  the text between documents stays in place). Works with any query engine, no postprocessor needed.

Trade-off: a different order is a different prompt. Reuse stays exact for that prompt, but the answer can differ
from the answer to the relevance-ordered prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle
from llama_index.llms.pcr.hook import node_texts, retrieval_hook

from pcr_rag.client.handoff import Announcement, cache_aware_order, documents_in_prompt
from pcr_rag.reorder import apply_order, permute_documents

logger = logging.getLogger(__name__)

__all__ = ["REORDER_MODES", "PCRReorderPostprocessor", "cache_aware_documents"]

#: The values of ``PCRLLM(reorder=...)``: "relevance" keeps the retriever's order, "cache-aware" reorders.
REORDER_MODES = ("relevance", "cache-aware")


def _engine_of(target: Any) -> Any:
    """A `PCREngine` (anything with ``order_for_reuse``) from a `PCRLLM` or an engine."""
    engine = getattr(target, "engine", None) if not hasattr(target, "order_for_reuse") else target
    if engine is None or not hasattr(engine, "order_for_reuse"):
        raise TypeError(f"expected a PCRLLM or a PCREngine, got {type(target).__name__}")
    return engine


class PCRReorderPostprocessor(BaseNodePostprocessor):
    """Reorders retrieved nodes for KV-cache reuse (`PCREngine.order_for_reuse`); opt-in.

    Nodes whose documents' KV is cached or announced come first, in the order they were cached in; the rest keep
    relevance order. When the retrieval was announced (the retrieval hook), its announcement is re-made in the new
    order so that prefetch matches the prompt. Nodes without text keep relevance order at the end.

    Args:
        target: the `PCRLLM` that will answer (its engine), or a `PCREngine`.
    """

    target: Any = Field(default=None, exclude=True, description="the PCRLLM or PCREngine whose cache decides")

    def __init__(self, target: Any = None, **kwargs: Any) -> None:
        if target is None:
            raise TypeError("PCRReorderPostprocessor needs the PCRLLM (or PCREngine) whose cache decides the order")
        if not hasattr(target, "order_for_reuse") and not hasattr(type(target), "engine"):
            # checked without reading ``target.engine``: that would load a PCRLLM's model now
            raise TypeError(f"expected a PCRLLM or a PCREngine, got {type(target).__name__}")
        # ``target`` is this class's field; mypy checks against the parent's synthesized pydantic __init__
        super().__init__(target=target, **kwargs)  # type: ignore[call-arg]

    @classmethod
    def class_name(cls) -> str:
        return "PCRReorderPostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        return reorder_nodes(nodes, _engine_of(self.target))

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore],
                                  query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        return self._postprocess_nodes(nodes, query_bundle)  # a cheap walk: no thread hop needed


def reorder_nodes(nodes: Sequence[NodeWithScore], engine: Any) -> list[NodeWithScore]:
    """``nodes`` in cache-aware order; re-announces the retrieval that returned them in that order."""
    texts = [node_texts([n]) for n in nodes]
    with_text = [n for n, t in zip(nodes, texts) if t]
    without_text = [n for n, t in zip(nodes, texts) if not t]
    docs = [t[0] for t in texts if t]
    if len(docs) < 2:
        return list(nodes)
    ann = retrieval_hook().announcement_for(docs)
    order = cache_aware_order(engine, docs, ann)
    if ann is not None:
        ann.reannounce(order)
    return apply_order(with_text, docs, order) + without_text


def cache_aware_documents(engine: Any, units: Sequence[str], documents: Sequence[str],
                          ann: Announcement | None) -> tuple[tuple[str, ...], list[str]]:
    """The documents of an LLM call in cache-aware order, and the call's text units (the prompt, or each chat
    message's content) with the documents rearranged to it.

    ``documents`` are the announced (or explicit) ones; those present in the prompt are reordered when one unit
    holds them all. Otherwise (fewer than two present, or spread over several messages) nothing changes.
    """
    units = list(units)
    present = documents_in_prompt("\n".join(units), documents)
    if len(present) < 2:
        return tuple(documents), units
    holder = next((i for i, u in enumerate(units) if documents_in_prompt(u, present) == present), None)
    if holder is None:
        logger.debug("documents spread over several messages: keeping their order")
        return tuple(documents), units
    order = cache_aware_order(engine, present, ann)
    rewritten = permute_documents(units[holder], present, order)
    if rewritten is None:  # pragma: no cover - documents_in_prompt found them in this order
        return tuple(documents), units
    units[holder] = rewritten
    return order, units
