"""`pcr-rag profile`: measure a cost-model profile on this machine with a model, for `pcr-rag simulate`.

What is measured (medians of repeated timings, seconds and bytes/s):

- prefill: forward steps of ``c`` new tokens after ``p`` cached ones through the runtime's own forward
  (`FastForward.prefill` on a KV arena row, as the runner runs them), timed per layer with its layer hooks; a least-squares
  fit gives ``layer_s_fixed + layer_s_per_token * c + layer_s_per_token_ctx * (c p + c (c+1) / 2)`` per layer
  and ``step_s_fixed`` for what runs outside the layers (embeddings, norm, LM head);
- decode: one-token steps at several context lengths (the fixed-shape decode forward of the engine's
  ``max_active`` rows with one active, argmax, detokenisation, as the executor does), then with every row active
  (what each more decoding row adds to a step);
- host copies: a chunk's KV copied into a request's cache and out again (``h2d``/``d2h``: on a CPU "device"
  both are memory copies);
- disk: sequential write with fdatasync and the latency of small reads; the read speed is the SSD tier's own layer
  reads (`SSDStore.read_layer` of this model's chunks, page cache dropped, every layer verified: what a prefix load
  runs), the raw sequential read kept in ``derivation``;
- request overhead: a few real `PCREngine` requests without cache; each one's TTFT minus its own prefill steps
  (both timed in that request) is the per-request cost outside the model (hand-offs, the executor's loop, the
  first token's choice).

On a CPU the model's "device" is host memory: the profile says ``device_is_host``, ``prefill_steps="engine"``
(the runtime's fixed-size steps) and ``loads_share_compute`` (loads and offloads run on the cores the forward
uses, so they add to its time).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pcr_rag.bench.disk import evict_from_page_cache
from pcr_rag.cache import LocalDirBackend, chunk_key, namespace_key
from pcr_rag.cache.tiers.chunk_file import ChunkMeta
from pcr_rag.cache.tiers.ssd_store import SSDStore
from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.model.forward import FastForward
from pcr_rag.model.model import load_model
from pcr_rag.sim.profiles import Profile
from pcr_rag.sim.systems import engine_default

log = logging.getLogger(__name__)


class ProfilingError(RuntimeError):
    """A measurement could not be taken (the message says which and why)."""


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class StepSample:
    new_tokens: int
    context_tokens: int
    total_s: float
    layers_s: float  # first layer hook -> last layer hook, i.e. (L - 1) layers


class _LayerClock:
    """`LayerHooks` that stamp the time as each layer finishes."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def before_attention(self, layer: int) -> None:
        return None

    def after_layer(self, layer: int, start: int, end: int) -> None:
        self.stamps.append(time.perf_counter())


def measure_prefill(loaded: Any, *, new_tokens: Sequence[int] = (64, 128, 256),
                    contexts: Sequence[int] = (0, 256, 768), reps: int = 3, seed: int = 0) -> list[StepSample]:
    """Time `FastForward.prefill` steps of ``c`` tokens after ``p`` tokens already in the row (per-layer stamps)."""
    forward = FastForward(loaded, batch_rows=1)
    vocab = int(getattr(loaded.model.config, "vocab_size", 1000))
    gen = torch.Generator().manual_seed(seed)
    max_ctx = max(contexts) + max(new_tokens)
    ids = torch.randint(0, vocab, (max_ctx,), generator=gen)
    row = forward.new_arena(1, max_ctx).row(0)
    samples: list[StepSample] = []
    for p in contexts:
        if p:
            forward.prefill(row, ids[:p], 0, want_logits=False)
        for c in new_tokens:
            totals, layers = [], []
            for _ in range(max(1, reps)):
                clock = _LayerClock()
                t0 = time.perf_counter()
                logits = forward.prefill(row, ids[p:p + c], p, hooks=clock)
                int(torch.argmax(logits).item())
                totals.append(time.perf_counter() - t0)
                layers.append(clock.stamps[-1] - clock.stamps[0] if len(clock.stamps) > 1 else 0.0)
            samples.append(StepSample(c, p, statistics.median(totals), statistics.median(layers)))
    return samples


