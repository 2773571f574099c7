"""The store a remote tier's URL names: `open_store`. Above both store kinds (`remote_store`'s single-node ones
and `remote_cluster`'s sharded one), so neither imports the other's module to build it."""

from __future__ import annotations

from urllib.parse import urlsplit

from pcr_rag.cache.config import CLUSTER_SCHEMES, RemoteConfig, redacted_url
from pcr_rag.cache.tiers.remote_cluster import ClusterStore
from pcr_rag.cache.tiers.remote_store import MemoryRemoteStore, RedisStore, RemoteStore
from pcr_rag.errors import ConfigError

__all__ = ["open_store"]


def open_store(config: RemoteConfig) -> RemoteStore:
    """The store a remote tier's URL names (``memory://name``: the shared in-process store; a ``+cluster`` scheme:
    a ``ClusterStore``). Raises `ConfigError` for a Valkey/Redis URL when the redis package is not installed."""
    parts = urlsplit(str(config.url))
    if parts.scheme == "memory":
        return MemoryRemoteStore.named(parts.netloc + parts.path)
    try:
        import redis  # noqa: F401  (optional dependency, the "remote" extra: only a Valkey/Redis tier needs it)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"remote_url {redacted_url(str(config.url))} needs the redis package: "
                          f"pip install 'pcr-rag[remote]'") from exc
    if parts.scheme in CLUSTER_SCHEMES:
        return ClusterStore(config)
    return RedisStore(config)
