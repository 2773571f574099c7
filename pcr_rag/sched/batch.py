"""The engine step: one fixed-shape decode forward over every decoding row, then at most one prefill chunk.

Rows: the KV arena has ``batch_rows`` rows; a request holds one from admission to its last token. Each step:
1. **decode** (when any row is decoding): one `FastForward.decode` over all ``batch_rows`` rows - padding rows
   where nothing decodes; with fewer active rows its GEMMs run at a smaller row count proven at start-up to give
   the same numbers - so a row's numbers never depend on who is active; every decoding row then picks its token.
2. **prefill** (when any admitted request is prefilling): a step of the next ``prefill_chunk_tokens`` tokens of one
   request, chosen by the schedule (`pcr_rag.sched.admission.prefill_candidates`: prefills that share documents
   rank as a group) - as many of its layers as the ITL budget allows (`pcr_rag.sched.step_budget`), whether
   rows decode or not, so that the executor is back at its queue soon; a paused step resumes when the schedule
   picks its request again. A finished prefill yields the first token and the row joins the decode batch at the
   next step.

So a long cold prefill never freezes streaming answers: the gap between two tokens of a decoding row is one
decode forward plus prefill layers planned to take at most ``itl_budget_steps - 1`` decode steps. And since the
forward is split- and batch-invariant (and pausing between layers changes nothing), a request's tokens are the
same alone, in any batch and with any chunking.

Failures are per request, and handled in one place. A request's life is a chain of phases - admission, prefill
(lease, load and steps), prefill -> decode, decode, finish - and each runs through `BatchExecutor._run`, which
turns any exception into `_fail`: the request's lease and pins are released, its row is freed and its future gets
a `RequestFailedError` (cause attached), all within the engine step that raised; the other rows carry on. Only
the batched decode forward fails every row in it. A row that holds neither a prefill nor a decode, or a step in
which no row could move, fails the requests concerned ("could not make progress") instead of leaving the loop
spinning over rows nobody will free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pcr_rag import logs
from pcr_rag.errors import EngineClosedError, RequestCancelledError, RequestFailedError
from pcr_rag.handle import RequestState
from pcr_rag.metrics import MetricsRecorder
from pcr_rag.model.forward import WarmUp
from pcr_rag.model.kv_arena import KVArena
from pcr_rag.model.sampling import TokenTexts
from pcr_rag.request import GenerationResult
from pcr_rag.sched.admission import prefill_candidates, rank
from pcr_rag.sched.request_state import Request
from pcr_rag.sched.runner import DecodeRow, PrefillContext, PrefillTask
from pcr_rag.sched.step_budget import StepBudget

log = logging.getLogger(__name__)

_FAILED: Any = object()  # what `BatchExecutor._run` returns when the phase failed (the request is failed then)
_DELIVERED_AS_IS = (RequestCancelledError, EngineClosedError, RequestFailedError)  # already say what happened


@dataclass(eq=False)
class ActiveRequest:
    """A request holding a row: prefilling (``prefill`` set) or decoding (``decode`` set); ``phase`` names the
    phase it is in (or failed in)."""

    request: Request
    row: int
    admitted_at: float
    prefill: PrefillTask | None = None
    decode: DecodeRow | None = None
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    phase: str = "admission"


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
        if ctx.cache is not None:  # the load-or-recompute cost model runs the steps as this executor does
            ctx.cache.planner.configure(step_tokens=prefill_chunk_tokens, layerwise=ctx.layerwise)
        self.budget = budget
        self.schedule = schedule
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # token strings and bytes of logprobs, cached per id
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
        """Chunk key chains of admitted requests whose prefill has not begun, oldest first (any thread): the head
        of the prefetch window. A blend request's documents' position-independent chains follow its own."""
        with self._lock:
            tasks = [a.prefill for a in self._active.values() if a.prefill is not None]
        chains: list[list[bytes]] = []
        for t in tasks:
            if not t.begun:
                chains.append([c.key for c in t.plan])
                blend = getattr(t.request, "blend", None)
                chains.extend(list(c) for c in (blend.chains if blend is not None else ()))
        return chains

    def in_flight_keys(self) -> set[bytes]:
        """Chunk keys in the plans of admitted requests still prefilling (any thread): what the waiting queue counts
        as on its way into the cache (`pcr_rag.sched.admission.queue_candidates`)."""
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

    def _record_prefill(self, tokens: int, seconds: float, start: int = 0) -> None:
        """A complete prefill step: ``tokens`` positions from ``start`` in ``seconds`` of compute. The one place its
        speed goes: the ITL budget, the aging rate and the load-or-recompute decision (`PrefillContext.record_step`)."""
        self.budget.record_prefill(tokens, seconds)
        self.ctx.record_step(tokens, seconds, start)

    # -------------------------------------------------------------------------------------------- admission
    def admit(self, req: Request) -> None:
        """Give ``req`` a row; its prefill begins (lease + load) at its first step. Needs a free row. A failure
        fails ``req`` alone and gives the row back at once."""
        row = self._free.pop()
        active = ActiveRequest(req, row, self.clock())
        with self._lock:
            self._active[row] = active
        self._run(active, "admission", self._start, active)

    def _start(self, a: ActiveRequest) -> None:
        req = a.request
        req.state = RequestState.RUNNING
        req.metrics.queue_s = a.admitted_at - req.submitted_at
        req.metrics.prompt_tokens = len(req.token_ids)
        if req.cancelled.is_set():
            raise RequestCancelledError("request cancelled while waiting")
        a.prefill = PrefillTask(req, self.arena.row(a.row), self.ctx)

    # ----------------------------------------------------------------------------------------------- phases
    def _run(self, a: ActiveRequest, phase: str, action: Callable[..., Any], *args: Any) -> Any:
        """Run ``action(*args)`` as ``a``'s ``phase``: the one place a request's failure is handled. Any exception
        fails ``a`` alone (`_fail`: lease, pins and row released now) and returns `_FAILED`; else the action's
        value. ``a.phase`` is the last phase entered; phases nest (prefill -> decode runs the first token's decode,
        which may run finish), and a nested phase is always its caller's last act, so a failure is named by the
        phase that raised it."""
        a.phase = phase
        scope = logs.REQUEST_ID.set(a.request.log_id or None)  # its log lines name it (`pcr_rag.logs`)
        try:
            return action(*args)
        except Exception as exc:  # noqa: BLE001 - delivered to this request's caller through its future
            self._fail(a, exc)
            return _FAILED
        finally:
            logs.REQUEST_ID.reset(scope)

    def _holds_row(self, a: ActiveRequest) -> bool:
        return self._active.get(a.row) is a

    # ------------------------------------------------------------------------------------------------- step
    def step(self) -> bool:
        """One engine step: decode every decoding row, then one prefill chunk. Returns whether anything moved (a
        forward ran or a row was freed); rows that could not move fail instead of being held (`_fail_stuck`), so
        a step that returns False leaves the executor idle and its loop may sleep."""
        self.steps += 1
        free_before = len(self._free)
        self._drop_cancelled()
        computed = False
        decoding = [a for a in self._active.values() if a.decode is not None]
        if decoding:
            started = self.clock()
            computed = self._decode(decoding)
            if computed:
                self.budget.record_decode(self.clock() - started)
        pending = self.prefilling()
        chosen = self._next_prefill(pending) if pending else None
        if chosen is not None:
            phase = "prefill" if chosen.prefill.begun else "prefill (lease and load)"
            self._run(chosen, phase, self._prefill, chosen, self.budget.layers)
            computed = True
        self._fail_stuck(moved=computed or len(self._free) > free_before)
        return computed or len(self._free) > free_before

    def _fail_stuck(self, moved: bool) -> None:
        """Fail the requests that cannot progress: a row with neither a prefill nor a decode (a phase change that
        went wrong), and every admitted request when the step moved nothing (no prefill could run and no row
        decodes). Either is an engine bug; failing them frees their rows and keeps the loop from spinning."""
        for a in list(self._active.values()):
            if not moved or (a.prefill is None and a.decode is None):
                self._fail(a, RequestFailedError(
                    f"request {a.request.request_id} could not make progress after {a.phase} (nothing left to "
                    f"prefill or decode for it); its row was released - retry it, and report this engine bug"))

    def _next_prefill(self, pending: list[ActiveRequest]) -> ActiveRequest | None:
        """The prefill to advance, by the schedule over `prefill_candidates`: a prefill whose next chunks another
        running prefill is computing waits for them and lends it its place; one that others will reuse ranks by
        its group's work per request. A step paused between its layers competes like any other: a hit need not
        wait for a cold step's remaining layers under ``cache-aware``; each task keeps its own paused step. None
        when no prefill can run (a request whose outlook fails, e.g. its cache match, fails alone)."""
        outlooks = [(a, self._run(a, "prefill (scheduling)", a.prefill.outlook)) for a in pending]
        live = [(a, o) for a, o in outlooks if o is not _FAILED]
        if not live:
            return None
        candidates = prefill_candidates(self.schedule, [o for _, o in live])
        runnable = [(a, c) for (a, _), c in zip(live, candidates, strict=True) if c is not None]
        if not runnable:
            return None
        order = rank(self.schedule, [c for _, c in runnable], self.clock(), self.ctx.speed.tokens_per_s)
        return runnable[order[0]][0]

    def _decode(self, decoding: list[ActiveRequest]) -> bool:
        """One decode forward over the decoding rows, then each row's token; False if no row was left to run."""
        rows: list[int | None] = [None] * self.batch_rows
        tokens = torch.zeros(self.batch_rows, dtype=torch.long)
        positions = torch.zeros(self.batch_rows, dtype=torch.long)

        def place(a: ActiveRequest) -> None:  # all or nothing: a row whose input fails stays padding
            token, position = a.decode.last_token, a.decode.position
            tokens[a.row], positions[a.row], rows[a.row] = token, position, a.row

        decoding = [a for a in decoding if self._run(a, "decode", place, a) is not _FAILED]
        if not decoding:
            return False
        try:
            logits = self.ctx.forward.decode(self.arena, rows, tokens, positions)
        except Exception as exc:  # noqa: BLE001 - the batch forward itself failed: every row in it fails
            log.exception("decode forward failed")
            for a in decoding:
                self._fail(a, exc)
            return True
        self.decode_steps += 1
        for a in decoding:
            self._run(a, "decode", self._accept, a, logits[a.row])
        return True

    def _accept(self, a: ActiveRequest, logits: torch.Tensor) -> None:
        """Choose ``a``'s next token; the request finishes when it is its last."""
        if a.decode.accept(logits):
            self._run(a, "finish", self._finish, a)

    def _prefill(self, a: ActiveRequest, layers: Callable[[int], int]) -> None:
        """Advance ``a``'s prefill by one step (or part of one); a complete prompt moves it to decode."""
        task = a.prefill
        logits = task.advance(self.prefill_chunk_tokens, layers)
        if task.in_flight:
            return
        self.prefill_steps += 1
        self._record_prefill(*task.last_step)
        if logits is not None:
            self._run(a, "prefill->decode", self._to_decode, a, logits)

    def _to_decode(self, a: ActiveRequest, logits: torch.Tensor) -> None:
        """The prompt is done: record its prefill, unpin its prefix, build its decode row (its token sampler) and
        choose the first token from the prompt's last logits."""
        task = a.prefill
        m = a.request.metrics
        m.prefill_s = self.clock() - a.admitted_at
        m.prefill_compute_s = task.step_seconds
        m.computed_tokens = task.computed_tokens
        m.reused_by_tier = dict(task.reused_by_tier)
        m.reused_tokens = sum(task.reused_by_tier.values())
        m.blended_tokens = task.blended_tokens
        m.load_wait_s = task.load_wait_s
        m.recomputed_after_error = task.retries
        m.prefetch_hit_chunks = len(a.request.ssd_keys_at_entry & task.memory_keys)
        task.release()
        a.prefill = None
        a.first_logits = logits
        a.decode = DecodeRow(a.request, task.total, self.tokenizer, self.eos_ids, self._emitter(a))
        self._run(a, "decode", self._accept, a, logits)

    def _emitter(self, a: ActiveRequest) -> Callable[[int, str], None]:
        req = a.request

        def emit(token_id: int, delta: str) -> None:
            if req.metrics.ttft_s == 0.0:
                req.metrics.ttft_s = self.clock() - req.submitted_at
            if req.on_token is not None:
                raw = a.decode.sampler.last_logprob if req.params.logprobs else None
                req.on_token(token_id, delta, None if raw is None else self.token_texts.describe(raw))
        return emit

    # ------------------------------------------------------------------------------------------ completion
    def _finish(self, a: ActiveRequest) -> None:
        """Deliver the result. What can fail (building it, recording its metrics) comes before the row is freed,
        so a failure here is handled like any other phase's."""
        req, m, d = a.request, a.request.metrics, a.decode
        end = self.clock()
        if m.ttft_s == 0.0:  # no visible token (immediate EOS): the first token still came out of prefill
            m.ttft_s = end - req.submitted_at
        m.e2e_s = end - req.submitted_at
        m.generated_tokens = len(d.tokens)
        result = GenerationResult(
            text=d.text, token_ids=d.tokens, prompt_token_ids=list(req.token_ids), metrics=m,
            finish_reason=d.finish_reason, request_id=req.request_id, documents_found=req.documents_found,
            first_token_logits=a.first_logits.detach().float().cpu(),
            logprobs=[self.token_texts.describe(r) for r in d.sampler.logprobs] if req.params.logprobs else None)
        if not req.shadow:  # a blend gate's exact twin is counted by the gate, not as a user request
            self.recorder.record(m)
        log.debug("request %d finished (%s): %d prompt tokens, %d reused, %d blended, %d generated, ttft %.3f s, "
                  "e2e %.3f s", req.request_id, d.finish_reason, m.prompt_tokens, m.reused_tokens, m.blended_tokens,
                  m.generated_tokens, m.ttft_s, m.e2e_s)
        self._release(a)
        req.state = RequestState.FINISHED
        if not req.future.done():
            req.future.set_result(result)

    def _fail(self, a: ActiveRequest, exc: BaseException) -> None:
        """Fail ``a``: release its lease, pins and row (`_release`, which never raises), then deliver the error -
        a cancellation or shutdown as it is, anything else as a `RequestFailedError` naming the phase, with the
        original error as its cause. Idempotent."""
        req = a.request
        if isinstance(exc, _DELIVERED_AS_IS):
            error = exc
        else:
            with logs.request_scope(req.log_id or None):
                log.warning("request %d failed during %s: %s: %s", req.request_id, a.phase, type(exc).__name__,
                            exc)
            error = RequestFailedError(
                f"request {req.request_id} failed during {a.phase}: {type(exc).__name__}: {exc}; its row was "
                f"released and the engine keeps serving other requests")
            error.__cause__ = exc
        req.state = RequestState.CANCELLED if isinstance(exc, RequestCancelledError) else RequestState.FAILED
        self._release(a)
        if not req.future.done():
            req.future.set_exception(error)

    def _release(self, a: ActiveRequest) -> None:
        """Unpin ``a``'s prefix (stopping its load and any step in flight) and give its row back. Idempotent and
        never raises: a lease that fails to release is logged, and the row is freed whatever happens."""
        task, a.prefill = a.prefill, None
        if task is not None:
            try:
                task.release()
            except Exception:  # noqa: BLE001 - the row must come back even if the cache misbehaves
                log.exception("releasing the lease of request %d failed", a.request.request_id)
        with self._lock:
            released = self._holds_row(a)
            if released:
                del self._active[a.row]
        if released:
            self._free.append(a.row)

    def _drop_cancelled(self) -> None:
        for a in list(self._active.values()):
            if a.request.cancelled.is_set():
                what = "prefill" if a.prefill is not None else "decode"
                self._fail(a, RequestCancelledError(f"request cancelled during {what}"))

    def fail_all(self, exc: BaseException) -> None:
        """Fail every admitted request with ``exc`` (engine shutdown after its grace period, or a step that failed
        outside any request's phase)."""
        for a in list(self._active.values()):
            self._fail(a, exc)