def fit_prefill(samples: Sequence[StepSample], num_layers: int) -> dict[str, float]:
    """Least squares per layer: ``layer = fixed + a c + b (c p + c (c+1)/2)`` (coefficients clipped at 0), and
    ``step_s_fixed`` = mean of what the layers do not explain."""
    if num_layers < 2:
        raise ProfilingError("per-layer timing needs a model with at least 2 layers")
    x = np.array([[1.0, s.new_tokens, s.new_tokens * s.context_tokens + s.new_tokens * (s.new_tokens + 1) / 2]
                  for s in samples])
    y = np.array([s.layers_s / (num_layers - 1) for s in samples])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    per_layer = x @ coef
    rest = [s.total_s - num_layers * pl for s, pl in zip(samples, per_layer, strict=True)]
    return {"layer_s_fixed": float(coef[0]), "layer_s_per_token": float(coef[1]),
            "layer_s_per_token_ctx": float(coef[2]), "step_s_fixed": max(0.0, float(statistics.fmean(rest)))}


def measure_decode(loaded: Any, *, contexts: Sequence[int] = (128, 512, 1024), steps: int = 8,
                   batch_rows: int | None = None, seed: int = 0) -> dict[str, float]:
    """Decode steps as the runner runs them (one fixed-shape decode forward over ``batch_rows`` rows - the engine's
    ``max_active`` by default - then argmax and detokenise per active row). One active row at several contexts
    fits base + per context; every row active at the first context gives the cost of each row after the first
    (``decode_s_per_row``: that row's own attention and row work; the weights are read once per step)."""
    tok = loaded.tokenizer
    rows = int(batch_rows or engine_default("max_active"))
    forward = FastForward(loaded, batch_rows=rows)
    vocab = int(getattr(loaded.model.config, "vocab_size", 1000))
    gen = torch.Generator().manual_seed(seed)
    arena = forward.new_arena(rows, max(contexts) + steps + 1)

    def steps_s(ctx: int, active: int) -> float:
        """Median seconds of a decode step with rows [0, active) at context ``ctx`` (prefilled with random ids)."""
        logits = []
        for r in range(active):
            ids = torch.randint(0, vocab, (ctx,), generator=gen)
            logits.append(forward.prefill(arena.row(r), ids, 0))
        tokens: list[list[int]] = [[] for _ in range(active)]
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            batch = torch.zeros(rows, dtype=torch.long)
            for r in range(active):
                t = int(torch.argmax(logits[r]).item())
                tokens[r].append(t)
                batch[r] = t
                if tok is not None:
                    tok.decode(tokens[r], skip_special_tokens=True)
            out = forward.decode(arena, [r if r < active else None for r in range(rows)], batch,
                                 torch.full((rows,), ctx + i, dtype=torch.long))
            logits = [out[r] for r in range(active)]
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    pts = [(ctx, steps_s(ctx, 1)) for ctx in contexts]
    x = np.array([[1.0, c] for c, _ in pts])
    y = np.array([t for _, t in pts])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    base, per_ctx = float(max(coef[0], 0.0)), float(max(coef[1], 0.0))
    if base == 0.0:
        base = float(min(y))
    per_row = 0.0
    if rows > 1:  # every row at the first context: rows x ctx tokens of KV read, rows - 1 more rows of work
        full = steps_s(contexts[0], rows)
        per_row = max(0.0, (full - base - per_ctx * rows * contexts[0]) / (rows - 1))
    return {"decode_s_per_token": base, "decode_s_per_token_ctx": per_ctx, "decode_s_per_row": per_row}


