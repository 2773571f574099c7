"""`pcr-rag bench kernels`: the forward pass against the machine's limit, measured in one run.

Every row is measured on the same prompt tokens (``--prompt-tokens`` of the built-in stdlib corpus, default 1,536)
of one model (default: the engine's default model, SmolLM2-135M, in bf16), A/B interleaved: each repetition runs
every variant of a section once, in an order rotated per repetition, and a row reports the median over repetitions
(the machine is shared and noisy; compare ratios within one run, not absolute figures across runs).

Sections:
- **prefill**: ``chunk_size: null`` is plain transformers one-shot prefill, ``model(input_ids, logits_to_keep=1)``
  with a fresh cache (what `HuggingFaceLLM` does) - the baseline. Then the engine's `FastForward.prefill` in steps
  of each ``--chunk-sizes`` (the engine's ``prefill_chunk_tokens``; 256 is its default plan) and in one step
  (``chunk_size`` = the prompt length), in bf16, plus the default plan in the other weight formats. Per row:
  seconds, tokens/s, ``vs_one_shot`` (seconds / the null row's) and ``split_invariant`` (the last logits equal
  the one-step run's of the same format bit for bit; null for the transformers row, which is another arithmetic).
- **decode**: ms per step of `FastForward.decode` over a KV arena of ``batch_rows`` rows (8, as the engine runs)
  with ``--decode-context`` tokens of context per active row, at each batch size and weight format. A step with
  fewer active rows runs its GEMMs at the smallest row count proven exact that holds them (``gemm_rows``; padding
  rows fill the rest); the ``fast-fixed`` row is batch 1 run over all ``batch_rows`` rows, the fixed shape, for
  comparison (same numbers). Plus transformers' own decode step at batch 1 (a DynamicCache of the same context)
  as a reference. ``tokens_per_s`` = batch / step time. The context KV is computed once by the bf16 forward and copied
  into every row (a step's time does not depend on the KV's values).
- **invariance**: what fixed shapes cost. For each count k of active rows (``--invariance-rows``, default 1 ..
  ``batch_rows``): the engine's step (k rows of a ``batch_rows``-row batch, GEMMs at the smallest proven-exact row
  count that holds them, padding included) vs the fastest batching without fixed shapes that we could build: a
  forward prepacked for exactly k rows, so its GEMMs run k rows and a row's numbers change with the batch size
  (attention per row in both: one padded call over all rows was slower here, and not exact either). bf16; each k's
  pair is interleaved on its own (one extra forward alive at a time) and ``fixed_over_free`` is the median of the
  paired ratios. Issue 11 asks for a ``batch_invariant=False``
  mode only if fixed shapes cost more than 15% (the ``decode_fixed_shapes_vs_free`` target, on the geometric mean
  over k; k = ``batch_rows`` runs the same forward twice: the noise floor).
- **roofline**: ``roofline_ms`` = weight bytes one decode step reads (`FastForward.weight_bytes`) / memory
  bandwidth. The bandwidth is measured in the same run, interleaved with the decode repetitions, by copying a
  buffer larger than the last-level cache: bytes read + bytes written per second, best of the tries (a limit).
  ``vs_roofline`` = a decode row's ms per step / its format's roofline.
- **profile**: `torch.profiler` top ops by self CPU time of one bf16 decode step and one prefill step of the
  default plan's size.
- **perplexity**: per weight format next to bf16, over fixed corpus passages (`pcr_rag.bench.perplexity` states
  the method).
- **peer**: llama.cpp on the GGUF file the model was converted from, same threads, same prompt tokens, when
  llama-cpp-python is importable (`pcr_rag.bench.llamacpp_peer`); else null.

Run: ``pcr-rag bench kernels [--quick] [--json PATH]`` or ``python -m pcr_rag.bench.kernels``. ``--quick`` is a
small preset (short prompt, few repetitions) for tests and CI; the default takes a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm
from transformers import DynamicCache

from pcr_rag.bench import llamacpp_peer
from pcr_rag.bench.llamacpp_peer import PeerError
from pcr_rag.bench.perplexity import METHOD, measure
from pcr_rag.bench.targets import KERNEL_TARGETS
from pcr_rag.config import EngineConfig
from pcr_rag.model.forward import FastForward
from pcr_rag.model.model import load_model
from pcr_rag.model.weights import WEIGHT_FORMATS, resolve_weight_format
from pcr_rag.rag.corpus import load_corpus

log = logging.getLogger(__name__)

MiB = 1 << 20
TARGETS = KERNEL_TARGETS


def _default_plan() -> int:
    """The engine's default ``prefill_chunk_tokens`` (one place: `EngineConfig`)."""

    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "prefill_chunk_tokens")


