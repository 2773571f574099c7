"""`PCREngine`: the public facade. A local transformers model that reuses cached document KV across requests.

    from pcr_rag import PCREngine, EngineConfig
    with PCREngine(config=EngineConfig(cache_dir="/tmp/kv")) as engine:
        result = engine.generate("What does pathlib do?", documents=[doc1, doc2])
        print(result.text, result.metrics.ttft_s, result.metrics.reused_tokens)

Flow of a request: validate -> render + segment (one token run per document) -> chunk plan -> waiting queue
(the prefetcher protects and prefetches its chunks) -> executor: match + lease, layer-wise load of the prefix,
one forward per unmatched chunk with layer-wise offload, insert new chunks -> decode, streaming tokens out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import Queue
from typing import Any

from pcr_rag.cache import CacheConfig, CacheEngine, namespace_key, plan_chunks
from pcr_rag.config import EngineConfig
from pcr_rag.errors import EngineClosedError, InvalidRequestError, PromptTooLongError, RequestCancelledError
from pcr_rag.metrics import MetricsRecorder, RequestMetrics, prometheus_text
from pcr_rag.prompt import PromptBuilder, SegmentedPrompt, validate_documents
from pcr_rag.runtime.model import LoadedModel, load_model
from pcr_rag.runtime.prefetcher import Prefetcher
from pcr_rag.runtime.runner import Runner, SamplingParams
from pcr_rag.runtime.scheduler import AnnouncementBoard, Request, RequestState, Scheduler, Ticket
from pcr_rag.runtime.transfer import CopyEngine

log = logging.getLogger(__name__)

_DONE = object()


@dataclass
class GenerationResult:
    """A finished request. finish_reason: "stop" (EOS or a stop string) or "length" (max_new_tokens)."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    finish_reason: str
    request_id: int = 0
    documents_found: int = 0
    first_token_logits: Any = None  # the prefill's last-position logits (a CPU tensor), for checks and scoring


@dataclass(frozen=True)
class StreamChunk:
    """One generated token as it comes: its id and the text it added (may be "" mid-way through a character).

    The last chunk of every stream is a closing one: ``token_id=-1``, ``text=""`` and ``result`` set to the
    request's `GenerationResult` (finish reason, token counts, metrics)."""

    token_id: int
    text: str
    index: int
    result: GenerationResult | None = None

    @property
    def is_final(self) -> bool:
        return self.result is not None


@dataclass
class EngineStats:
    """Engine-wide counters: requests, latency percentiles (seconds), hit ratios (fraction of prompt tokens),
    the cache engine's tier stats, prefetch and announcement counts, and per-layer load wait (seconds)."""

    requests: dict[str, Any]
    cache: dict[str, Any]
    prefetch: dict[str, Any]
    queue_depth: int
    max_queue_depth: int
    layer_wait_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "cache": self.cache,
            "prefetch": self.prefetch,
            "queue_depth": self.queue_depth,
            "max_queue_depth": self.max_queue_depth,
            "layer_wait_s": list(self.layer_wait_s),
        }

    def prometheus(self) -> str:
        return prometheus_text(self.as_dict())


class TokenStream:
    """Iterator of `StreamChunk`s for one request; `.result` holds the `GenerationResult` once exhausted.

    Closing the stream early (``close()`` or leaving a ``for`` loop via break and garbage collection) cancels
    the request and releases what it holds."""

    def __init__(self, request: Request, queue: Queue, engine: PCREngine) -> None:
        self._request = request
        self._queue = queue
        self._engine = engine
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        if self.result is not None:
            raise StopIteration
        item = self._queue.get()
        if item is _DONE:
            self.result = self._request.future.result()
            return StreamChunk(-1, "", -1, self.result)
        return item

    def close(self) -> None:
        if not self._request.future.done():
            self._engine._cancel(self._request)