def measure_store_reads(loaded: Any, directory: str | Path, *, chunks: int = 4, tokens: int = 256,
                        reps: int = 3) -> dict[str, float]:
    """Bytes/s of the SSD tier's own layer reads, as a prefix load runs them: chunks of this model's KV written by
    `SSDStore` (page cache dropped), then every layer of every chunk read back with `SSDStore.read_layer` (each
    layer verified against its checksum). The median of ``reps`` rounds; the files are removed."""
    work = Path(tempfile.mkdtemp(prefix="pcr-profile-store-", dir=directory))
    payload = torch.randn(loaded.kv.payload_shape(tokens)).to(loaded.kv.dtype)
    speeds = []
    try:
        for r in range(reps):
            store = SSDStore(LocalDirBackend(work / str(r), fsync=False, drop_page_cache=True))
            parent = namespace_key("profile", str(loaded.kv.dtype), tokens)
            keys = []
            for i in range(chunks):
                key = chunk_key(parent, (r, i))
                store.write(ChunkMeta(key, parent, i == 0, tokens, False, b"\x00" * 16), payload)
                keys.append(key)
                parent = key
            t0 = time.perf_counter()
            for key in keys:
                for layer in range(loaded.kv.num_layers):
                    store.read_layer(key, layer)
            speeds.append(payload.nbytes * chunks / (time.perf_counter() - t0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"ssd_read_bytes_per_s": statistics.median(speeds)}


def measure_copies(loaded: Any, *, tokens: int = 256, reps: int = 5) -> dict[str, float]:
    """Bytes/s of moving one chunk's KV into a request's arena row (load) and out into a payload (offload), with
    the runtime's own tensors and copy ops."""
    g = loaded.kv
    row = FastForward(loaded, batch_rows=1).new_arena(1, 2 * tokens).row(0)
    payload = torch.randn(g.payload_shape(tokens)).to(g.dtype)
    nbytes = g.payload_bytes(tokens)

    def load() -> None:
        for i in range(g.num_layers):
            row.load_payload_layer(i, 0, tokens, payload[i])

    load()
    h2d = nbytes / _median_time(load, reps)
    d2h = nbytes / _median_time(lambda: row.chunk_payload(0, tokens), reps)
    return {"h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h}


def measure_disk(directory: str | Path, *, nbytes: int = 256 << 20, block: int = 8 << 20, small_reads: int = 64,
                 seed: int = 0) -> dict[str, float]:
    """Sequential write (fdatasync) and read (page cache dropped) bandwidth, and small-read latency, in
    ``directory``; the test file is removed."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(d).free < 2 * nbytes:
        raise ProfilingError(f"not enough free space in {d} for a {nbytes >> 20} MiB disk test; use --dir")
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 256, size=block, dtype=np.uint8).tobytes()
    fd, name = tempfile.mkstemp(prefix="pcr-profile-", dir=d)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, buf)
        os.fdatasync(fd)
        write_bw = written / (time.perf_counter() - t0)
        evict_from_page_cache(fd)
        t0 = time.perf_counter()
        got = 0
        while got < written:
            chunk = os.pread(fd, block, got)
            if not chunk:
                break
            got += len(chunk)
        read_bw = got / (time.perf_counter() - t0)
        evict_from_page_cache(fd)
        lat = []
        for off in rng.integers(0, max(1, written - 65536), size=small_reads):
            aligned = int(off) & ~4095
            t0 = time.perf_counter()
            os.pread(fd, 4096, aligned)
            lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        os.write(fd, buf[:4096])
        os.fdatasync(fd)
        write_lat = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(name)
    return {"ssd_write_bytes_per_s": write_bw, "ssd_read_bytes_per_s": read_bw,
            "ssd_read_latency_s": statistics.median(lat), "ssd_write_latency_s": write_lat}


def measure_request_overhead(loaded: Any, *, chunk_size: int = 256, reps: int = 3,
                             documents: Sequence[str] | None = None) -> float:
    """Per-request seconds outside the model: a real no-cache `PCREngine` request's TTFT minus its own prefill
    steps (`RequestMetrics.prefill_compute_s`), both timed within the same request - queueing hand-off, the
    executor's loop between steps, the first token's choice and emission. Median over ``reps`` (after one warm-up
    request), floored at 0. (An earlier estimator subtracted a second, direct run of the same steps: two
    seconds-long timings whose difference was mostly noise, larger than the overhead itself.)"""
    cfg = EngineConfig(enable_cache=False, chunk_size=chunk_size, device="cpu", max_new_tokens=1,
                       dtype=loaded.dtype, cache_dir=tempfile.mkdtemp(prefix="pcr-profile-engine-"))
    # default: three ~300-token passages, the bench's default prompt size
    docs = list(documents) if documents is not None else [
        " ".join(f"{w}{i}" for i in range(100)) for w in ("alpha", "beta", "gamma")]
    gaps = []
    try:
        with PCREngine(model=loaded.model, tokenizer=loaded.tokenizer, config=cfg) as eng:
            for i in range(reps + 1):
                m = eng.generate(f"question {i}?", documents=docs, max_new_tokens=1).metrics
                if i > 0:  # the first request warms up
                    gaps.append(m.ttft_s - m.prefill_compute_s)
    finally:
        shutil.rmtree(cfg.cache_dir, ignore_errors=True)
    return max(0.0, statistics.median(gaps))


def build_profile(loaded: Any, *, name: str, disk_dir: str | Path, quick: bool = False,
                  with_engine: bool = True, say: Callable[[str], None] = lambda _m: None) -> Profile:
    """Measure everything and assemble a `Profile` (see the module docstring)."""
    reps = 2 if quick else 3
    say("prefill steps ...")
    samples = measure_prefill(loaded, new_tokens=(32, 128, 256) if quick else (32, 128, 256),
                              contexts=(0, 512) if quick else (0, 256, 512, 1024), reps=reps)
    fit = fit_prefill(samples, loaded.kv.num_layers)
    say("decode steps ...")
    dec = measure_decode(loaded, contexts=(64, 256) if quick else (128, 512, 1024), steps=4 if quick else 8)
    say("host copies ...")
    cp = measure_copies(loaded, reps=reps)
    say(f"disk in {disk_dir} ...")
    disk = measure_disk(disk_dir, nbytes=(32 << 20) if quick else (256 << 20))
    raw_read = disk["ssd_read_bytes_per_s"]
    disk.update(measure_store_reads(loaded, disk_dir, chunks=2 if quick else 4, reps=reps))
    overhead = 0.0
    if with_engine:
        say("request overhead (real PCREngine, no cache) ...")
        overhead = measure_request_overhead(loaded, reps=2 if quick else 3)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return Profile(
        name=name,
        description=f"{loaded.name} ({str(loaded.dtype).replace('torch.', '')}) measured on {loaded.device} of "
                    f"this machine",
        model=str(loaded.name),
        num_layers=loaded.kv.num_layers,
        kv_bytes_per_token=loaded.kv.bytes_per_token,
        **fit,
        **dec,
        **cp,
        **disk,
        device_kv_bytes=0.0,
        dram_bytes=float(mem),
        ssd_bytes=float(shutil.disk_usage(disk_dir).free),
        layer_sync_s=0.0,
        request_overhead_s=overhead,
        device_is_host=loaded.device.type == "cpu",
        loads_share_compute=loaded.device.type == "cpu",
        prefill_steps="engine",
        source="measured",
        derivation={"prefill_samples": [s.__dict__ for s in samples], "torch_threads": torch.get_num_threads(),
                    "cpus": os.cpu_count(), "fingerprint": getattr(loaded, "fingerprint", ""),
                    "raw_disk_read_bytes_per_s": raw_read},
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model alias or local HF directory (default: the default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: CPUs - 1, like bench)")
    parser.add_argument("--out", default="results/profile-local.json", help="where to write the profile JSON")
    parser.add_argument("--name", default="local", help="profile name")
    parser.add_argument("--dir", default=None, help="directory for the disk test (default: the temp directory)")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller measurements")
    parser.add_argument("--no-engine", action="store_true", help="skip the real-engine request-overhead test")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    try:
        loaded = load_model(args.model, dtype=args.dtype, device="cpu")
        prof = build_profile(loaded, name=args.name, disk_dir=args.dir or tempfile.gettempdir(), quick=args.quick,
                             with_engine=not args.no_engine, say=lambda m: print(m, flush=True))
    except (ProfilingError, OSError) as exc:
        print(f"pcr-rag profile: {exc}", file=sys.stderr)
        return 1
    path = prof.save(args.out)
    print(prof.to_json())
    print(f"profile written to {path}; use it with `pcr-rag simulate --profile {path}`")
    return 0