@dataclass(frozen=True)
class KernelBenchConfig:
    """What the kernel bench measures. Sizes are tokens unless named otherwise."""

    model: str | None = None          # alias or local path; None = the engine's default model
    dtype: str = "auto"                # the engine's: bfloat16 where the CPU runs it natively, else float32
    threads: int | None = None        # torch compute threads (and llama.cpp's); None = torch's current setting
    corpus: str | None = None         # None = the built-in stdlib corpus
    prompt_tokens: int = 1536
    chunk_sizes: tuple[int, ...] = (64, 128, 256, 512)
    prefill_formats: tuple[str, ...] = WEIGHT_FORMATS  # formats of the default-plan prefill row
    prefill_reps: int = 5
    weight_formats: tuple[str, ...] = WEIGHT_FORMATS
    decode_batches: tuple[int, ...] = (1, 4, 8)
    batch_rows: int = 8               # rows of every decode forward (the engine's max_active)
    decode_context: int = 512
    decode_steps: int = 8             # timed steps per try (the try's figure is their median)
    decode_reps: int = 5
    invariance_rows: tuple[int, ...] | None = None  # active-row counts of the invariance section; None = 1..batch_rows
    ppl_passages: int = 8
    ppl_tokens: int = 384             # tokens per perplexity passage
    bandwidth_bytes: int = 512 * MiB  # copy buffer (larger than the last-level cache)
    profile_top: int = 12
    peer: bool = True
    tile_rows: int | None = None        # FastForward's prefill GEMM rows; None = its default
    attention_block: int | None = None  # FastForward's prefill attention block; None = its default

    @classmethod
    def quick(cls, **changes: Any) -> KernelBenchConfig:
        """The ``--quick`` preset: the same rows on tiny inputs (well under a minute on a small model)."""
        base = cls(prompt_tokens=160, chunk_sizes=(32, 64), prefill_reps=2, decode_context=48, decode_steps=2,
                   decode_reps=2, invariance_rows=(3, 8), ppl_passages=2, ppl_tokens=48, bandwidth_bytes=64 * MiB,
                   profile_top=8)
        return dataclasses.replace(base, **changes)

    @property
    def default_plan(self) -> int:
        """The chunk size of the rows in other weight formats: the engine's default when measured, else the
        largest chunk size measured."""
        plan = _default_plan()
        return plan if plan in self.chunk_sizes else max(self.chunk_sizes)

    @property
    def active_row_counts(self) -> tuple[int, ...]:
        """The invariance section's active-row counts."""
        rows = self.invariance_rows
        return tuple(range(1, self.batch_rows + 1)) if rows is None else tuple(rows)

    def validate(self) -> None:
        for name in ("prompt_tokens", "prefill_reps", "batch_rows", "decode_context", "decode_steps", "decode_reps",
                     "ppl_passages", "ppl_tokens", "bandwidth_bytes", "profile_top"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.ppl_tokens < 2:
            raise ValueError("ppl_tokens must be >= 2 (a passage predicts its tokens after the first)")
        if not self.chunk_sizes or any(c < 1 for c in self.chunk_sizes):
            raise ValueError(f"chunk_sizes must be positive token counts, got {self.chunk_sizes}")
        if not self.decode_batches or any(not 1 <= b <= self.batch_rows for b in self.decode_batches):
            raise ValueError(f"decode_batches must lie in [1, batch_rows={self.batch_rows}], got {self.decode_batches}")
        if any(not 1 <= k <= self.batch_rows for k in self.active_row_counts):
            raise ValueError(f"invariance_rows must lie in [1, batch_rows={self.batch_rows}], got "
                             f"{self.invariance_rows}")
        for fmt in (*self.weight_formats, *self.prefill_formats):
            if fmt not in WEIGHT_FORMATS:
                raise ValueError(f"unknown weight format {fmt!r}; valid: {list(WEIGHT_FORMATS)}")
        if "bf16" not in self.weight_formats:
            raise ValueError("weight_formats must include 'bf16' (the reference of the other formats)")
        for name in ("tile_rows", "attention_block"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


# ------------------------------------------------------------------------------------------------- inputs


def corpus_token_stream(tokenizer: Any, corpus: str | None, min_tokens: int) -> list[list[int]]:
    """Token ids of corpus documents in corpus order, as many documents as it takes to hold ``min_tokens``."""

    docs: list[list[int]] = []
    total = 0
    for doc in load_corpus(corpus):
        ids = tokenizer(doc.text, add_special_tokens=False, verbose=False)["input_ids"]
        docs.append(ids)
        total += len(ids)
        if total >= min_tokens:
            break
    return docs


def bench_inputs(tokenizer: Any, cfg: KernelBenchConfig) -> tuple[list[int], list[list[int]]]:
    """(prompt tokens, perplexity passages). The prompt is the first ``prompt_tokens`` tokens of the corpus
    documents in order; each passage is the first ``ppl_tokens`` tokens of a later document long enough."""
    docs = corpus_token_stream(tokenizer, cfg.corpus, cfg.prompt_tokens + cfg.ppl_passages * cfg.ppl_tokens * 4)
    stream: list[int] = []
    used = 0
    while len(stream) < cfg.prompt_tokens and used < len(docs):
        stream.extend(docs[used])
        used += 1
    if len(stream) < cfg.prompt_tokens:
        raise ValueError(f"the corpus holds {len(stream)} tokens, fewer than prompt_tokens={cfg.prompt_tokens}")
    passages = [d[: cfg.ppl_tokens] for d in docs[used:] if len(d) >= cfg.ppl_tokens][: cfg.ppl_passages]
    if len(passages) < cfg.ppl_passages:
        more = corpus_token_stream(tokenizer, cfg.corpus, 10**9)
        passages = [d[: cfg.ppl_tokens] for d in more[used:] if len(d) >= cfg.ppl_tokens][: cfg.ppl_passages]
    if not passages:
        raise ValueError(f"no corpus document after the prompt has {cfg.ppl_tokens} tokens for perplexity")
    return stream[: cfg.prompt_tokens], passages


# ------------------------------------------------------------------------------------------- measurements


def copy_bandwidth_gb_s(src: torch.Tensor, dst: torch.Tensor) -> float:
    """One copy of ``src`` into ``dst``: (bytes read + bytes written) / seconds / 1e9 (on a GPU, from the copy's
    launch to its end: the device is synchronized before and after)."""
    cuda = dst.is_cuda or src.is_cuda
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src)
    if cuda:
        torch.cuda.synchronize()
    return 2 * src.nbytes / (time.perf_counter() - t0) / 1e9


def copy_row_prefix(arena: Any, tokens: int, rows: int) -> None:
    """Give arena rows ``1 .. rows - 1`` row 0's KV of positions ``[0, tokens)``: a decode batch whose rows all hold
    the same context, prefilled once."""
    payload = arena.row(0).chunk_payload(0, tokens)
    for r in range(1, rows):
        for layer in range(payload.shape[0]):
            arena.row(r).load_payload_layer(layer, 0, tokens, payload[layer])


def _rotated(items: Sequence[Any], rep: int) -> list[Any]:
    k = rep % len(items)
    return [*items[k:], *items[:k]]


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


@dataclass
class _Variant:
    """One row being measured: ``run()`` returns seconds of one try."""

    key: str
    run: Callable[[], float]
    times: list[float] = field(default_factory=list)


def _interleaved(variants: Sequence[_Variant], reps: int, progress: bool, desc: str) -> None:
    """Warm every variant once, then ``reps`` rounds of every variant in a rotated order."""

    for v in variants:
        v.run()
    for rep in tqdm(range(reps), desc=desc, disable=not progress, leave=False):
        for v in _rotated(variants, rep):
            v.times.append(v.run())


class _Bench:
    """One run of the kernel bench over a loaded model (see the module docstring)."""

    def __init__(self, loaded: Any, cfg: KernelBenchConfig, progress: bool) -> None:

        self.loaded = loaded
        self.cfg = cfg
        self.progress = progress
        self.prompt, self.passages = bench_inputs(loaded.tokenizer, cfg)
        if len(self.prompt) < cfg.decode_context:
            raise ValueError(f"decode_context={cfg.decode_context} exceeds the prompt ({len(self.prompt)} tokens)")
        formats = dict.fromkeys((*cfg.weight_formats, *cfg.prefill_formats))
        self.ran_as = {fmt: resolve_weight_format(fmt, loaded.dtype, loaded.device) for fmt in formats}
        capacity = max(len(self.prompt), cfg.decode_context + cfg.decode_steps + 1, cfg.ppl_tokens)
        shape = {k: v for k, v in (("tile_rows", cfg.tile_rows), ("attention_block", cfg.attention_block))
                 if v is not None}
        self.forwards = {fmt: FastForward(loaded, weights=self.ran_as[fmt], batch_rows=cfg.batch_rows,
                                          max_positions=capacity + 1, **shape) for fmt in formats}
        self.capacity = capacity

    # -------------------------------------------------------------------------------------------- prefill
    def prefill(self) -> list[dict]:
        cfg, model = self.cfg, self.loaded.model
        ids = torch.tensor(self.prompt, dtype=torch.long)
        n = len(self.prompt)
        last: dict[str, torch.Tensor] = {}

        def one_shot() -> float:
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = model(input_ids=ids[None], logits_to_keep=1)
                dt = time.perf_counter() - t0
            last["hf"] = out.logits[0, -1].float()
            return dt

        def fast(fmt: str, chunk: int) -> Callable[[], float]:
            fw = self.forwards[fmt]
            arena = fw.new_arena(1, n)

            def run() -> float:
                row = arena.row(0)
                t0 = time.perf_counter()
                for s in range(0, n, chunk):
                    e = min(n, s + chunk)
                    logits = fw.prefill(row, ids[s:e], s, want_logits=e == n)
                dt = time.perf_counter() - t0
                last[f"{fmt}/{chunk}"] = logits.float()
                return dt
            return run

        rows = [("transformers", "bf16", None)]
        rows += [("fast", "bf16", c) for c in cfg.chunk_sizes] + [("fast", "bf16", n)]
        rows += [("fast", fmt, cfg.default_plan) for fmt in cfg.prefill_formats if fmt != "bf16"]
        rows = list(dict.fromkeys(rows))
        variants = [_Variant("hf", one_shot) if impl == "transformers" else _Variant(f"{fmt}/{c}", fast(fmt, c))
                    for impl, fmt, c in rows]
        peer_variant = self._peer_prefill_variant()
        _interleaved(variants + ([peer_variant] if peer_variant else []), cfg.prefill_reps, self.progress, "prefill")
        for fmt in cfg.prefill_formats:  # one untimed one-step run: the split-invariance reference of the format
            if f"{fmt}/{n}" not in last:
                fast(fmt, n)()
        self.peer_prefill_s = _median(peer_variant.times) if peer_variant and self._peer_obj else None
        base = _median(variants[0].times)
        self.one_shot_s = base
        out = []
        for (impl, fmt, chunk), v in zip(rows, variants):
            secs = _median(v.times)
            ref = last.get(f"{fmt}/{n}")
            diff = float((last[v.key] - ref).abs().max()) if ref is not None else None
            out.append({
                "chunk_size": chunk, "impl": impl, "weights": fmt, "ran_as": self.ran_as.get(fmt, fmt),
                "tokens": n, "seconds": secs, "tokens_per_s": n / secs, "vs_one_shot": secs / base,
                "split_invariant": None if impl == "transformers" else bool(torch.equal(last[v.key], ref)),
                "max_abs_diff_vs_one_step": diff, "tries": len(v.times),
            })
        return out

    # --------------------------------------------------------------------------------------------- decode
    def decode(self) -> tuple[list[dict], dict]:
        cfg, model = self.cfg, self.loaded.model
        ctx, steps, rows_n = cfg.decode_context, cfg.decode_steps, cfg.batch_rows
        ref_fw = self.forwards["bf16"]
        arena = ref_fw.new_arena(rows_n, ctx + steps + 1)
        context = torch.tensor(self.prompt[:ctx], dtype=torch.long)
        ref_fw.prefill(arena.row(0), context, 0, want_logits=False)
        copy_row_prefix(arena, ctx, rows_n)
        token = int(self.prompt[ctx]) if len(self.prompt) > ctx else 0

        def fast(fmt: str, batch: int, fixed_rows: bool = False) -> Callable[[], float]:
            fw = self.forwards[fmt]
            rows: list[int | None] = [r if r < batch else None for r in range(rows_n)]

            def run() -> float:
                tokens = torch.full((rows_n,), token, dtype=torch.long)
                times = []
                for s in range(steps):
                    pos = torch.full((rows_n,), ctx + s, dtype=torch.long)
                    t0 = time.perf_counter()
                    logits = fw.decode(arena, rows, tokens, pos, fixed_rows=fixed_rows)
                    times.append(time.perf_counter() - t0)
                    tokens = logits.argmax(-1)
                return _median(times)
            return run


        hf_cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=context[None], cache=hf_cache, use_cache=True, logits_to_keep=1)

        def hf_step() -> float:
            tok = torch.tensor([[token]], dtype=torch.long)
            times = []
            with torch.inference_mode():
                for s in range(steps):
                    t0 = time.perf_counter()
                    out = model(input_ids=tok, position_ids=torch.tensor([[ctx + s]]), cache=hf_cache,
                                use_cache=True, logits_to_keep=1)
                    times.append(time.perf_counter() - t0)
                    tok = out.logits[:, -1].argmax(-1, keepdim=True)
                hf_cache.crop(-steps)  # back to the context (transformers 5: a negative count to remove)
            return _median(times)

        src = torch.ones(cfg.bandwidth_bytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        bandwidth: list[float] = []

        def copy() -> float:
            bandwidth.append(copy_bandwidth_gb_s(src, dst))
            return 0.0

        keys = [(fmt, b) for fmt in cfg.weight_formats for b in cfg.decode_batches]
        variants = [_Variant(f"{fmt}/{b}", fast(fmt, b)) for fmt, b in keys]
        fixed_variant = _Variant("bf16/fixed", fast("bf16", 1, fixed_rows=True))
        hf_variant = _Variant("hf", hf_step)
        peer_variant = self._peer_decode_variant()
        extra = [fixed_variant, hf_variant, _Variant("copy", copy)] + ([peer_variant] if peer_variant else [])
        _interleaved(variants + extra, cfg.decode_reps, self.progress, "decode")
        bw = max(bandwidth)
        roofline = {fmt: self.forwards[fmt].weight_bytes / (bw * 1e9) * 1e3 for fmt in cfg.weight_formats}
        out = []
        for (fmt, b), v in zip(keys, variants):
            ms = _median(v.times) * 1e3
            out.append({"batch": b, "weights": fmt, "ran_as": self.ran_as[fmt], "impl": "fast", "context": ctx,
                        "gemm_rows": self.forwards[fmt].decode_rows_for(b),
                        "ms_per_step": ms, "tokens_per_s": b / ms * 1e3, "vs_roofline": ms / roofline[fmt],
                        "tries": len(v.times)})
        for impl, v, gemm_rows in (("fast-fixed", fixed_variant, rows_n), ("transformers", hf_variant, 1)):
            ms = _median(v.times) * 1e3
            out.append({"batch": 1, "weights": "bf16", "ran_as": self.ran_as["bf16"] if impl != "transformers"
                        else "bf16", "impl": impl, "context": ctx, "gemm_rows": gemm_rows,
                        "ms_per_step": ms, "tokens_per_s": 1e3 / ms, "vs_roofline": ms / roofline["bf16"],
                        "tries": len(v.times)})
        self.peer_decode_ms = _median(peer_variant.times) * 1e3 if peer_variant and self._peer_obj else None
        memory = {
            "bandwidth_gb_s": bw, "bandwidth_median_gb_s": _median(bandwidth), "copy_buffer_bytes": cfg.bandwidth_bytes,
            "weight_bytes": {fmt: self.forwards[fmt].weight_bytes for fmt in cfg.weight_formats},
            "roofline_ms_by_weights": roofline,
        }
        return out, memory

    # ------------------------------------------------------------------------------------------ invariance
    def invariance(self) -> dict:
        """Fixed-shape decode vs decode in exactly k rows, per active-row count k (see the module docstring)."""
        cfg = self.cfg
        ctx, steps, rows_n = cfg.decode_context, cfg.decode_steps, cfg.batch_rows
        fixed_fw = self.forwards["bf16"]
        shape = {k: v for k, v in (("tile_rows", cfg.tile_rows), ("attention_block", cfg.attention_block))
                 if v is not None}
        arena = fixed_fw.new_arena(rows_n, ctx + steps + 1)
        fixed_fw.prefill(arena.row(0), torch.tensor(self.prompt[:ctx], dtype=torch.long), 0, want_logits=False)
        copy_row_prefix(arena, ctx, rows_n)

        def steps_of(fw: FastForward, rows: list[int | None]) -> Callable[[], float]:
            n = len(rows)

            def run() -> float:
                times = []
                for s in range(steps):
                    tokens = torch.full((n,), 7, dtype=torch.long)
                    pos = torch.full((n,), ctx + s, dtype=torch.long)
                    t0 = time.perf_counter()
                    fw.decode(arena, rows, tokens, pos)
                    times.append(time.perf_counter() - t0)
                return _median(times)
            return run

        def pair(k: int) -> dict:
            """k active rows, fixed vs free, interleaved; the free forward (its own prepacked weights) is dropped on
            return, so one extra forward is alive at a time."""
            free_fw = fixed_fw if k == rows_n else FastForward(
                self.loaded, weights=self.ran_as["bf16"], batch_rows=k, max_positions=self.capacity + 1, **shape)
            fixed = _Variant(f"fixed/{k}", steps_of(fixed_fw, [r if r < k else None for r in range(rows_n)]))
            free = _Variant(f"free/{k}", steps_of(free_fw, list(range(k))))
            _interleaved([fixed, free], cfg.decode_reps, self.progress, f"invariance {k} rows")
            ratios = [a / b for a, b in zip(fixed.times, free.times)]
            return {"active_rows": k, "fixed_gemm_rows": fixed_fw.decode_rows_for(k), "free_gemm_rows": k,
                    "fixed_ms": _median(fixed.times) * 1e3, "free_ms": _median(free.times) * 1e3,
                    "fixed_over_free": _median(ratios), "tries": len(ratios)}

        rows = [pair(k) for k in cfg.active_row_counts]
        ratios = [r["fixed_over_free"] for r in rows]
        return {"rows": rows, "geomean_fixed_over_free": math.exp(statistics.fmean(math.log(x) for x in ratios)),
                "max_fixed_over_free": max(ratios), "batch_rows": rows_n, "context": ctx, "weights": "bf16"}

    # -------------------------------------------------------------------------------------------- profile
    def profile(self) -> dict:

        cfg = self.cfg
        fw = self.forwards["bf16"]
        chunk = min(cfg.default_plan, len(self.prompt))
        ids = torch.tensor(self.prompt, dtype=torch.long)
        arena = fw.new_arena(cfg.batch_rows, self.capacity + 1)
        start = min(chunk, len(self.prompt) - chunk)  # a middle step when the prompt has room for one before
        if start:
            fw.prefill(arena.row(0), ids[:start], 0, want_logits=False)
        rows: list[int | None] = [0] + [None] * (cfg.batch_rows - 1)

        def prefill_step() -> None:
            fw.prefill(arena.row(0), ids[start: start + chunk], start)

        def decode_step() -> None:
            pos = torch.full((cfg.batch_rows,), start + chunk, dtype=torch.long)
            fw.decode(arena, rows, torch.zeros(cfg.batch_rows, dtype=torch.long), pos)

        result = {}
        for name, fn, what in (("decode", decode_step, f"one bf16 decode step, 1 active row of {cfg.batch_rows}, "
                                                       f"context {start + chunk}"),
                               ("prefill", prefill_step, f"one bf16 prefill step of {chunk} tokens at position "
                                                         f"{start}")):
            prefill_step()  # both: the prefill writes the context the decode step reads; also a warm-up
            fn()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                fn()
                wall = time.perf_counter() - t0
            events = list(prof.key_averages())
            total = sum(e.self_cpu_time_total for e in events) or 1.0
            top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: cfg.profile_top]
            result[name] = {
                "what": what, "wall_ms": wall * 1e3, "self_cpu_ms_total": total / 1e3,
                "top_ops": [{"op": e.key, "calls": int(e.count), "self_cpu_ms": e.self_cpu_time_total / 1e3,
                             "share": e.self_cpu_time_total / total} for e in top],
            }
        return result

    # ----------------------------------------------------------------------------------------- perplexity
    def perplexity(self) -> dict:

        first = torch.tensor(self.passages[0], dtype=torch.long)
        by_fmt = {}
        for fmt in self.cfg.weight_formats:
            fw = self.forwards[fmt]
            fast_last = fw.prefill(fw.new_arena(1, len(first)).row(0), first, 0)
            res = measure(self.loaded.model, self.passages, self.ran_as[fmt], fast_last)
            by_fmt[fmt] = {"ran_as": self.ran_as[fmt], "perplexity": res.perplexity,
                           "nll_per_token": res.nll_per_token,
                           "fast_last_logits_max_abs_diff": res.fast_last_logits_max_abs_diff}
        base = by_fmt["bf16"]["perplexity"]
        for row in by_fmt.values():
            row["vs_bf16"] = row["perplexity"] / base
        return {"method": METHOD, "passages": len(self.passages), "tokens_per_passage": self.cfg.ppl_tokens,
                "predicted_tokens": sum(len(p) - 1 for p in self.passages), "by_weights": by_fmt}

    # ----------------------------------------------------------------------------------------------- peer
    def _peer(self):
        if getattr(self, "_peer_obj", None) is not None or getattr(self, "_peer_tried", False):
            return getattr(self, "_peer_obj", None)
        self._peer_tried = True
        self._peer_obj = None
        self.peer_skip_reason = None

        if not self.cfg.peer:
            self.peer_skip_reason = "disabled (--no-peer)"
        elif not llamacpp_peer.available():
            self.peer_skip_reason = "llama_cpp is not importable (pip install llama-cpp-python)"
        else:
            gguf = llamacpp_peer.find_gguf(self.cfg.model or self.loaded.source)
            if gguf is None:
                self.peer_skip_reason = "no single-file GGUF behind this model"
            else:
                try:
                    peer = llamacpp_peer.LlamaCppPeer(gguf, threads=torch.get_num_threads(),
                                                      n_ctx=self.capacity + 16)
                except llamacpp_peer.PeerError as exc:
                    self.peer_skip_reason = str(exc)
                else:
                    vocab = len(self.loaded.tokenizer)
                    if peer.n_vocab != vocab and peer.n_vocab != self.loaded.model.config.vocab_size:
                        self.peer_skip_reason = (f"the GGUF vocabulary ({peer.n_vocab}) differs from the "
                                                 f"tokenizer's ({vocab})")
                        peer.close()
                    else:
                        self._peer_obj = peer
        if self.peer_skip_reason:
            log.info("llama.cpp peer skipped: %s", self.peer_skip_reason)
        return self._peer_obj

    def _peer_try(self, fn: Callable[[], float]) -> float:
        """One peer try; a failed worker drops the peer row (with the reason) instead of failing the bench."""

        if self._peer_obj is None:
            return math.nan
        try:
            return fn()
        except PeerError as exc:
            log.warning("llama.cpp peer dropped: %s", exc)
            self.peer_skip_reason = str(exc)
            self._peer_obj.close()
            self._peer_obj = None
            return math.nan

    def _peer_prefill_variant(self) -> _Variant | None:
        peer = self._peer()
        if peer is None:
            return None
        return _Variant("peer", lambda: self._peer_try(lambda: peer.prefill_s(self.prompt)))

    def _peer_decode_variant(self) -> _Variant | None:
        peer = self._peer()
        if peer is None:
            return None
        ctx = self.cfg.decode_context
        token = int(self.prompt[ctx]) if len(self.prompt) > ctx else 0
        self._peer_try(lambda: peer.prepare_decode(self.prompt[:ctx]) or 0.0)
        if self._peer_obj is None:
            return None
        return _Variant("peer", lambda: self._peer_try(
            lambda: _median(peer.decode_steps_s(token, self.cfg.decode_steps))))

    def peer_report(self, decode: list[dict]) -> dict | None:
        peer = getattr(self, "_peer_obj", None)
        if peer is None or self.peer_decode_ms is None or self.peer_prefill_s is None:
            return None
        ms = self.peer_decode_ms
        ours = {r["weights"]: r["ms_per_step"] for r in decode if r["impl"] == "fast" and r["batch"] == 1}
        report = {
            "impl": "llama.cpp", "gguf": peer.gguf.name, "threads": peer.threads, "n_batch": peer.n_batch,
            "prefill": {"tokens": len(self.prompt), "seconds": self.peer_prefill_s,
                        "tokens_per_s": len(self.prompt) / self.peer_prefill_s,
                        "vs_one_shot": self.peer_prefill_s / self.one_shot_s},
            "decode": {"batch": 1, "context": self.cfg.decode_context, "ms_per_step": ms,
                       "tokens_per_s": 1e3 / ms},
            "ours_b1_vs_peer": {fmt: v / ms for fmt, v in ours.items()},
        }
        peer.close()
        return report


