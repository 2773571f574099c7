"""Chunk payloads: a real KV tensor ``[layers, 2, kv_heads, tokens, head_dim]`` or a metadata-only
``VirtualPayload`` (size and layer count, no bytes) for the simulator's GB-TB tiers.

Byte accounting uses ``payload.nbytes`` for both. Dim 0 is the layer, so one layer of a contiguous tensor is a
contiguous slice and can be read from SSD on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Payload", "VirtualPayload", "payload_nbytes", "payload_num_layers", "validate_payload"]


@dataclass(frozen=True)
class VirtualPayload:
    """Metadata-only payload: ``nbytes`` of KV over ``num_layers`` layers, no storage behind it.

    The engine accounts, evicts, writes back and loads it like a tensor, but no bytes are copied or stored
    (the SSD tier keeps only an index entry). ``payload[layer]`` gives the one-layer virtual payload."""

    nbytes: int
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.nbytes < 0 or self.num_layers <= 0:
            raise ValueError(f"VirtualPayload needs nbytes >= 0 and num_layers > 0, got {self}")

    def __getitem__(self, layer: int) -> VirtualPayload:
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        return VirtualPayload(self.nbytes // self.num_layers, 1)


Payload = torch.Tensor | VirtualPayload


def payload_nbytes(payload: Payload) -> int:
    return int(payload.nbytes)


def payload_num_layers(payload: Payload) -> int:
    if isinstance(payload, VirtualPayload):
        return payload.num_layers
    return int(payload.shape[0])


def validate_payload(payload: Payload, num_tokens: int) -> Payload:
    """Check a payload against its chunk; return it (a tensor made contiguous if it was not).

    Raises ``TypeError``/``ValueError`` naming the expected layout."""
    if isinstance(payload, VirtualPayload):
        return payload
    if not isinstance(payload, torch.Tensor):
        raise TypeError(
            f"payload must be a torch.Tensor [layers, 2, kv_heads, tokens, head_dim] or a VirtualPayload, "
            f"got {type(payload).__name__}"
        )
    if payload.dim() != 5 or payload.shape[1] != 2:
        raise ValueError(
            f"payload must have shape [layers, 2, kv_heads, tokens, head_dim], got {tuple(payload.shape)}"
        )
    if payload.shape[3] != num_tokens:
        raise ValueError(f"payload holds {payload.shape[3]} tokens (dim 3) but the chunk has {num_tokens}")
    return payload if payload.is_contiguous() else payload.contiguous()
