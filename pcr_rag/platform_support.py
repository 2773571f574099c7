"""Which platforms the engine runs on, checked when an engine starts.

The engine runs on **Linux** only. Its SSD tier and model cache rely on what Linux provides and other systems do not
in the same way: ``fcntl.flock`` on the cache directory's lock file, ``openat``-style walks with ``O_NOFOLLOW``
(``dir_fd``, ``os.fwalk``), ``O_DIRECT`` and ``posix_fadvise`` so that the page cache neither inflates the DRAM
budget nor flatters reads, and POSIX ownership and modes for the private directory checks. Where a call has a free
portable fallback it is used (``fdatasync`` falls back to ``fsync``, a missing ``posix_fadvise`` is skipped), but
the security checks have none, so another system is refused at start with `UnsupportedPlatformError` rather than
run with weaker guarantees. The thin HTTP client (`pcr_rag.client.http`, the integrations' ``base_url=``) is pure
Python and runs anywhere.
"""

from __future__ import annotations

import sys

from pcr_rag.errors import PCRError

SUPPORTED_PLATFORMS = ("linux",)


class UnsupportedPlatformError(PCRError, RuntimeError):
    """The engine was started on a system other than Linux."""


def check_engine_platform(platform: str | None = None) -> None:
    """Raise `UnsupportedPlatformError` unless ``platform`` (default ``sys.platform``) runs the engine."""
    platform = sys.platform if platform is None else platform
    if not platform.startswith(SUPPORTED_PLATFORMS):
        raise UnsupportedPlatformError(
            f"the pcr-rag engine runs on Linux only (this is {platform!r}): its cache directories need Linux's "
            f"file locking, no-follow directory walks and page-cache control. Run the engine on Linux (a container "
            f"works: deploy/Dockerfile) and use it from here through `pcr-rag serve` with base_url=, which needs "
            f"only the core install (pip install pcr-rag)")