def _targets(report: dict) -> dict:
    """The kernel targets (`KERNEL_TARGETS`) with the measured ratio and whether it is met (None: not measured in this run)."""
    dec = {(r["weights"], r["batch"]): r for r in report["decode"] if r["impl"] == "fast"}
    out: dict[str, dict] = {}

    def put(name: str, value: float | None, at_most: bool) -> None:
        limit = TARGETS[name]
        met = None if value is None else (value <= limit if at_most else value >= limit)
        out[name] = {"value": value, ("at_most" if at_most else "at_least"): limit, "met": met}

    b1 = dec.get(("bf16", 1))
    put("decode_bf16_b1_vs_roofline", b1["vs_roofline"] if b1 else None, True)
    plan = next((r for r in report["prefill"] if r["impl"] == "fast" and r["weights"] == "bf16"
                 and r["chunk_size"] == report["config"]["default_plan"]), None)
    put("prefill_default_plan_vs_one_shot", plan["vs_one_shot"] if plan else None, True)
    b8 = dec.get(("bf16", 8))
    put("decode_b8_vs_b1_tokens_per_s", b8["tokens_per_s"] / b1["tokens_per_s"] if b8 and b1 else None, False)
    peer = report.get("peer")
    quant = [peer["ours_b1_vs_peer"][f] for f in ("int4", "int8") if peer and f in peer["ours_b1_vs_peer"]]
    put("decode_quantized_b1_vs_peer", min(quant) if quant else None, True)
    inv = report.get("invariance")
    put("decode_fixed_shapes_vs_free", inv["geomean_fixed_over_free"] if inv else None, True)
    return out


