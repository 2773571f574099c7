"""Key-value stores behind the remote tier: ``RedisStore`` (Valkey/Redis through the maintained ``redis``
client: a connection pool, pipelining, TLS and AUTH from the URL), ``ClusterStore`` (a Valkey/Redis Cluster,
``remote_cluster``) and ``MemoryRemoteStore`` (in-process; the simulator and unit tests). All speak
``RemoteStore``; ``open_store`` picks one from a URL.

Every failure of a store call raises ``RemoteUnavailableError`` (``RemoteTimeoutError`` past a timeout); a value
the store does not hold reads as None. A ``RedisStore`` never retries and never waits without a bound: connects
and operations have timeouts, and a call waits at most ``timeout_s`` for a free pooled connection.

``scan`` lists names by prefix (the root manifests, at start: never on a request's path), bounded both in names
returned and in SCAN round trips, so a store of millions of values costs a bounded walk, reported as incomplete.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

from pcr_rag.cache.config import RemoteConfig, redacted_url
from pcr_rag.cache.errors import RemoteTimeoutError, RemoteUnavailableError

__all__ = ["MemoryRemoteStore", "RedisStore", "RemoteStore", "glob_prefix", "redacted_url"]

# bytes per socket read: values are whole chunks (MBs), and redis-py's default (64 KiB) costs a recv, a parser feed
# and a parser poll per 64 KiB, so fewer, larger reads move a chunk faster (see docs/measurements-history.md)
SOCKET_READ_BYTES = 1 << 20
#: Keys a SCAN call asks the server to look at (its COUNT hint).
SCAN_COUNT = 1000


def glob_prefix(prefix: str) -> str:
    """A SCAN MATCH pattern for names starting with ``prefix`` (its glob characters escaped)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in prefix) + "*"


class RemoteStore(Protocol):
    """A shared key-value store of chunk values (see the module docstring)."""

    def probe(self, names: Sequence[str], nbytes: int) -> list[bytes | None]:
        """The first ``nbytes`` of each value (None where there is none), in one round trip."""
        ...

    def get_many(self, names: Sequence[str], max_bytes: int | None = None) -> list[bytes | None]:
        """Whole values (None where there is none), in one round trip; with ``max_bytes``, no more than that of
        each (a longer value comes back cut, so a writer cannot make a reader take in more than it expects)."""
        ...

    def set_nx(self, name: str, value: bytes, ttl_s: float) -> bool:
        """Store ``value`` unless ``name`` exists (True when written); ``ttl_s`` > 0 sets an expiry."""
        ...

    def delete(self, name: str) -> None: ...

    def scan(self, prefix: str, limit: int, max_calls: int) -> tuple[list[str], bool]:
        """Up to ``limit`` names that start with ``prefix``, walking the keyspace in at most ``max_calls`` SCAN
        round trips; and whether the walk was complete (False: stopped at a bound, or some node failed)."""
        ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


class RedisStore:
    """A Valkey/Redis server through ``redis``'s blocking connection pool (see the module docstring)."""

    def __init__(self, config: RemoteConfig) -> None:
        import redis  # optional dependency: only a remote tier needs it
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = redis.exceptions
        url = str(config.url)
        scheme = urlsplit(url).scheme
        if scheme in ("valkey", "valkeys"):
            url = ("rediss" if scheme == "valkeys" else "redis") + url[len(scheme) :]
        self.url = url
        self._pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=config.max_connections,
            timeout=config.timeout_s,  # longest wait for a free connection
            socket_connect_timeout=config.connect_timeout_s,
            socket_timeout=config.timeout_s,
            socket_read_size=SOCKET_READ_BYTES,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._client = redis.Redis(connection_pool=self._pool, retry=Retry(NoBackoff(), 0))

    def _fail(self, exc: Exception) -> RemoteUnavailableError:
        if isinstance(exc, self._errors.TimeoutError):
            return RemoteTimeoutError(f"{redacted_url(self.url)}: {exc}")
        return RemoteUnavailableError(f"{redacted_url(self.url)}: {type(exc).__name__}: {exc}")

    def _pipeline(self, commands: Sequence[tuple]) -> list:
        try:
            pipe = self._client.pipeline(transaction=False)
            for name, *args in commands:
                getattr(pipe, name)(*args)
            results = pipe.execute(raise_on_error=False)
        except (self._errors.RedisError, OSError) as exc:
            raise self._fail(exc) from exc
        for r in results:  # a connection-level failure inside the pipeline fails the call; a per-key one is a miss
            if isinstance(r, (self._errors.ConnectionError, self._errors.TimeoutError)):
                raise self._fail(r)
        return results

    def probe(self, names: Sequence[str], nbytes: int) -> list[bytes | None]:
        results = self._pipeline([("getrange", n, 0, nbytes - 1) for n in names])
        return [r if isinstance(r, bytes) and r else None for r in results]

    def get_many(self, names: Sequence[str], max_bytes: int | None = None) -> list[bytes | None]:
        if max_bytes is not None:  # GETRANGE: the server sends no more (an empty reply is no value)
            if len(names) == 1:
                value = self._call(self._client.getrange, names[0], 0, max_bytes - 1)
                return [value if isinstance(value, bytes) and value else None]
            return self.probe(names, max_bytes)
        if len(names) == 1:
            return [self._call(self._client.get, names[0])]
        results = self._pipeline([("get", n) for n in names])
        return [r if isinstance(r, bytes) else None for r in results]

    def _call(self, fn, *args, **kwargs):  # noqa: ANN001, ANN202 - a thin wrapper
        try:
            return fn(*args, **kwargs)
        except (self._errors.RedisError, OSError) as exc:
            raise self._fail(exc) from exc

    def set_nx(self, name: str, value: bytes, ttl_s: float) -> bool:
        px = int(ttl_s * 1000) if ttl_s > 0 else None
        return bool(self._call(self._client.set, name, value, nx=True, px=px))

    def delete(self, name: str) -> None:
        self._call(self._client.delete, name)

    def scan(self, prefix: str, limit: int, max_calls: int) -> tuple[list[str], bool]:
        names, complete, _ = scan_client(self._call, self._client, prefix, limit, max_calls)
        return names, complete

    def describe(self) -> str:
        return redacted_url(self.url)

    def close(self) -> None:
        self._pool.disconnect()


