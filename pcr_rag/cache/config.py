"""CacheConfig: tier capacities (bytes), SSD directory, eviction policy and I/O mode of a CacheManager."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import unquote, urlsplit

import torch

from pcr_rag.cache.seal import check_secret
from pcr_rag.units import parse_bytes

__all__ = [
    "CLUSTER_SCHEMES", "PLANNER_MODES", "REMOTE_SCHEMES", "CacheConfig", "ClusterURL", "KVLayout", "POLICIES",
    "RemoteConfig",
    "parse_cluster_url", "redacted_repr", "redacted_url", "remote_with_layout",
]

POLICIES = ("lookahead-lru", "lru")
#: How cached chunks are chosen for loading (``cache.reuse_planner``): from measured speeds, or every one.
PLANNER_MODES = ("measured", "always-load")
#: URL schemes of a Valkey/Redis Cluster (sharded by hash slot): ``redis+cluster://``, ``valkey+cluster://`` and
#: their TLS forms; the host part may list several seed nodes, comma-separated.
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster", "valkey+cluster", "valkeys+cluster")
#: URL schemes of the remote tier; valkey(s):// are spelled redis(s):// for the client. "memory://name" is an
#: in-process store (``MemoryRemoteStore``: the simulator, unit tests), shared by every engine using the same name.
REMOTE_SCHEMES = ("redis", "rediss", "valkey", "valkeys", "memory", *CLUSTER_SCHEMES)


def redacted_url(url: object) -> str:
    """``url`` with the password of its user info replaced by ``***`` (the whole user info when it has no
    ``user:`` part, which Redis reads as the password too), for every message, ``repr`` and log line. Works on
    any text, a URL or not, and on cluster URLs (``host:port,host:port``)."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return text
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user + ':***' if colon else '***'}@{hosts}{slash}{tail}"


def redacted_repr(obj: object, urls: tuple[str, ...]) -> str:
    """The dataclass repr of ``obj`` (fields declared ``repr=False`` left out) with the fields named in ``urls``
    passed through `redacted_url`."""
    parts = []
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if not f.repr:
            continue
        value = getattr(obj, f.name)
        if f.name in urls and value is not None:
            value = redacted_url(value)
        parts.append(f"{f.name}={value!r}")
    return f"{type(obj).__qualname__}({', '.join(parts)})"


@dataclass(frozen=True)
class ClusterURL:
    """A parsed cluster URL: the seed nodes the client asks for the slot map, TLS, and AUTH (sent to every node)."""

    seeds: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None = None
    password: str | None = field(default=None, repr=False)


def parse_cluster_url(url: str) -> ClusterURL:
    """``<scheme>://[[user]:password@]host:port[,host:port...][/0]`` (``CLUSTER_SCHEMES``; IPv6 hosts in
    brackets; the port defaults to 6379). ``ValueError`` saying what is wrong: a cluster has one database (0), so
    another path is refused, as is a query string (no option is read from it)."""
    shown = repr(redacted_url(url))  # messages never carry the password
    scheme, sep, rest = str(url).partition("://")
    if not sep or scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"cluster url {shown} must start with one of {[s + '://' for s in CLUSTER_SCHEMES]}")
    if "?" in rest or "#" in rest:
        raise ValueError(f"cluster url {shown}: no query string or fragment is read; remove it")
    netloc, _, path = rest.partition("/")
    if path not in ("", "0"):
        raise ValueError(f"cluster url {shown}: a cluster has only database 0 (path '/{path}')")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    seeds: list[tuple[str, int]] = []
    for item in hosts.split(","):
        item = item.strip()
        if item.startswith("["):  # [v6]:port
            host, bracket, tail = item[1:].partition("]")
            if not bracket or (tail and not tail.startswith(":")):
                raise ValueError(f"cluster url {shown}: bad seed {item!r}")
            port_text = tail[1:]
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise ValueError(f"cluster url {shown}: empty seed host in {hosts!r}; list seeds as host:port,host:port")
        try:
            port = int(port_text) if port_text else 6379
        except ValueError:
            raise ValueError(f"cluster url {shown}: bad port in seed {item!r}") from None
        if not 0 < port < 65536:
            raise ValueError(f"cluster url {shown}: port {port} of seed {item!r} is out of range")
        seeds.append((host, port))
    return ClusterURL(tuple(seeds), tls=scheme.startswith(("rediss", "valkeys")), username=username,
                      password=password)


