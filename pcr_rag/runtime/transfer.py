"""The copy engine: moves cached KV into a request's `PCRKVCache` and new KV out of it, layer by layer.

- Loads (`PrefixLoad`): a worker thread walks layers in order; for layer i it copies layer i of every matched chunk
  into the request's buffers (from a resident payload, or a verified per-layer SSD read) and then marks layer i
  ready. On CUDA the copies are issued on a dedicated load stream and "ready" is a CUDA event the compute stream
  waits on; on the CPU "ready" is a threading event. The compute thread only ever waits for the layer it is about
  to run, so layer i computes while layers > i are still loading.
- Offloads (`ChunkOffload`): as soon as layer i of a step has written its new KV, the copy of that layer into the
  chunk's host payload is queued (an offload stream on CUDA, a worker thread on the CPU); `finish()` returns the
  payload once every layer has landed.

Units: seconds for waits, tokens for positions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pcr_rag.errors import PrefixLoadError
from pcr_rag.runtime.kv_cache import PCRKVCache

OpenReader = Callable[[bytes], "LayerReader"]


class LayerReader(Protocol):
    """What `CacheEngine.open_layer_reader` returns: verified per-layer reads of one chunk, then close()."""

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LoadSource:
    """One matched chunk to load: plan index, key, token span, and its resident payload (None: read from SSD)."""

    index: int
    key: bytes
    start: int
    end: int
    payload: torch.Tensor | None


@dataclass
class LayerWaits:
    """Seconds the compute thread spent waiting for each layer's loaded KV (summed over requests)."""

    seconds: list[float] = field(default_factory=list)

    def add(self, layer: int, seconds: float) -> None:
        while len(self.seconds) <= layer:
            self.seconds.append(0.0)
        self.seconds[layer] += seconds


class CopyEngine:
    """Owns the transfer resources of one device: CUDA streams, or worker threads on the CPU."""

    def __init__(self, device: torch.device, *, workers: int = 2) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pcr-load")
        self._offloader = ThreadPoolExecutor(max_workers=max(1, workers - 1), thread_name_prefix="pcr-offload")
        if self.is_cuda:
            self.load_stream = torch.cuda.Stream(device=device)
            self.offload_stream = torch.cuda.Stream(device=device)
        self.waits = LayerWaits()
        self.last_load: PrefixLoad | None = None
        self._closed = False

    def start_load(self, kv: PCRKVCache, sources: Sequence[LoadSource], open_reader: OpenReader,
                   *, layerwise: bool) -> PrefixLoad:
        """Begin loading ``sources`` into ``kv``; with ``layerwise=False`` the load completes before returning."""
        load = PrefixLoad(self, kv, list(sources), open_reader)
        self.last_load = load
        if layerwise and not self.is_cuda and all(s.payload is not None for s in sources):
            # CPU, everything in memory: layer i's copy is a memcpy best done by the compute thread right before
            # layer i runs (no hand-off to a worker, data hot in cache); see PrefixLoad.inline.
            load.inline = True
        elif layerwise:
            load.future = self._loader.submit(load.run)
        else:
            load.run()
            load.raise_if_failed()
        return load

    def offload(self, kv: PCRKVCache, start: int, end: int, *, layerwise: bool) -> ChunkOffload:
        return ChunkOffload(self, kv, start, end, layerwise=layerwise)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loader.shutdown(wait=True)
            self._offloader.shutdown(wait=True)


