"""`PCREngine`: the public facade. A local transformers model that reuses cached document KV across requests.

    from pcr_rag import PCREngine, EngineConfig
    with PCREngine(config=EngineConfig(cache_dir="/tmp/kv")) as engine:
        result = engine.generate("What does pathlib do?", documents=[doc1, doc2])
        print(result.text, result.metrics.ttft_s, result.metrics.reused_tokens)

Every request goes through `PCREngine.submit(prompt, params) -> RequestHandle` (`pcr_rag.requests`); the
generate/stream/agenerate/astream methods are one-line wrappers over it.

Flow of a request: validate -> render + segment (one token run per document) -> chunk plan -> waiting queue
(the prefetcher protects and prefetches its chunks) -> executor: match + lease, layer-wise load of the prefix,
one forward per unmatched chunk with layer-wise offload, insert new chunks -> decode, streaming tokens out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pcr_rag.cache import CacheConfig, CacheEngine, CacheStats, ChunkSpec, Tier, namespace_key, plan_chunks
from pcr_rag.config import EngineConfig
from pcr_rag.errors import EngineClosedError, InvalidRequestError, PromptTooLongError, RequestCancelledError
from pcr_rag.metrics import MetricsRecorder, prometheus_text
from pcr_rag.prompt import PromptBuilder, validate_documents
from pcr_rag.requests import (
    PROMPT_KINDS,
    ChatPrompt,
    FlatPrompt,
    GenerationResult,
    Prompt,
    RagPrompt,
    Request,
    RequestHandle,
    RequestState,
    SamplingParams,
    StreamChunk,
    TokenChannel,
)
from pcr_rag.runtime.model import LoadedModel, load_model
from pcr_rag.runtime.prefetcher import Prefetcher
from pcr_rag.runtime.runner import Runner
from pcr_rag.runtime.scheduler import AnnouncementBoard, Scheduler, Ticket
from pcr_rag.runtime.transfer import CopyEngine

log = logging.getLogger(__name__)

__all__ = ["EngineStats", "GenerationResult", "PCREngine", "StreamChunk"]


@dataclass(frozen=True)
class EngineStats:
    """Engine-wide counters. ``requests``: counts, latency percentiles (seconds) and hit ratios (fraction of prompt
    tokens), as `MetricsRecorder.snapshot`; ``cache``: the cache engine's `CacheStats` (all zero when the cache is
    off); ``prefetch``: window size, prefetch cycles and loads, announcement counts; ``layer_wait_s``: per-layer
    prefix-load wait (seconds)."""

    requests: Mapping[str, Any]
    cache: CacheStats
    prefetch: Mapping[str, int]
    queue_depth: int
    max_queue_depth: int
    layer_wait_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Everything as plain dicts and numbers (the bench's records, `prometheus`)."""
        return {
            "requests": dict(self.requests),
            "cache": self.cache.as_dict(),
            "prefetch": dict(self.prefetch),
            "queue_depth": self.queue_depth,
            "max_queue_depth": self.max_queue_depth,
            "layer_wait_s": list(self.layer_wait_s),
        }

    def prometheus(self) -> str:
        return prometheus_text(self.as_dict())


