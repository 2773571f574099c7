"""`ServerSettings`: how `pcr-rag serve` listens, authenticates, limits bodies and shuts down."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_BODY_BYTES", "LOOPBACK_HOSTS", "ServerSettings"]

DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # bytes; a request with a dozen long documents is well under 1 MiB
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServerSettings:
    """Server configuration (the engine has its own `EngineConfig`).

    host / port: where to listen (loopback by default; anything else should come with API keys).
    api_keys: accepted bearer keys; empty = no authentication.
    tenant_per_key: each key runs in its own cache namespace (tenants never share KV).
    served_model_name: the model id clients send and ``/v1/models`` lists (None: the engine's model name).
    shutdown_timeout_s: on SIGTERM, seconds in-flight requests get to finish before they are cancelled.
    max_body_bytes: larger request bodies get 413 before they are parsed.
    max_tickets: announcement tickets remembered for withdrawal (oldest forgotten first; they expire anyway).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    tenant_per_key: bool = False
    served_model_name: str | None = None
    shutdown_timeout_s: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tickets: int = 4096

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0 seconds, got {self.shutdown_timeout_s!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes!r}")
        if self.tenant_per_key and not any(self.api_keys):
            raise ValueError("tenant_per_key needs at least one API key (--api-key or PCR_RAG_API_KEY)")
        object.__setattr__(self, "api_keys", tuple(k for k in self.api_keys if k))

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")
