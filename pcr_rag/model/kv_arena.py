"""The KV arena: one preallocated KV buffer per layer, cut into fixed rows (one per running request).

Layout per layer: ``k[l]`` and ``v[l]`` are ``[rows + 1, kv_heads, row_capacity, head_dim]`` in the KV dtype. Row
``rows`` is a scratch row that padding rows of the fixed-shape decode batch write into. A request holds one row
from admission to its last token; its positions ``[0, n)`` are its prompt and generated tokens.

Invariants:
- Every row has the same capacity and strides, so a view ``k[l][row, :, a:b]`` has the same strides for every
  row and every request (attention inputs never depend on which row a request got).
- Positions a kernel may read but that hold no KV yet (the masked tail of an attention block) are finite: before
  a prefill step reads them, the positions it computes and the rest of their last block are zero-filled where
  never written (`ensure_finite`), so masked scores never meet NaN. Positions below the step's start are left
  alone: they hold computed KV or are arriving from a load running on another thread.
- A chunk payload ``[layers, 2, kv_heads, tokens, head_dim]`` maps onto ``k[l][row, :, start:end]`` without a
  transpose (same head-major order), so loads and offloads are plain strided copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pcr_rag.model.model import KVGeometry


class KVCapacityError(RuntimeError):
    """More tokens than a row holds (the engine checks prompt + max_new_tokens against the capacity first)."""


@dataclass(frozen=True)
class RowKV:
    """One request's row in the arena: views by layer and position."""

    arena: KVArena
    row: int

    def keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        """``[kv_heads, end - start, head_dim]`` view of the keys at positions [start, end)."""
        return self.arena.k[layer][self.row, :, start:end]

    def values(self, layer: int, start: int, end: int) -> torch.Tensor:
        return self.arena.v[layer][self.row, :, start:end]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` at positions [start, start + n)."""
        end = start + k.shape[0]
        if end > self.arena.row_capacity:
            raise KVCapacityError(f"a KV row holds {self.arena.row_capacity} tokens, asked to write up to {end}")
        self.arena.k[layer][self.row, :, start:end].copy_(k.transpose(0, 1))
        self.arena.v[layer][self.row, :, start:end].copy_(v.transpose(0, 1))

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` at ``positions`` (n ascending positions, a scattered
        prefill step of blend mode)."""
        if int(positions[-1]) >= self.arena.row_capacity:
            raise KVCapacityError(f"a KV row holds {self.arena.row_capacity} tokens, asked to write at "
                                  f"{int(positions[-1])}")
        self.arena.k[layer][self.row, :, positions] = k.transpose(0, 1)
        self.arena.v[layer][self.row, :, positions] = v.transpose(0, 1)

    def load_payload_layer(self, layer: int, start: int, end: int, data: torch.Tensor,
                           non_blocking: bool = False) -> None:
        """Copy one layer of a chunk payload (``data [2, kv_heads, end - start, head_dim]``) into the row."""
        self.arena.k[layer][self.row, :, start:end].copy_(data[0], non_blocking=non_blocking)
        self.arena.v[layer][self.row, :, start:end].copy_(data[1], non_blocking=non_blocking)

    def store_payload_layer(self, layer: int, start: int, end: int, out: torch.Tensor,
                            non_blocking: bool = False) -> None:
        """Copy positions [start, end) of one layer into ``out [2, kv_heads, end - start, head_dim]``."""
        out[0].copy_(self.arena.k[layer][self.row, :, start:end], non_blocking=non_blocking)
        out[1].copy_(self.arena.v[layer][self.row, :, start:end], non_blocking=non_blocking)

    def chunk_payload(self, start: int, end: int, *, pin_memory: bool = False) -> torch.Tensor:
        """A host copy ``[layers, 2, kv_heads, end - start, head_dim]`` of positions [start, end)."""
        g = self.arena.geometry
        out = torch.empty(g.payload_shape(end - start), dtype=g.dtype, pin_memory=pin_memory)
        for layer in range(g.num_layers):
            self.store_payload_layer(layer, start, end, out[layer])
        return out

    def ensure_finite(self, start: int, end: int) -> None:
        """Zero-fill positions in [start, end) that were never written (so masked reads see finite values).
        Positions below ``start`` are never touched: they may be arriving from a concurrent load."""
        self.arena.ensure_finite(self.row, start, end)


class KVArena:
    """``rows`` request rows of ``row_capacity`` tokens each (plus one scratch row), per layer, on ``device``."""

    def __init__(self, geometry: KVGeometry, rows: int, row_capacity: int, device: torch.device) -> None:
        if rows < 1 or row_capacity < 1:
            raise ValueError(f"rows and row_capacity must be >= 1, got {rows}, {row_capacity}")
        self.geometry = geometry
        self.rows = rows
        self.row_capacity = row_capacity
        self.device = device
        shape = (rows + 1, geometry.num_kv_heads, row_capacity, geometry.head_dim)
        # empty, not zeros: pages are touched only as rows fill (see ensure_finite for the masked-read invariant)
        self.k = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.num_layers)]
        self.v = [torch.empty(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.num_layers)]
        self._finite_upto = [0] * (rows + 1)  # per row: positions [0, n) hold finite values
        self.ensure_finite(rows, 0, 1)  # the scratch row: padding rows attend to its position 0

    @property
    def scratch_row(self) -> int:
        return self.rows

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def row(self, index: int) -> RowKV:
        if not 0 <= index <= self.rows:
            raise IndexError(f"row {index} outside [0, {self.rows}]")
        return RowKV(self, index)

    def ensure_finite(self, row: int, start: int, end: int) -> None:
        end = min(end, self.row_capacity)
        start = max(start, self._finite_upto[row])
        if end <= start:
            return
        for t in (*self.k, *self.v):
            t[row, :, start:end].zero_()
        self._finite_upto[row] = end
