"""Move cached keys to new positions: rotate post-rotary keys by a position delta (blend mode's placement).

The KV cache holds keys after the rotary embedding, ``k_p = R(p) k``. A key computed at position ``p`` and needed at
``p + delta`` is ``R(p + delta) k = R(delta) k_p``: a rotation of each (i, i + D/2) pair by ``delta * theta_i``.

Invariants:
- The rotation runs in float32 on the keys as stored, with tables built for ``delta`` itself by the model's own
  rotary module in float32 and *unscaled* (a rotary kind that multiplies its cos/sin by an attention factor, such
  as YaRN, is divided back to a pure rotation: each pair's amplitude is 1), then rounds once to the KV dtype. So a
  placed key differs from a freshly computed one by one extra rounding of the KV dtype (bf16: not bit-equal; the
  tests state the tolerance), never by a rescale.
- Each rotary kind has its own table (Gemma 3's sliding and full layers use different bases).
- ``delta == 0`` returns the keys unchanged (no rounding at all).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

_TABLES_KEPT = 256  # (kind, delta) rotation tables kept; a document's placement uses one per rotary kind


class RopeShift:
    """Rotation tables per (rotary kind, delta) from the model's rotary module, and the rotation itself."""

    def __init__(self, rotary: Any, *, per_kind: bool, device: torch.device) -> None:
        """``rotary``: the model's rotary module (called as ``rotary(x, positions[, kind])``); ``per_kind``: it
        takes the layer's rotary kind as a third argument (Gemma 3)."""
        self._rotary = rotary
        self._per_kind = per_kind
        self._device = device
        self._tables: OrderedDict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    @torch.inference_mode()
    def table(self, kind: str, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` float32 ``[head_dim]`` of a pure rotation by ``delta`` positions (signed sin:
        ``[-sin1, sin2]``, the forward's convention, so ``k * cos + swap_halves(k) * signed_sin`` rotates)."""
        key = (kind, delta)
        hit = self._tables.get(key)
        if hit is not None:
            self._tables.move_to_end(key)
            return hit
        probe = torch.zeros(1, dtype=torch.float32, device=self._device)
        positions = torch.tensor([[abs(delta)]], dtype=torch.long, device=self._device)
        c, s = self._rotary(probe, positions, kind) if self._per_kind else self._rotary(probe, positions)
        c, s = c[0, 0].float(), s[0, 0].float()
        amplitude = torch.sqrt(c * c + s * s)  # 1 for a plain rotary table; the attention factor otherwise
        c, s = c / amplitude, s / amplitude
        if delta < 0:
            s = -s  # R(-d) = R(d)^T
        half = s.shape[-1] // 2
        out = (c.contiguous(), torch.cat((-s[:half], s[half:])).contiguous())
        self._tables[key] = out
        if len(self._tables) > _TABLES_KEPT:
            self._tables.popitem(last=False)
        return out

    @torch.inference_mode()
    def shift(self, keys: torch.Tensor, kind: str, delta: int) -> torch.Tensor:
        """``keys`` (``[..., head_dim]``, post-rotary, any float dtype) moved by ``delta`` positions, in the same
        dtype: rotated in float32, rounded once."""
        if delta == 0:
            return keys
        cos, sin = self.table(kind, delta)
        k = keys.float()
        rotated = k * cos + torch.roll(k, k.shape[-1] // 2, dims=-1) * sin
        return rotated.to(keys.dtype)
