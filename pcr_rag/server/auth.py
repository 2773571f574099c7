"""API keys and tenants: ``Authorization: Bearer <key>`` -> the cache namespace the request runs in.

Without keys every request is anonymous and shares the engine's namespace. With keys, every endpoint but
``/health`` needs one of them (401 otherwise). With ``tenant_per_key`` each key gets its own namespace (a salt of
the chunk keys' root, `PCREngine.root_for`), so tenants never share KV and cannot probe each other's prefixes by
timing; the namespace is derived from a hash of the key, so neither keys nor namespaces are logged or stored.

``/metrics`` shows every tenant's traffic, so a tenant key does not open it: `MetricsGuard` lets through the
``metrics_key`` only (403 for a tenant key), anyone when ``metrics_public`` or when no keys are configured at all.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from pcr_rag.server.errors import APIError

__all__ = ["Authenticator", "MetricsGuard", "Tenant"]


@dataclass(frozen=True)
class Tenant:
    """Who a request runs as: ``namespace`` is passed to `PCREngine.submit` / `announce` ("" = shared)."""

    namespace: str = ""


ANONYMOUS = Tenant()


class Authenticator:
    """Checks ``Authorization`` headers against ``keys`` (empty: no auth) in constant time per key."""

    def __init__(self, keys: Sequence[str] = (), *, tenant_per_key: bool = False) -> None:
        keys = tuple(k for k in keys if k)
        if tenant_per_key and not keys:
            raise ValueError("tenant_per_key needs at least one API key (--api-key or PCR_RAG_API_KEY)")
        self._keys = tuple((k.encode(), _namespace_of(k) if tenant_per_key else "") for k in keys)
        self.tenant_per_key = tenant_per_key

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of a request's ``Authorization`` header; `APIError` 401 when keys are set and it is not
        ``Bearer <one of them>``."""
        if not self._keys:
            return ANONYMOUS
        given = _bearer(authorization)
        found: str | None = None
        for key, namespace in self._keys:  # compare against every key: time does not depend on which matched
            if hmac.compare_digest(given, key):
                found = namespace
        if found is None:
            raise APIError.unauthorized("incorrect API key provided")
        return Tenant(found)

    def is_key(self, given: bytes) -> bool:
        """Whether ``given`` is one of the API keys (constant time per key)."""
        matched = False
        for key, _ in self._keys:
            matched |= hmac.compare_digest(given, key)
        return matched


class MetricsGuard:
    """Who may scrape ``/metrics``: the ``metrics_key`` holder; anyone when ``public`` or when neither API keys nor
    a metrics key are configured (an open server). A tenant's API key gets 403: the metrics show every tenant's
    traffic."""

    def __init__(self, auth: Authenticator, metrics_key: str | None, *, public: bool) -> None:
        if public and metrics_key:
            raise ValueError("metrics_key and metrics_public exclude each other")
        self._auth = auth
        self._key = metrics_key.encode() if metrics_key else None
        self.open = public or (self._key is None and not auth.enabled)

    def check(self, authorization: str | None) -> None:
        """Returns when the request may read ``/metrics``; `APIError` 401 (no or unknown key) or 403 (a tenant
        key) otherwise."""
        if self.open:
            return
        given = _bearer(authorization)
        if self._key is not None and hmac.compare_digest(given, self._key):
            return
        if self._auth.is_key(given):
            raise APIError(403, "this API key may not read /metrics: scrape it with the server's metrics key "
                                "(--metrics-key), or start the server with --metrics-public",
                           type="permission_error", code="metrics_forbidden")
        raise APIError.unauthorized("incorrect API key provided")


def _bearer(authorization: str | None) -> bytes:
    """The key of ``Authorization: Bearer <key>``; `APIError` 401 when the header is missing or malformed."""
    if not authorization:
        raise APIError.unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError.unauthorized("malformed Authorization header: send 'Authorization: Bearer <key>'")
    return token.strip().encode()


def _namespace_of(key: str) -> str:
    return "tenant-" + hashlib.sha256(b"pcr-rag-tenant|" + key.encode()).hexdigest()[:24]
