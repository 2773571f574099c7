"""Cost model: compute and transfer times of one request's prefill and decode, per layer.

The layer-wise pipeline is modelled layer by layer, not as a discount. With three streams (load, compute,
offload) and per-layer times ``l[i]``, ``c[i]``, ``o[i]``::

    load_end[i]  = load_start + l[0] + ... + l[i]                 (loads issued back to back)
    comp_end[i]  = max(comp_end[i-1], load_end[i]) + c[i] + sync  (layer i waits for its KV)
    off_end[i]   = max(off_end[i-1], comp_end[i]) + o[i]          (offload runs alongside compute)

A forward step is done at ``max(comp_end[-1] + post, off_end[-1])``: the runtime (and the paper's pipeline, whose
overhead is "about one layer's transfer") waits for the last layer's offload before it moves on. Without overlap
the phases run back to back: ``load_start + sum(l) + sum(c) + post + sum(o)``. All times are seconds, sizes bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pcr_rag.sim.profiles import Profile


@dataclass(frozen=True)
class PipelineResult:
    """Times relative to the start of the forward step (seconds)."""

    done_s: float  # the step is over: last layer computed (+ post) and its KV offloaded
    compute_end_s: float  # the last layer's compute ends
    offload_end_s: float  # the last layer's new KV is off the device
    stall_s: float  # compute time lost waiting for loads (overlap) or for transfers (no overlap)


def pipeline(
    load: Sequence[float],
    compute: Sequence[float],
    offload: Sequence[float],
    *,
    overlap: bool,
    sync_s: float = 0.0,
    load_start: float = 0.0,
    post_s: float = 0.0,
) -> PipelineResult:
    """Schedule one forward step of ``len(compute)`` layers, layer by layer.

    ``load_start`` delays the first load (e.g. a busy SSD); ``post_s`` is compute after the last layer (LM head);
    ``sync_s`` the per-layer cost of the event handshakes the overlapped pipeline needs. Invariant: with
    ``sync_s == 0`` the overlapped step is never slower than the serial one for the same inputs.
    """
    n = len(compute)
    if len(load) != n or len(offload) != n:
        raise ValueError(f"load/compute/offload need one entry per layer, got {len(load)}/{n}/{len(offload)}")
    if not overlap:
        total_l, total_c, total_o = sum(load), sum(compute), sum(offload)
        start = load_start + total_l if total_l > 0 else 0.0
        comp_end = start + total_c + post_s
        done = comp_end + total_o
        return PipelineResult(done, comp_end, done, start + total_o)
    load_end = load_start
    comp_end = 0.0
    off_end = 0.0
    stall = 0.0
    any_load = False
    for i in range(n):
        if load[i] > 0:
            any_load = True
        load_end += load[i]
        start = comp_end
        if any_load and load_end > start:
            stall += load_end - start
            start = load_end
        comp_end = start + compute[i] + sync_s
        off_end = max(off_end, comp_end) + offload[i]
    return PipelineResult(max(comp_end + post_s, off_end), comp_end, off_end, stall)


def pipeline_uniform(
    n: int, load: float, compute: float, offload: float, *, overlap: bool, sync_s: float = 0.0,
    load_start: float = 0.0, post_s: float = 0.0,
) -> PipelineResult:
    """:func:`pipeline` for ``n`` identical layers in closed form (O(1); equal to the loop, see the tests).

    The maxima of the recurrences are reached at the ends of the pipeline: with ``c' = c + sync`` and
    ``L0 = load_start``, ``comp_end = L0 + max(l + n c', n l + c')`` and
    ``off_end = L0 + max(l + c' + n o, l + n c' + o, n l + c' + o)`` (``L0`` and ``l`` vanish without loads).
    """
    if n <= 0:
        return PipelineResult(post_s, 0.0, 0.0, 0.0)
    if not overlap:
        start = load_start + n * load if load > 0 else 0.0
        comp_end = start + n * compute + post_s
        done = comp_end + n * offload
        return PipelineResult(done, comp_end, done, start + n * offload)
    c = compute + sync_s
    if load > 0:
        l0, ll = load_start, load
    else:
        l0, ll = 0.0, 0.0
    comp_end = l0 + max(ll + n * c, n * ll + c)
    off_end = l0 + max(ll + c + n * offload, ll + n * c + offload, n * ll + c + offload)
    return PipelineResult(max(comp_end + post_s, off_end), comp_end, off_end, comp_end - n * c)


def attention_pairs(start: int, end: int) -> float:
    """The (query, key) pairs of causal attention for the queries at positions ``[start, end)``: each attends to
    every position up to its own (``n * start + n * (n + 1) / 2`` for ``n = end - start``), whatever sits before
    ``start`` (an exact prefix, placed documents, earlier spans)."""
    n = max(0, end - start)
    return n * start + n * (n + 1) / 2.0


@dataclass(frozen=True)
class PrefillWork:
    """What one prefill has to do (tokens).

    ``cached_tokens`` is the matched prefix (reused, not computed); ``compute_steps`` the token counts of the forward
    steps that compute the rest, in prompt order. The cached prefix splits by where it is read from:
    ``device_tokens`` (already on the device: free), ``dram_tokens`` (host -> device copy) and ``ssd_tokens``
    (read from SSD on demand, one read per chunk per layer, then host -> device), ``ssd_chunks`` of them.
    ``ssd_wait_s`` delays the SSD reads (the SSD is busy with earlier reads). ``promote_tokens`` are copied back
    device -> host after the prefill (the runtime keeps a DRAM copy of chunks it read from SSD). ``offload``: the
    new KV is copied device -> host layer by layer (False when nothing is cached, e.g. no-reuse).

    Blend mode (`pcr_rag.sched.blend`): the steps need not be contiguous. ``step_context`` gives the tokens
    already in the request's KV before each step (its attention reads them all: the exact prefix, placed
    documents and earlier computed spans); empty: ``cached_tokens`` plus the steps before it. ``step_offload``
    gives the tokens of each step copied to the host (the runtime inserts nothing computed after a placed
    document); empty: every step's tokens when ``offload``. ``placed_tokens`` are placed from documents'
    position-independent KV in the first step, each layer's keys rotated (`CostModel.place_s`); their loads from
    the host are in ``dram_tokens`` / ``ssd_tokens`` like any cached chunk's. ``step_pairs`` (optional) gives each
    step's attention (query, key) pairs where a step computes several spans at once (blend mode's scattered steps:
    the sum of `attention_pairs` over its spans; `CostModel.layer_compute_s`).
    """

    cached_tokens: int
    compute_steps: tuple[int, ...]
    device_tokens: int = 0
    dram_tokens: int = 0
    ssd_tokens: int = 0
    ssd_chunks: int = 0
    ssd_wait_s: float = 0.0
    promote_tokens: int = 0
    offload: bool = True
    step_context: tuple[int, ...] = ()
    step_offload: tuple[int, ...] = ()
    placed_tokens: int = 0
    step_pairs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.compute_steps)
        for name in ("step_context", "step_offload", "step_pairs"):
            got = len(getattr(self, name))
            if got not in (0, n):
                raise ValueError(f"{name} needs one entry per compute step ({n}), got {got}")

    @property
    def computed_tokens(self) -> int:
        return sum(self.compute_steps)

    def context_of(self, index: int) -> int:
        """Tokens in the request's KV before compute step ``index``."""
        if self.step_context:
            return self.step_context[index]
        return self.cached_tokens + sum(self.compute_steps[:index])

    def offload_of(self, index: int) -> int:
        """Tokens of compute step ``index`` copied device -> host."""
        if not self.offload:
            return 0
        return self.step_offload[index] if self.step_offload else self.compute_steps[index]


