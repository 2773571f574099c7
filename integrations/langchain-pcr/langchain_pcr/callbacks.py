"""The retrieval hook: a callback handler that announces retrieved documents to the PCR engine.

When a retriever run ends, `PCRRetrievalCallback.on_retriever_end` calls `engine.announce(texts, query)`: the
request enters the engine's waiting queue and SSD -> DRAM prefetch of those documents' KV starts while the chain
is still formatting the prompt. When a `ChatPCR` / `PCRLLM` run later starts in the same run tree, the model finds
the handler among its run manager's handlers and asks it for the announcement that belongs to its run, found by
walking parent run ids (`run_id -> parent_run_id`) from the model up to the nearest ancestor that also contains
the retriever. This works across LCEL parallel branches, threads and asyncio tasks, where a contextvar set in the
retriever branch would not be visible to the model.

Memory: only open runs are tracked (a run is dropped when it ends or errors), announcements are dropped when their
root run ends, and both maps are bounded (oldest dropped first), so nothing accumulates across runs even when
end events never come (an abandoned stream).

Reuse mode: the announcement carries the reuse mode of the model that will answer (``ChatPCR(reuse="blend")``
also prefetches the documents' position-independent chains on an engine whose default is exact); with an engine
or no target, that of the live models using each engine (`langchain_pcr._common.announce_plan`, which says what
happens when two of them differ).

Sharing scopes: a retrieved `Document` whose ``metadata[scope_metadata_key]`` (default ``"pcr_scope"``) is
"shared" or "private" is announced and passed to the engine as a `pcr_rag.Doc` with that scope
(`pcr_rag.client.handoff.scope_of`; anything else counts as private).

Attach it per call (``config={"callbacks": [handler]}``) or globally (`install_global_retrieval_hook`).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.tracers.context import register_configure_hook

from langchain_pcr._common import RequestDocuments, announce_plan
from langchain_pcr._tracing import run_span
from pcr_rag.client.handoff import SCOPE_METADATA_KEY, Announcement, scope_of
from pcr_rag.prompt import Doc

logger = logging.getLogger(__name__)

__all__ = [
    "PCRRetrievalCallback",
    "get_global_retrieval_hook",
    "install_global_retrieval_hook",
    "resolve_documents",
    "uninstall_global_retrieval_hook",
]


class PCRRetrievalCallback(BaseCallbackHandler):
    """Announces retrieved documents to the PCR engine the moment a retriever finishes.

    Args:
        target: where to announce: a `ChatPCR` / `PCRLLM` (its engine, in its ``reuse`` mode), a `PCREngine`, or
            None for the engines of every `ChatPCR` / `PCRLLM` of this process whose engine is already loaded (each
            in the mode of the live models using it: `langchain_pcr._common.announce_plan`).
        max_open_runs: bound on tracked open runs (oldest dropped first).
        max_trees: bound on run trees holding announcements (oldest dropped first).
        scope_metadata_key: the `Document` metadata key holding a document's sharing scope ("shared" or
            "private", see `pcr_rag.Doc`); documents without it get the engine's default.
    """

    raise_error: bool = False

    def __init__(self, target: Any = None, *, max_open_runs: int = 10_000, max_trees: int = 1_024,
                 scope_metadata_key: str = SCOPE_METADATA_KEY) -> None:
        super().__init__()
        if max_open_runs < 1 or max_trees < 1:
            raise ValueError("max_open_runs and max_trees must be >= 1")
        self.target = target
        self.scope_metadata_key = scope_metadata_key
        self.max_open_runs = max_open_runs
        self.max_trees = max_trees
        self._lock = threading.Lock()
        self._parents: OrderedDict[UUID, UUID | None] = OrderedDict()
        self._queries: dict[UUID, str] = {}
        self._trees: OrderedDict[UUID, list[Announcement]] = OrderedDict()
        self.announced = 0  # announcements made (documents non-empty)

    # ------------------------------------------------------------------------------------------ run tracking
    def _track(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        with self._lock:
            self._parents[run_id] = parent_run_id
            self._parents.move_to_end(run_id)
            while len(self._parents) > self.max_open_runs:
                old, _ = self._parents.popitem(last=False)
                self._queries.pop(old, None)

    def _ancestors(self, run_id: UUID | None) -> list[UUID]:
        """``run_id`` and the runs above it, nearest first (caller holds the lock)."""
        chain: list[UUID] = []
        seen: set[UUID] = set()
        while run_id is not None and run_id not in seen:
            chain.append(run_id)
            seen.add(run_id)
            run_id = self._parents.get(run_id)
        return chain

    def _finish(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        dropped: list[Announcement] = []
        with self._lock:
            self._parents.pop(run_id, None)
            self._queries.pop(run_id, None)
            if parent_run_id is None:
                dropped = self._trees.pop(run_id, [])
        for ann in dropped:
            ann.release_unclaimed()

    # ---------------------------------------------------------------------------------------------- events
    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       **kwargs: Any) -> None:
        self._track(run_id, parent_run_id)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._finish(run_id, parent_run_id)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                       **kwargs: Any) -> None:
        self._finish(run_id, parent_run_id)

    def on_tool_start(self, serialized: Any, input_str: str, *, run_id: UUID, parent_run_id: UUID | None = None,
                      **kwargs: Any) -> None:
        self._track(run_id, parent_run_id)

    def on_tool_end(self, output: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._finish(run_id, parent_run_id)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                      **kwargs: Any) -> None:
        self._finish(run_id, parent_run_id)

    def on_llm_start(self, serialized: Any, prompts: list[str], *, run_id: UUID, parent_run_id: UUID | None = None,
                     **kwargs: Any) -> None:
        self._track(run_id, parent_run_id)

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID,
                            parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._track(run_id, parent_run_id)

    def on_llm_end(self, response: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        self._finish(run_id, parent_run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                     **kwargs: Any) -> None:
        self._finish(run_id, parent_run_id)

    def on_retriever_start(self, serialized: Any, query: str, *, run_id: UUID, parent_run_id: UUID | None = None,
                           **kwargs: Any) -> None:
        self._track(run_id, parent_run_id)
        with self._lock:
            self._queries[run_id] = query

    def on_retriever_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                           **kwargs: Any) -> None:
        self._finish(run_id, parent_run_id)

    def on_retriever_end(self, documents: Sequence[Document], *, run_id: UUID, parent_run_id: UUID | None = None,
                         **kwargs: Any) -> None:
        kept = [d for d in documents if isinstance(d, Document) and d.page_content]
        texts = tuple(d.page_content for d in kept)
        scopes = {d.page_content: scope for d in kept
                  if (scope := scope_of(d.metadata, self.scope_metadata_key)) is not None}
        with self._lock:
            query = self._queries.get(run_id)
            ancestors = tuple(self._ancestors(parent_run_id))
        try:
            if texts:
                with run_span(run_id, parent_run_id):  # an OpenInference trace: the announcement under its retriever
                    self._announce(texts, query, run_id, ancestors, scopes)
        except Exception:  # a failed announce only costs the prefetch, never the chain
            logger.exception("announcing retrieved documents to the PCR engine failed")
        finally:
            self._finish(run_id, parent_run_id)

    def _announce(self, texts: tuple[str, ...], query: str | None, run_id: UUID, ancestors: tuple[UUID, ...],
                  scopes: dict[str, str] | None = None) -> None:
        ann = Announcement(documents=texts, query=query, origin=run_id, ancestors=ancestors, scopes=scopes or {})
        engines, reuse = announce_plan(self.target)
        ann.announce_to(engines, reuse)
        root = ancestors[-1] if ancestors else run_id
        evicted: list[Announcement] = []
        with self._lock:
            self.announced += 1
            if ancestors:  # a retriever run on its own has nobody to hand the documents to
                self._trees.setdefault(root, []).append(ann)
                self._trees.move_to_end(root)
                while len(self._trees) > self.max_trees:
                    _, old = self._trees.popitem(last=False)
                    evicted.extend(old)
            else:
                evicted.append(ann)
        for stale in evicted:
            stale.release_unclaimed()
        logger.debug("announced %d documents (retriever run %s)", len(texts), run_id)

    # ------------------------------------------------------------------------------------------ model side
    def lookup(self, run_id: UUID, parent_run_id: UUID | None) -> Announcement | None:
        """The announcement for a model run: the latest one under the model's nearest ancestor that has one."""
        with self._lock:
            chain = self._ancestors(parent_run_id)
            if not chain:
                return None
            anns = self._trees.get(chain[-1])
            if not anns:
                return None
            for ancestor in chain:
                for ann in reversed(anns):
                    if ancestor in ann.ancestors:
                        return ann
        return None

    def tracked_sizes(self) -> dict[str, int]:
        """How much state the handler holds (open runs, trees, announcements): for leak checks."""
        with self._lock:
            return {
                "open_runs": len(self._parents),
                "trees": len(self._trees),
                "announcements": sum(len(v) for v in self._trees.values()),
            }