@dataclass(frozen=True)
class KVLayout:
    """The KV layout of the engine's model: a chunk of ``T`` tokens is ``[num_layers, 2, kv_heads, T, head_dim]``
    of ``dtype``. The remote tier sizes what it learns from this (never from a stored header's claim) and rejects
    a value of any other dtype or shape."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")

    def shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.kv_heads, num_tokens, self.head_dim)

    def nbytes(self, num_tokens: int) -> int:
        return self.num_layers * 2 * self.kv_heads * num_tokens * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class RemoteConfig:
    """The shared remote tier (Valkey/Redis) below SSD. Times in seconds, sizes in bytes.

    - ``url``: ``redis://[:password@]host:port/db``, ``rediss://`` (TLS), ``valkey://``/``valkeys://`` (same),
      a Valkey/Redis Cluster: ``redis+cluster://[:password@]host:port[,host:port...]`` (seed nodes; also
      ``valkey+cluster``, ``rediss+cluster``, ``valkeys+cluster``: see ``tiers.remote_cluster``), or
      ``memory://name`` (in-process).
    - ``capacity_bytes``: bytes of remote values this engine keeps track of in its prefix tree (the store's own
      ``maxmemory`` bounds what it really holds; values it evicts are misses).
    - ``ttl_s``: expiry of written values (0: none, the store's eviction policy decides).
    - ``namespace``: prefix of every key (``<namespace>:<chunk key hex>``); engines share chunks only within one.
    - ``connect_timeout_s`` / ``timeout_s``: bound every connect and every operation; no call waits longer.
    - ``breaker_errors`` / ``breaker_backoff_s``: after this many consecutive errors the tier is skipped for the
      back-off, then one trial operation decides whether it is used again (per node of a cluster: one failing shard
      is skipped, the others still serve).
    - ``write_queue``: chunks waiting to be written; a full queue drops new writes (counted), never blocks.
    - ``max_connections``: connection pool size (per node of a cluster).
    - ``secret``: the replicas' shared secret (at least 16 characters): every value carries a MAC under keys
      derived from it (``pcr_rag.cache.seal``); never sent to the store. Required unless ``insecure``.
    - ``insecure``: no secret; values are checked with unkeyed checksums only (anyone who can write to the store
      can change answers). ``encrypt``: AES-GCM payloads (needs ``secret`` and the ``cryptography`` package).
    - ``kv_layout``: the engine's KV layout; without it the tier only reads back chunks whose sizes the engine
      already knows and learns nothing from lookups (sizes never come from a stored header).
    """

    url: str
    capacity_bytes: int | str = "64GiB"
    ttl_s: float = 0.0
    namespace: str = "pcr-rag"
    connect_timeout_s: float = 0.25
    timeout_s: float = 1.0
    breaker_errors: int = 3
    breaker_backoff_s: float = 5.0
    write_queue: int = 64
    max_connections: int = 8
    secret: str | None = field(default=None, repr=False)
    insecure: bool = False
    encrypt: bool = False
    kv_layout: KVLayout | None = None

    def __repr__(self) -> str:
        return redacted_repr(self, ("url",))

    def __post_init__(self) -> None:
        object.__setattr__(self, "capacity_bytes", parse_bytes(self.capacity_bytes))
        if self.secret is not None:
            check_secret(self.secret, "remote secret")
        elif not self.insecure:
            raise ValueError("a remote tier needs a secret to authenticate its values: set remote_secret (or "
                             "$PCR_RAG_REMOTE_SECRET) to the same random string of >= 16 characters on every "
                             "replica, or remote_insecure=True to accept unauthenticated values")
        if self.encrypt and self.secret is None:
            raise ValueError("remote encryption needs a secret: set remote_secret (or $PCR_RAG_REMOTE_SECRET)")
        scheme = urlsplit(str(self.url)).scheme
        if scheme not in REMOTE_SCHEMES:
            raise ValueError(
                f"remote url {redacted_url(self.url)!r} must start with one of {[s + '://' for s in REMOTE_SCHEMES]}"
            )
        if scheme in CLUSTER_SCHEMES:
            parse_cluster_url(self.url)
        for name in ("connect_timeout_s", "timeout_s", "breaker_backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 s, got {getattr(self, name)!r}")
        if self.ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0 s (0: no expiry), got {self.ttl_s!r}")
        for name in ("breaker_errors", "write_queue", "max_connections"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.namespace or ":" in self.namespace:
            raise ValueError(f"namespace must be a non-empty string without ':', got {self.namespace!r}")
        if int(self.capacity_bytes) <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes!r}")


def remote_with_layout(remote: RemoteConfig | None, kv: object) -> RemoteConfig | None:
    """``remote`` with the KV layout of a model's KV geometry (``num_layers``, ``num_kv_heads``, ``head_dim``,
    ``dtype``: ``runtime.model.KVGeometry``); None stays None."""
    if remote is None:
        return None
    layout = KVLayout(kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype)  # type: ignore[attr-defined]
    return replace(remote, kv_layout=layout)


@dataclass
class CacheConfig:
    """Configuration of a :class:`~pcr_rag.cache.manager.CacheManager`.

    Capacities accept ints (bytes) or strings such as ``"2GiB"``; they are normalised to ints of bytes.

    - ``dram_bytes``: host DRAM tier budget (never exceeded).
    - ``ssd_bytes`` / ``cache_dir``: SSD tier budget and directory; the SSD tier exists when ``ssd_bytes > 0`` and
      either ``cache_dir`` is set or a storage backend is passed to the engine.
    - ``device`` / ``device_bytes``: an optional device tier (only when ``device`` is not ``"cpu"`` and
      ``device_bytes > 0``), e.g. ``"cuda:0"``; DRAM payloads are then pinned when ``pin_memory``.
    - ``policy``: ``"lookahead-lru"`` (the paper's default: protected chunks are evicted last) or ``"lru"``.
    - ``sync_io``: write-back and loads run inline in the calling thread (deterministic; the simulator's mode);
      otherwise one background writer thread and ``io_workers`` loader threads.
    - ``fsync``: fdatasync each chunk file before it becomes visible. Off by default: every read is verified
      (header and per-layer checksums), so a file torn by a crash is dropped as corrupt, never served; turn it on
      to keep more of the cache across power loss at the cost of write throughput. ``drop_page_cache``: without
      O_DIRECT, posix_fadvise DONTNEED after reads and writes so the DRAM budget is honest and reads measure the
      disk (O_DIRECT is used where the filesystem supports it).
    - ``writeback_wait_s``: how long an insert may wait for pending write-backs to finish when the only DRAM
      eviction candidates are chunks not yet on SSD (backpressure instead of losing data).
    - ``remote``: a shared remote tier below SSD (:class:`RemoteConfig`), or None.
    - ``ssd_secret``: when set (>= 16 characters), SSD chunk files are sealed and encrypted (AES-GCM per layer,
      keys derived from it): the cache directory holds no KV in the clear and a file written without the secret
      is dropped as forged.
    - ``tenant_dram_bytes`` / ``tenant_ssd_bytes``: per-tenant quotas (bytes or e.g. ``"1GiB"``; None = none) of
      the DRAM and SSD tiers: a chunk counts against the tenant whose request computed it, and a tenant at its
      quota makes room by evicting its own chunks only, so one tenant cannot evict another's working set (the
      rules and their guarantee: ``cache.residency``).
    - ``load_planner``: ``"measured"`` (the default: a cached chunk is loaded only where that beats recomputing it, from the
      measured read and prefill speeds: ``cache.reuse_planner``) or ``"always-load"`` (every cached chunk a tier
      can serve is loaded).
    """

    chunk_size: int = 256
    dram_bytes: int | str = "2GiB"
    ssd_bytes: int | str = 0
    cache_dir: str | Path | None = None
    device: str = "cpu"
    device_bytes: int | str = 0
    policy: str = "lookahead-lru"
    pin_memory: bool = True
    sync_io: bool = False
    io_workers: int = 2
    fsync: bool = False
    drop_page_cache: bool = True
    writeback_wait_s: float = 10.0
    remote: RemoteConfig | None = None
    ssd_secret: str | None = field(default=None, repr=False)
    tenant_dram_bytes: int | str | None = None
    tenant_ssd_bytes: int | str | None = None
    load_planner: str = "measured"

    def __post_init__(self) -> None:
        if self.load_planner not in PLANNER_MODES:
            raise ValueError(f"unknown load_planner {self.load_planner!r}; choose one of {PLANNER_MODES}")
        if self.ssd_secret is not None:
            check_secret(self.ssd_secret, "SSD secret")
        self.dram_bytes = parse_bytes(self.dram_bytes)
        self.ssd_bytes = parse_bytes(self.ssd_bytes)
        self.device_bytes = parse_bytes(self.device_bytes)
        for name in ("tenant_dram_bytes", "tenant_ssd_bytes"):
            value = getattr(self, name)
            if value is not None:
                value = parse_bytes(value)
                if value <= 0:
                    raise ValueError(f"{name} must be > 0 bytes or None (no quota), got {getattr(self, name)!r}")
                setattr(self, name, value)
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0 tokens, got {self.chunk_size}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.policy!r}; choose one of {POLICIES}")
        if self.io_workers < 1:
            raise ValueError(f"io_workers must be >= 1, got {self.io_workers}")
        if self.writeback_wait_s < 0:
            raise ValueError(f"writeback_wait_s must be >= 0 s, got {self.writeback_wait_s}")
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir).expanduser()

    @property
    def has_device_tier(self) -> bool:
        return self.device != "cpu" and int(self.device_bytes) > 0

    @property
    def pin_dram(self) -> bool:
        return self.pin_memory and self.device.startswith("cuda")
