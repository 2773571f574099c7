"""Disk helpers for honest measurements: evict files from the page cache (the bytes a storage backend moves are
counted by `pcr_rag.cache.CountingBackend`).

Benchmarks that read "from SSD" must not read from the page cache, so before each try the files are evicted
(``posix_fadvise(DONTNEED)``, after an fsync: dirty pages cannot be dropped). Eviction is best effort by design:
where the OS cannot do it, the measurement still runs (and reads faster than a disk would).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["drop_page_cache", "evict_from_page_cache"]


def evict_from_page_cache(fd: int) -> bool:
    """``posix_fadvise(DONTNEED)`` on an open file; False where the OS has no such call or refuses it."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        return False
    return True


def drop_page_cache(path: str | Path) -> int:
    """Evict ``path`` (a file, or every file below a directory) from the page cache, fsync first. Returns the
    files evicted; silently skips what it cannot open or evict."""
    p = Path(path)
    files = [p] if p.is_file() else [Path(root, name) for root, _dirs, names in os.walk(p) for name in names]
    evicted = 0
    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            evicted += evict_from_page_cache(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
    return evicted
