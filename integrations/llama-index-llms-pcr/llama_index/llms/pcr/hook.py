"""The retrieval hook: LlamaIndex instrumentation handlers that announce retrieved nodes to the PCR engine.

Two handlers on the root dispatcher:

* a span handler that records, for every open span, its parent span and (when the span's instance holds a
  registered `PCRLLM`, e.g. a query engine's response synthesizer) that LLM;
* an event handler for `RetrievalEndEvent` that renders each node exactly as the response synthesizer will
  (``node.get_content(metadata_mode=MetadataMode.LLM).strip()``: `PromptHelper.repack` strips chunks before
  joining them) and calls ``engine.announce(texts, query)`` on the engine of the `PCRLLM` found above the
  retrieval span (or, when none is found, of every live `PCRLLM`). The request enters the engine's waiting queue
  and its SSD -> DRAM prefetch starts while LlamaIndex is still building the prompt. The announcement carries the
  answering LLM's ``reuse`` (``PCRLLM(reuse="blend")`` also prefetches the documents' position-independent
  chains); announced to every live LLM's engine, each engine gets `pcr_rag.client.handoff.announcement_reuse` of the LLMs
  on it (`PCRRetrievalHook.live_engines_with_reuse`). A per-call ``reuse=`` comes after the retrieval and is not
  seen here: set the mode on the LLM for the prefetch to match.

`PCRLLM.complete` / `chat` then look up the announcement by walking up from the active span to the nearest
ancestor that also contains the retrieval (the query span), and pass the documents with the prompt. A streaming
query engine calls the LLM only when the response generator is consumed, after the query span has ended; for that
case the announcements of ended queries are kept for a short while (`ORPHAN_TTL_S`) and matched by content: the
newest one whose documents all occur verbatim in the prompt (else the one with most documents present).

Memory: only open spans are tracked; announcements move to the bounded, short-lived orphan list when their root
span ends, and unclaimed tickets are withdrawn when they leave it; every map is bounded.

With ``PCRLLM(reorder="cache-aware")`` the announced order is the engine's cache-aware one
(`PCREngine.order_for_reuse`) and the LLM rearranges its prompt to it; a `PCRReorderPostprocessor` re-announces
the retrieval in the order it chose (`announcement_for` finds it). Either way prefetch and the prompt agree.

Sharing scopes: a node whose metadata holds "shared" or "private" under the answering LLM's
``scope_metadata_key`` (default ``"pcr_scope"``; `pcr_rag.client.handoff.scope_of`) is announced and passed to the engine
as a `pcr_rag.Doc` with that scope (`node_scopes`). Exclude the key from the LLM's view of the node
(``excluded_llm_metadata_keys``) unless the prompt should show it.

Every `PCRLLM` registers itself with the hook (`PCRRetrievalHook.register_llm`) when constructed, so the hook
knows the LLMs without importing their class; it installs the hook too (``retrieval_hook=True``, the default).
`install_retrieval_hook()` does it explicitly, `uninstall_retrieval_hook()` removes it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.instrumentation.span import active_span_id
from llama_index.core.instrumentation.span.base import BaseSpan
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from llama_index.core.schema import MetadataMode, QueryBundle
from pydantic import Field, PrivateAttr

from pcr_rag.client.handoff import (
    SCOPE_METADATA_KEY,
    Announcement,
    announcement_reuse,
    documents_in_prompt,
    reuse_argument,
    scope_of,
)

logger = logging.getLogger(__name__)

__all__ = [
    "PCRRetrievalHook",
    "install_retrieval_hook",
    "node_scopes",
    "node_texts",
    "retrieval_hook",
    "uninstall_retrieval_hook",
]

MAX_OPEN_SPANS = 20_000
MAX_TREES = 1_024
MAX_ORPHANS = 256
ORPHAN_TTL_S = 30.0  # seconds an ended query's announcement waits for a deferred (streaming) LLM call


def node_texts(nodes: Any) -> tuple[str, ...]:
    """Node texts as the response synthesizers put them in the prompt (LLM metadata mode, stripped)."""
    out: list[str] = []
    for n in nodes or ():
        node = getattr(n, "node", n)
        try:
            text = node.get_content(metadata_mode=MetadataMode.LLM).strip()
        except Exception:  # a node type without text content (image nodes...)
            continue
        if text:
            out.append(text)
    return tuple(out)


def node_scopes(nodes: Any, key: str = SCOPE_METADATA_KEY) -> dict[str, str]:
    """Node text (as `node_texts` renders it) -> sharing scope, for the nodes whose ``metadata[key]`` gives one."""
    out: dict[str, str] = {}
    for n in nodes or ():
        node = getattr(n, "node", n)
        scope = scope_of(getattr(node, "metadata", None), key)
        if scope is None:
            continue
        for text in node_texts([node]):
            out[text] = scope
    return out


@dataclass
class _Span:
    parent: str | None
    llm: weakref.ref | None


class PCRRetrievalHook:
    """Process-wide state of the hook: open spans, announcements per root span. Thread-safe."""

    def __init__(self, max_open_spans: int = MAX_OPEN_SPANS, max_trees: int = MAX_TREES,
                 max_orphans: int = MAX_ORPHANS, orphan_ttl_s: float = ORPHAN_TTL_S,
                 clock: Any = time.monotonic) -> None:
        self.max_open_spans = max_open_spans
        self.max_trees = max_trees
        self.max_orphans = max_orphans
        self.orphan_ttl_s = orphan_ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._spans: OrderedDict[str, _Span] = OrderedDict()
        self._trees: OrderedDict[str, list[Announcement]] = OrderedDict()
        self._orphans: OrderedDict[int, tuple[float, Announcement]] = OrderedDict()  # id(ann) -> (ended, ann)
        # id -> live PCRLLM, weakly (pydantic models are unhashable, so no WeakSet)
        self._llms: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.announced = 0
        self.installed = False
        self._span_handler = _SpanTracker(hook=self)
        self._event_handler = _RetrievalEndHandler(hook=self)

    # ------------------------------------------------------------------------------------------ LLMs
    def register_llm(self, llm: Any) -> None:
        """Make ``llm`` (a `PCRLLM`: anything with an ``engine``) known: spans holding it announce to its engine
        (loading it: that LLM answers next), and a retrieval that shows no LLM announces to the already-loaded
        engine of every registered one (``loaded_engine``). Held weakly."""
        with self._lock:
            self._llms[id(llm)] = llm

    def live_engines(self) -> list[Any]:
        """The distinct open engines of every live registered LLM that has loaded one (none is loaded here)."""
        return self.live_engines_with_reuse()[0]

    def live_engines_with_reuse(self) -> tuple[list[Any], dict[int, str | None]]:
        """(`live_engines`, ``id(engine) ->`` the reuse mode to announce to it): `pcr_rag.client.handoff.announcement_reuse`
        of the ``reuse`` of the live LLMs on that engine. Two LLMs on one engine that differ get the widest
        prefetch: "blend" if either blends, else the engine's default if either leaves the mode to it (None)."""
        with self._lock:
            llms = list(self._llms.values())
        engines: dict[int, Any] = {}
        modes: dict[int, list[str | None]] = {}
        for llm in llms:
            engine = getattr(llm, "loaded_engine", None)
            if engine is not None and not engine.closed:
                engines.setdefault(id(engine), engine)
                modes.setdefault(id(engine), []).append(getattr(llm, "reuse", None))
        return list(engines.values()), {key: announcement_reuse(found) for key, found in modes.items()}

    def _llm_of(self, instance: Any) -> Any:
        """The registered LLM a span's instance will answer with, if it shows one (query/chat engines,
        synthesizers)."""
        if instance is None:
            return None
        candidates = (
            instance,
            getattr(instance, "_llm", None),
            getattr(instance, "llm", None),
            getattr(getattr(instance, "_response_synthesizer", None), "_llm", None),
        )
        with self._lock:
            return next((c for c in candidates if c is not None and self._llms.get(id(c)) is c), None)

    # ------------------------------------------------------------------------------------------ spans
    def span_enter(self, span_id: str, parent_id: str | None, instance: Any) -> None:
        llm = self._llm_of(instance)
        with self._lock:
            self._spans[span_id] = _Span(parent_id, weakref.ref(llm) if llm is not None else None)
            while len(self._spans) > self.max_open_spans:
                self._spans.popitem(last=False)

    def span_end(self, span_id: str) -> None:
        with self._lock:
            span = self._spans.pop(span_id, None)
            ended = self._trees.pop(span_id, []) if span is not None and span.parent is None else []
        self._orphan(ended)

    def _orphan(self, anns: list[Announcement]) -> None:
        """Keep ended queries' announcements briefly for deferred LLM calls; withdraw what falls out."""
        now = self.clock()
        dropped: list[Announcement] = []
        with self._lock:
            for ann in anns:
                if not ann.fully_claimed:
                    self._orphans[id(ann)] = (now, ann)
            while self._orphans:
                key, (ended, ann) = next(iter(self._orphans.items()))
                if len(self._orphans) <= self.max_orphans and now - ended < self.orphan_ttl_s:
                    break
                del self._orphans[key]
                dropped.append(ann)
        for ann in dropped:
            ann.release_unclaimed()

    def _chain(self, span_id: str | None) -> list[str]:
        """``span_id`` and its open ancestors, nearest first (caller holds the lock)."""
        chain: list[str] = []
        while span_id is not None and span_id not in chain:
            chain.append(span_id)
            span = self._spans.get(span_id)
            span_id = span.parent if span is not None else None
        return chain

    # ------------------------------------------------------------------------------------------ retrieval
    def on_retrieval_end(self, event: RetrievalEndEvent) -> None:
        texts = node_texts(event.nodes)
        if not texts:
            return
        query = event.str_or_query_bundle
        query_str = query.query_str if isinstance(query, QueryBundle) else (query if isinstance(query, str) else None)
        with self._lock:
            chain = self._chain(event.span_id)
            llms = [s.llm() for s in (self._spans.get(sid) for sid in chain) if s is not None and s.llm is not None]
        llm = next((x for x in llms if x is not None), None)
        if llm is not None and getattr(llm, "reorder", "relevance") == "cache-aware":
            texts = self._cache_aware(llm.engine, texts)
        key = getattr(llm, "scope_metadata_key", None) or SCOPE_METADATA_KEY
        ann = Announcement(documents=texts, query=query_str, origin=str(event.span_id), ancestors=tuple(chain[1:]),
                           scopes=node_scopes(event.nodes, key))
        if llm is not None:  # the LLM that answers: its engine, in its reuse mode
            engines, reuse = [llm.engine], {id(llm.engine): getattr(llm, "reuse", None)}
        else:
            engines, reuse = self.live_engines_with_reuse()
        self._announce(ann, engines, reuse)
        root = chain[-1] if chain else str(event.span_id)
        evicted: list[Announcement] = []
        with self._lock:
            self.announced += 1
            if len(chain) > 1:
                self._trees.setdefault(root, []).append(ann)
                self._trees.move_to_end(root)
                while len(self._trees) > self.max_trees:
                    _, old = self._trees.popitem(last=False)
                    evicted.extend(old)
        if len(chain) <= 1:  # a bare retriever call: only a later call with these documents can use it
            evicted.append(ann)
        self._orphan(evicted)

    def _announce(self, ann: Announcement, engines: list[Any], reuse: dict[int, str | None]) -> None:
        """Announce ``ann`` to ``engines``, each in its reuse mode (``reuse``: ``id(engine) ->`` "exact", "blend" or
        None, the engine's default; `Announcement.announce_to`). An async retriever emits its event on the event
        loop: there an engine with ``announce_task`` (a `pcr_rag.client.http.HTTPEngine`) announces from a task, so
        its HTTP call never blocks the loop; the ticket it returns at once is filled in when the server answers,
        and withdrawn then if the model call already took it (the server saw the call first and will not claim
        it)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            ann.announce_to(engines, reuse)
            return
        ann.announce_to([e for e in engines if not hasattr(e, "announce_task")], reuse)
        for engine in (e for e in engines if hasattr(e, "announce_task")):
            try:
                mode = ann.reuse_mode(engine, reuse)
                ticket = engine.announce_task(list(ann.with_scopes(ann.documents)), query=ann.query or None,
                                              withdraw_if=lambda key=id(engine): key in ann.claimed,
                                              **reuse_argument(mode))
                ann.tickets[id(engine)] = (engine, ticket)
            except Exception:  # noqa: BLE001 - never fail the retrieval for a prefetch
                logger.exception("announcing retrieved documents to the PCR engine failed")

    @staticmethod
    def _cache_aware(engine: Any, texts: tuple[str, ...]) -> tuple[str, ...]:
        """``texts`` in the engine's cache-aware order (`PCRLLM(reorder="cache-aware")`); relevance order if the
        walk fails (a reorder never fails a retrieval)."""
        try:
            return tuple(engine.order_for_reuse(texts))
        except Exception:  # noqa: BLE001
            logger.exception("cache-aware ordering of retrieved nodes failed; announcing relevance order")
            return texts

    def announcement_for(self, documents: Sequence[str], span_id: str | None = None) -> Announcement | None:
        """The announcement of the retrieval that returned ``documents`` (in any order), for a component running
        at ``span_id`` (default: the active span), e.g. a node postprocessor: through the span tree first, then
        among ended queries and bare retrievals, newest first."""
        want = sorted(documents)
        ann = self.lookup(span_id)
        if ann is not None and sorted(ann.documents) == want:
            return ann
        self._orphan([])  # purge expired ones first
        with self._lock:
            candidates = [a for _, a in reversed(self._orphans.values())]
        return next((a for a in candidates if sorted(a.documents) == want), None)

    def lookup(self, span_id: str | None = None, text: str | None = None) -> Announcement | None:
        """The announcement for an LLM call at ``span_id`` (default: the active span) whose prompt is ``text``.

        First through the span tree; then, when ``text`` is given, among recently ended queries by content."""
        span_id = span_id if span_id is not None else active_span_id.get()
        with self._lock:
            chain = self._chain(span_id)
            anns = self._trees.get(chain[-1], []) if chain else []
            for ancestor in chain:
                for ann in reversed(anns):
                    if ancestor in ann.ancestors:
                        return ann
        return self._lookup_orphan(text) if text else None

    def _lookup_orphan(self, text: str) -> Announcement | None:
        self._orphan([])  # purge expired ones first
        with self._lock:
            candidates = [ann for _, ann in reversed(self._orphans.values())]
        best, best_count = None, 0
        for ann in candidates:
            present = documents_in_prompt(text, ann.documents)
            if sorted(present) == sorted(ann.documents):  # in any order: a cache-aware LLM rearranges them
                with self._lock:
                    self._orphans.pop(id(ann), None)  # fully used: this call takes its ticket
                return ann
            if len(present) > best_count:
                best, best_count = ann, len(present)
        return best

    def tracked_sizes(self) -> dict[str, int]:
        """How much state the hook holds (for leak checks)."""
        with self._lock:
            return {"open_spans": len(self._spans), "trees": len(self._trees),
                    "announcements": sum(len(v) for v in self._trees.values()), "orphans": len(self._orphans)}

    # ------------------------------------------------------------------------------------------ install
    def install(self) -> None:
        """Register the handlers on the root dispatcher (idempotent)."""
        with self._lock:
            if self.installed:
                return
            root = get_dispatcher()
            root.add_span_handler(self._span_handler)
            root.add_event_handler(self._event_handler)
            self.installed = True

    def uninstall(self) -> None:
        with self._lock:
            if not self.installed:
                return
            root = get_dispatcher()
            root.span_handlers = [h for h in root.span_handlers if h is not self._span_handler]
            root.event_handlers = [h for h in root.event_handlers if h is not self._event_handler]
            self.installed = False
            self._spans.clear()
            dropped = [a for anns in self._trees.values() for a in anns] + [a for _, a in self._orphans.values()]
            self._trees.clear()
            self._orphans.clear()
        for ann in dropped:
            ann.release_unclaimed()


class _SpanTracker(BaseSpanHandler[BaseSpan]):
    """Feeds span enter/exit/drop to the hook (it keeps no spans of its own)."""

    _hook: PCRRetrievalHook = PrivateAttr()

    def __init__(self, hook: PCRRetrievalHook) -> None:  # BaseSpanHandler.__init__ takes no extra fields
        super().__init__()
        self._hook = hook

    @property
    def hook(self) -> PCRRetrievalHook:
        return self._hook

    @classmethod
    def class_name(cls) -> str:
        return "PCRSpanTracker"

    def span_enter(self, id_: str, bound_args: inspect.BoundArguments, instance: Any = None,
                   parent_id: str | None = None, tags: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.hook.span_enter(id_, parent_id, instance)

    def span_exit(self, id_: str, bound_args: inspect.BoundArguments, instance: Any = None, result: Any = None,
                  **kwargs: Any) -> None:
        self.hook.span_end(id_)

    def span_drop(self, id_: str, bound_args: inspect.BoundArguments, instance: Any = None,
                  err: BaseException | None = None, **kwargs: Any) -> None:
        self.hook.span_end(id_)

    def new_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any = None,
                 parent_span_id: str | None = None, tags: dict[str, Any] | None = None,
                 **kwargs: Any) -> BaseSpan | None:
        return None

    def prepare_to_exit_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any = None,
                             result: Any = None, **kwargs: Any) -> BaseSpan | None:
        return None

    def prepare_to_drop_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any = None,
                             err: BaseException | None = None, **kwargs: Any) -> BaseSpan | None:
        return None


class _RetrievalEndHandler(BaseEventHandler):
    """Feeds `RetrievalEndEvent`s to the hook."""

    hook: Any = Field(exclude=True)

    @classmethod
    def class_name(cls) -> str:
        return "PCRRetrievalEndHandler"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            self.hook.on_retrieval_end(event)


_HOOK = PCRRetrievalHook()


def retrieval_hook() -> PCRRetrievalHook:
    """The process-wide hook (installed or not)."""
    return _HOOK


def install_retrieval_hook() -> PCRRetrievalHook:
    """Announce every LlamaIndex retrieval in this process to the PCR engine (idempotent)."""
    _HOOK.install()
    return _HOOK


def uninstall_retrieval_hook() -> None:
    _HOOK.uninstall()
