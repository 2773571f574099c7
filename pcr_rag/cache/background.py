"""Background cache threads (write-back, remote write-through) yield the CPU to the compute threads.

Their work - checksums, copies, file and socket writes - is never on a request's critical path, but on a machine
with as many cores as compute threads it would otherwise take its fair share of them in the middle of a prefill
(measured: part of what a cache miss costs over the same request with the cache off). So each such thread lowers
its own scheduling priority to `BACKGROUND_NICE` when it starts: it runs on idle cores and between steps, and
still gets a tenth of a core under full load, so its queue drains (backpressure covers the rest).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10  # Linux nice value (CFS weight ~1/10 of a normal thread's)


def lower_this_thread_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Set the calling thread's nice value (Linux: per thread). False where the platform does not allow it."""
    setpriority = getattr(os, "setpriority", None)
    if setpriority is None:
        return False
    try:
        current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(current, nice))
    except OSError as exc:  # e.g. a sandbox that forbids it: the thread just runs at normal priority
        log.debug("could not lower a background thread's priority: %s", exc)
        return False
    return True