def run_kernel_bench(cfg: KernelBenchConfig, loaded: Any = None, *, progress: bool = True) -> dict:
    """Measure everything (see the module docstring) and return the JSON-ready report. ``loaded``: a
    `LoadedModel` to use instead of loading ``cfg.model``."""

    cfg.validate()
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    try:
        if loaded is None:
            loaded = load_model(cfg.model, dtype=cfg.dtype, device="cpu")
        bench = _Bench(loaded, cfg, progress)
        log.info("kernel bench: %s, %s, %d threads, prompt %d tokens", loaded.name, loaded.dtype,
                 torch.get_num_threads(), len(bench.prompt))
        sections = {}
        for name, section in (("prefill", bench.prefill), ("decode", bench.decode), ("invariance", bench.invariance),
                              ("profile", bench.profile), ("perplexity", bench.perplexity)):
            t0 = time.perf_counter()
            sections[name] = section()
            log.info("kernel bench: %s measured in %.0f s", name, time.perf_counter() - t0)
        prefill, (decode, memory), invariance, profile, perplexity = (
            sections[k] for k in ("prefill", "decode", "invariance", "profile", "perplexity"))
        peer = bench.peer_report(decode)
        report = {
            "roofline_ms": memory["roofline_ms_by_weights"]["bf16"],
            "bandwidth_gb_s": memory["bandwidth_gb_s"],
            "decode": decode, "prefill": prefill, "invariance": invariance, "perplexity": perplexity, "peer": peer,
            "peer_skipped": None if peer is not None else getattr(bench, "peer_skip_reason", None),
            "profile": profile, "memory": memory,
            "config": {**dataclasses.asdict(cfg), "default_plan": cfg.default_plan},
            "environment": {
                "model": loaded.name, "dtype": str(loaded.dtype).replace("torch.", ""), "device": str(loaded.device),
                "plan_id": bench.forwards["bf16"].plan_id,
                "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                "machine": platform.machine(), "load_average_start": list(load_start),
                "load_average_end": list(os.getloadavg()), "wall_s": time.perf_counter() - t_start,
            },
        }
        report["targets"] = _targets(report)
        return report
    finally:
        torch.set_num_threads(threads_before)


