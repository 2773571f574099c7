"""The engine step: one fixed-shape decode forward over every decoding row, then at most one prefill chunk.

Rows: the KV arena has ``batch_rows`` rows; a request holds one from admission to its last token. Each step:
1. **decode** (when any row is decoding): one `FastForward.decode` over all ``batch_rows`` rows - padding rows
   where nothing decodes; with fewer active rows its GEMMs run at a smaller row count proven at start-up to give
   the same numbers - so a row's numbers never depend on who is active; every decoding row then picks its token.
2. **prefill** (when any admitted request is prefilling): a step of the next ``prefill_chunk_tokens`` tokens of one
   request, chosen by the schedule (`pcr_rag.runtime.admission.prefill_candidates`: prefills that share documents
   rank as a group) - as many of its layers as the ITL budget allows (`pcr_rag.runtime.step_budget`), whether
   rows decode or not, so that the executor is back at its queue soon; a paused step resumes when the schedule
   picks its request again. A finished prefill yields the first token and the row joins the decode batch at the
   next step.

So a long cold prefill never freezes streaming answers: the gap between two tokens of a decoding row is one
decode forward plus prefill layers planned to take at most ``itl_budget_steps - 1`` decode steps. And since the
forward is split- and batch-invariant (and pausing between layers changes nothing), a request's tokens are the
same alone, in any batch and with any chunking.
Failures are per request: an error in one request's prefill or token choice fails that request only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pcr_rag.errors import RequestCancelledError
from pcr_rag.metrics import MetricsRecorder
from pcr_rag.requests import GenerationResult, Request, RequestState
from pcr_rag.runtime.admission import prefill_candidates, rank
from pcr_rag.runtime.forward import WarmUp
from pcr_rag.runtime.kv_arena import KVArena
from pcr_rag.runtime.runner import DecodeRow, PrefillContext, PrefillTask
from pcr_rag.runtime.step_budget import StepBudget

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ActiveRequest:
    """A request holding a row: prefilling (``prefill`` set) or decoding (``decode`` set)."""

    request: Request
    row: int
    admitted_at: float
    prefill: PrefillTask | None = None
    decode: DecodeRow | None = None
    first_logits: torch.Tensor | None = field(default=None, repr=False)


class BatchExecutor:
    """Runs engine steps over the arena's rows (see the module docstring). Executor thread only."""

    def __init__(self, ctx: PrefillContext, arena: KVArena, *, prefill_chunk_tokens: int, budget: StepBudget,
                 schedule: str,
                 tokenizer, eos_ids: frozenset[int], recorder: MetricsRecorder,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.ctx = ctx
        self.arena = arena
        self.batch_rows = arena.rows
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.budget = budget
        self.schedule = schedule
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.recorder = recorder
        self.clock = clock
        self._free = list(range(arena.rows - 1, -1, -1))  # pop() hands out row 0 first
        self._active: dict[int, ActiveRequest] = {}
        self._lock = threading.Lock()  # guards _active for readers on other threads (`waiting_keys`)
        self.steps = 0
        self.decode_steps = 0
        self.prefill_steps = 0

    # ------------------------------------------------------------------------------------------------ state
    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def idle(self) -> bool:
        return not self._active

    def prefilling(self) -> list[ActiveRequest]:
        return [a for a in self._active.values() if a.prefill is not None]

    def waiting_keys(self) -> list[list[bytes]]:
        """Chunk keys of admitted requests whose prefill has not begun, oldest first (any thread): the head of
        the prefetch window."""
        with self._lock:
            tasks = [a.prefill for a in self._active.values() if a.prefill is not None]
        return [[c.key for c in t.plan] for t in tasks if not t.begun]

    def in_flight_keys(self) -> set[bytes]:
        """Chunk keys in the plans of admitted requests still prefilling (any thread): what the waiting queue counts
        as on its way into the cache (`pcr_rag.runtime.admission.queue_candidates`)."""
        with self._lock:
            tasks = [a.prefill for a in self._active.values() if a.prefill is not None]
        return {c.key for t in tasks for c in t.plan}

    def seed(self, warm: WarmUp) -> None:
        """Learn the engine's speed from its warm-up's timed prefill tile and decode step (when it timed them), as
        from the requests' own steps: the ITL budget, the aging rate and the load-or-recompute decision hold from
        the first request on (without, a new engine's first prefill steps ran whole)."""
        if warm.prefill_s and warm.decode_s:
            self._record_prefill(warm.prefill_tokens, warm.prefill_s)
            self.budget.record_decode(warm.decode_s)

    def _record_prefill(self, tokens: int, seconds: float) -> None:
        """A complete prefill step: ``tokens`` positions in ``seconds`` of compute. The one place its speed goes:
        the ITL budget, the aging rate and the load-or-recompute decision (`PrefillContext.record_step`)."""
        self.budget.record_prefill(tokens, seconds)
        self.ctx.record_step(tokens, seconds)

    # -------------------------------------------------------------------------------------------- admission
    def admit(self, req: Request) -> None:
        """Give ``req`` a row; its prefill begins (lease + load) at its first step. Needs a free row."""
        row = self._free.pop()
        now = self.clock()
        req.state = RequestState.RUNNING
        req.metrics.queue_s = now - req.submitted_at
        req.metrics.prompt_tokens = len(req.token_ids)
        active = ActiveRequest(req, row, now)
        with self._lock:
            self._active[row] = active
        try:
            if req.cancelled.is_set():
                raise RequestCancelledError("request cancelled while waiting")
            active.prefill = PrefillTask(req, self.arena.row(row), self.ctx)
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller through the future
            self._fail(active, exc)

    # ------------------------------------------------------------------------------------------------- step
    def step(self) -> None:
        """One engine step: decode every decoding row, then one prefill chunk."""
        self.steps += 1
        self._drop_cancelled()
        decoding = [a for a in self._active.values() if a.decode is not None]
        if decoding:
            started = self.clock()
            self._decode(decoding)
            self.budget.record_decode(self.clock() - started)
        pending = self.prefilling()
        if pending:
            self._prefill(self._next_prefill(pending), self.budget.layers)

    def _next_prefill(self, pending: list[ActiveRequest]) -> ActiveRequest:
        """The prefill to advance, by the schedule over `prefill_candidates`: a prefill whose next chunks another
        running prefill is computing waits for them and lends it its place; one that others will reuse ranks by
        its group's work per request. A step paused between its layers competes like any other: a hit need not
        wait for a cold step's remaining layers under ``cache-aware``; each task keeps its own paused step."""
        candidates = prefill_candidates(self.schedule, [a.prefill.outlook() for a in pending])
        runnable = [(a, c) for a, c in zip(pending, candidates, strict=True) if c is not None]
        order = rank(self.schedule, [c for _, c in runnable], self.clock(), self.ctx.speed.tokens_per_s)
        return runnable[order[0]][0]

    def _decode(self, decoding: list[ActiveRequest]) -> None:
        rows: list[int | None] = [None] * self.batch_rows
        tokens = torch.zeros(self.batch_rows, dtype=torch.long)
        positions = torch.zeros(self.batch_rows, dtype=torch.long)
        for a in decoding:
            rows[a.row] = a.row
            tokens[a.row] = a.decode.last_token
            positions[a.row] = a.decode.position
        try:
            logits = self.ctx.forward.decode(self.arena, rows, tokens, positions)
        except Exception as exc:  # noqa: BLE001 - the batch forward itself failed: every row in it fails
            log.exception("decode forward failed")
            for a in decoding:
                self._fail(a, exc)
            return
        self.decode_steps += 1
        for a in decoding:
            try:
                if a.decode.accept(logits[a.row]):
                    self._finish(a)
            except Exception as exc:  # noqa: BLE001 - this row alone fails
                self._fail(a, exc)

    def _prefill(self, a: ActiveRequest, layers: Callable[[int], int]) -> None:
        task = a.prefill
        try:
            logits = task.advance(self.prefill_chunk_tokens, layers)
        except Exception as exc:  # noqa: BLE001 - this request alone fails
            self._fail(a, exc)
            return
        if task.in_flight:
            return
        self.prefill_steps += 1
        self._record_prefill(*task.last_step)
        if logits is None:
            return
        m = a.request.metrics
        m.prefill_s = self.clock() - a.admitted_at
        m.prefill_compute_s = task.step_seconds
        m.computed_tokens = task.computed_tokens
        m.reused_by_tier = dict(task.reused_by_tier)
        m.reused_tokens = sum(task.reused_by_tier.values())
        m.load_wait_s = task.load_wait_s
        m.recomputed_after_error = task.retries
        m.prefetch_hit_chunks = len(a.request.ssd_keys_at_entry & task.memory_keys)
        task.release()
        a.prefill = None
        a.first_logits = logits
        a.decode = DecodeRow(a.request, task.total, self.tokenizer, self.eos_ids, self._emitter(a))
        try:
            if a.decode.accept(logits):
                self._finish(a)
        except Exception as exc:  # noqa: BLE001
            self._fail(a, exc)

    def _emitter(self, a: ActiveRequest) -> Callable[[int, str], None]:
        req = a.request

        def emit(token_id: int, delta: str) -> None:
            if req.metrics.ttft_s == 0.0:
                req.metrics.ttft_s = self.clock() - req.submitted_at
            if req.on_token is not None:
                req.on_token(token_id, delta)
        return emit

    # ------------------------------------------------------------------------------------------ completion
    def _finish(self, a: ActiveRequest) -> None:
        req, m, d = a.request, a.request.metrics, a.decode
        end = self.clock()
        if m.ttft_s == 0.0:  # no visible token (immediate EOS): the first token still came out of prefill
            m.ttft_s = end - req.submitted_at
        m.e2e_s = end - req.submitted_at
        m.generated_tokens = len(d.tokens)
        req.state = RequestState.FINISHED
        self._release(a)
        self.recorder.record(m)
        if not req.future.done():
            req.future.set_result(GenerationResult(
                text=d.text, token_ids=d.tokens, prompt_token_ids=list(req.token_ids), metrics=m,
                finish_reason=d.finish_reason, request_id=req.request_id, documents_found=req.documents_found,
                first_token_logits=a.first_logits.detach().float().cpu()))

    def _fail(self, a: ActiveRequest, exc: BaseException) -> None:
        req = a.request
        req.state = RequestState.CANCELLED if isinstance(exc, RequestCancelledError) else RequestState.FAILED
        self._release(a)
        if not req.future.done():
            req.future.set_exception(exc)

    def _release(self, a: ActiveRequest) -> None:
        if a.prefill is not None:
            a.prefill.release()
            a.prefill = None
        with self._lock:
            released = self._active.pop(a.row, None) is not None
        if released:
            self._free.append(a.row)

    def _drop_cancelled(self) -> None:
        for a in list(self._active.values()):
            if a.request.cancelled.is_set():
                what = "prefill" if a.prefill is not None else "decode"
                self._fail(a, RequestCancelledError(f"request cancelled during {what}"))

    def fail_all(self, exc: BaseException) -> None:
        """Fail every admitted request (engine shutdown after its grace period)."""
        for a in list(self._active.values()):
            self._fail(a, exc)