class PCREngine:
    """KV-cache reuse runtime for RAG. Thread-safe; also usable from asyncio (`agenerate`, `astream`, `await`
    on a `RequestHandle`).

    Args:
        model: None (the default model), a known alias ("smollm2-135m-instruct", "gemma3-270m"), a local HF model
            directory, or a transformers `PreTrainedModel` (then ``tokenizer`` is required).
        tokenizer: the tokenizer for a model object (optional otherwise).
        config: an `EngineConfig`; keyword overrides (``PCREngine(cache_dir=...)``) build one.
        storage: an SSD-tier storage backend (`pcr_rag.cache.storage`) instead of the local ``cache_dir``
            (tests, simulations, other media).
    """

    def __init__(self, model: Any = None, tokenizer: Any = None, config: EngineConfig | None = None,
                 *, storage: Any = None, **overrides: Any) -> None:
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = config.with_overrides(**overrides)
        self.config = config
        self.loaded: LoadedModel = load_model(model, tokenizer, dtype=config.dtype, device=config.device,
                                              model_cache_dir=config.model_cache_dir)
        self.device = self.loaded.device
        self.builder = PromptBuilder(self.loaded.tokenizer)
        self.root_key = namespace_key(self.loaded.fingerprint, str(self.loaded.kv.dtype).replace("torch.", ""),
                                      config.chunk_size, config.namespace)
        self.cache: CacheEngine | None = None
        if config.enable_cache:
            self.cache = CacheEngine(CacheConfig(
                chunk_size=config.chunk_size,
                dram_bytes=config.dram_capacity,
                ssd_bytes=config.ssd_capacity,
                cache_dir=config.cache_dir if config.ssd_capacity > 0 else None,
                device=str(self.device),
                device_bytes=config.device_capacity,
                policy=config.eviction,
                io_workers=config.io_workers,
            ), storage=storage)
        self.copy_engine = CopyEngine(self.device, workers=config.io_workers)
        self.runner = Runner(self.loaded, self.cache, self.copy_engine, layerwise=config.layerwise)
        self.recorder = MetricsRecorder()
        self.board = AnnouncementBoard(config.announce_ttl_s)
        self._closed = False
        self._close_lock = threading.Lock()
        self.prefetcher: Prefetcher | None = None
        self.scheduler = Scheduler(self._execute, max_queue=config.max_queue, max_active=config.max_active,
                                   on_change=self._queue_changed)
        if self.cache is not None and (config.prefetch or config.eviction == "lookahead-lru"):
            self.prefetcher = Prefetcher(
                self.cache, self._window_keys, window=config.prefetch_window, do_loads=config.prefetch,
                protect=config.eviction == "lookahead-lru", on_cycle=self.board.expire,
            )
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
               timeout: float | None = None) -> RequestHandle:
        """Validate, render and enqueue one request; returns at once with its `RequestHandle`.

        Args:
            prompt: a `RagPrompt`, `FlatPrompt` or `ChatPrompt` (validated when constructed).
            params: `SamplingParams` (None = defaults; ``max_new_tokens=None`` = ``EngineConfig.max_new_tokens``).
            timeout: seconds from now after which any wait on the handle cancels the request and raises
                `TimeoutError` (None = no deadline).
        Raises (before any compute): `InvalidRequestError` (bad prompt kind, params or timeout),
            `PromptTooLongError`, `QueueFullError`, `EngineClosedError`.
        """
        self._check_open()
        if not isinstance(prompt, PROMPT_KINDS):
            raise InvalidRequestError(f"prompt must be a RagPrompt, FlatPrompt or ChatPrompt, got "
                                      f"{type(prompt).__name__}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise InvalidRequestError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        if params.max_new_tokens is None:
            params = SamplingParams.from_kwargs(params, max_new_tokens=self.config.max_new_tokens)
        seg = prompt.segment(self.builder)
        n = seg.num_tokens
        if n + params.max_new_tokens > self.loaded.context_window:
            raise PromptTooLongError(n, params.max_new_tokens, self.loaded.context_window)
        plan = plan_chunks(self.root_key, seg.segments, self.config.chunk_size)
        ticket = self.board.claim(prompt.documents) if prompt.documents else None
        channel = TokenChannel()
        req = Request(
            request_id=self.scheduler.next_id(), token_ids=seg.token_ids, plan=plan, params=params,
            submitted_at=time.perf_counter(), on_token=channel.put, documents_found=seg.documents_found,
        )
        req.ssd_keys_at_entry = self._ssd_keys(req.keys) | (ticket.ssd_keys_at_entry if ticket else frozenset())
        req.metrics.announced = ticket is not None
        req.future.add_done_callback(channel.close)
        req.future.add_done_callback(self._count_failure)
        self.scheduler.submit(req)
        return RequestHandle(req, channel, self._cancel, timeout)

    # The public methods below are wrappers over `submit`: generate* wait for the result, stream* return the
    # handle (iterate it for `StreamChunk`s, ``.result()`` afterwards), agenerate* await it, astream* are stream*
    # for ``async for``. Sampling keywords: see `SamplingParams`; ``timeout`` as for `submit`.
    def generate(self, query: str, documents: Sequence[str] = (), *, system: str | None = None,
                 max_new_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 stop: Sequence[str] | str | None = None, seed: int | None = None,
                 timeout: float | None = None) -> GenerationResult:
        """Answer ``query`` over ``documents`` (in order, each cached as its own token run)."""
        return self.submit(RagPrompt(query, documents, system),
                           SamplingParams(max_new_tokens, temperature, top_p, stop, seed), timeout=timeout).result()

    def generate_prompt(self, prompt: str, documents: Sequence[str] = (), *, chat: bool = True,
                        system: str | None = None, max_new_tokens: int | None = None, temperature: float = 0.0,
                        top_p: float = 1.0, stop: Sequence[str] | str | None = None, seed: int | None = None,
                        timeout: float | None = None) -> GenerationResult:
        """A flat prompt that contains ``documents`` verbatim, in order (a framework's rendered template); see
        `FlatPrompt`. ``chat=True`` wraps the prompt as one user turn of the model's chat template."""
        return self.submit(FlatPrompt(prompt, documents, chat, system),
                           SamplingParams(max_new_tokens, temperature, top_p, stop, seed), timeout=timeout).result()

    def generate_messages(self, messages: Sequence[Mapping[str, Any]], documents: Sequence[str] = (), *,
                          max_new_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                          stop: Sequence[str] | str | None = None, seed: int | None = None,
                          timeout: float | None = None) -> GenerationResult:
        """A chat conversation ([{"role", "content"}]) rendered with the chat template; ``documents`` found in
        the rendered text get their own token runs."""
        return self.submit(ChatPrompt(messages, documents),
                           SamplingParams(max_new_tokens, temperature, top_p, stop, seed), timeout=timeout).result()

    def stream(self, query: str, documents: Sequence[str] = (), *, system: str | None = None,
               timeout: float | None = None, **sampling: Any) -> RequestHandle:
        """Like `generate`; iterate the handle for `StreamChunk`s as tokens come, ``.result()`` afterwards."""
        return self.submit(RagPrompt(query, documents, system), SamplingParams.from_kwargs(**sampling),
                           timeout=timeout)

    def stream_prompt(self, prompt: str, documents: Sequence[str] = (), *, chat: bool = True,
                      system: str | None = None, timeout: float | None = None, **sampling: Any) -> RequestHandle:
        return self.submit(FlatPrompt(prompt, documents, chat, system), SamplingParams.from_kwargs(**sampling),
                           timeout=timeout)

    def stream_messages(self, messages: Sequence[Mapping[str, Any]], documents: Sequence[str] = (), *,
                        timeout: float | None = None, **sampling: Any) -> RequestHandle:
        return self.submit(ChatPrompt(messages, documents), SamplingParams.from_kwargs(**sampling), timeout=timeout)

    async def agenerate(self, query: str, documents: Sequence[str] = (), **kwargs: Any) -> GenerationResult:
        """`generate` without blocking the event loop; cancelling the task cancels the request."""
        return await self.stream(query, documents, **kwargs)

    async def agenerate_prompt(self, prompt: str, documents: Sequence[str] = (), *, chat: bool = True,
                               **kwargs: Any) -> GenerationResult:
        return await self.stream_prompt(prompt, documents, chat=chat, **kwargs)

    async def agenerate_messages(self, messages: Sequence[Mapping[str, Any]], documents: Sequence[str] = (),
                                 **kwargs: Any) -> GenerationResult:
        return await self.stream_messages(messages, documents, **kwargs)

    def astream(self, query: str, documents: Sequence[str] = (), **kwargs: Any) -> RequestHandle:
        """`stream` for ``async for``; cancelling the consumer (or ``aclose()``) cancels the request."""
        return self.stream(query, documents, **kwargs)

    def astream_prompt(self, prompt: str, documents: Sequence[str] = (), *, chat: bool = True,
                       **kwargs: Any) -> RequestHandle:
        return self.stream_prompt(prompt, documents, chat=chat, **kwargs)

    def astream_messages(self, messages: Sequence[Mapping[str, Any]], documents: Sequence[str] = (),
                         **kwargs: Any) -> RequestHandle:
        return self.stream_messages(messages, documents, **kwargs)

    # ------------------------------------------------------------------------------------------ announcements
    def announce(self, documents: Sequence[str], query: str | None = None, *, system: str | None = None,
                 prefix: str | None = None, separator: str | None = None, layout: str = "auto") -> Ticket:
        """Retrieval finished: put the coming request into the prefetch window before the LLM call exists.

        The prefix's chunk keys are predicted: ``layout="rag"`` uses the engine's own layout (as `generate`),
        ``"flat"`` the ``prefix``/``separator`` given or learned from the last flat prompt (as
        `generate_prompt`), ``"auto"`` picks flat once a flat prompt has been seen. A later request with the same
        documents claims the ticket; an unclaimed one expires after ``announce_ttl_s``."""
        self._check_open()
        docs = validate_documents(documents)
        if not docs:
            raise InvalidRequestError("announce() needs at least one document")
        flat = layout == "flat" or (layout == "auto" and self.builder._learned_prefix is not None)
        if query is not None and not flat:
            seg = self.builder.build_rag(query, docs, system)
        else:
            seg = self.builder.predict_prefix(docs, system=system, prefix=prefix, separator=separator, flat=flat)
        keys = [c.key for c in plan_chunks(self.root_key, seg.segments, self.config.chunk_size)]
        ticket = self.board.add(docs, keys, self._ssd_keys(keys))
        self._queue_changed()
        return ticket

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
                           layer_wait_s=list(self.copy_engine.waits.seconds))

    def plan_for(self, query: str, documents: Sequence[str] = (), *,
                 system: str | None = None) -> list[ChunkSpec]:
        """The chunk plan `generate` would use for this request (no compute, no side effects)."""
        seg = RagPrompt(query, documents, system).segment(self.builder)
        return plan_chunks(self.root_key, seg.segments, self.config.chunk_size)

    def window_snapshot(self) -> list[tuple[bytes, ...]]:
        """Chunk keys of the requests currently in the prefetch window (waiting queue first, then announced)."""
        return [tuple(k) for k in self._window_keys(self.config.prefetch_window)]

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
        self.scheduler.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.copy_engine.close()
        if self.cache is not None:
            self.cache.close()

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

    def _ssd_keys(self, keys: Sequence[bytes]) -> frozenset[bytes]:
        if self.cache is None:
            return frozenset()
        m = self.cache.match(keys)
        return frozenset(k for k, t in zip(m.keys, m.tiers) if t is Tier.SSD)

    def _window_keys(self, limit: int) -> list[Sequence[bytes]]:
        waiting = [r.keys for r in self.scheduler.window(limit)]
        if len(waiting) < limit:
            waiting.extend(self.board.keys(limit - len(waiting)))
        return waiting

    def _queue_changed(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.wake()

    def _execute(self, req: Request) -> _ActiveRequest | None:
        """Runs on the executor thread: prefill with reuse; returns the request's decode to be advanced."""
        m = req.metrics
        started = time.perf_counter()
        m.queue_s = started - req.submitted_at
        m.prompt_tokens = len(req.token_ids)
        capacity = len(req.token_ids) + req.params.max_new_tokens
        pre = self.runner.prefill(req.token_ids, req.plan, capacity, req.cancelled)
        # prefetch hits: chunks that were on SSD when the request entered the queue (or was announced) and were
        # served from memory when it ran
        m.prefetch_hit_chunks = len(req.ssd_keys_at_entry & pre.memory_keys)
        m.prefill_s = time.perf_counter() - started
        m.computed_tokens = pre.computed_tokens
        m.reused_by_tier = pre.reused_by_tier
        m.reused_tokens = sum(pre.reused_by_tier.values())
        m.load_wait_s = pre.load_wait_s
        m.recomputed_after_error = pre.retries
        active = _ActiveRequest(self, req, pre.last_logits)
        active.state = self.runner.start_decode(pre.kv, pre.last_logits, len(req.token_ids), req.params,
                                                self.loaded.tokenizer, active.on_token, req.cancelled, m)
        return active

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


class _ActiveRequest:
    """A request between prefill and its last token, advanced by the executor one token per `step()`."""

    def __init__(self, engine: PCREngine, req: Request, first_logits) -> None:
        self.engine = engine
        self.req = req
        self.first_logits = first_logits
        self.state = None
        self._first = True

    def on_token(self, token_id: int, delta: str) -> None:
        if self._first:
            self._first = False
            self.req.metrics.ttft_s = time.perf_counter() - self.req.submitted_at
        if self.req.on_token is not None:
            self.req.on_token(token_id, delta)

    def step(self) -> bool:
        if not self.state.step():
            return False
        req, m, st = self.req, self.req.metrics, self.state
        end = time.perf_counter()
        if self._first:  # no visible token (immediate EOS): the first token still came out of prefill
            m.ttft_s = end - req.submitted_at
        m.e2e_s = end - req.submitted_at
        m.generated_tokens = len(st.tokens)
        req.state = RequestState.FINISHED
        self.engine.recorder.record(m)
        req.future.set_result(GenerationResult(
            text=st.text, token_ids=st.tokens, prompt_token_ids=list(req.token_ids), metrics=m,
            finish_reason=st.finish, request_id=req.request_id, documents_found=req.documents_found,
            first_token_logits=self.first_logits.detach().to("cpu")))
        return True

    def fail(self, exc: BaseException) -> None:
        self.req.state = RequestState.CANCELLED if isinstance(exc, RequestCancelledError) else RequestState.FAILED
        self.state = None  # drop the KV buffers
        if not self.req.future.done():
            self.req.future.set_exception(exc)
