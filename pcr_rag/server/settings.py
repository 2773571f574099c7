"""`ServerSettings`: how `pcr-rag serve` listens, authenticates, limits bodies, slow clients and its request
threads, and shuts down."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_BODY_BYTES", "LOOPBACK_HOSTS", "ServerSettings"]

DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # bytes; a request with a dozen long documents is well under 1 MiB
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _default_request_threads() -> int:
    return max(2, min(8, os.cpu_count() or 2))


@dataclass(frozen=True)
class ServerSettings:
    """Server configuration (the engine has its own `EngineConfig`). Each field is one ``pcr-rag serve`` flag.

    host / port: where to listen (loopback by default; anything else should come with API keys).
    api_keys: accepted bearer keys; empty = no authentication.
    tenant_per_key: each key runs in its own cache namespace (tenants never share KV).
    served_model_name: the model id clients send and ``/v1/models`` lists (None: the engine's model name).
    shutdown_timeout_s: on SIGTERM, seconds in-flight requests get to finish before they are cancelled.
    max_body_bytes: larger request bodies get 413 before they are parsed.
    max_tickets: announcement tickets remembered for withdrawal (oldest forgotten first; they expire anyway).
    metrics_key: the bearer key that may scrape ``/metrics`` (a key of its own, not one of ``api_keys``). None:
        with ``api_keys`` set nobody may read ``/metrics`` (tenant keys get 403) unless ``metrics_public``; without
        ``api_keys`` ``/metrics`` is as open as every other route.
    metrics_public: ``/metrics`` needs no key at all, even when ``api_keys`` guard the API (an explicit choice,
        e.g. a scraper on a private network); excludes ``metrics_key``.
    header_timeout_s: seconds a client gets, from its connection (or the first byte of its next request on a
        kept-alive connection), to send a request's complete headers; past it the server answers 408 and closes
        the connection (a client sending partial headers cannot hold a connection open).
    body_timeout_s: seconds a client gets, from the end of a request's headers, to send the whole body; past it the
        connection is closed (counted as status 408) so a client trickling its body cannot hold a request open.
    keep_alive_timeout_s: seconds an idle kept-alive connection stays open between requests.
    max_connections: connections served at once; a request arriving on a connection beyond it gets 503 at once
        (uvicorn's ``limit_concurrency``, which also counts in-flight requests).
    max_header_bytes: bytes a request's line and headers may take; more gets 431 and the connection closed.
    write_timeout_s: seconds a response's unsent output may wait without the client reading any of it; past it
        the connection is dropped, which cancels its requests and frees their rows and the connection's slot (a
        client that stops reading cannot hold the server).
    write_buffer_bytes: output a connection buffers beyond what the kernel took; above it the response waits for
        the client to read (the write-buffer high-water mark; one message may pass it once).
    request_threads: threads that parse, render, tokenize and submit requests (and compile their grammars) off the
        event loop, so a large body never delays other requests' responses or ``/health``; requests beyond them
        wait their turn.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    tenant_per_key: bool = False
    served_model_name: str | None = None
    shutdown_timeout_s: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tickets: int = 4096
    metrics_key: str | None = None
    metrics_public: bool = False
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 1024
    max_header_bytes: int = 64 * 1024
    write_timeout_s: float = 30.0
    write_buffer_bytes: int = 256 * 1024
    request_threads: int = _default_request_threads()

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        for name in ("shutdown_timeout_s", "keep_alive_timeout_s"):
            _check_seconds(name, getattr(self, name), allow_zero=True)
        for name in ("header_timeout_s", "body_timeout_s", "write_timeout_s"):
            _check_seconds(name, getattr(self, name), allow_zero=False)
        for name, low in (("max_body_bytes", 1024), ("max_tickets", 1), ("max_connections", 1),
                          ("max_header_bytes", 1024), ("write_buffer_bytes", 1024), ("request_threads", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.tenant_per_key and not any(self.api_keys):
            raise ValueError("tenant_per_key needs at least one API key (--api-key or PCR_RAG_API_KEY)")
        object.__setattr__(self, "api_keys", tuple(k for k in self.api_keys if k))
        if not isinstance(self.metrics_public, bool):
            raise ValueError(f"metrics_public must be true or false, got {self.metrics_public!r}")
        if self.metrics_key is not None:
            if not isinstance(self.metrics_key, str) or not self.metrics_key.strip():
                raise ValueError("metrics_key must be a non-empty string (or None)")
            if self.metrics_public:
                raise ValueError("metrics_key and metrics_public exclude each other: a public /metrics needs no "
                                 "key; drop one of them")
            if self.metrics_key in self.api_keys:
                raise ValueError("metrics_key must differ from every API key: a tenant key must not read /metrics")

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")


def _check_seconds(name: str, value: object, *, allow_zero: bool) -> None:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value >= 0 if allow_zero else value > 0))
    if not ok:
        raise ValueError(f"{name} must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, "
                         f"got {value!r}")
