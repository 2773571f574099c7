"""``BufferPool``: the host buffers of dropped DRAM copies, handed out again for new chunks' payloads.

Why: a fresh multi-MB host tensor pays first-touch page faults on its first write, so copying a chunk into a fresh
tensor costs several times the copy into a buffer already touched (see
docs/measurements-history.md#figures-moved-from-code-comments). Every chunk a prefill step computes gets such a
payload (its DRAM copy), so that fault cost is most of
what a miss costs with the cache on. Once the DRAM tier is full, every new chunk evicts an older one, so buffers of
the same shape come back all the time: reusing them keeps a busy engine's misses free of page faults.

Invariant: a buffer is handed out again only when nothing else can read or write its bytes, i.e. the pool holds the
only reference to the tensor and the tensor the only reference to its storage (no view, no numpy array, no reader,
no write-back or remote-writer job). Buffers still shared when asked for are left for a later call. The pool keeps
at most ``max_buffers`` (the oldest go first), so it holds at most that many payloads' bytes beyond the tier budget.
Thread-safe.
"""

from __future__ import annotations

import sys
import threading
from collections import deque

import torch

__all__ = ["BufferPool"]

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private; without it nothing is ever reused


def _sole_reference_counts() -> tuple[int, int]:
    """What `BufferPool.take` sees for a pooled tensor nobody else holds, measured on this interpreter and torch in
    take's own pattern: Python references (the deque, the local name, ``sys.getrefcount``'s argument) and storage
    references (the tensor's own, plus the temporary ``UntypedStorage`` that asking creates)."""
    free = deque([torch.empty(1)])
    t = free[0]
    refs = sys.getrefcount(t)
    uses = _storage_use_count(t.untyped_storage()._cdata) if _storage_use_count is not None else -1
    return refs, uses


_SOLE_TAKE_REFS, _SOLE_STORAGE_USES = _sole_reference_counts()


class BufferPool:
    """Dense, unpinned CPU tensors given back by the DRAM tier, reused by exact (shape, dtype)."""

    def __init__(self, max_buffers: int = 16) -> None:
        if max_buffers < 0:
            raise ValueError(f"max_buffers must be >= 0, got {max_buffers}")
        self.max_buffers = max_buffers
        self._free: deque[torch.Tensor] = deque()
        self._lock = threading.Lock()
        self.reused = 0     # payloads served from a given-back buffer
        self.allocated = 0  # payloads that needed a fresh tensor

    def give(self, tensor: object) -> None:
        """Offer a dropped copy for reuse. Anything but a whole, dense, unpinned CPU tensor is ignored."""
        if (self.max_buffers == 0 or _storage_use_count is None or not isinstance(tensor, torch.Tensor)
                or tensor.device.type != "cpu" or tensor.is_pinned() or not tensor.is_contiguous()
                or tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.nbytes):
            return
        with self._lock:
            self._free.append(tensor)
            while len(self._free) > self.max_buffers:
                self._free.popleft()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A CPU tensor of ``shape`` and ``dtype`` with undefined contents: a given-back buffer nothing else
        references, else a fresh one. The caller overwrites every element before anyone reads it."""
        shape = tuple(shape)
        with self._lock:
            for i in range(len(self._free)):  # indexing, not enumerate: its cached tuple would hold a reference
                t = self._free[i]
                if (t.dtype == dtype and tuple(t.shape) == shape and sys.getrefcount(t) == _SOLE_TAKE_REFS
                        and _storage_use_count(t.untyped_storage()._cdata) == _SOLE_STORAGE_USES):
                    del self._free[i]
                    self.reused += 1
                    return t
            self.allocated += 1
        return torch.empty(shape, dtype=dtype)

    def __len__(self) -> int:
        return len(self._free)