# ------------------------------------------------------------------------------------------------ model side
def resolve_documents(engine: Any, text: str, run_manager: Any, explicit: Sequence[str] | None) -> RequestDocuments:
    """Documents for a model call: explicit ``documents=`` wins; else the announcement found through the run tree.

    ``text`` is the prompt (or the messages' contents) the documents are searched in. An announcement whose
    documents are all present in order is passed unchanged, so the engine claims its ticket; otherwise the present
    documents are passed in prompt order and the ticket is withdrawn (`Announcement.documents_for`). Documents
    with a scope (from the retrieved documents' metadata, or explicit `pcr_rag.Doc`s) are passed as `Doc`s.
    """
    if explicit is not None:
        if isinstance(explicit, (str, Doc)):
            raise ValueError("documents= must be a list of strings, not a single string; wrap it: [doc]")
        return RequestDocuments(tuple(explicit), announced=False)
    ann = find_announcement(run_manager)
    if ann is None:
        return RequestDocuments((), announced=False)
    return RequestDocuments(ann.with_scopes(ann.documents_for(engine, text)), announced=True)


def find_announcement(run_manager: Any) -> Announcement | None:
    """The announcement for a model run, asked of every `PCRRetrievalCallback` among its handlers. ``run_manager``:
    the run's LangChain run manager, or the `langchain_pcr._stream_run.StartedRun` a chat-model stream recorded
    (LangChain passes none to ``_stream``); either gives ``run_id``, ``parent_run_id`` and ``handlers``."""
    if run_manager is None:
        return None
    handlers = list(getattr(run_manager, "handlers", []) or []) + list(
        getattr(run_manager, "inheritable_handlers", []) or []
    )
    seen: set[int] = set()
    for handler in handlers:
        if isinstance(handler, PCRRetrievalCallback) and id(handler) not in seen:
            seen.add(id(handler))
            ann = handler.lookup(run_manager.run_id, run_manager.parent_run_id)
            if ann is not None:
                return ann
    return None


