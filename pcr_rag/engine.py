"""`PCREngine`: the public facade. A local transformers model that reuses cached document KV across requests.

    from pcr_rag import PCREngine, EngineConfig
    with PCREngine(config=EngineConfig(cache_dir="/tmp/kv")) as engine:
        result = engine.generate("What does pathlib do?", documents=[doc1, doc2])
        print(result.text, result.metrics.ttft_s, result.metrics.reused_tokens)

Every request goes through `PCREngine.submit(prompt, params) -> RequestHandle` (`pcr_rag.request`); the
generate/stream/agenerate/astream methods are one-line wrappers over it.

Flow of a request: validate -> render + segment (one token run per document) -> chunk plan -> waiting queue
(the prefetcher protects and prefetches its chunks, in the schedule's order) -> admitted into a KV row: match +
lease, layer-wise load of the prefix -> prefill of the rest in chunks between decode steps, new chunks offloaded
layer by layer and inserted -> batched decode with every other running request, streaming tokens out.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pcr_rag import logs, tracing
from pcr_rag.cache import CacheConfig, CacheManager, CacheStats, ChunkSpec, Tier, blend_root, plan_chunks
from pcr_rag.cache.config import remote_with_layout
from pcr_rag.cache.keys import scope_key
from pcr_rag.cache.roots import RootIdentity, RootManifest, foreign_chunks_note
from pcr_rag.cache.storage.private_dir import refuse_unsafe
from pcr_rag.config import EngineConfig
from pcr_rag.errors import EngineClosedError, InvalidRequestError, PromptTooLongError, RequestCancelledError
from pcr_rag.handle import EngineSource, RequestHandle, RequestState, TokenChannel
from pcr_rag.metrics import REUSE_MODES, MetricsRecorder, prometheus_text
from pcr_rag.model.forward import WARM_UP_ROW, FastForward
from pcr_rag.model.grammar import GrammarCompiler
from pcr_rag.model.kernel_probe import first_step_positions, kernel_identity
from pcr_rag.model.model import PLAIN_TEMPLATE, LoadedModel, load_model
from pcr_rag.model.weights import resolve_weight_format
from pcr_rag.platform_support import check_engine_platform
from pcr_rag.prompt import Doc, DocumentPieces, PromptBuilder, PromptContext, SegmentedPrompt, split_documents
from pcr_rag.reorder import reuse_order
from pcr_rag.request import (
    GREEDY_BELOW,
    PROMPT_KINDS,
    ChatPrompt,
    FlatPrompt,
    GenerationResult,
    Prompt,
    RagPrompt,
    SamplingParams,
    StreamChunk,
)
from pcr_rag.sched import gc_pauses
from pcr_rag.sched.announcements import AnnouncementBoard, Ticket
from pcr_rag.sched.batch import BatchExecutor
from pcr_rag.sched.blend import BlendDocument, BlendRequest
from pcr_rag.sched.blend_gate import BlendGate, ShadowJob, ShadowRunner
from pcr_rag.sched.lookahead import QueueOutlook
from pcr_rag.sched.prefetcher import Prefetcher
from pcr_rag.sched.request_state import Request
from pcr_rag.sched.runner import PrefillContext
from pcr_rag.sched.scheduler import Scheduler
from pcr_rag.sched.step_budget import StepBudget
from pcr_rag.sched.transfer import KVCopier

log = logging.getLogger(__name__)

__all__ = ["EngineStats", "GenerationResult", "PCREngine", "StreamChunk"]


@dataclass(frozen=True)
class EngineStats:
    """Engine-wide counters. ``requests``: counts, latency percentiles (seconds) and hit ratios (fraction of prompt
    tokens), as `MetricsRecorder.snapshot`; ``cache``: the cache engine's `CacheStats` (all zero when the cache is
    off); ``prefetch``: window size, prefetch cycles and loads, announcement counts; ``layer_wait_s``: per-layer
    prefix-load wait (seconds); ``queue_depth``: requests waiting for a row; ``running``: requests holding a row
    (prefilling or decoding); ``prefill_tokens_per_s``: the measured prefill speed, which is also the cache-aware
    schedule's aging rate (`admission.PrefillSpeed`); ``step_budget``: the ITL budget's reading (decode step and
    prefill cost line in ms, the last layers-per-step cap chosen while rows decoded; `StepBudget.as_dict`); ``gc``:
    the process's garbage collections per generation, their total and longest pause (seconds), and the objects
    frozen now (`gc_pauses.GCPauses.snapshot`: process-wide figures); ``blend``: blend mode's gate
    (`pcr_rag.sched.blend_gate.BlendGate.snapshot`: verified requests, greedy answers identical to exact, mean
    token agreement, median first-token KL, fallbacks to exact, the shadow requests' cost)."""

    requests: Mapping[str, Any]
    cache: CacheStats
    prefetch: Mapping[str, int]
    queue_depth: int
    max_queue_depth: int
    layer_wait_s: list[float] = field(default_factory=list)
    running: int = 0
    prefill_tokens_per_s: float = 0.0
    step_budget: Mapping[str, Any] = field(default_factory=dict)
    gc: Mapping[str, Any] = field(default_factory=dict)
    blend: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Everything as plain dicts and numbers (the bench's records, `prometheus`)."""
        return {
            "requests": dict(self.requests),
            "cache": self.cache.as_dict(),
            "prefetch": dict(self.prefetch),
            "queue_depth": self.queue_depth,
            "max_queue_depth": self.max_queue_depth,
            "layer_wait_s": list(self.layer_wait_s),
            "running": self.running,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "step_budget": dict(self.step_budget),
            "gc": dict(self.gc),
            "blend": dict(self.blend),
        }

    def prometheus(self) -> str:
        return prometheus_text(self.as_dict())


class PCREngine:
    """KV-cache reuse runtime for RAG. Thread-safe; also usable from asyncio (`agenerate`, `astream`, `await`
    on a `RequestHandle`).

    Args:
        model: None (the default model), a known alias ("smollm2-135m-instruct", "gemma3-270m"), a local HF model
            directory, a Hugging Face repo id ("org/name": from the local HF cache, downloaded only with
            ``allow_download=True``), or a transformers `PreTrainedModel` (then ``tokenizer`` is required).
        tokenizer: the tokenizer for a model object (optional otherwise).
        config: an `EngineConfig`; keyword overrides (``PCREngine(cache_dir=...)``) build one.
        storage: an SSD-tier storage backend (`pcr_rag.cache.storage`) instead of the local ``cache_dir``
            (tests, simulations, other media).
    """

    def __init__(self, model: Any = None, tokenizer: Any = None, config: EngineConfig | None = None,
                 *, storage: Any = None, **overrides: Any) -> None:
        check_engine_platform()  # before any work: the cache directories need Linux
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = config.with_overrides(**overrides)
        self.config = config
        if config.enable_cache and config.ssd_capacity > 0 and storage is None:
            refuse_unsafe(config.cache_dir)  # an unsafe cache_dir fails before the model loads
        self.loaded: LoadedModel = load_model(model, tokenizer, dtype=config.dtype, device=config.device,
                                              model_cache_dir=config.model_cache_dir,
                                              allow_download=config.allow_download,
                                              chat_template=config.chat_template)
        self.device = self.loaded.device
        self.builder = PromptBuilder(self.loaded.tokenizer, token_cache_bytes=int(config.token_cache_bytes),
                                     system_prompt_scope=config.system_prompt_scope,
                                     plain_text=config.chat_template == PLAIN_TEMPLATE,
                                     chat_template_kwargs=config.chat_template_kwargs)
        weights = resolve_weight_format(config.weights, self.loaded.dtype, self.device)
        self.max_model_len = min(config.max_model_len or self.loaded.context_window, self.loaded.context_window)
        # tokens a KV row holds (prompt + generated); rows are preallocated, pages touched as they fill
        self.forward = FastForward(self.loaded, weights=weights, batch_rows=config.max_active,
                                   max_positions=self.max_model_len, compile=config.compile)
        self.arena = self.forward.new_arena(config.max_active, self.max_model_len)
        warm = self.forward.warm_up(self.arena) if config.warmup else None
        if warm is not None:
            log.info("forward warm-up: %.2f s", warm.seconds)
        # the root covers everything that fixes the KV's bits: model, dtype, chunk size, the forward's tile
        # sizes and weight format, the kernels' bits (a probe of the forward, the warm-up's tile its first step)
        # and the tenant namespace (config.namespace, plus a request's own namespace)
        warmed = (self.arena.row(WARM_UP_ROW) if warm is not None
                  and warm.prefill_tokens == first_step_positions(self.forward.tile_rows, self.forward.max_positions)
                  else None)
        self.identity = RootIdentity.of(self.loaded, self.forward, config.chunk_size,
                                        kernel_identity(self.forward, warmed))
        self._roots: dict[str, bytes] = {}
        self._blend_roots: dict[str, bytes] = {}  # blend mode's roots per namespace (`_blend_root_for`)
        self._anchor: tuple[int, ...] | None = None  # blend mode's anchor (`_blend_anchor`), made on first use
        self._ssd_roots: Any = None  # the SSD tier, once open: it stores each root's manifest (`note_root`)
        self._remote_roots: Any = None  # the remote tier, once open: it stores them in the shared store too
        self.root_key = self.root_for(None)
        self.cache: CacheManager | None = None
        if config.enable_cache:
            self.cache = CacheManager(CacheConfig(
                chunk_size=config.chunk_size,
                dram_bytes=config.dram_capacity,
                ssd_bytes=config.ssd_capacity,
                cache_dir=config.cache_dir if config.ssd_capacity > 0 else None,
                device=str(self.device),
                device_bytes=config.device_capacity,
                tenant_dram_bytes=config.tenant_dram_quota,
                tenant_ssd_bytes=config.tenant_ssd_quota,
                policy=config.eviction,
                load_planner=config.load_planner,
                io_workers=config.io_workers,
                remote=remote_with_layout(config.remote_config, self.loaded.kv),
                ssd_secret=config.secret if config.ssd_encrypt else None,
            ), storage=storage)
        if self.cache is not None and self.cache.storage_tier is not None:
            self._ssd_roots = self.cache.storage_tier
            self._ssd_roots.note_root(RootManifest.new(self.identity, config.namespace))
            note = foreign_chunks_note(self._ssd_roots, self.identity, self._roots.values(),
                                       str(config.cache_dir) if storage is None else self._ssd_roots.describe())
            if note is not None:
                log.warning("%s", note)
        if self.cache is not None and self.cache.remote is not None:
            self._remote_roots = self.cache.remote.tier  # the shared store: manifests too, and their census
            self._remote_roots.note_root(RootManifest.new(self.identity, config.namespace))
            self._remote_roots.start_census(self.identity)  # off the request path; logs roots of other identities
        self.copy_engine = KVCopier(self.device)
        # response formats compiled against the vocabulary (the rows of the logits), cached by format
        vocab_rows = self.loaded.model.get_output_embeddings().weight.shape[0]
        self.grammars = GrammarCompiler(self.loaded.tokenizer, vocab_rows, self.loaded.eos_token_ids)
        self.limits = config.request_limits  # bounds on a request's stop strings, format and tools (submit checks)
        self.recorder = MetricsRecorder()
        self.board = AnnouncementBoard(config.announce_ttl_s, max_pending=config.max_announcements,
                                       max_per_namespace=config.max_announcements_per_namespace)
        self._closed = False
        self._close_lock = threading.Lock()
        self.prefetcher: Prefetcher | None = None
        prefill_ctx = PrefillContext(self.forward, self.cache, self.copy_engine, config.layerwise)
        self.executor = BatchExecutor(
            prefill_ctx, self.arena, prefill_chunk_tokens=config.prefill_chunk_tokens,
            budget=StepBudget(len(self.forward.layers), config.itl_budget_steps), schedule=config.schedule,
            tokenizer=self.loaded.tokenizer, eos_ids=frozenset(self.loaded.eos_token_ids), recorder=self.recorder)
        if warm is not None:
            self.executor.seed(warm)
        # the queue's outlook and the prefetch window are the scheduler's values, from the state handed in here
        # (cache, prefill speed, board), never calls back into this facade
        self.scheduler = Scheduler(self.executor, schedule=config.schedule, max_queue=config.max_queue,
                                   outlook_of=QueueOutlook(self.cache), speed=prefill_ctx.speed, board=self.board)
        self.blend_gate = BlendGate(verify=config.blend_verify, window=config.blend_gate_window,
                                    min_identical=config.blend_gate_min_identical, max_kl=config.blend_gate_max_kl)
        self._shadows: ShadowRunner | None = None
        if (config.blend_verify > 0 or config.blend_backfill) and self.cache is not None:
            self._shadows = ShadowRunner(self.blend_gate,
                                         lambda: self.scheduler.depth == 0 and self.executor.active == 0)
        if self.cache is not None and (config.prefetch or config.eviction == "lookahead-lru"):
            self.prefetcher = Prefetcher(
                self.cache, self.scheduler, window=config.prefetch_window, do_loads=config.prefetch,
                protect=config.eviction == "lookahead-lru", on_cycle=self.board.expire,
            )
            self.scheduler.watch(self.prefetcher.wake)
        gc_pauses.pauses.install()
        self._gc_held = config.freeze_gc
        if self._gc_held:
            gc_pauses.hold()
        log.info("PCREngine ready: model=%s device=%s dtype=%s cache=%s", self.loaded.name, self.device,
                 self.loaded.dtype, "off" if self.cache is None else "on")

    # ------------------------------------------------------------------------------------------ properties
    @property
    def model(self):
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def closed(self) -> bool:
        """True once `close()` was called."""
        return self._closed

    @property
    def context_window(self) -> int:
        return self.loaded.context_window

    def count_tokens(self, text: str) -> int:
        return len(self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------------------------------ requests
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *,
               timeout: float | None = None, namespace: str | None = None,
               reuse: str | None = None) -> RequestHandle:
        """Validate, render and enqueue one request; returns at once with its `RequestHandle`.

        Args:
            prompt: a `RagPrompt`, `FlatPrompt` or `ChatPrompt` (validated when constructed).
            params: `SamplingParams` (None = defaults; ``max_new_tokens=None`` = ``EngineConfig.max_new_tokens``).
            timeout: seconds from now after which any wait on the handle cancels the request and raises
                `TimeoutError` (None = no deadline).
            namespace: a tenant namespace inside the engine's (`root_for`): requests of different namespaces share
                cached KV only for a prefix of shared segments (documents marked shared, see `pcr_rag.Doc`, after
                a shared system prompt), never from a private segment on, and never claim each other's
                announcements (None or "" = the engine's own, the shared pool, where documents are shared unless
                marked private). The prompt's token pieces and learned layout are kept per namespace.
            reuse: "exact" or "blend" for this request (None = ``EngineConfig.reuse``): blend also places the
                documents after the exact prefix from their position-independent KV (approximate, opt-in;
                `pcr_rag.sched.blend`); the result's ``metrics.reuse`` says how it was served (a namespace whose
                blend gate tripped is served exactly) and ``metrics.blended_tokens`` how many tokens were placed.
        Raises (before any compute): `InvalidRequestError` (bad prompt kind, params or timeout; a response format
            that does not compile), `PromptTooLongError` (a rendered prompt longer than
            `PromptBuilder.max_prompt_chars` is rejected before it is tokenized), `QueueFullError`,
            `EngineClosedError`. Only an accepted request's pieces enter the prompt builder's token cache.
        The handle raises what happens later: `RequestFailedError` (the engine failed this request alone; its row
            and pins are already released), `RequestCancelledError`, `EngineClosedError`, `TimeoutError`.
        """
        return self._submit(prompt, params, timeout=timeout, namespace=namespace, reuse=reuse)

    def _submit(self, prompt: Prompt, params: SamplingParams | None, *, timeout: float | None,
                namespace: str | None, reuse: str | None, shadow: bool = False) -> RequestHandle:
        """`submit`; ``shadow``: the blend gate's exact twin of a blended request (not counted as a request)."""
        self._check_open()
        if not isinstance(prompt, PROMPT_KINDS):
            raise InvalidRequestError(f"prompt must be a RagPrompt, FlatPrompt or ChatPrompt, got "
                                      f"{type(prompt).__name__}")
        root = self.root_for(namespace)
        mode = self._reuse_mode(reuse)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        self.limits.check_stop(params.stop)
        if params.response_format is not None:
            self.limits.check_format(params.response_format.source)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise InvalidRequestError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        if params.max_new_tokens is None:
            params = SamplingParams.from_kwargs(params, max_new_tokens=self.config.max_new_tokens)
        limit = ("the model's context window" if self.max_model_len == self.loaded.context_window
                 else "the engine's max_model_len")
        context = PromptContext(namespace or "", self.max_model_len - params.max_new_tokens, params.max_new_tokens,
                                self.max_model_len, limit)
        seg = prompt.segment(self.builder, context)
        n = seg.num_tokens
        if n + params.max_new_tokens > self.max_model_len:
            raise PromptTooLongError(n, params.max_new_tokens, self.max_model_len, limit)
        if params.response_format is not None:
            self.scheduler.check_room()  # a full queue refuses before the grammar is compiled and cached
        constraint = None if params.response_format is None else self.grammars.matcher(params.response_format)
        plan = self._plan(seg, root)
        ticket = self.board.claim(prompt.documents, namespace or "") if prompt.documents else None
        channel = TokenChannel()
        request_id = self.scheduler.next_id()
        trace = tracing.capture(self.loaded.name, _operation_name(prompt), self.loaded.kv.bytes_per_token,
                                None if ticket is None else ticket.ticket_id)
        req = Request(
            request_id=request_id, token_ids=seg.token_ids, plan=plan, params=params,
            submitted_at=time.perf_counter(), on_token=channel.put, documents_found=seg.documents_found,
            constraint=constraint, log_id=logs.request_id() or f"req-{request_id}", trace=trace, tenant=root,
            blend=self._blend_for(seg, namespace, root, mode),
            shadow=shadow,
        )
        req.metrics.reuse = "blend" if req.blend is not None else "exact"
        if req.blend is not None and self._shadows is not None:
            verify = self.blend_gate.sample()
            req.future.add_done_callback(functools.partial(self._after_blend, prompt, params, namespace, root,
                                                           req.keys, verify))
        req.ssd_keys_at_entry = self._ssd_keys(req.keys) | (ticket.ssd_keys_at_entry if ticket else frozenset())
        req.metrics.announced = ticket is not None
        req.future.add_done_callback(channel.close)
        req.future.add_done_callback(self._count_failure)
        if trace is not None:
            req.future.add_done_callback(functools.partial(trace.finish, req))
        self.scheduler.submit(req)
        self.builder.accept(context)
        return RequestHandle(EngineSource(req, channel, self._cancel), timeout)

    # The public methods below are wrappers over `submit`: generate* wait for the result, stream* return the
    # handle (iterate it for `StreamChunk`s, ``.result()`` afterwards), agenerate* await it, astream* are stream*
    # for ``async for``. Sampling keywords (``response_format`` too): see `SamplingParams`; ``timeout`` as for
    # `submit`.
    def generate(self, query: str, documents: Sequence[str | Doc] = (), **kwargs: Any) -> GenerationResult:
        """Answer ``query`` over ``documents`` (in order, each cached as its own token run; a str or a `Doc` with
        its sharing scope each, or ``scopes`` alongside; ``system``, ``namespace`` as for `submit`; ``system_tail``:
        per-request instructions placed after the documents, see `RagPrompt`): `stream`, waited for. Every `SamplingParams` field (``max_new_tokens`` / ``max_tokens``, ``temperature``,
        ``top_k``, the penalties, ``logprobs``, ...) is a keyword; an unknown keyword raises `TypeError`."""
        return self.stream(query, documents, **kwargs).result()

    def generate_prompt(self, prompt: str, documents: Sequence[str | Doc] = (), *, chat: bool = True,
                        **kwargs: Any) -> GenerationResult:
        """A flat prompt that contains ``documents`` verbatim, in order (a framework's rendered template); see
        `FlatPrompt`. ``chat=True`` wraps the prompt as one user turn of the model's chat template. `stream_prompt`,
        waited for (keywords as `generate`)."""
        return self.stream_prompt(prompt, documents, chat=chat, **kwargs).result()

    def generate_messages(self, messages: Sequence[Mapping[str, Any]], documents: Sequence[str | Doc] = (),
                          **kwargs: Any) -> GenerationResult:
        """A chat conversation ([{"role", "content"}]) rendered with the chat template (``chat_template_kwargs``:
        this request's extra template variables); ``documents`` found in the rendered text get their own token
        runs. `stream_messages`, waited for (keywords as `generate`)."""
        return self.stream_messages(messages, documents, **kwargs).result()

    def stream(self, query: str, documents: Sequence[str | Doc] = (), *, system: str | None = None,
               timeout: float | None = None, namespace: str | None = None,
               scopes: Sequence[str | None] | None = None, system_tail: str | None = None,
               reuse: str | None = None, **sampling: Any) -> RequestHandle:
        """Like `generate`; iterate the handle for `StreamChunk`s as tokens come, ``.result()`` afterwards."""
        return self.submit(RagPrompt(query, documents, system, scopes, system_tail),
                           SamplingParams.from_kwargs(**sampling), timeout=timeout, namespace=namespace, reuse=reuse)

    def stream_prompt(self, prompt: str, documents: Sequence[str | Doc] = (), *, chat: bool = True,
                      system: str | None = None, timeout: float | None = None, namespace: str | None = None,
                      scopes: Sequence[str | None] | None = None, reuse: str | None = None,
                      **sampling: Any) -> RequestHandle:
        return self.submit(FlatPrompt(prompt, documents, chat, system, scopes),
                           SamplingParams.from_kwargs(**sampling), timeout=timeout, namespace=namespace, reuse=reuse)

    def stream_messages(self, messages: Sequence[Mapping[str, Any]], documents: Sequence[str | Doc] = (), *,
                        timeout: float | None = None, namespace: str | None = None,
                        scopes: Sequence[str | None] | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None, reuse: str | None = None,
                        **sampling: Any) -> RequestHandle:
        return self.submit(ChatPrompt(messages, documents, scopes, chat_template_kwargs),
                           SamplingParams.from_kwargs(**sampling), timeout=timeout, namespace=namespace, reuse=reuse)

    async def agenerate(self, query: str, documents: Sequence[str | Doc] = (), **kwargs: Any) -> GenerationResult:
        """`generate` without blocking the event loop; cancelling the task cancels the request."""
        return await self.stream(query, documents, **kwargs)

    async def agenerate_prompt(self, prompt: str, documents: Sequence[str | Doc] = (), *, chat: bool = True,
                               **kwargs: Any) -> GenerationResult:
        return await self.stream_prompt(prompt, documents, chat=chat, **kwargs)

    async def agenerate_messages(self, messages: Sequence[Mapping[str, Any]], documents: Sequence[str | Doc] = (),
                                 **kwargs: Any) -> GenerationResult:
        return await self.stream_messages(messages, documents, **kwargs)

    def astream(self, query: str, documents: Sequence[str | Doc] = (), **kwargs: Any) -> RequestHandle:
        """`stream` for ``async for``; cancelling the consumer (or ``aclose()``) cancels the request."""
        return self.stream(query, documents, **kwargs)

    def astream_prompt(self, prompt: str, documents: Sequence[str | Doc] = (), *, chat: bool = True,
                       **kwargs: Any) -> RequestHandle:
        return self.stream_prompt(prompt, documents, chat=chat, **kwargs)

    def astream_messages(self, messages: Sequence[Mapping[str, Any]], documents: Sequence[str | Doc] = (),
                         **kwargs: Any) -> RequestHandle:
        return self.stream_messages(messages, documents, **kwargs)

    # ------------------------------------------------------------------------------------------ announcements
    def announce(self, documents: Sequence[str | Doc], query: str | None = None, *, system: str | None = None,
                 prefix: str | None = None, separator: str | None = None, layout: str = "auto",
                 namespace: str | None = None, scopes: Sequence[str | None] | None = None,
                 reuse: str | None = None) -> Ticket:
        """Retrieval finished: put the coming request into the prefetch window before the LLM call exists.

        The prefix's chunk keys are predicted: ``layout="rag"`` uses the engine's own layout (as `generate`),
        ``"flat"`` the ``prefix``/``separator`` given or learned from the namespace's last flat prompt (as
        `generate_prompt`), ``"auto"`` picks flat once a flat prompt of the namespace has been seen. Documents and
        their scopes as for `generate`. A later request with the same documents and ``namespace`` (as for
        `submit`) claims the ticket; an unclaimed one expires after ``announce_ttl_s``. Documents too long for
        any request raise `PromptTooLongError` before they are tokenized. ``reuse`` as for `submit`: for a blend
        request the documents' position-independent chains are prefetched too."""
        self._check_open()
        root = self.root_for(namespace)
        mode = self._reuse_mode(reuse)
        docs, doc_scopes = split_documents(documents, scopes)
        if not docs:
            raise InvalidRequestError("announce() needs at least one document")
        flat = self._flat_layout(layout, namespace)
        limit = ("the model's context window" if self.max_model_len == self.loaded.context_window
                 else "the engine's max_model_len")
        context = PromptContext(namespace or "", self.max_model_len, 0, self.max_model_len, limit)
        scoped = [Doc(text, scope) for text, scope in zip(docs, doc_scopes)]
        if query is not None and not flat:
            seg = self.builder.build_rag(query, scoped, system, context=context)
        else:
            seg = self.builder.predict_prefix(scoped, system=system, prefix=prefix, separator=separator, flat=flat,
                                              context=context)
        with tracing.announcement_span(len(docs)) as span:
            keys = [c.key for c in self._plan(seg, root)]
            blend = self._blend_for(seg, namespace, root, mode)
            chains = blend.chains if blend is not None else ()
            ssd = self._ssd_keys(keys).union(*(self._ssd_keys(c) for c in chains))
            ticket = self.board.add(docs, keys, ssd, namespace or "", chains)
            tracing.remember_announcement(span, ticket.ticket_id, len(keys))
        self.builder.accept(context)
        self._queue_changed()
        return ticket

    def order_for_reuse(self, documents: Sequence[str | Doc], *, system: str | None = None, layout: str = "auto",
                        prefix: str | None = None, separator: str | None = None,
                        exclude: Iterable[Ticket | None] = (), namespace: str | None = None,
                        scopes: Sequence[str | None] | None = None) -> list[Any]:
        """``documents`` in the order whose chunk chain matches the longest cached prefix (`pcr_rag.reorder`).

        Cached chunks (any tier) and the chunks of live announcements count; relevance order (the given order)
        breaks ties and is kept after the last position the cache decides, so with nothing cached the given order
        comes back. The layout is chosen as in `announce` (``layout``, ``system``, ``prefix``, ``separator``).
        ``exclude``: announcements whose chunks do not count (the caller's own, made for the order it is
        replacing). No compute and no side effects besides the prompt builder's token cache; a greedy walk over at
        most ``k (k + 1) / 2`` document runs.

        The given objects come back (str or `Doc`). ``namespace`` and the scopes (as for `generate`) pick the keys
        walked, those the request will have: every document shared, or every one private; documents of mixed
        scopes come back in the given order (the order would also move where the private part starts), as do
        documents longer together than any prompt can be (`PromptBuilder.max_prompt_chars`), untokenized.

        A different order is a different prompt: reuse stays exact for it, but the answer can differ from the
        answer to the relevance-ordered prompt.
        """
        self._check_open()
        root = self.root_for(namespace)
        docs, doc_scopes = split_documents(documents, scopes)
        items = list(documents)
        flat = self._flat_layout(layout, namespace)
        if len(docs) < 2:
            return items
        bound = self.builder.max_prompt_chars(self.max_model_len)
        if bound is not None and sum(len(d) for d in docs) > bound:
            return items  # no request can hold them all: nothing to order, and nothing worth tokenizing
        ns = namespace or ""
        private = {(scope != "shared") if ns else (scope == "private") for scope in doc_scopes}
        if len(private) > 1:
            return items
        context = PromptContext(ns)
        lay = self.builder.layout(system=system, prefix=prefix, separator=separator, flat=flat, namespace=ns)
        announced = Counter(k for keys in self.board.keys(len(self.board)) for k in keys)
        for ticket in exclude:
            if ticket is not None and not ticket.claimed and not ticket.expired:
                announced.subtract(ticket.keys)
        cache = self.cache

        def known(key: bytes) -> bool:
            return announced[key] > 0 or (cache is not None and key in cache)

        pieces = self.builder.document_pieces(lay, context=context)
        head = (self.builder.tokenize_piece(pieces.head, first=True, context=context),) if pieces.head else ()
        start = self._walk_start(head, private.pop(), pieces, root, known, lay.head_is_template)
        if start is None:
            return items
        walk_root, walk_head = start

        def run_of(i: int, previous: int | None) -> tuple[int, ...]:
            text = pieces.piece(docs[i], None if previous is None else docs[previous])
            return self.builder.tokenize_piece(text, first=previous is None and not head, context=context)

        walk = reuse_order(len(docs), walk_head, run_of, walk_root, self.config.chunk_size, known)
        self.builder.accept(context)
        return [items[i] for i in walk.order]

    def _walk_start(self, head: tuple[tuple[int, ...], ...], private: bool, pieces: DocumentPieces, root: bytes,
                    known: Callable[[bytes], bool],
                    head_is_template: bool = True) -> tuple[bytes, tuple[tuple[int, ...], ...]] | None:
        """Where `order_for_reuse`'s walk starts for documents all ``private`` (or all shared) in a request whose
        namespace has ``root``: (the key the first document chains from, the head segments still to walk), as
        `_plan` keys that request; None when the head is not cached (nothing after it can be) or the layout puts
        non-whitespace text between shared documents (it is private in a namespaced request). ``head_is_template``:
        the layout's head holds no request text (`DocumentLayout.head_is_template`); otherwise a namespaced
        request is private from its head on."""
        shared_root = self.root_key
        namespaced = root != shared_root
        shared_head = not namespaced or (self.builder.system_prompt_scope == "shared" and head_is_template)
        if not private:
            if namespaced and not shared_head:
                return root, head  # private from the head on: the tenant's own chain
            between = pieces.first_lead + pieces.lead + pieces.trail
            if namespaced and between and not between.isspace():
                return None
            return shared_root, head
        if namespaced:  # the head is shared only in front of a shared document: the tenant's own chain
            return root, head
        if not head:
            return scope_key(shared_root, shared_root), ()
        parent = shared_root
        for spec in plan_chunks(shared_root, head, self.config.chunk_size):
            if not known(spec.key):
                return None
            parent = spec.key
        return scope_key(root, parent), ()

    def cancel_announcement(self, ticket: Ticket) -> bool:
        """Withdraw an announcement nobody will claim (e.g. the framework dropped the retrieval); True if it was
        still pending. Its chunks leave the prefetch window at the next cycle."""
        withdrawn = self.board.cancel(ticket)
        if withdrawn:
            self._queue_changed()
        return withdrawn

    def stats(self) -> EngineStats:
        cache = self.cache.stats() if self.cache is not None else CacheStats()
        pf = {
            "window": self.config.prefetch_window,
            "cycles": self.prefetcher.cycles if self.prefetcher else 0,
            "loads_started": self.prefetcher.loads_started if self.prefetcher else 0,
            "announced": self.board.announced,
            "claimed": self.board.claimed,
            "expired": self.board.expired,
            "pending_announcements": len(self.board),
        }
        req = self.recorder.snapshot()
        pf["prefetch_hit_chunks"] = req["prefetch_hit_chunks"]
        return EngineStats(requests=req, cache=cache, prefetch=pf, queue_depth=self.scheduler.depth,
                           max_queue_depth=self.scheduler.max_depth,
                           layer_wait_s=list(self.copy_engine.waits.seconds), running=self.executor.active,
                           prefill_tokens_per_s=self.executor.ctx.speed.tokens_per_s,
                           step_budget=self.executor.budget.as_dict(), gc=gc_pauses.pauses.snapshot(),
                           blend=self.blend_gate.snapshot(self._shadows.pending if self._shadows else 0,
                                                          self._shadows.backfills if self._shadows else 0))

    def root_for(self, namespace: str | None = None) -> bytes:
        """The chunk keys' root for requests of ``namespace`` (None or "" = `root_key`, the engine's own).

        Equal roots mean shareable KV: a root hashes the model fingerprint, KV dtype, chunk size, the forward's
        plan id, ``EngineConfig.namespace`` and the request namespace."""
        ns = "" if namespace is None else namespace
        if not isinstance(ns, str):
            raise InvalidRequestError(f"namespace must be a str or None, got {type(namespace).__name__}")
        root = self._roots.get(ns)
        if root is None:
            root = self.identity.root(self.config.namespace, ns)
            self._roots[ns] = root
            for tier in (self._ssd_roots, self._remote_roots):
                if tier is not None:
                    tier.note_root(RootManifest.new(self.identity, self.config.namespace, ns))
        return root

    def plan_for(self, query: str, documents: Sequence[str | Doc] = (), *, system: str | None = None,
                 namespace: str | None = None, scopes: Sequence[str | None] | None = None) -> list[ChunkSpec]:
        """The chunk plan `generate` would use for this request (no compute, no side effects)."""
        root = self.root_for(namespace)
        seg = RagPrompt(query, documents, system, scopes).segment(self.builder, PromptContext(namespace or ""))
        return self._plan(seg, root)

    def _after_blend(self, prompt: Prompt, params: SamplingParams, namespace: str | None, root: bytes,
                     keys: Sequence[bytes], verify: bool, done: Future) -> None:
        """A blended request finished: queue its exact twin (`ShadowRunner`) - to verify (a sampled one, the whole
        answer), or to backfill the exact prefix tree (one token) when the tree does not hold the prompt."""
        if done.cancelled() or done.exception() is not None or self._shadows is None:
            return
        if not verify:
            if not self.config.blend_backfill or self.cache is None or not keys:
                return
            if len(self.cache.match(keys).keys) == len(keys):
                return  # the exact tree holds the prompt already
            params = SamplingParams.from_kwargs(max_new_tokens=1)

        def run() -> GenerationResult:
            return self._submit(prompt, params, timeout=None, namespace=namespace, reuse="exact",
                                shadow=True).result()

        reproducible = params.temperature < GREEDY_BELOW or params.seed is not None
        self._shadows.add(ShadowJob(done.result(), root, reproducible, run, verify, keys[-1] if keys else b""))

    def _blend_root_for(self, namespace: str | None) -> bytes:
        """The blend root of ``namespace``'s root (`pcr_rag.cache.keys.blend_root`); its manifest is written to the
        SSD and remote tiers the first time (so their census knows its chunks as this identity's)."""
        ns = namespace or ""
        root = self._blend_roots.get(ns)
        if root is None:
            root = blend_root(self.root_for(ns))
            self._blend_roots[ns] = root
            for tier in (self._ssd_roots, self._remote_roots):
                if tier is not None:
                    tier.note_root(RootManifest.new(self.identity, self.config.namespace, ns, blend=True))
        return root

    def _reuse_mode(self, reuse: str | None) -> str:
        """A request's reuse mode: ``reuse``, or ``EngineConfig.reuse`` for None; `InvalidRequestError` else."""
        mode = self.config.reuse if reuse is None else reuse
        if mode not in REUSE_MODES:
            raise InvalidRequestError(f"reuse must be one of {REUSE_MODES} or None, got {reuse!r}")
        return mode

    def _blend_for(self, seg: SegmentedPrompt, namespace: str | None, root: bytes, mode: str) -> BlendRequest | None:
        """Blend mode's view of ``seg`` in ``namespace`` (whose root is ``root``): its document segments, each keyed
        under the blend root of the engine-wide root while every segment up to it is shared, else of the
        namespace's root. None - the request is served exactly - in exact mode, without a cache (nothing to
        reuse), or once the namespace's blend gate fell back to exact."""
        if mode != "blend" or self.cache is None or not self.blend_gate.allows(root):
            return None
        shared, own = self._blend_root_for(None), self._blend_root_for(namespace)
        offsets = [0]
        for s in seg.segments:
            offsets.append(offsets[-1] + len(s))
        private_from = len(seg.segments) if seg.private_from is None else seg.private_from
        docs = tuple(BlendDocument(offsets[i], offsets[i + 1], shared if i < private_from else own)
                     for i in seg.document_segments)
        return BlendRequest.build(self._blend_anchor(), docs, float(self.config.blend_recompute),
                                  self.config.chunk_size, seg.token_ids)

    def _blend_anchor(self) -> tuple[int, ...]:
        """The fixed head that documents' position-independent KV is computed behind: the tokens of the engine's
        default RAG layout before its first document (chat template, system turn, instruction), once."""
        if self._anchor is None:
            seg = self.builder.build_rag("?", ["Document."])
            first = seg.document_segments[0] if seg.document_segments else 1
            self._anchor = tuple(t for s in seg.segments[:first] for t in s)
        return self._anchor

    def _plan(self, seg: SegmentedPrompt, root: bytes) -> list[ChunkSpec]:
        """The chunk plan of ``seg`` in the namespace whose root is ``root``: its shared segments key from the
        engine-wide root (`root_key`), so every namespace shares them, and from its first private segment on
        the keys switch to ``root`` (`pcr_rag.cache.keys.plan_chunks`). Without a private segment, or in the
        engine's own namespace without a document marked private, these are the plain chain's keys."""
        return plan_chunks(self.root_key, seg.segments, self.config.chunk_size, private_root=root,
                           private_from=seg.private_from)

    def window_snapshot(self) -> list[tuple[bytes, ...]]:
        """Chunk keys of the requests currently in the prefetch window (waiting queue first, then announced)."""
        return list(self.scheduler.prefetch_window(self.config.prefetch_window).chains)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until queued write-backs reached the SSD tier."""
        if self.cache is not None:
            self.cache.flush(timeout)

    def close(self) -> None:
        """Finish the running request, fail the waiting ones, flush write-back, release the cache directory."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._shadows is not None:
            self._shadows.close()
        self.scheduler.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.copy_engine.close()
        if self.cache is not None:
            self.cache.close()
        if self._gc_held:
            gc_pauses.release()

    def __enter__(self) -> PCREngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed; create a new PCREngine")

    def _flat_layout(self, layout: str, namespace: str | None) -> bool:
        """Whether a request announced or ordered with ``layout`` ("rag", "flat", "auto") has a framework's flat
        layout ("auto": once a flat prompt of ``namespace`` has been seen; one tenant's prompts never change how
        another's announcements are keyed)."""
        if layout not in ("auto", "rag", "flat"):
            raise InvalidRequestError(f"layout must be 'auto', 'rag' or 'flat', got {layout!r}")
        return layout == "flat" or (layout == "auto" and self.builder.learned_flat_layout(namespace or ""))

    def _ssd_keys(self, keys: Sequence[bytes]) -> frozenset[bytes]:
        if self.cache is None:
            return frozenset()
        m = self.cache.match(keys)
        return frozenset(k for k, t in zip(m.keys, m.tiers) if t is Tier.SSD or t is Tier.REMOTE)

    def _queue_changed(self) -> None:
        """The announcement board changed: the prefetch window's tail did (the scheduler wakes the prefetcher
        itself when its queue changes: `Scheduler.watch`)."""
        if self.prefetcher is not None:
            self.prefetcher.wake()

    def _cancel(self, req: Request) -> bool:
        """Cancel ``req``: a waiting one leaves the queue and fails now; a running one fails at its next forward.
        False if it had already finished."""
        if req.future.done():
            return False
        req.cancel()
        if self.scheduler.remove_waiting(req) and not req.future.done():
            req.state = RequestState.CANCELLED
            req.future.set_exception(RequestCancelledError("request cancelled while waiting"))
        return True

    def _count_failure(self, future) -> None:
        exc = future.exception()
        if exc is not None:
            self.recorder.record_failure(cancelled=isinstance(exc, RequestCancelledError))


def _operation_name(prompt: Prompt) -> str:
    """The GenAI operation a prompt is (`pcr_rag.tracing`): "text_completion" for a flat prompt that continues raw
    text, else "chat" (rendered with the chat template)."""
    return "text_completion" if isinstance(prompt, FlatPrompt) and not prompt.chat else "chat"