class PCREngine:
    """KV-cache reuse runtime for RAG. Thread-safe; also usable from asyncio (`agenerate`, `astream`).

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

    # ------------------------------------------------------------------------------------------ public API
    def generate(self, query: str, documents: Sequence[str] = (), *, system: str | None = None,
                 max_new_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 stop: Sequence[str] | str | None = None, seed: int | None = None,
                 timeout: float | None = None) -> GenerationResult:
        """Answer ``query`` over ``documents`` (in order, each cached as its own token run)."""
        req = self._submit_rag(query, documents, system, max_new_tokens, temperature, top_p, stop, seed, None)
        return self._wait(req, timeout)

    def generate_prompt(self, prompt: str, documents: Sequence[str] = (), *, chat: bool = True,
                        system: str | None = None, max_new_tokens: int | None = None, temperature: float = 0.0,
                        top_p: float = 1.0, stop: Sequence[str] | str | None = None, seed: int | None = None,
                        timeout: float | None = None) -> GenerationResult:
        """A flat prompt that contains ``documents`` verbatim, in order (a framework's rendered template).

        Documents are located from a moving cursor; one that is not found is simply computed as part of the
        surrounding text. ``chat=True`` wraps the prompt as one user turn of the model's chat template."""
        req = self._submit_flat(prompt, documents, chat, system, max_new_tokens, temperature, top_p, stop, seed,
                                None)
        return self._wait(req, timeout)

    def generate_messages(self, messages: Sequence[dict[str, str]], documents: Sequence[str] = (), *,
                          max_new_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                          stop: Sequence[str] | str | None = None, seed: int | None = None,
                          timeout: float | None = None) -> GenerationResult:
        """A chat conversation ([{"role", "content"}]) rendered with the chat template; ``documents`` found in
        the rendered text get their own token runs."""
        req = self._submit_messages(messages, documents, max_new_tokens, temperature, top_p, stop, seed, None)
        return self._wait(req, timeout)

    def stream(self, query: str, documents: Sequence[str] = (), **kwargs: Any) -> TokenStream:
        """Like `generate`, yielding `StreamChunk`s as tokens come; ``.result`` afterwards."""
        return self._stream(lambda cb: self._submit_rag(query, documents, kwargs.get("system"),
                                                         *self._sampling_args(kwargs), cb))

    def stream_prompt(self, prompt: str, documents: Sequence[str] = (), *, chat: bool = True,
                      **kwargs: Any) -> TokenStream:
        return self._stream(lambda cb: self._submit_flat(prompt, documents, chat, kwargs.get("system"),
                                                          *self._sampling_args(kwargs), cb))

    def stream_messages(self, messages: Sequence[dict[str, str]], documents: Sequence[str] = (),
                        **kwargs: Any) -> TokenStream:
        return self._stream(lambda cb: self._submit_messages(messages, documents, *self._sampling_args(kwargs),
                                                              cb))

    async def agenerate(self, query: str, documents: Sequence[str] = (), **kwargs: Any) -> GenerationResult:
        """`generate` without blocking the event loop; cancelling the task cancels the request."""
        req = self._submit_rag(query, documents, kwargs.get("system"), *self._sampling_args(kwargs), None)
        return await self._await(req)

    async def agenerate_prompt(self, prompt: str, documents: Sequence[str] = (), *, chat: bool = True,
                               **kwargs: Any) -> GenerationResult:
        req = self._submit_flat(prompt, documents, chat, kwargs.get("system"), *self._sampling_args(kwargs),
                                None)
        return await self._await(req)

    async def agenerate_messages(self, messages: Sequence[dict[str, str]], documents: Sequence[str] = (),
                                 **kwargs: Any) -> GenerationResult:
        req = self._submit_messages(messages, documents, *self._sampling_args(kwargs), None)
        return await self._await(req)

    async def astream(self, query: str, documents: Sequence[str] = (), **kwargs: Any) -> AsyncIterator[StreamChunk]:
        """Async iterator of `StreamChunk`s; cancelling the consumer cancels the request."""
        async for chunk in self._astream(lambda cb: self._submit_rag(
                query, documents, kwargs.get("system"), *self._sampling_args(kwargs), cb)):
            yield chunk

    async def astream_prompt(self, prompt: str, documents: Sequence[str] = (), *, chat: bool = True,
                             **kwargs: Any) -> AsyncIterator[StreamChunk]:
        async for chunk in self._astream(lambda cb: self._submit_flat(
                prompt, documents, chat, kwargs.get("system"), *self._sampling_args(kwargs), cb)):
            yield chunk

    async def astream_messages(self, messages: Sequence[dict[str, str]], documents: Sequence[str] = (),
                               **kwargs: Any) -> AsyncIterator[StreamChunk]:
        async for chunk in self._astream(lambda cb: self._submit_messages(
                messages, documents, *self._sampling_args(kwargs), cb)):
            yield chunk

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
        cache = self.cache.stats().as_dict() if self.cache is not None else {}
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

    def plan_for(self, query: str, documents: Sequence[str] = (), *, system: str | None = None) -> list:
        """The chunk plan (`ChunkSpec`s) `generate` would use for this request (no compute, no side effects)."""
        seg = self.builder.build_rag(query, validate_documents(documents), system)
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

    @staticmethod
    def _sampling_args(kwargs: dict[str, Any]) -> tuple:
        allowed = {"system", "max_new_tokens", "temperature", "top_p", "stop", "seed", "timeout"}
        unknown = set(kwargs) - allowed
        if unknown:
            raise TypeError(f"unexpected keyword argument(s): {sorted(unknown)}; allowed: {sorted(allowed)}")
        return (kwargs.get("max_new_tokens"), kwargs.get("temperature", 0.0), kwargs.get("top_p", 1.0),
                kwargs.get("stop"), kwargs.get("seed"))

    def _params(self, max_new_tokens, temperature, top_p, stop, seed) -> SamplingParams:
        n = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"max_new_tokens must be a positive int, got {n!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise InvalidRequestError(f"temperature must be a number >= 0, got {temperature!r}")
        if not 0 < float(top_p) <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p!r}")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        else:
            stops = tuple(stop)
            if not all(isinstance(s, str) for s in stops):
                raise InvalidRequestError("stop must be a string or a sequence of strings")
        return SamplingParams(n, float(temperature), float(top_p), stops, seed)

    def _submit_rag(self, query, documents, system, max_new_tokens, temperature, top_p, stop, seed, on_token):
        self._check_open()
        if not isinstance(query, str):
            raise InvalidRequestError(f"query must be a str, got {type(query).__name__}")
        docs = validate_documents(documents)
        if not query.strip() and not any(d.strip() for d in docs):
            raise InvalidRequestError("empty request: pass a non-empty query or at least one document")
        if system is not None and not isinstance(system, str):
            raise InvalidRequestError(f"system must be a str or None, got {type(system).__name__}")
        params = self._params(max_new_tokens, temperature, top_p, stop, seed)
        seg = self.builder.build_rag(query, docs, system)
        return self._enqueue(seg, docs, params, on_token)

    def _submit_flat(self, prompt, documents, chat, system, max_new_tokens, temperature, top_p, stop, seed,
                     on_token):
        self._check_open()
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt.strip():
            raise InvalidRequestError("empty prompt: pass the rendered prompt text")
        docs = validate_documents(documents)
        params = self._params(max_new_tokens, temperature, top_p, stop, seed)
        seg = self.builder.build_flat(prompt, docs, chat=chat, system=system)
        return self._enqueue(seg, docs, params, on_token)

    def _submit_messages(self, messages, documents, max_new_tokens, temperature, top_p, stop, seed, on_token):
        self._check_open()
        if isinstance(messages, (str, bytes)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
                raise InvalidRequestError(f"message #{i} must be a dict with 'role' and a str 'content'")
        if not any(m["content"].strip() for m in messages):
            raise InvalidRequestError("all messages are empty")
        docs = validate_documents(documents)
        params = self._params(max_new_tokens, temperature, top_p, stop, seed)
        text = self.builder.render_messages(messages)
        seg = self.builder.segment(text, docs)
        return self._enqueue(seg, docs, params, on_token)

    def _enqueue(self, seg: SegmentedPrompt, docs: tuple[str, ...], params: SamplingParams,
                 on_token) -> Request:
        n = seg.num_tokens
        if n + params.max_new_tokens > self.loaded.context_window:
            raise PromptTooLongError(n, params.max_new_tokens, self.loaded.context_window)
        plan = plan_chunks(self.root_key, seg.segments, self.config.chunk_size)
        keys = [c.key for c in plan]
        ticket = self.board.claim(docs) if docs else None
        req = Request(
            request_id=self.scheduler.next_id(), token_ids=seg.token_ids, plan=plan, params=params,
            submitted_at=time.perf_counter(), on_token=on_token, documents_found=seg.documents_found,
        )
        ssd_now = self._ssd_keys(keys)
        req.ssd_keys_at_entry = ssd_now | (ticket.ssd_keys_at_entry if ticket else frozenset())
        req.metrics.announced = ticket is not None
        return self.scheduler.submit(req)

    def _ssd_keys(self, keys: Sequence[bytes]) -> frozenset[bytes]:
        if self.cache is None:
            return frozenset()
        m = self.cache.match(keys)
        return frozenset(k for k, t in zip(m.keys, m.tiers) if getattr(t, "value", t) == "ssd")

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

    def _cancel(self, req: Request) -> None:
        if req.future.done():
            return
        req.cancel()
        if self.scheduler.remove_waiting(req) and not req.future.done():
            req.future.set_exception(RequestCancelledError("request cancelled while waiting"))
        self.recorder.record_failure(cancelled=True)

    def _wait(self, req: Request, timeout: float | None) -> GenerationResult:
        try:
            return req.future.result(timeout=timeout)
        except TimeoutError:
            self._cancel(req)
            raise
        except RequestCancelledError:
            raise
        except Exception:
            self.recorder.record_failure()
            raise

    async def _await(self, req: Request) -> GenerationResult:
        try:
            return await asyncio.wrap_future(req.future)
        except asyncio.CancelledError:
            self._cancel(req)
            raise

    def _stream(self, submit) -> TokenStream:
        queue: Queue = Queue()
        counter = [0]

        def cb(token_id: int, delta: str) -> None:
            queue.put(StreamChunk(token_id, delta, counter[0]))
            counter[0] += 1

        req = submit(cb)
        req.future.add_done_callback(lambda _f: queue.put(_DONE))
        return TokenStream(req, queue, self)

    async def _astream(self, submit) -> AsyncIterator[StreamChunk]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        counter = [0]

        def cb(token_id: int, delta: str) -> None:
            chunk = StreamChunk(token_id, delta, counter[0])
            counter[0] += 1
            loop.call_soon_threadsafe(queue.put_nowait, chunk)

        req = submit(cb)
        fut: Future = req.future
        fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(queue.put_nowait, _DONE))
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    result = fut.result()  # re-raises a failure
                    yield StreamChunk(-1, "", counter[0], result)
                    return
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            self._cancel(req)
            raise


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