# ------------------------------------------------------------------------------------------------ global hook
class _GlobalSlot:
    """Quacks like the ContextVar that `register_configure_hook` expects, but is process-wide (all threads)."""

    def __init__(self) -> None:
        self.handler: PCRRetrievalCallback | None = None

    def get(self) -> PCRRetrievalCallback | None:
        return self.handler


_GLOBAL_SLOT = _GlobalSlot()
_GLOBAL_LOCK = threading.Lock()
_REGISTERED = False


def install_global_retrieval_hook(target: Any = None, *,
                                  scope_metadata_key: str = SCOPE_METADATA_KEY) -> PCRRetrievalCallback:
    """Attach a `PCRRetrievalCallback` to every LangChain run in this process (all threads), and return it.

    Replaces a previously installed global hook. ``target`` and ``scope_metadata_key`` are as for
    `PCRRetrievalCallback`.
    """
    global _REGISTERED
    handler = PCRRetrievalCallback(target, scope_metadata_key=scope_metadata_key)
    with _GLOBAL_LOCK:
        if not _REGISTERED:
            register_configure_hook(_GLOBAL_SLOT, inheritable=True)  # type: ignore[arg-type]
            _REGISTERED = True
        _GLOBAL_SLOT.handler = handler
    return handler


def uninstall_global_retrieval_hook() -> None:
    """Stop attaching the global hook to new runs."""
    with _GLOBAL_LOCK:
        _GLOBAL_SLOT.handler = None


def get_global_retrieval_hook() -> PCRRetrievalCallback | None:
    return _GLOBAL_SLOT.handler
