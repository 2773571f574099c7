"""The transformers `Cache` the runner feeds to the model: preallocated per-layer KV with per-layer hooks.

Layout: each layer holds ``keys``/``values`` buffers of shape ``[1, capacity, kv_heads, head_dim]``; the model sees
``buf[:, :n].transpose(1, 2)``, i.e. ``[1, kv_heads, n, head_dim]``. That view's strides do not depend on the
capacity, so two runs with different capacities feed attention bit-identical inputs (the fidelity invariant).

Every layer keeps the full KV, sliding-window layers too (Gemma 3): all layers report ``is_sliding=False``, so the
masking utilities size masks on the full length and enforce the window in the mask function; positions stay right
past the window.

Hooks (`LayerHooks`) run on the compute thread inside `update`, once per layer per forward, in layer order:
``before_layer(i)`` waits until layer i's cached prefix KV is in the buffers (layer-wise loading), and
``after_layer(i, start, end)`` hands layer i's new KV to the offloader as soon as it exists.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from pcr_rag.runtime.model import KVGeometry


class LayerHooks(Protocol):
    def before_layer(self, layer_idx: int) -> None: ...

    def after_layer(self, layer_idx: int, start: int, end: int) -> None: ...


class KVCapacityError(RuntimeError):
    """More tokens were written than the cache was allocated for (a runner bug, never user input)."""


class PCRLayer(CacheLayerMixin):
    """One layer's preallocated KV buffers and fill length (tokens)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        shape = (1, capacity, kv_heads, head_dim)
        self.k_buf = torch.empty(shape, dtype=dtype, device=device)
        self.v_buf = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0
        self.device = device
        self.is_initialized = True
        self._refresh()

    def _refresh(self) -> None:
        self.keys = self.k_buf[:, : self.length].transpose(1, 2)
        self.values = self.v_buf[:, : self.length].transpose(1, 2)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # buffers are allocated up front

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        start, end = self.length, self.length + n
        if end > self.capacity:
            raise KVCapacityError(f"KV cache holds {self.capacity} tokens, asked to write up to {end}")
        self.k_buf[:, start:end].copy_(key_states.transpose(1, 2))
        self.v_buf[:, start:end].copy_(value_states.transpose(1, 2))
        self.length = end
        self._refresh()
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def set_length(self, length: int) -> None:
        if not 0 <= length <= self.capacity:
            raise KVCapacityError(f"length {length} outside [0, {self.capacity}]")
        self.length = length
        self._refresh()

    def crop(self, tokens_to_remove: int) -> None:
        self.set_length(max(0, self.length - abs(tokens_to_remove)))

    def reset(self) -> None:
        self.set_length(0)

    def slot(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer views ``[end-start, kv_heads, head_dim]`` for positions [start, end) (for loads and offloads)."""
        return self.k_buf[0, start:end], self.v_buf[0, start:end]


class PCRKVCache(Cache):
    """A request's KV cache: ``capacity`` tokens per layer, preallocated on the compute device."""

    def __init__(self, geometry: KVGeometry, capacity: int, device: torch.device,
                 hooks: LayerHooks | None = None) -> None:
        layers = [PCRLayer(capacity, geometry.num_kv_heads, geometry.head_dim, geometry.dtype, device)
                  for _ in range(geometry.num_layers)]
        super().__init__(layers=layers)
        self.geometry = geometry
        self.capacity = capacity
        self.hooks = hooks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer: PCRLayer = self.layers[layer_idx]
        hooks = self.hooks
        if hooks is not None:
            hooks.before_layer(layer_idx)
        start = layer.length
        keys, values = layer.update(key_states, value_states)
        if hooks is not None:
            hooks.after_layer(layer_idx, start, layer.length)
        return keys, values

    def set_length(self, length: int) -> None:
        """Declare positions [0, length) filled (by loads that may still be running, waited for in hooks)."""
        for layer in self.layers:
            layer.set_length(length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def layer(self, layer_idx: int) -> PCRLayer:
        return self.layers[layer_idx]

    def chunk_payload(self, start: int, end: int, *, pin_memory: bool = False) -> torch.Tensor:
        """Copy positions [start, end) of every layer into a contiguous ``[layers, 2, kv_heads, n, head_dim]``
        tensor on the host (the cache engine's payload layout)."""
        g = self.geometry
        out = torch.empty((g.num_layers, 2, g.num_kv_heads, end - start, g.head_dim), dtype=g.dtype,
                          pin_memory=pin_memory)
        for i, layer in enumerate(self.layers):
            k, v = layer.slot(start, end)
            out[i, 0].copy_(k.transpose(0, 1))
            out[i, 1].copy_(v.transpose(0, 1))
        return out