class PrefixLoad:
    """Layer-wise load of a request's matched prefix. `wait_layer(i)` blocks until layer i is in the buffers."""

    def __init__(self, engine: CopyEngine, kv: PCRKVCache, sources: list[LoadSource], open_reader: OpenReader):
        self.engine = engine
        self.kv = kv
        self.sources = sources
        self.open_reader = open_reader
        self._readers: dict[int, LayerReader] = {}  # plan index -> open SSD reader (file + verified header)
        self._staging: dict[tuple[int, ...], torch.Tensor] = {}  # reused per layer shape: no fresh page faults
        n = kv.geometry.num_layers
        self._ready = [threading.Event() for _ in range(n)]
        self._cuda_events: list[torch.cuda.Event | None] = [None] * n
        self._error: PrefixLoadError | None = None
        self._cancelled = False
        self.future: Future | None = None
        self.bytes_loaded = 0
        self.started_at = time.perf_counter()
        self.ready_at: list[float] = [0.0] * n  # perf_counter() when each layer was fully issued
        self.first_wait_done_at: float | None = None  # when the compute thread got layer 0 (prefill started)
        self.inline = False  # copy layer i on the compute thread inside wait_layer(i) (CPU, memory sources)

    def run(self) -> None:
        stream_ctx = torch.cuda.stream(self.engine.load_stream) if self.engine.is_cuda else nullcontext()
        try:
            with stream_ctx, torch.inference_mode():  # inference mode is per thread; the buffers are inference tensors
                for layer in range(self.kv.geometry.num_layers):
                    for src in self.sources:
                        if self._cancelled:
                            raise PrefixLoadError(src.index, RuntimeError("load cancelled"))
                        self._copy_layer(src, layer)
                    if self.engine.is_cuda:
                        ev = torch.cuda.Event()
                        ev.record(self.engine.load_stream)
                        self._cuda_events[layer] = ev
                    self.ready_at[layer] = time.perf_counter()
                    self._ready[layer].set()
        except PrefixLoadError as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - any failure becomes a recompute, never a wrong answer
            index = self._current_index if hasattr(self, "_current_index") else 0
            self._fail(PrefixLoadError(index, exc))
        finally:
            self._close_readers()

    def _close_readers(self) -> None:
        readers, self._readers = self._readers, {}
        for r in readers.values():
            try:
                r.close()
            except Exception:  # noqa: BLE001
                pass

    def _copy_layer(self, src: LoadSource, layer: int) -> None:
        self._current_index = src.index
        if src.payload is not None:
            data = src.payload[layer]
        else:
            try:
                reader = self._readers.get(src.index)
                if reader is None:
                    reader = self._readers[src.index] = self.open_reader(src.key)
                shape = self.kv.geometry.payload_shape(src.end - src.start)[1:]
                staging = self._staging.get(shape)
                if staging is None:
                    staging = self._staging[shape] = torch.empty(shape, dtype=self.kv.geometry.dtype,
                                                                 pin_memory=self.engine.is_cuda)
                elif self.engine.is_cuda:
                    torch.cuda.current_stream(self.engine.device).synchronize()  # previous H2D copy done
                data = reader.read_layer(layer, out=staging)
            except Exception as exc:  # noqa: BLE001
                raise PrefixLoadError(src.index, exc) from exc
        k_dst, v_dst = self.kv.layer(layer).slot(src.start, src.end)
        non_blocking = self.engine.is_cuda
        k_dst.copy_(data[0].transpose(0, 1), non_blocking=non_blocking)
        v_dst.copy_(data[1].transpose(0, 1), non_blocking=non_blocking)
        self.bytes_loaded += data.nbytes

    def _fail(self, exc: PrefixLoadError) -> None:
        self._error = exc
        for ev in self._ready:
            ev.set()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def wait_layer(self, layer: int) -> float:
        """Block until layer ``layer`` is loaded; returns seconds waited. Raises `PrefixLoadError` on failure."""
        t0 = time.perf_counter()
        if self.inline and not self._ready[layer].is_set():
            try:
                for src in self.sources:
                    self._copy_layer(src, layer)
            except PrefixLoadError as exc:
                self._fail(exc)
            self.ready_at[layer] = time.perf_counter()
            self._ready[layer].set()
        self._ready[layer].wait()
        self.raise_if_failed()
        ev = self._cuda_events[layer]
        if ev is not None:
            torch.cuda.current_stream(self.engine.device).wait_event(ev)
        now = time.perf_counter()
        if layer == 0 and self.first_wait_done_at is None:
            self.first_wait_done_at = now
        waited = now - t0
        self.engine.waits.add(layer, waited)
        return waited

    def wait_all(self) -> None:
        for layer in range(len(self._ready)):
            self.wait_layer(layer)

    def cancel(self) -> None:
        """Stop early and wait for the worker, so nothing writes into the buffers afterwards."""
        self._cancelled = True
        if self.future is not None:
            self.future.result()


class ChunkOffload:
    """Copies one step's new KV (positions [start, end)) into a contiguous host payload, layer by layer."""

    def __init__(self, engine: CopyEngine, kv: PCRKVCache, start: int, end: int, *, layerwise: bool) -> None:
        g = kv.geometry
        self.engine = engine
        self.kv = kv
        self.start, self.end = start, end
        self.layerwise = layerwise
        self.payload = torch.empty((g.num_layers, 2, g.num_kv_heads, end - start, g.head_dim), dtype=g.dtype,
                                   pin_memory=engine.is_cuda)
        self._futures: list[Future] = []

    def _copy(self, layer: int) -> None:
        k, v = self.kv.layer(layer).slot(self.start, self.end)
        nb = self.engine.is_cuda
        with torch.inference_mode():  # may run on a worker thread; inference mode is per thread
            self.payload[layer, 0].copy_(k.transpose(0, 1), non_blocking=nb)
            self.payload[layer, 1].copy_(v.transpose(0, 1), non_blocking=nb)

    def after_layer(self, layer: int) -> None:
        if not self.layerwise:
            return
        if self.engine.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.engine.device))
            with torch.cuda.stream(self.engine.offload_stream):
                self.engine.offload_stream.wait_event(ev)
                self._copy(layer)
        else:
            self._futures.append(self.engine._offloader.submit(self._copy, layer))

    def finish(self) -> torch.Tensor:
        """The payload ``[layers, 2, kv_heads, tokens, head_dim]`` once all layers have been copied."""
        if not self.layerwise:
            for layer in range(self.kv.geometry.num_layers):
                self._copy(layer)
            if self.engine.is_cuda:
                torch.cuda.current_stream(self.engine.device).synchronize()
        elif self.engine.is_cuda:
            self.engine.offload_stream.synchronize()
        else:
            for fut in self._futures:
                fut.result()
        return self.payload


class StepHooks:
    """`LayerHooks` for one forward step: wait for the prefix load (first computed step) and offload new KV."""

    def __init__(self, load: PrefixLoad | None, offload: ChunkOffload | None) -> None:
        self.load = load
        self.offload = offload

    def before_layer(self, layer_idx: int) -> None:
        if self.load is not None:
            self.load.wait_layer(layer_idx)

    def after_layer(self, layer_idx: int, start: int, end: int) -> None:
        if self.offload is not None:
            self.offload.after_layer(layer_idx)