@dataclass(frozen=True)
class PrefillCost:
    """Seconds from the start of the prefill; the parts are stream busy times (they overlap when pipelined)."""

    total_s: float  # prefill start -> first token
    compute_s: float
    h2d_s: float
    ssd_read_s: float
    d2h_s: float
    stall_s: float  # critical-path time not spent computing
    step_s: tuple[float, ...] = ()  # seconds of each forward step, in order; sums to total_s (the first step
    #                                 carries the request overhead, the last the copy-back of SSD-read chunks)


class CostModel:
    """Times of the pieces of a request under one :class:`Profile`."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._layer_bytes = profile.kv_bytes_per_token_layer

    # --- compute -----------------------------------------------------------------------------------------------
    def layer_compute_s(self, new_tokens: int, context_tokens: int, pairs: float | None = None) -> float:
        """One layer of one forward step computing ``new_tokens`` after ``context_tokens`` (causal attention);
        ``pairs``: the (query, key) pairs its attention computes, where the step is not one contiguous span
        (default: ``new * context + new * (new + 1) / 2``)."""
        if new_tokens <= 0:
            return 0.0
        p = self.profile
        if pairs is None:
            pairs = attention_pairs(context_tokens, context_tokens + new_tokens)
        return p.layer_s_fixed + p.layer_s_per_token * new_tokens + p.layer_s_per_token_ctx * pairs

    def compute_only_s(self, steps: Sequence[int], cached_tokens: int = 0) -> float:
        """Forward steps with no transfers at all (the no-reuse baseline when ``cached_tokens == 0``)."""
        p = self.profile
        total = p.request_overhead_s
        ctx = cached_tokens
        for c in steps:
            if c > 0:
                total += p.num_layers * self.layer_compute_s(c, ctx) + p.step_s_fixed
                ctx += c
        return total

    def decode_s(self, context_tokens: int, new_tokens: int) -> float:
        """``new_tokens`` decode steps starting at context ``context_tokens`` (sum of an arithmetic series)."""
        if new_tokens <= 0:
            return 0.0
        p = self.profile
        mean_ctx = context_tokens + (new_tokens - 1) / 2.0
        return new_tokens * (p.decode_s_per_token + p.decode_s_per_token_ctx * mean_ctx)

    def decode_step_s(self, context_tokens: int, rows: int = 1) -> float:
        """One decode step of ``rows`` sequences holding ``context_tokens`` tokens of KV in all: the weights are
        read once, each row adds ``decode_s_per_row`` (its own attention and row work), every token of KV is read."""
        p = self.profile
        return (p.decode_s_per_token + p.decode_s_per_row * max(0, rows - 1)
                + p.decode_s_per_token_ctx * context_tokens)

    def place_s(self, tokens: int) -> float:
        """Placing ``tokens`` of a document's position-independent KV, all layers: one elementwise pass over their
        keys, modelled as memory traffic (the keys, half of the KV bytes, read and written once). On a GPU the rate
        is the device memory's as a decode step reads KV (``decode_s_per_token_ctx``: seconds per token of KV read,
        so one token's keys read and written cost one token's KV read); on a CPU (``device_is_host``) it is the
        measured host memory copy (``h2d_bytes_per_s``: bytes copied per second), since a CPU decode step's
        per-context cost is attention compute, not a memory rate. The value copy is the load (``dram_tokens``) or
        already on the device."""
        p = self.profile
        tokens = max(0, tokens)
        if p.device_is_host:
            return tokens * (p.kv_bytes_per_token / 2.0) / p.h2d_bytes_per_s
        return tokens * p.decode_s_per_token_ctx

    # --- transfers ---------------------------------------------------------------------------------------------
    def h2d_s(self, tokens: int) -> float:
        return tokens * self.profile.kv_bytes_per_token / self.profile.h2d_bytes_per_s

    def d2h_s(self, tokens: int) -> float:
        return tokens * self.profile.kv_bytes_per_token / self.profile.d2h_bytes_per_s

    def ssd_read_s(self, nbytes: float, ops: int = 1) -> float:
        p = self.profile
        return ops * p.ssd_read_latency_s + nbytes / p.ssd_read_bytes_per_s

    def ssd_write_s(self, nbytes: float, ops: int = 1) -> float:
        p = self.profile
        return ops * p.ssd_write_latency_s + nbytes / p.ssd_write_bytes_per_s

    # --- one prefill -------------------------------------------------------------------------------------------
    def prefill(self, work: PrefillWork, *, overlap: bool) -> PrefillCost:
        """Time of one prefill with reuse: forward steps in order, the first one gated layer by layer by the
        loads of the cached prefix (with ``overlap``; all loads first without it); each step's new KV offloaded
        layer by layer; then the SSD-read chunks copied back to the host. Where the profile's loads share the
        forward's cores (``loads_share_compute``), pipelining hides nothing: the phases add up."""
        p = self.profile
        overlap = overlap and not p.loads_share_compute
        n = p.num_layers
        lb = self._layer_bytes
        h2d_layer = (work.dram_tokens + work.ssd_tokens) * lb / p.h2d_bytes_per_s
        ssd_layer = (
            work.ssd_chunks * p.ssd_read_latency_s + work.ssd_tokens * lb / p.ssd_read_bytes_per_s
            if work.ssd_tokens
            else 0.0
        )
        load_layer = h2d_layer + ssd_layer
        sync = p.layer_sync_s if (load_layer > 0 or work.offload) else 0.0
        compute = d2h = stall = 0.0
        steps: list[float] = []
        place_layer = self.place_s(work.placed_tokens) / n
        first = True
        for i, step in enumerate(work.compute_steps):
            if step <= 0:
                continue
            pairs = work.step_pairs[i] if work.step_pairs else None
            c = self.layer_compute_s(step, work.context_of(i), pairs) + (place_layer if first else 0.0)
            o = work.offload_of(i) * lb / p.d2h_bytes_per_s
            res = pipeline_uniform(
                n,
                load_layer if first else 0.0,
                c,
                o,
                overlap=overlap,
                sync_s=sync,
                load_start=work.ssd_wait_s if first and ssd_layer > 0 else 0.0,
                post_s=p.step_s_fixed,
            )
            steps.append(res.done_s + (p.request_overhead_s if first else 0.0))
            stall += res.done_s - n * c - p.step_s_fixed
            compute += n * c + p.step_s_fixed
            d2h += n * o
            first = False
        promote = self.d2h_s(work.promote_tokens)
        if steps:
            steps[-1] += promote
        else:  # nothing to compute (not a runtime case: its last chunk is always computed)
            steps.append(promote + p.request_overhead_s)
        total = sum(steps)
        stall += promote
        return PrefillCost(
            total_s=total,
            compute_s=compute,
            h2d_s=n * h2d_layer,
            ssd_read_s=n * ssd_layer,
            d2h_s=d2h + promote,
            stall_s=max(0.0, stall),
            step_s=tuple(steps),
        )
