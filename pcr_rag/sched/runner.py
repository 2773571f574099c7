"""One request's prefill with reuse (`PrefillTask`), and its decode row (`DecodeRow`).

Prefill, on the request's arena row:
1. `begin()` (at the first step, not at admission, so chunks that an earlier request is computing are cached by
   then): lease (pin) the longest cached prefix of the chunk plan, wait for in-flight prefetches of its SSD chunks
   (rather than reading them twice), and start the layer-wise load of the prefix into the row.
2. `advance(budget, layers)`: compute the next ``budget`` tokens with `FastForward.prefill_layers`, at most
   ``layers(n)`` of the model's layers per call (a step may span engine steps; the ITL budget). The first step's
   layer i waits only for layer i of the prefix; every plan chunk the step completes is offloaded layer by layer
   and inserted into the cache (DRAM, then SSD write-back). Returns the last position's logits when the prompt
   is done.
3. `release()`: unpin.

Because the forward is split-invariant, a hit replays bit for bit what it skips, whatever the step sizes. When
every chunk is cached, the last token is still computed (its logits are the first token's) - the rest of the last
chunk is loaded. A chunk that fails to load (verification, a MAC, an I/O error or a timeout, from any tier) raises
`PrefixLoadError`; the task then leases the prefix before that chunk and recomputes from there; a lease that cannot
be taken at all (the cache or store raising) recomputes the whole prompt. Both count in ``retries``: a cache
failure never fails the request.

Blend mode (a request with a `BlendRequest`, `pcr_rag.sched.blend`): after the exact prefix, `begin` plans the
blend spans, gets each placed document's position-independent KV (from DRAM, or by an isolated prefill of
``[anchor][document]`` in this row before the prefix load starts), and zero-fills the row to the end of the prompt;
the first step places that KV layer by layer (`Placement`, from the step's hooks); steps then compute the compute
spans, several at once across the placed KV (`_blend_step`); no plan chunk ending after the first placed position
is inserted. An exact request never takes any of these paths.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from pcr_rag.cache import CacheManager, ChunkSpec, Tier
from pcr_rag.errors import PrefixLoadError
from pcr_rag.metrics import TIERS
from pcr_rag.model.detokenize import INCOMPLETE_CHAR, IncrementalText
from pcr_rag.model.forward import FastForward, run_layers
from pcr_rag.model.kv_arena import RowKV
from pcr_rag.model.sampling import TokenSampler
from pcr_rag.sched.admission import PrefillOutlook, PrefillSpeed
from pcr_rag.sched.blend import BlendRequest, PlacedPiece, Placement, Span, blend_spans
from pcr_rag.sched.request_state import Request
from pcr_rag.sched.transfer import ChunkOffload, KVCopier, LoadSource, PrefixLoad

log = logging.getLogger(__name__)

PREFETCH_WAIT_S = 30.0  # longest wait for an in-flight prefetch of a chunk this request needs
_STORED = (Tier.SSD, Tier.REMOTE)  # tiers whose chunks are read (and may be prefetched into DRAM) before use


@dataclass(frozen=True)
class PrefillContext:
    """What every prefill task shares: the forward, the cache (None = no reuse), the copy engine, the mode, and
    the measured prefill speed (the schedule's aging rate)."""

    forward: FastForward
    cache: CacheManager | None
    copy: KVCopier
    layerwise: bool
    speed: PrefillSpeed = field(default_factory=PrefillSpeed)

    def record_step(self, tokens: int, seconds: float, start: int = 0) -> None:
        """A prefill step computed ``tokens`` positions from ``start`` in ``seconds`` of compute: the aging rate and
        the cache's load-or-recompute decision learn the engine's speed from it (the latter at that position)."""
        self.speed.record(tokens, seconds)
        if self.cache is not None:
            self.cache.record_compute(tokens, seconds, start)


class _StepHooks:
    """`LayerHooks` of one prefill step: wait for the prefix load, place blended documents' KV (blend mode),
    offload completed chunks."""

    def __init__(self, load: PrefixLoad | None, offload: ChunkOffload | None,
                 placement: Placement | None = None) -> None:
        self.load = load
        self.offload = offload
        self.placement = placement

    def before_attention(self, layer: int) -> None:
        if self.load is not None:
            self.load.wait_layer(layer)
        if self.placement is not None:
            self.placement.place_layer(layer)

    def after_layer(self, layer: int, start: int, end: int) -> None:
        if self.offload is not None:
            self.offload.after_layer(layer)


@dataclass(eq=False)
class _InflightStep:
    """A prefill step between its layers: positions [start, end), the forward's layer generator, the offload of
    the chunks it completes, and the seconds its calls took so far (``waited``: of which waiting for its KV)."""

    start: int
    end: int
    layers: Generator[int, None, torch.Tensor | None]
    offload: ChunkOffload | None
    tokens: int = 0  # positions it computes (``end - start`` unless a blend step spans placed KV)
    scattered: bool = False  # a blend step over several compute spans
    rest: tuple[Span, ...] = ()  # ... and the compute spans it leaves (the first one may be partly done)
    seconds: float = 0.0
    waited: float = 0.0
    started_at: float = field(default_factory=time.perf_counter)  # perf_counter seconds (a traced request's span)


@dataclass(frozen=True)
class _IsolatedDocument:
    """The request-like input of a blend document's isolated prefill (``[anchor][document]`` on its own chain):
    what `PrefillTask` reads of a request."""

    token_ids: list[int]
    plan: list[ChunkSpec]
    submitted_at: float
    tenant: bytes
    trace: None = None
    blend: None = None


class PrefillTask:
    """A request's prefill, advanced in steps on the executor thread (see the module docstring)."""

    def __init__(self, request: Request, row: RowKV, ctx: PrefillContext) -> None:
        self.request = request
        self.row = row
        self.ctx = ctx
        self.plan: Sequence[ChunkSpec] = request.plan
        self.total = len(request.token_ids)
        self._ids = torch.tensor(request.token_ids, dtype=torch.long)
        self.position = 0                      # tokens [0, position) are in the row (or arriving by the load)
        self.retries = 0
        self.reused_by_tier = dict.fromkeys(TIERS, 0)
        self.memory_keys: frozenset[bytes] = frozenset()  # matched chunks served from memory
        self.load_wait_s = 0.0
        self.step_seconds = 0.0                # seconds in its `advance` calls: begin, layers, KV waits
        self._lease = None
        self._load: PrefixLoad | None = None
        self._sources: list[LoadSource] = []
        self._stored_upto = 0                  # plan chunks [0, _stored_upto) are cached or matched
        self._max_chunks = len(self.plan)
        self.begun = False
        self.began_at = math.inf               # perf_counter seconds of its first `advance` (the schedule's aging)
        self._inflight: _InflightStep | None = None
        self.last_step: tuple[int, float, int] = (0, 0.0, 0)  # the last complete step's (tokens, compute s, start)
        self._trace = getattr(request, "trace", None)  # a traced request notes its load's and steps' times
        # blend mode (`pcr_rag.sched.blend`): None in exact mode, and without a cache
        self._blend: BlendRequest | None = getattr(request, "blend", None) if ctx.cache is not None else None
        self.blended_tokens = 0                # prompt tokens whose KV was placed from documents' isolated KV
        self._compute_spans: list[Span] = []   # blend: the compute spans after the current one
        self._span_end = self.total            # end of the compute span `position` is in
        self._exact_until = self.total         # plan chunks ending after this are never inserted (blend)
        self._placement: Placement | None = None
        self._blend_leases: list = []          # leases pinning documents' isolated KV until it is placed

    # ------------------------------------------------------------------------------------------------ state
    @property
    def remaining(self) -> int:
        """Tokens still to compute."""
        return self._span_end - self.position + sum(s.end - s.start for s in self._compute_spans)

    @property
    def computed_tokens(self) -> int:
        return self.total - sum(self.reused_by_tier.values()) - self.blended_tokens

    def outlook(self) -> PrefillOutlook:
        """What the schedule ranks this task by: tokens left to compute (exact once begun, else the prompt minus
        what the cache matches now) and the plan chunks it will compute and insert but has not yet (once begun:
        after its stored prefix; before: after the cache's match; none without a cache)."""
        cache, arrived = self.ctx.cache, self.request.submitted_at
        if not self.begun:
            match = None if cache is None else cache.match([c.key for c in self.plan])
            return PrefillOutlook.not_begun(arrived, self.total, self.plan, match)
        chunks = {} if cache is None else {spec.key: spec.num_tokens for spec in self.plan[self._stored_upto:]
                                           if spec.end <= self._exact_until}  # blend: none after a placed one
        return PrefillOutlook(arrived, self.remaining, chunks, begun=True, began_s=self.began_at,
                              served_s=self.step_seconds)

    # -------------------------------------------------------------------------------------------- lifecycle
    def begin(self) -> None:
        """Lease the cached prefix and start loading it (no compute). Called by the first `advance`, so a task
        admitted behind another one that computes the same documents finds them cached."""
        self.begun = True
        cache = self.ctx.cache
        self.reused_by_tier = dict.fromkeys(TIERS, 0)
        self._span_end, self._compute_spans, self._exact_until = self.total, [], self.total
        self._sources = []
        matched = 0
        if cache is not None and self._max_chunks > 0:
            self._lease = cache.acquire(self.plan, max_chunks=self._max_chunks, prompt_tokens=self.total)
            matched = self._lease.num_chunks
        if matched:
            if self._trace is not None:
                self._trace.note_load_began(time.perf_counter())
            self._collect_sources(matched)
        self.position = min(self.plan[matched - 1].end, self.total - 1) if matched else 0
        self._stored_upto = matched
        if self._blend is not None:
            self._begin_blend()
        if self._sources:
            self._load = self.ctx.copy.start_load(self.row, self._sources, cache.open_layer_reader,
                                                  layerwise=self.ctx.layerwise)

    def _collect_sources(self, matched: int) -> None:
        """The matched chunks as load sources. SSD chunks are read layer by layer as the step needs them; a
        remote chunk is fetched whole anyway, so it is loaded into DRAM here, through the loader, which shares
        a fetch with a prefetch of the same chunk in flight (the prefetcher, woken by the same arrival, would
        otherwise fetch it a second time). A load that fails leaves the chunk to the layer reader (or to
        recompute)."""
        cache, tiers = self.ctx.cache, self._lease.tiers
        on_ssd = [self.plan[i].key for i in range(matched) if tiers[i] is Tier.SSD]
        remote = [self.plan[i].key for i in range(matched) if tiers[i] is Tier.REMOTE]
        waiting_since = time.perf_counter()
        if remote:
            try:
                cache.load(remote)
            except Exception as exc:  # noqa: BLE001 - loading is an optimisation: the layer reader retries
                log.debug("loading remote chunks before the step failed: %s", exc)
        for fut in cache.pending_loads(on_ssd):  # a prefetch may be finishing: wait rather than read twice
            try:
                fut.result(timeout=PREFETCH_WAIT_S)
            except Exception:  # noqa: BLE001 - timed out or failed: read from SSD below
                pass
        self.load_wait_s += time.perf_counter() - waiting_since
        fetched_now = frozenset(remote)  # reused from the remote tier by this request, whoever fetched them
        last = self.total - 1
        in_memory = []
        for i in range(matched):
            spec = self.plan[i]
            payload = cache.get_payload(spec.key)
            from_memory = payload is not None and tiers[i] in _STORED and spec.key not in fetched_now
            tier = Tier.DRAM if from_memory else tiers[i]
            fill_end = min(spec.end, last)
            if fill_end <= spec.start:
                continue
            self.reused_by_tier[tier.value] += fill_end - spec.start
            self._sources.append(LoadSource(i, spec.key, spec.start, spec.end, payload, fill_end))
            if payload is not None and spec.key not in fetched_now:
                in_memory.append(spec.key)
        self.memory_keys = frozenset(in_memory)

    # ------------------------------------------------------------------------------------------------ blend
    def _begin_blend(self) -> None:
        """Plan the blend spans after the exact prefix (`blend_spans`), get each placed document's isolated KV
        (DRAM chunks as they are, anything else through an isolated prefill in this row, which also caches it),
        zero-fill the row from the prefix to the end, and hand the placement to the first step's hooks. Runs
        before the prefix load starts (an isolated prefill uses the row's first positions)."""
        blend, ids = self._blend, self.request.token_ids
        self._release_blend()
        self.blended_tokens = 0
        exact_end = self.position
        anchor = len(blend.anchor)
        limit = min(self.row.arena.row_capacity, self.ctx.forward.max_positions)
        wanted = [i for i, d in enumerate(blend.documents) if d.end > exact_end and anchor + d.num_tokens <= limit]
        if wanted and blend.documents[wanted[0]].start >= exact_end and not self._has_document_kv(wanted[0]):
            # the document right after the exact match, seen for the first time: computed in context, exactly,
            # at the cost of computing it in isolation; its chunks extend the exact tree, so a document that keeps
            # coming first behind the same head (a static system part, a popular first passage) is exact from now
            wanted = wanted[1:]
        spans = blend_spans(self.total, exact_end, blend.documents, wanted, blend.recompute)
        pieces: list[PlacedPiece] = []
        kept: list[int] = []
        from_cache = 0  # placed tokens whose isolated KV was cached before this request (the rest: computed now)
        for span in spans:
            if span.placed:
                doc = blend.documents[span.document]
                got = self._document_kv(blend, span.document, ids)
                if got is None:
                    continue
                found, cached_upto = got
                iso_lo, iso_hi = anchor + span.start - doc.start, anchor + span.end - doc.start
                for payload, lo, hi in found:
                    a, b = max(lo, iso_lo), min(hi, iso_hi)
                    if a < b:
                        pieces.append(PlacedPiece(payload, a - lo, b - lo, a, a - anchor + doc.start))
                from_cache += max(0, min(iso_hi, cached_upto) - iso_lo)
                kept.append(span.document)
        spans = blend_spans(self.total, exact_end, blend.documents, kept, blend.recompute)
        placed = [s for s in spans if s.placed]
        computes = [s for s in spans if not s.placed]
        # reused means cached before this request: a document computed in isolation now counts as computed
        self.blended_tokens = from_cache
        self._exact_until = placed[0].start if placed else self.total
        self.position, self._span_end = computes[0].start, computes[0].end  # placed spans come first
        self._compute_spans = computes[1:]
        if placed:
            block = self.ctx.forward.attention_block
            self.row.ensure_finite(exact_end, -(-self.total // block) * block)
            self._placement = Placement(self.row, self.ctx.forward.rope_shift,
                                        [lw.rope for lw in self.ctx.forward.layers], pieces)

    def _has_document_kv(self, index: int) -> bool:
        """Whether document ``index``'s whole position-independent chain is cached (any tier)."""
        chain = self._blend.chains[index]
        return len(self.ctx.cache.match(chain).keys) == len(chain)

    def _document_kv(self, blend: BlendRequest, index: int, ids: Sequence[int]
                     ) -> tuple[list[tuple[torch.Tensor, int, int]], int] | None:
        """Document ``index``'s isolated KV as pieces ``(payload, start, end)`` (positions of the isolated
        ``[anchor][document]`` prompt) and the isolated position below which that KV came from the cache (the rest
        was computed by this request), or None when it is better computed in place: the load-or-recompute planner
        (`pcr_rag.cache.reuse_planner`) declines to load its cached chunks from a slow tier, or the cache fails.
        Cached in DRAM: the chunks' payloads, pinned until placed. Otherwise the isolated prompt is prefilled in
        this row (loading what a tier holds, computing the rest - a document seen for the first time is computed
        once, here, never also in context - and caching every chunk) and copied out."""
        doc = blend.documents[index]
        cache = self.ctx.cache
        plan = blend.document_plan(doc, ids)
        n = len(blend.anchor) + doc.num_tokens
        try:
            lease = cache.acquire(plan, prompt_tokens=n)
            doc_chunks = [s for s in plan if s.segment == 1]
            if lease.num_chunks == len(plan):
                payloads = [cache.get_payload(s.key) for s in doc_chunks]
                if all(isinstance(p, torch.Tensor) for p in payloads):
                    self._blend_leases.append(lease)
                    return [(p, s.start, s.end) for p, s in zip(payloads, doc_chunks)], n
            declined = lease.num_chunks < len(cache.match([s.key for s in plan]).keys)
            lease.release()
            if declined:
                # the load-or-recompute planner finds its tier slower than computing: compute it in place (the
                # same tokens as in isolation, exact against its real context, and no placement)
                return None
            iso = PrefillTask(_IsolatedDocument([*blend.anchor, *ids[doc.start: doc.end]], plan,
                                                self.request.submitted_at, self.request.tenant), self.row, self.ctx)
            try:
                while iso.advance(self.total) is None:
                    pass
            finally:
                iso.release()
            self.retries += iso.retries
            cached_upto = sum(iso.reused_by_tier.values())  # its lease covers a prefix of the isolated prompt
            return [(self.row.chunk_payload(len(blend.anchor), n), len(blend.anchor), n)], cached_upto
        except Exception as exc:  # noqa: BLE001 - blending is an optimisation: the document is computed in place
            log.warning("blend: document at %d computed in place: %s: %s", doc.start, type(exc).__name__, exc)
            return None

    def _release_blend(self) -> None:
        self._placement = None
        for lease in self._blend_leases:
            lease.release()
        self._blend_leases = []

    @property
    def in_flight(self) -> bool:
        """True while a step has computed some of its layers but not all (the next `advance` resumes it)."""
        return self._inflight is not None

    def advance(self, budget: int, layers: Callable[[int], int] | None = None) -> torch.Tensor | None:
        """Compute the model's layers for up to ``budget`` more tokens: the step in flight, else a new step of at
        most ``budget`` tokens. ``layers(n)`` caps the layers computed now for a step of n tokens (None: all);
        the step pauses between layers and resumes at the next call. Returns the last position's logits once
        the prompt is complete, else None."""
        started = time.perf_counter()
        try:
            if not self.begun:
                self.began_at = started
                self._begin_or_recompute()
            while True:
                try:
                    return self._step(budget, layers)
                except PrefixLoadError as exc:
                    self._recompute_from(exc.chunk_index, exc)
                    self._begin_or_recompute()
        finally:
            self.step_seconds += time.perf_counter() - started

    def _begin_or_recompute(self) -> None:
        """`begin`, falling back to less reuse when the cache fails: a chunk whose load fails (`PrefixLoadError`,
        raised here when loads are not layer-wise) is recomputed from there, and any other failure of the cache
        or a store while leasing (a lookup, a tier read or a timeout raising) recomputes the whole prompt without
        a lease. Each fallback counts in ``retries``. Invariant: a cache failure never fails the request, and its
        tokens are the cache-off ones (the forward is split-invariant, so recomputing from any chunk is exact)."""
        while True:
            try:
                self.begin()
                return
            except PrefixLoadError as exc:
                self._recompute_from(exc.chunk_index, exc)
            except Exception as exc:  # noqa: BLE001 - a broken cache or store falls back to recompute
                self._recompute_from(0, exc)

    def _recompute_from(self, chunk_index: int, exc: BaseException) -> None:
        """Give up the lease and reuse only the plan's chunks before ``chunk_index`` at the next `begin` (counted
        in ``retries``). Terminates: ``_max_chunks`` drops each time, and with 0 no lease is taken."""
        if self._max_chunks == 0:
            raise exc  # nothing was leased: not a cache failure
        self.retries += 1
        log.warning("recomputing from chunk %d after a cache failure: %s: %s", chunk_index, type(exc).__name__, exc)
        self._inflight = None
        self._cancel_load()
        self.release()
        self._max_chunks = min(self._max_chunks, chunk_index)

    def _step(self, budget: int, layers: Callable[[int], int] | None) -> torch.Tensor | None:
        step = self._inflight
        if step is None:
            start = self.position
            positions, rest = self._blend_step(max(1, budget))
            if positions is None:
                end = min(self._span_end, _aligned_end(start, max(1, budget), self.ctx.forward.attention_block))
                ids = self._ids[start:end]
            else:
                end = int(positions[-1]) + 1
                ids = self._ids[positions]
            offload = self._offload_for(end)
            generator = self.ctx.forward.prefill_layers(self.row, ids, start,
                                                        hooks=_StepHooks(self._load, offload, self._placement),
                                                        want_logits=end == self.total, positions=positions)
            step = self._inflight = _InflightStep(start, end, generator, offload, len(ids), positions is not None,
                                                  rest)
        waits_before, t0 = sum(self.ctx.copy.waits.seconds), time.perf_counter()
        count = None if layers is None else max(1, layers(step.tokens))
        done, logits = run_layers(step.layers, count)
        if done and self._load is not None:
            self._load.wait_all()  # the first layers waited for their KV; this only surfaces a late error
        step.seconds += time.perf_counter() - t0
        # this task's own waits only: other tasks' steps run between its calls
        step.waited += sum(self.ctx.copy.waits.seconds) - waits_before
        if not done:
            return None
        self._inflight = None
        compute_s = step.seconds - step.waited
        if self._trace is not None:
            done_at = time.perf_counter()
            self._trace.note_step(step.started_at, done_at, step.tokens)
            if self._load is not None:
                self._trace.note_load_done(done_at)  # the step's layers waited for every layer of the prefix
        if self._load is not None:
            self.load_wait_s += step.waited
            self._load = None
            self._promote_ssd_chunks()
        self.last_step = (step.tokens, compute_s, step.start)
        self.position = step.end
        if step.scattered:  # a blend step that spanned placed KV: resume at the compute spans it left
            first = step.rest[0] if step.rest else Span(step.end, step.end)
            self.position, self._span_end = first.start, first.end
            self._compute_spans = list(step.rest[1:])
        elif self.position == self._span_end and self._compute_spans:
            span = self._compute_spans.pop(0)  # skip the placed span before it
            self.position, self._span_end = span.start, span.end
        if self._placement is not None and self._placement.done:
            self._release_blend()  # placed: the documents' chunks need no pin any more
        if step.offload is not None:
            self._insert_completed(step.offload)
        return logits

    def _blend_step(self, budget: int) -> tuple[torch.Tensor | None, tuple[Span, ...]]:
        """A blend step's positions when the current compute span has fewer than ``budget`` tokens left and more
        compute spans follow: one forward computes the next ``budget`` tokens of them all, across the placed KV
        between them (fewer forwards: each one pays a fixed cost per layer, which on a GPU outweighs a short
        span's tokens). Returns (positions, the compute spans left after the step), or (None, ()) for a
        contiguous step."""
        if not self._compute_spans or self._span_end - self.position >= budget:
            return None, ()
        pieces = [Span(self.position, self._span_end)]
        left = budget - (self._span_end - self.position)
        rest = list(self._compute_spans)
        while rest and left > 0:
            span = rest.pop(0)
            take = min(left, span.end - span.start)
            pieces.append(Span(span.start, span.start + take))
            left -= take
            if take < span.end - span.start:
                rest.insert(0, Span(span.start + take, span.end))
        return torch.cat([torch.arange(p.start, p.end) for p in pieces]), tuple(rest)

    def _offload_for(self, end: int) -> ChunkOffload | None:
        """The offload of plan chunks this step completes (ending at or before ``end``, not cached yet)."""
        if self.ctx.cache is None:
            return None
        upto = self._stored_upto
        end = min(end, self._exact_until)  # nothing computed after a placed document is exact
        while upto < len(self.plan) and self.plan[upto].end <= end:
            upto += 1
        if upto == self._stored_upto:
            return None
        spans = [(self.plan[i].start, self.plan[i].end) for i in range(self._stored_upto, upto)]
        return self.ctx.copy.offload(self.row, spans, self.ctx.cache.host_buffers)

    def _insert_completed(self, offload: ChunkOffload) -> None:
        for payload in offload.finish():
            spec = self.plan[self._stored_upto]
            self._insert(spec, payload)
            self._stored_upto += 1

    def _promote_ssd_chunks(self) -> None:
        """Chunks read from SSD on demand are now in the row: keep a DRAM copy too (once the row holds them)."""
        for src in self._sources:
            if src.payload is None and src.fill_end == src.end:
                self._insert(self.plan[src.index], self.row.chunk_payload(src.start, src.end))

    def _insert(self, spec: ChunkSpec, payload: torch.Tensor) -> None:
        tokens = self._ids[spec.start: spec.end].tolist() if spec.partial else None
        try:
            self.ctx.cache.insert(spec, payload, tokens=tokens, tenant=self.request.tenant)
        except Exception as exc:  # noqa: BLE001 - caching is best effort; the answer is already right
            log.warning("could not cache chunk %s: %s", spec.key.hex()[:12], exc)

    def _cancel_load(self) -> None:
        if self._load is not None:
            self._load.cancel()
            self._load = None

    def release(self) -> None:
        """Unpin the leased prefix (idempotent); stops a load still running and drops a step in flight."""
        self._inflight = None
        self._cancel_load()
        self._release_blend()
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def prefill_step_sizes(start: int, total: int, budget: int, block: int) -> list[int]:
    """The tokens of each prefill step a task runs from position ``start`` to ``total``: steps of at most
    ``budget`` tokens cut at multiples of ``block`` (`_aligned_end`), as `PrefillTask` runs them when no error
    intervenes (what `pcr-rag simulate` models; the sizes sum to ``total - start``)."""
    sizes, pos = [], start
    while pos < total:
        end = min(total, _aligned_end(pos, max(1, budget), block))
        sizes.append(end - pos)
        pos = end
    return sizes


def _aligned_end(start: int, budget: int, block: int) -> int:
    """End of a step of at most ``budget`` tokens from ``start``, cut at a multiple of ``block`` (the forward's
    attention block) when that leaves a non-empty step: after a partial hit (e.g. a cached 33-token preamble) the
    steps then cover whole attention blocks instead of straddling two per step, which is the
    cheaper split (see docs/measurements-history.md#figures-moved-from-code-comments).
    The numbers do not change: prefill is split-invariant."""
    end = start + budget
    cut = end // block * block
    return cut if cut > start else end


class DecodeRow:
    """One request's decode: picks each token from the row's logits, streams its text, applies stop strings,
    end-of-sequence and ``max_new_tokens``. Invariants: ``tokens[-1]`` sits at `position` in the row and is the
    next decode input (until `finished`); ``text`` is exactly the concatenation of the streamed deltas - a token
    that ends inside a multi-byte character streams "" until the character is complete (a character still
    incomplete when the request ends is dropped)."""

    def __init__(self, request: Request, prompt_tokens: int, tokenizer, eos_ids: frozenset[int],
                 on_token: Callable[[int, str], None]) -> None:
        self.request = request
        self.params = request.params
        self.prompt_tokens = prompt_tokens
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.on_token = on_token
        self.sampler = TokenSampler(request.params, getattr(request, "constraint", None),
                                    prompt_token_ids=request.token_ids, eos_ids=eos_ids)
        self._decoded = IncrementalText(tokenizer)  # holds the answer's tokens (`tokens`) and decodes them
        self.text = ""
        self.finish_reason = "length"
        self.finished = False
        self._last_t: float | None = None

    @property
    def tokens(self) -> list[int]:
        """The answer's tokens so far (end-of-sequence excluded)."""
        return self._decoded.tokens

    @property
    def position(self) -> int:
        return self.prompt_tokens + len(self.tokens) - 1

    @property
    def last_token(self) -> int:
        return self.tokens[-1]

    def accept(self, logits: torch.Tensor) -> bool:
        """Choose the next token from ``logits``; True once the request is finished."""
        tok = self.sampler.select(logits)
        now = time.perf_counter()
        if self._last_t is not None:
            self.request.metrics.itl_s.append(now - self._last_t)
        self._last_t = now
        if tok in self.eos_ids and not self.params.ignore_eos:
            return self._end("stop")
        self.sampler.accept(tok)
        new_text = self._decoded.append(tok)  # appends to `tokens`; the text of them all, decoding the recent ones
        stops = self.params.stop if len(self.tokens) >= self.params.min_tokens else ()  # vLLM: none before min_tokens
        stop_at = _find_stop(new_text, stops, len(self.text))
        if stop_at is not None:
            delta = new_text[len(self.text): stop_at]
            if delta:
                self.on_token(tok, delta)
            self.text = new_text[:stop_at]
            return self._end("stop")
        complete = len(new_text)
        while complete > len(self.text) and new_text[complete - 1] == INCOMPLETE_CHAR:
            complete -= 1  # a token that ends mid-character: hold the partial character back until it completes
        delta = new_text[len(self.text): complete]
        self.text = new_text[:complete]
        self.on_token(tok, delta)
        if len(self.tokens) >= self.params.max_new_tokens:
            return self._end("length")
        if self.sampler.constraint is not None and self.sampler.constraint.is_terminated():
            return self._end("stop")
        return False

    def _end(self, reason: str) -> bool:
        self.finish_reason = reason
        self.finished = True
        return True


def _find_stop(text: str, stops: Sequence[str], searched_upto: int) -> int | None:
    """Index where the earliest stop string starts in ``text``, else None. ``text[:searched_upto]`` held none, so
    only a match the new characters complete can be there: each stop is looked for in the tail that starts
    ``len(stop) - 1`` characters before them. A token's cost is then the new characters plus the stops' lengths
    (bounded by `pcr_rag.limits.RequestLimits`), never the length of the output."""
    best = None
    for s in stops:
        if not s:
            continue
        pos = text.find(s, max(0, searched_upto - len(s) + 1))
        if pos >= 0 and (best is None or pos < best):
            best = pos
    return best