# -------------------------------------------------------------------------------------------------- output


def _fmt(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(r) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("---" for _ in headers) + "|")
    return "\n".join(lines)


def _chunk_label(row: dict) -> str:
    if row["chunk_size"] is None:
        return "null (one shot)"
    return f"{row['chunk_size']} (one step)" if row["chunk_size"] >= row["tokens"] else str(row["chunk_size"])


def format_report(report: dict) -> str:
    """The report as Markdown tables (what the CLI prints)."""
    env = report["environment"]
    parts = [f"Kernel bench: {env['model']} {env['dtype']}, {env['threads']} threads, torch {env['torch']}, "
             f"load average {env['load_average_start'][0]:.2f} -> {env['load_average_end'][0]:.2f}, "
             f"{env['wall_s']:.0f} s", ""]
    parts.append("Prefill (medians; vs_one_shot = seconds / transformers one-shot):")
    parts.append(_table(
        ("chunk_size", "impl", "weights", "tokens", "seconds", "tokens/s", "vs_one_shot", "split_invariant"),
        [(_chunk_label(r), r["impl"], r["weights"],
          r["tokens"], _fmt(r["seconds"], ".3f"), _fmt(r["tokens_per_s"], ".0f"), _fmt(r["vs_one_shot"]),
          _fmt(r["split_invariant"])) for r in report["prefill"]]))
    mem = report["memory"]
    parts += ["", f"Memory: copy bandwidth {report['bandwidth_gb_s']:.1f} GB/s (read + write, best of "
                  f"{report['config']['decode_reps'] + 1}; median {mem['bandwidth_median_gb_s']:.1f}); "
                  + ", ".join(f"{k} weights {v / 1e6:.0f} MB -> roofline {mem['roofline_ms_by_weights'][k]:.2f} ms"
                              for k, v in mem["weight_bytes"].items()), ""]
    parts.append(f"Decode (ms per step of a {report['config']['batch_rows']}-row batch, context "
                 f"{report['config']['decode_context']} tokens; gemm_rows: rows its GEMMs run, padding included):")
    parts.append(_table(("batch", "weights", "impl", "gemm_rows", "ms/step", "tokens/s", "vs_roofline"),
                        [(r["batch"], r["weights"], r["impl"], r.get("gemm_rows", "-"), _fmt(r["ms_per_step"], ".1f"),
                          _fmt(r["tokens_per_s"], ".1f"), _fmt(r["vs_roofline"], ".1f")) for r in report["decode"]]))
    inv = report.get("invariance")
    if inv:
        parts += ["", f"Invariance (bf16, context {inv['context']}): the engine's fixed-shape step vs a forward "
                      f"that runs exactly the active rows (non-invariant); fixed_over_free = median of paired ratios; "
                      f"geometric mean {inv['geomean_fixed_over_free']:.3f}, max {inv['max_fixed_over_free']:.3f}:"]
        parts.append(_table(("active rows", "fixed gemm_rows", "fixed ms", "free ms", "fixed_over_free"),
                            [(r["active_rows"], r["fixed_gemm_rows"], _fmt(r["fixed_ms"], ".1f"),
                              _fmt(r["free_ms"], ".1f"), _fmt(r["fixed_over_free"], ".3f")) for r in inv["rows"]]))
    ppl = report["perplexity"]
    parts += ["", f"Perplexity ({ppl['passages']} passages x {ppl['tokens_per_passage']} tokens; {ppl['method']}):"]
    parts.append(_table(("weights", "perplexity", "vs_bf16", "fast vs emulated last logits, max abs diff"),
                        [(k, _fmt(v["perplexity"], ".3f"), _fmt(v["vs_bf16"], ".4f"),
                          _fmt(v["fast_last_logits_max_abs_diff"], ".3g")) for k, v in ppl["by_weights"].items()]))
    peer = report["peer"]
    parts.append("")
    if peer is None:
        parts.append(f"Peer: none ({report.get('peer_skipped')})")
    else:
        parts.append(f"Peer llama.cpp ({peer['gguf']}, {peer['threads']} threads, n_batch {peer['n_batch']}): "
                     f"prefill {peer['prefill']['seconds']:.3f} s ({peer['prefill']['vs_one_shot']:.2f}x one shot), "
                     f"decode {peer['decode']['ms_per_step']:.1f} ms/token; ours at batch 1 / peer: "
                     + ", ".join(f"{k} {v:.2f}x" for k, v in peer["ours_b1_vs_peer"].items()))
    for prof in report["profile"].values():
        parts += ["", f"Profile: {prof['what']} (wall {prof['wall_ms']:.1f} ms, self CPU {prof['self_cpu_ms_total']:.1f}"
                      " ms):"]
        parts.append(_table(("op", "calls", "self CPU ms", "share"),
                            [(o["op"], o["calls"], _fmt(o["self_cpu_ms"], ".2f"), f"{o['share'] * 100:.0f}%")
                             for o in prof["top_ops"]]))
    parts += ["", "Targets:"]
    parts.append(_table(("target", "measured", "limit", "met"),
                        [(k, _fmt(v["value"]), ("<= " if "at_most" in v else ">= ") + str(v.get("at_most",
                          v.get("at_least"))), _fmt(v["met"])) for k, v in report["targets"].items()]))
    return "\n".join(parts)


