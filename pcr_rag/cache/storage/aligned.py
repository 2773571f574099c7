"""Page-aligned memory for O_DIRECT I/O: thread-local scratch buffers and an alignment check.

O_DIRECT needs file offsets, lengths and buffer addresses that are multiples of ``BLOCK`` (4096 bytes). The chunk
files are laid out on that grid; these helpers give the bounce buffers for the pieces that are not.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

__all__ = ["BLOCK", "aligned_scratch", "is_aligned"]

BLOCK = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses
_bounce = threading.local()


def aligned_scratch(nbytes: int, slot: str = "bounce") -> memoryview:
    """A thread-local, page-aligned scratch buffer of at least ``nbytes`` (anonymous mmap), reused across calls:
    valid until the same thread asks for the same ``slot`` again (the backends use slot "bounce")."""
    buffers: dict[str, mmap.mmap] | None = getattr(_bounce, "buffers", None)
    if buffers is None:
        buffers = _bounce.buffers = {}
    buf = buffers.get(slot)
    if buf is None or len(buf) < nbytes:
        size = max(nbytes, 1 << 20)
        size = (size + BLOCK - 1) // BLOCK * BLOCK
        buf = buffers[slot] = mmap.mmap(-1, size)
    return memoryview(buf)


def is_aligned(view: memoryview) -> bool:
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else -1
    return addr >= 0 and addr % BLOCK == 0
