"""The copy engine: moves cached KV into a request's arena row and new KV out of it, layer by layer.

- Loads (`PrefixLoad`): layer i of every matched chunk is copied into the row (from a resident payload, or a
  verified per-layer SSD read), then layer i is marked ready. The compute thread waits only for the layer it is
  about to attend with (`wait_layer`), so layer i computes while layers > i are still loading.
  - CUDA: copies run on a load stream; "ready" is a CUDA event the compute stream waits on.
  - CPU with an SSD source: a worker thread reads and copies; "ready" is a threading event (the worker mostly waits
    on I/O, so it does not compete with the compute threads).
  - CPU with every chunk in memory: the compute thread itself copies layer i right before attending with it (a
    memcpy; a hand-off would cost more than it hides).
- Offloads (`ChunkOffload`): once layer i of a prefill step has written its KV, layer i of every plan chunk that
  this step completes is copied into that chunk's host payload: on an offload stream on CUDA, inline on the CPU
  (a layer of a chunk is a short memcpy, so a worker thread would only steal a core from the GEMMs; see
  docs/measurements-history.md#figures-moved-from-code-comments). `finish()` returns the payloads once every layer
  has landed.

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

from pcr_rag.cache.buffer_pool import BufferPool
from pcr_rag.errors import PrefixLoadError
from pcr_rag.model.kv_arena import RowKV

OpenReader = Callable[[bytes], "LayerReader"]


class LayerReader(Protocol):
    """What `CacheManager.open_layer_reader` returns: verified per-layer reads of one chunk, then close()."""

    def read_layer(self, layer: int, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LoadSource:
    """One matched chunk to load: plan index, key, its span [start, end), its resident payload (None: read it
    from SSD), and ``fill_end``: positions [start, fill_end) are copied (less than the span when the request
    recomputes the chunk's tail)."""

    index: int
    key: bytes
    start: int
    end: int
    payload: torch.Tensor | None
    fill_end: int

    @property
    def fill_tokens(self) -> int:
        return self.fill_end - self.start


@dataclass
class LayerWaits:
    """Seconds the compute thread spent waiting for each layer's loaded KV (summed over requests)."""

    seconds: list[float] = field(default_factory=list)

    def add(self, layer: int, seconds: float) -> None:
        while len(self.seconds) <= layer:
            self.seconds.append(0.0)
        self.seconds[layer] += seconds


class KVCopier:
    """Owns the transfer resources of one device: CUDA streams, or one loader thread on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pcr-load")
        if self.is_cuda:
            self.load_stream = torch.cuda.Stream(device=device)
            self.offload_stream = torch.cuda.Stream(device=device)
        self.waits = LayerWaits()
        self.last_load: PrefixLoad | None = None  # the most recent load (tests and overlap measurements)
        self._closed = False

    def start_load(self, row: RowKV, sources: Sequence[LoadSource], open_reader: OpenReader,
                   *, layerwise: bool) -> PrefixLoad:
        """Begin loading ``sources`` into ``row``; with ``layerwise=False`` the load completes before returning."""
        load = PrefixLoad(self, row, list(sources), open_reader)
        self.last_load = load
        if layerwise and not self.is_cuda and all(s.payload is not None for s in sources):
            load.inline = True
        elif layerwise:
            load.future = self._loader.submit(load.run)
        else:
            load.run()
            load.raise_if_failed()
        return load

    def offload(self, row: RowKV, spans: Sequence[tuple[int, int]],
                buffers: BufferPool | None = None) -> ChunkOffload:
        """Begin copying ``spans`` of ``row`` into new payloads (host buffers from ``buffers`` when given)."""
        return ChunkOffload(self, row, spans, buffers)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loader.shutdown(wait=True)


class PrefixLoad:
    """Layer-wise load of a request's matched prefix. `wait_layer(i)` blocks until layer i is in the row."""

    def __init__(self, engine: KVCopier, row: RowKV, sources: list[LoadSource], open_reader: OpenReader):
        self.engine = engine
        self.row = row
        self.sources = sources
        self.open_reader = open_reader
        self._readers: dict[int, LayerReader] = {}  # plan index -> open SSD reader (file + verified header)
        self._staging: dict[tuple[int, ...], torch.Tensor] = {}  # reused per layer shape: no fresh page faults
        n = row.arena.geometry.num_layers
        self._ready = [threading.Event() for _ in range(n)]
        self._cuda_events: list[torch.cuda.Event | None] = [None] * n
        self._error: PrefixLoadError | None = None
        self._cancelled = False
        self._current_index = 0
        self.future: Future | None = None
        self.bytes_loaded = 0
        self.started_at = time.perf_counter()
        self.ready_at: list[float] = [0.0] * n  # perf_counter() when each layer was fully issued
        self.first_wait_done_at: float | None = None  # when the compute thread got layer 0 (prefill started)
        self.inline = False  # copy layer i on the compute thread inside wait_layer(i) (CPU, memory sources)

    def run(self) -> None:
        stream_ctx = torch.cuda.stream(self.engine.load_stream) if self.engine.is_cuda else nullcontext()
        try:
            with stream_ctx, torch.inference_mode():  # inference mode is per thread; the arena is an inference tensor
                for layer in range(len(self._ready)):
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
            self._fail(PrefixLoadError(self._current_index, exc))
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
                data = reader.read_layer(layer, out=self._staging_for(src.end - src.start))
            except Exception as exc:  # noqa: BLE001
                raise PrefixLoadError(src.index, exc) from exc
        data = data[:, :, : src.fill_tokens]
        self.row.load_payload_layer(layer, src.start, src.fill_end, data, non_blocking=self.engine.is_cuda)
        self.bytes_loaded += data.nbytes

    def _staging_for(self, tokens: int) -> torch.Tensor:
        """A reused host buffer for one layer of a ``tokens``-token chunk (no fresh page faults per read)."""
        geometry = self.row.arena.geometry
        shape = geometry.payload_shape(tokens)[1:]
        staging = self._staging.get(shape)
        if staging is None:
            staging = self._staging[shape] = torch.empty(shape, dtype=geometry.dtype, pin_memory=self.engine.is_cuda)
        elif self.engine.is_cuda:
            torch.cuda.current_stream(self.engine.device).synchronize()  # the previous H2D copy is done
        return staging

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
            except Exception as exc:  # noqa: BLE001 - a memory copy that fails is recomputed, as on the loader thread
                self._fail(PrefixLoadError(self._current_index, exc))
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
        """Stop early and wait for the worker, so nothing writes into the row afterwards."""
        self._cancelled = True
        if self.future is not None:
            self.future.result()
        self._close_readers()


class ChunkOffload:
    """Copies the KV of ``spans`` (each [start, end), complete once this step ends) into host payloads
    ``[layers, 2, kv_heads, tokens, head_dim]``, layer by layer as each layer is written."""

    def __init__(self, engine: KVCopier, row: RowKV, spans: Sequence[tuple[int, int]],
                 buffers: BufferPool | None = None) -> None:
        g = row.arena.geometry
        self.engine = engine
        self.row = row
        self.spans = list(spans)
        # every element of a payload is overwritten (all layers, K and V, every token), so reused buffers are fine
        if buffers is not None and not engine.is_cuda:
            self.payloads = [buffers.take(g.payload_shape(e - s), g.dtype) for s, e in self.spans]
        else:
            self.payloads = [torch.empty(g.payload_shape(e - s), dtype=g.dtype, pin_memory=engine.is_cuda)
                             for s, e in self.spans]

    def after_layer(self, layer: int) -> None:
        if not self.spans:
            return
        if self.engine.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.engine.device))
            with torch.cuda.stream(self.engine.offload_stream):
                self.engine.offload_stream.wait_event(ev)
                self._copy(layer, non_blocking=True)
        else:
            self._copy(layer, non_blocking=False)

    def _copy(self, layer: int, *, non_blocking: bool) -> None:
        for (s, e), payload in zip(self.spans, self.payloads):
            self.row.store_payload_layer(layer, s, e, payload[layer], non_blocking=non_blocking)

    def finish(self) -> list[torch.Tensor]:
        """The payloads, once every layer has been copied."""
        if self.engine.is_cuda and self.spans:
            self.engine.offload_stream.synchronize()
        return self.payloads