def check_report(report: dict) -> None:
    """Raise ValueError unless ``report`` has the keys outside tools read, with finite positive figures."""
    def positive(name: str, x: Any) -> None:
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x <= 0:
            raise ValueError(f"{name} must be a finite positive number, got {x!r}")

    positive("roofline_ms", report["roofline_ms"])
    positive("bandwidth_gb_s", report["bandwidth_gb_s"])
    if not report["decode"] or not report["prefill"]:
        raise ValueError("decode and prefill rows must not be empty")
    for r in report["decode"]:
        if not isinstance(r["batch"], int) or not isinstance(r["weights"], str):
            raise ValueError(f"decode row keys have wrong types: {r}")
        for k in ("ms_per_step", "tokens_per_s", "vs_roofline"):
            positive(f"decode {r['weights']}/{r['batch']} {k}", r[k])
    if sum(r["chunk_size"] is None for r in report["prefill"]) != 1:
        raise ValueError("exactly one prefill row must be the one-shot row (chunk_size null)")
    for r in report["prefill"]:
        if r["chunk_size"] is not None and not isinstance(r["chunk_size"], int):
            raise ValueError(f"prefill chunk_size must be an int or null: {r}")
        if not isinstance(r["tokens"], int) or r["tokens"] < 1:
            raise ValueError(f"prefill tokens must be a positive int: {r}")
        for k in ("seconds", "vs_one_shot"):
            positive(f"prefill {r['chunk_size']} {k}", r[k])
    for fmt, row in report["perplexity"]["by_weights"].items():
        positive(f"perplexity {fmt}", row["perplexity"])
    inv = report.get("invariance")
    if inv is not None:
        if not inv.get("rows"):
            raise ValueError("invariance must have rows (or be absent)")
        for r in inv["rows"]:
            for k in ("fixed_ms", "free_ms", "fixed_over_free"):
                positive(f"invariance {r.get('active_rows')} {k}", r[k])
    if report["peer"] is not None and not isinstance(report["peer"], dict):
        raise ValueError("peer must be an object or null")
    if not isinstance(report["profile"], dict) or not report["profile"]:
        raise ValueError("profile must be a non-empty object")


