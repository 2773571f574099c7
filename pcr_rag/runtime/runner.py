"""One request's prefill with prefix reuse, then decode.

Prefill advances one forward step per chunk of the plan (`plan_chunks`), whether or not the chunk is cached. A
hit skips exactly the step it would have run, and the next step sees bit-identical KV, so a cached run produces
bit for bit the tokens of an uncached run in any dtype (the fidelity invariant). The last chunk is always
computed, since its last position yields the first token's logits.

Reuse: the matched prefix (leased, i.e. pinned, from the cache engine) is loaded into the request's `PCRKVCache`
by the copy engine, layer by layer, while the first computed step runs; each computed step's new KV is offloaded
layer by layer and inserted into the cache engine (DRAM, then asynchronous SSD write-back). A chunk that fails
verification is dropped by the cache engine and the request restarts its prefill with the prefix before it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pcr_rag.cache import CacheEngine, ChunkSpec, Tier
from pcr_rag.errors import PrefixLoadError, RequestCancelledError
from pcr_rag.metrics import TIERS, RequestMetrics
from pcr_rag.requests import SamplingParams
from pcr_rag.runtime.kv_cache import PCRKVCache
from pcr_rag.runtime.model import LoadedModel
from pcr_rag.runtime.transfer import CopyEngine, LoadSource, StepHooks

log = logging.getLogger(__name__)


@dataclass
class PrefillOutcome:
    kv: PCRKVCache
    last_logits: torch.Tensor
    computed_tokens: int
    reused_by_tier: dict[str, int]
    load_wait_s: float
    retries: int
    memory_keys: frozenset[bytes] = frozenset()  # matched chunks served from memory (device/DRAM), not the SSD


class Runner:
    """Runs prefill-with-reuse and decode for one request at a time on the engine's executor thread."""

    def __init__(self, loaded: LoadedModel, cache: CacheEngine | None, copy_engine: CopyEngine,
                 *, layerwise: bool) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.cache = cache
        self.copy = copy_engine
        self.layerwise = layerwise
        self.prefetch_wait_s = 30.0  # longest wait for an in-flight prefetch of a chunk this request needs
        self._eos = set(loaded.eos_token_ids)

    # ------------------------------------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], plan: Sequence[ChunkSpec], capacity: int,
                cancelled: threading.Event | None = None) -> PrefillOutcome:
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        kv = PCRKVCache(self.loaded.kv, capacity, self.device)
        max_chunks = len(plan) - 1  # the last chunk is always computed: it yields the first token's logits
        retries = 0
        while True:
            lease = self.cache.acquire(plan, max_chunks=max_chunks) if self.cache is not None else None
            try:
                return self._prefill_once(ids, plan, kv, lease, cancelled, retries)
            except PrefixLoadError as exc:
                retries += 1
                log.warning("recomputing from chunk %d: %s", exc.chunk_index, exc)
                max_chunks = min(max_chunks, exc.chunk_index)
                kv.set_length(0)
            finally:
                if lease is not None:
                    lease.release()

    def _prefill_once(self, ids: torch.Tensor, plan: Sequence[ChunkSpec], kv: PCRKVCache, lease,
                      cancelled: threading.Event | None, retries: int) -> PrefillOutcome:
        m = lease.num_chunks if lease is not None else 0
        reused = dict.fromkeys(TIERS, 0)
        sources: list[LoadSource] = []
        tiers = lease.tiers if lease is not None else ()
        on_ssd = [plan[i].key for i in range(m) if tiers[i] is Tier.SSD]
        if on_ssd:  # a prefetch of these may be finishing: wait for it rather than read the chunk twice
            for fut in self.cache.pending_loads(on_ssd):
                try:
                    fut.result(timeout=self.prefetch_wait_s)
                except Exception:  # noqa: BLE001 - timed out or failed: read from SSD below
                    pass
        for i in range(m):
            spec = plan[i]
            payload = self.cache.get_payload(spec.key)
            served = Tier.DRAM if payload is not None and tiers[i] is Tier.SSD else tiers[i]  # prefetched
            reused[served.value] += spec.num_tokens
            sources.append(LoadSource(i, spec.key, spec.start, spec.end, payload))
        matched_tokens = plan[m - 1].end if m else 0
        kv.set_length(matched_tokens)
        load = None
        if sources:
            load = self.copy.start_load(kv, sources, self.cache.open_layer_reader, layerwise=self.layerwise)
        waits_before = sum(self.copy.waits.seconds)
        logits = None
        try:
            for idx in range(m, len(plan)):
                if cancelled is not None and cancelled.is_set():
                    raise RequestCancelledError("request cancelled during prefill")
                spec = plan[idx]
                offload = self.copy.offload(kv, spec.start, spec.end, layerwise=self.layerwise) \
                    if self.cache is not None else None
                kv.hooks = StepHooks(load if idx == m else None, offload)
                try:
                    out = self.model(
                        input_ids=ids[spec.start: spec.end].unsqueeze(0),
                        position_ids=torch.arange(spec.start, spec.end, device=self.device).unsqueeze(0),
                        cache=kv,
                        use_cache=True,
                        logits_to_keep=1,
                    )
                finally:
                    kv.hooks = None
                logits = out.logits[0, -1]
                if offload is not None:
                    self._insert(spec, offload.finish(), ids)
        except BaseException:
            if load is not None:
                load.cancel()
            raise
        if load is not None:
            load.wait_all()  # all layers were waited for by the first step; this only surfaces late errors
            self._promote_ssd_chunks(plan, sources, kv)
        computed = plan[-1].end - matched_tokens
        wait_s = sum(self.copy.waits.seconds) - waits_before
        in_memory = frozenset(src.key for src in sources if src.payload is not None)
        return PrefillOutcome(kv, logits, computed, reused, wait_s, retries, in_memory)

    def _insert(self, spec: ChunkSpec, payload: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        tokens = ids[spec.start: spec.end].tolist() if ids is not None and spec.partial else None
        try:
            self.cache.insert(spec, payload, tokens=tokens)
        except Exception as exc:  # noqa: BLE001 - caching is best effort; the answer is already right
            log.warning("could not cache chunk %s: %s", spec.key.hex()[:12], exc)

    def _promote_ssd_chunks(self, plan: Sequence[ChunkSpec], sources: Sequence[LoadSource],
                            kv: PCRKVCache) -> None:
        """Chunks read from SSD on demand are now in the request's buffers: keep a DRAM copy too."""
        for src in sources:
            if src.payload is None:
                self._insert(plan[src.index], kv.chunk_payload(src.start, src.end))

    # ------------------------------------------------------------------------------------------------- decode
    def start_decode(self, kv: PCRKVCache, first_logits: torch.Tensor, position: int, params: SamplingParams,
                     tokenizer, on_token: Callable[[int, str], None], cancelled: threading.Event | None,
                     metrics: RequestMetrics) -> DecodeState:
        """A request's decode, advanced one token per `DecodeState.step()` (so the executor can interleave it)."""
        return DecodeState(self, kv, first_logits, position, params, tokenizer, on_token, cancelled, metrics)


class DecodeState:
    """One request's decode loop, one token per `step()`. Invariant: ``logits`` are those of the last position
    in ``kv``; a step selects a token from them, streams it, and (unless finished) runs the model on it."""

    def __init__(self, runner: Runner, kv: PCRKVCache, first_logits: torch.Tensor, position: int,
                 params: SamplingParams, tokenizer, on_token: Callable[[int, str], None],
                 cancelled: threading.Event | None, metrics: RequestMetrics) -> None:
        self.runner = runner
        self.kv = kv
        self.logits = first_logits
        self.position = position
        self.params = params
        self.tokenizer = tokenizer
        self.on_token = on_token
        self.cancelled = cancelled
        self.metrics = metrics
        self.tokens: list[int] = []
        self.text = ""
        self.finish = "length"
        self.done = False
        self._step = 0
        self._last_t: float | None = None
        self._gen = None
        if params.temperature > 0:
            self._gen = torch.Generator(device="cpu")
            self._gen.manual_seed(params.seed if params.seed is not None else int(time.time_ns() % (2**31)))

    @torch.inference_mode()
    def step(self) -> bool:
        """Emit one token; True once the request is finished (EOS, a stop string, or max_new_tokens)."""
        if self.done:
            return True
        if self.cancelled is not None and self.cancelled.is_set():
            raise RequestCancelledError("request cancelled during decode")
        p = self.params
        tok = _select(self.logits, p, self._gen)
        now = time.perf_counter()
        if self._last_t is not None:
            self.metrics.itl_s.append(now - self._last_t)
        self._last_t = now
        if tok in self.runner._eos:
            return self._end("stop")
        self.tokens.append(tok)
        new_text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        stop_at = _find_stop(new_text, p.stop, len(self.text))
        if stop_at is not None:
            delta = new_text[len(self.text): stop_at]
            if delta:
                self.on_token(tok, delta)
            self.text = new_text[:stop_at]
            return self._end("stop")
        delta = new_text[len(self.text):]
        self.text = new_text
        self.on_token(tok, delta)
        self._step += 1
        if self._step >= p.max_new_tokens:
            return self._end("length")
        device = self.runner.device
        out = self.runner.model(
            input_ids=torch.tensor([[tok]], device=device),
            position_ids=torch.tensor([[self.position + self._step - 1]], device=device),
            cache=self.kv,
            use_cache=True,
            logits_to_keep=1,
        )
        self.logits = out.logits[0, -1]
        return False

    def _end(self, reason: str) -> bool:
        self.finish = reason
        self.done = True
        self.kv = None  # free the request's KV buffers as soon as it is done
        return True


def _select(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    scores = logits.float()
    if params.temperature <= 0:
        return int(torch.argmax(scores).item())
    probs = torch.softmax(scores / params.temperature, dim=-1).cpu()
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)
        return int(idx[choice].item())
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _find_stop(text: str, stops: Sequence[str], searched_upto: int) -> int | None:
    """Index where the earliest stop string starts in ``text`` (searching only what could be new), else None."""
    best = None
    for s in stops:
        if not s:
            continue
        pos = text.find(s, max(0, searched_upto - len(s) + 1))
        if pos >= 0 and (best is None or pos < best):
            best = pos
    return best