class MemoryRemoteStore:
    """An in-process store shared by every ``memory://<name>`` URL in the process: a dict in LRU order bounded
    by ``maxmemory`` bytes (the least recently used values are evicted, as Valkey's ``allkeys-lru`` does).
    ``down = True`` makes every call fail (fault injection)."""

    _registry: dict[str, MemoryRemoteStore] = {}
    _registry_lock = threading.Lock()

    def __init__(self, name: str = "", maxmemory: int = 1 << 62) -> None:
        self.name = name
        self.maxmemory = maxmemory
        self.values: OrderedDict[str, bytes] = OrderedDict()
        self.used = 0
        self.down = False
        self.evicted = 0
        self._lock = threading.Lock()

    @classmethod
    def named(cls, name: str) -> MemoryRemoteStore:
        """The process-wide store of ``memory://<name>``."""
        with cls._registry_lock:
            store = cls._registry.get(name)
            if store is None:
                store = cls._registry[name] = cls(name)
            return store

    @classmethod
    def forget(cls, name: str) -> None:
        """Drop the process-wide store of ``memory://<name>``."""
        with cls._registry_lock:
            cls._registry.pop(name, None)

    def _check(self) -> None:
        if self.down:
            raise RemoteUnavailableError(f"memory://{self.name} is down")

    def _get(self, name: str) -> bytes | None:
        value = self.values.get(name)
        if value is not None:
            self.values.move_to_end(name)
        return value

    def probe(self, names: Sequence[str], nbytes: int) -> list[bytes | None]:
        with self._lock:
            self._check()
            return [v[:nbytes] if (v := self._get(n)) is not None else None for n in names]

    def get_many(self, names: Sequence[str], max_bytes: int | None = None) -> list[bytes | None]:
        with self._lock:
            self._check()
            values = [self._get(n) for n in names]
        if max_bytes is None:
            return values
        return [v[:max_bytes] if v else None for v in values]

    def set_nx(self, name: str, value: bytes, ttl_s: float) -> bool:
        with self._lock:
            self._check()
            if name in self.values:
                return False
            if len(value) > self.maxmemory:
                raise RemoteUnavailableError(f"value of {len(value)} bytes exceeds maxmemory {self.maxmemory}")
            while self.used + len(value) > self.maxmemory:
                _, old = self.values.popitem(last=False)
                self.used -= len(old)
                self.evicted += 1
            self.values[name] = bytes(value)
            self.used += len(value)
            return True

    def delete(self, name: str) -> None:
        with self._lock:
            self._check()
            old = self.values.pop(name, None)
            if old is not None:
                self.used -= len(old)

    def scan(self, prefix: str, limit: int, max_calls: int) -> tuple[list[str], bool]:
        """Every matching name in one call (``max_calls`` has nothing to bound here)."""
        with self._lock:
            self._check()
            names = [n for n in self.values if n.startswith(prefix)]
        return names[:limit], len(names) <= limit

    def describe(self) -> str:
        return f"memory://{self.name}"

    def close(self) -> None:
        """The store outlives its clients (other engines may share it)."""


def scan_client(call: Callable[..., Any], client: Any, prefix: str, limit: int,
                max_calls: int) -> tuple[list[str], bool, int]:
    """``RemoteStore.scan`` over one server's ``redis.Redis`` ``client``, each SCAN through ``call`` (which turns
    a failure into the caller's error), plus the SCAN calls made. Names SCAN returns twice are kept once."""
    names: dict[str, None] = {}
    cursor = 0
    for calls in range(1, max_calls + 1):
        cursor, batch = call(client.scan, cursor, match=glob_prefix(prefix), count=SCAN_COUNT)
        for raw in batch:
            name = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
            if len(names) >= limit and name not in names:
                return list(names), False, calls
            names[name] = None
        if int(cursor) == 0:
            return list(names), True, calls
    return list(names), False, max_calls