# ----------------------------------------------------------------------------------------------------- CLI


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _formats(text: str) -> tuple[str, ...]:
    fmts = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [f for f in fmts if f not in WEIGHT_FORMATS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown weight formats {bad}; valid: {list(WEIGHT_FORMATS)}")
    return fmts


_OPTIONS = {  # argument name -> KernelBenchConfig field
    "model": "model", "dtype": "dtype", "threads": "threads", "corpus": "corpus", "prompt_tokens": "prompt_tokens",
    "chunk_sizes": "chunk_sizes", "weights": "weight_formats", "reps": "prefill_reps", "decode_reps": "decode_reps",
    "decode_context": "decode_context", "decode_steps": "decode_steps", "batches": "decode_batches",
    "invariance_rows": "invariance_rows", "ppl_passages": "ppl_passages", "ppl_tokens": "ppl_tokens",
    "tile_rows": "tile_rows",
    "attention_block": "attention_block",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    parser.epilog = "\n".join(__doc__.splitlines()[2:])
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--quick", action="store_true", help="tiny preset for tests and CI (well under a minute)")
    parser.add_argument("--json", metavar="PATH", help="write the JSON report here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-peer", action="store_true", help="skip the llama.cpp peer even when importable")
    parser.add_argument("--model", help="model alias or local path (default: the engine's default model)")
    parser.add_argument("--dtype", help="model dtype (default auto, as the engine: bfloat16 on CPUs with native "
                                        "bf16, else float32)")
    parser.add_argument("--threads", type=int, help="torch (and llama.cpp) threads (default: torch's setting)")
    parser.add_argument("--corpus", help="corpus directory or .jsonl (default: the stdlib corpus)")
    parser.add_argument("--prompt-tokens", type=int, help="prefill prompt length (default 1536; quick 160)")
    parser.add_argument("--chunk-sizes", type=_ints, help="prefill step sizes (default 64,128,256,512)")
    parser.add_argument("--weights", type=_formats, help="weight formats of the decode and perplexity rows "
                                                         "(default bf16,int8,int4)")
    parser.add_argument("--reps", type=int, help="prefill repetitions (default 5; quick 2)")
    parser.add_argument("--decode-reps", type=int, help="decode repetitions (default 5; quick 2)")
    parser.add_argument("--decode-context", type=int, help="context tokens per decode row (default 512)")
    parser.add_argument("--decode-steps", type=int, help="timed steps per decode try (default 8)")
    parser.add_argument("--batches", type=_ints, help="decode batch sizes (default 1,4,8)")
    parser.add_argument("--invariance-rows", type=_ints, help="active-row counts of the fixed-shape cost section "
                                                                "(default 1..8; quick 3,8)")
    parser.add_argument("--ppl-passages", type=int, help="perplexity passages (default 8)")
    parser.add_argument("--ppl-tokens", type=int, help="tokens per perplexity passage (default 384)")
    parser.add_argument("--tile-rows", type=int, help="FastForward prefill GEMM rows (default: the forward's)")
    parser.add_argument("--attention-block", type=int,
                        help="FastForward prefill attention block (default: the forward's)")


def config_from_args(args: argparse.Namespace) -> KernelBenchConfig:
    changes = {fld: getattr(args, arg) for arg, fld in _OPTIONS.items() if getattr(args, arg, None) is not None}
    if args.no_peer:
        changes["peer"] = False
    if "weight_formats" in changes:
        changes["prefill_formats"] = changes["weight_formats"]
    cfg = KernelBenchConfig.quick(**changes) if args.quick else dataclasses.replace(KernelBenchConfig(), **changes)
    cfg.validate()
    return cfg


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"pcr-rag bench kernels: {exc}", file=sys.stderr)
        return 2
    report = run_kernel_bench(cfg, progress=not args.no_progress)
    print(format_report(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"json: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcr_rag.bench.kernels")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
