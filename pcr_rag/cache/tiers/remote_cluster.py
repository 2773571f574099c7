"""``ClusterStore``: the remote tier's values in a Valkey/Redis Cluster (sharded by hash slot), through ``redis``'s
cluster client parts: ``NodesManager`` (the slot map ``RedisCluster`` routes by: ``CLUSTER SLOTS`` from the seed
nodes, then from every node it found; a client and connection pool per node; ``move_slot`` on MOVED) and
``key_slot`` (CRC16 hash slots, hash tags included). Not ``RedisCluster`` itself: its constructor also fetches the
``COMMAND`` table from the first primary, so with that one node dead no client could even be built.

- One round trip per node: a call's commands are grouped by the node that owns each key's slot and written to every
  node involved before any reply is read, as ``ClusterPipeline`` does. Unlike ``ClusterPipeline.execute``, a node
  that fails does not fail the call (``ClusterPipeline`` raises for the whole batch when one node cannot be
  connected, and resends failed commands one at a time through the cluster's retries): its keys read as misses.
- A circuit breaker per node (``BreakerSet``): a failing node is skipped for the back-off while the others are still
  called. A call whose every key sits on failed or skipped nodes raises ``RemoteNodeUnavailableError``, which the
  tier's own breaker does not count (the tier stays on); only a cluster that cannot be reached at all (no seed
  answers ``CLUSTER SLOTS``) raises a plain ``RemoteUnavailableError``.
- Failover: a node error asks for a slot-map refresh, run by a background thread (never in a request) at most once
  per ``refresh_interval_s``, and again each interval while a node that owns slots has a breaker that is not closed,
  so a replica promoted later is found without a restart. A MOVED reply patches that slot (``move_slot``) and the
  command is sent once more, to the new owner.
- Bounded: connects and socket reads have the tier's timeouts, a wait for a pooled connection at most ``timeout_s``,
  nothing is retried except one MOVED redirect. A call costs at most one timeout per node that hangs (whose breaker
  then opens at once, so later calls skip it).
- Opening does not touch the network: the slot map is read on first use.
- ``scan`` walks every primary in the slot map in turn (SCAN is per node), each under its own breaker: a node that
  fails or is skipped leaves the walk incomplete, not failed, unless no node answered.

Servers should run with ``cluster-require-full-coverage no``: otherwise, while a shard without a live replica is
down, every node answers ``CLUSTERDOWN`` and the whole cluster reads as failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from pcr_rag.cache.clock import Clock
from pcr_rag.cache.config import RemoteConfig, parse_cluster_url
from pcr_rag.cache.errors import RemoteNodeUnavailableError, RemoteTimeoutError, RemoteUnavailableError
from pcr_rag.cache.tiers.breaker import BreakerSet
from pcr_rag.cache.tiers.remote_store import SOCKET_READ_BYTES, scan_client

__all__ = ["NODE_COUNTERS", "ClusterStore"]

log = logging.getLogger(__name__)

#: Longest wait between slot-map refreshes while a node that owns slots is failing (the breaker back-off, when
#: shorter, is used instead): how soon a promoted replica is found.
REFRESH_INTERVAL_S = 1.0
#: Counters of a cluster store (since start): node calls that failed / were skipped by the node's open breaker,
#: MOVED redirects followed, slot-map refreshes done.
NODE_COUNTERS = ("node_errors", "node_skipped", "redirects", "slot_map_refreshes")


def _direct(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def _slot(name: str) -> int:
    from redis.crc import key_slot

    return key_slot(name.encode())


class _Op:
    """One command of a call, keyed by the value's name; ``result`` is the reply, a per-command error reply
    (``ResponseError``) or the ``RemoteNodeUnavailableError`` of a node that did not answer."""

    __slots__ = ("args", "key", "result")

    def __init__(self, key: str, args: tuple[Any, ...]) -> None:
        self.key = key
        self.args = args
        self.result: Any = None


class _NodeBatch:
    """The commands of one call for one node: sent on one pooled connection, replies read in order."""

    def __init__(self, node: Any, ops: list[int]) -> None:
        self.node = node
        self.ops = ops
        self.conn: Any = None
        self.error: BaseException | None = None
        self.clean = False  # every reply read: the connection can go back to the pool as it is

    def send(self, ops: Sequence[_Op], errors: tuple[type[BaseException], ...]) -> None:
        try:
            pool = self.node.redis_connection.connection_pool
            self.conn = pool.get_connection()
            self.conn.send_packed_command(self.conn.pack_commands([ops[i].args for i in self.ops]))
        except errors as exc:
            self.error = exc

    def read(self, ops: Sequence[_Op], errors: tuple[type[BaseException], ...], reply_error: type) -> None:
        try:
            for i in self.ops:
                try:
                    ops[i].result = self.conn.read_response()
                except reply_error as exc:  # an error reply: the connection is still in step
                    ops[i].result = exc
            self.clean = True
        except errors as exc:
            self.error = exc

    def release(self) -> None:
        if self.conn is None:
            return
        if not self.clean:
            self.conn.disconnect()  # replies may be left unread: never hand the socket to another caller
        self.node.redis_connection.connection_pool.release(self.conn)
        self.conn = None


class ClusterStore:
    """A Valkey/Redis Cluster behind the remote tier (see the module docstring). Thread-safe."""

    def __init__(self, config: RemoteConfig, *, clock: Clock | None = None) -> None:
        import redis  # optional dependency: only a remote tier needs it
        from redis import exceptions as rexc

        self._redis = redis
        self._rexc = rexc
        self._io_errors = (rexc.RedisError, OSError)
        self.config = config
        self.spec = parse_cluster_url(config.url)
        self.breakers = BreakerSet(config.breaker_errors, config.breaker_backoff_s, clock)
        self.refresh_interval_s = min(REFRESH_INTERVAL_S, config.breaker_backoff_s)
        self._nodes: Any = None  # redis.cluster.NodesManager, once the slot map was read
        self._open_lock = threading.Lock()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(NODE_COUNTERS, 0)
        self._down: set[str] = set()  # nodes logged as failing (logged again once they answer)
        self._refresh = threading.Condition()
        self._refresh_wanted = False
        self._last_refresh = float("-inf")
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ the client
    def _client(self) -> Any:
        nodes = self._nodes
        if nodes is not None:
            return nodes
        with self._open_lock:
            if self._closed:
                raise RemoteUnavailableError(f"{self.describe()}: the store was closed")
            if self._nodes is None:
                self._nodes = self._connect()
            return self._nodes

    def _connect(self) -> Any:
        from redis.cluster import ClusterNode, NodesManager

        cfg, spec = self.config, self.spec
        kwargs: dict[str, Any] = {
            "socket_connect_timeout": cfg.connect_timeout_s,
            "socket_timeout": cfg.timeout_s,
            "socket_read_size": SOCKET_READ_BYTES,
            "connection_pool_class": self._redis.BlockingConnectionPool,
            "max_connections": cfg.max_connections,
            "timeout": cfg.timeout_s,  # longest wait for a free pooled connection
        }
        if spec.username:
            kwargs["username"] = spec.username
        if spec.password is not None:
            kwargs["password"] = spec.password
        if spec.tls:
            kwargs["ssl"] = True
        try:  # node clients never retry (NodesManager builds them with retries=0)
            return NodesManager([ClusterNode(h, p) for h, p in spec.seeds], require_full_coverage=False,
                                dynamic_startup_nodes=True, **kwargs)
        except (*self._io_errors, self._rexc.RedisClusterException) as exc:
            cause = exc.__cause__ or exc
            message = f"{self.describe()}: no seed node answered CLUSTER SLOTS ({type(exc).__name__}: {exc})"
            if isinstance(cause, (self._rexc.TimeoutError, TimeoutError)):
                raise RemoteTimeoutError(message) from exc
            raise RemoteUnavailableError(message) from exc

    # ------------------------------------------------------------------ one call
    def _execute(self, ops: Sequence[_Op]) -> None:
        """Run ``ops``, one round trip per node involved (and one more for the commands a MOVED redirected)."""
        if not ops:
            return
        nodes = self._client()
        todo = list(range(len(ops)))
        for follow in (True, False):
            moved = self._round(nodes, ops, todo, follow=follow)
            if not moved:
                return
            todo = moved

    def _round(self, manager: Any, ops: Sequence[_Op], todo: list[int], *, follow: bool) -> list[int]:
        rexc = self._rexc
        groups: dict[str, _NodeBatch] = {}
        for i in todo:
            try:
                node = manager.get_node_from_slot(_slot(ops[i].key))
            except rexc.SlotNotCoveredError as exc:
                ops[i].result = RemoteNodeUnavailableError(f"{self.describe()}: {exc}")
                self._want_refresh()
                continue
            batch = groups.get(node.name)
            if batch is None:
                if node.redis_connection is None:  # a node first named by a MOVED reply: its pool (no connect)
                    manager.create_redis_connections([node])
                batch = groups[node.name] = _NodeBatch(node, [])
            batch.ops.append(i)
        live: list[_NodeBatch] = []
        for name, batch in groups.items():
            if self.breakers.get(name).allow():
                live.append(batch)
                continue
            self._count("node_skipped")
            self._want_refresh()  # keep looking for a failover while the node is skipped
            err = RemoteNodeUnavailableError(
                f"{self.describe()}: node {name} skipped: its circuit breaker is open after errors (retried after "
                f"{self.breakers.backoff_s:g} s)", skipped=True)
            for i in batch.ops:
                ops[i].result = err
        try:
            for batch in live:  # every node's commands go out before any reply is read
                batch.send(ops, self._io_errors)
            for batch in live:
                if batch.error is None:
                    batch.read(ops, self._io_errors, rexc.ResponseError)
        except BaseException:  # not an I/O error (a bug, an interrupt): hand every trial call back, then raise
            for batch in live:
                self.breakers.get(batch.node.name).failure()
            raise
        finally:
            for batch in live:
                batch.release()
        moved: list[int] = []
        for batch in live:
            down = batch.error
            if down is None:
                down = next((ops[i].result for i in batch.ops if isinstance(ops[i].result, rexc.ClusterDownError)),
                            None)
            if down is not None:
                self._node_failed(batch, down, ops)
                continue
            self._node_answered(batch.node.name)
            for i in batch.ops:
                r = ops[i].result
                if follow and isinstance(r, rexc.MovedError):
                    try:
                        manager.move_slot(r)
                    except (KeyError, ValueError):  # a slot the map does not cover: the refresh will
                        continue
                    moved.append(i)
        if moved:
            self._count("redirects", len(moved))
            self._want_refresh()
        return moved

    def _node_failed(self, batch: _NodeBatch, exc: BaseException, ops: Sequence[_Op]) -> None:
        err = self._fail_node(batch.node.name, exc)
        for i in batch.ops:
            ops[i].result = err

    def _fail_node(self, name: str, exc: BaseException) -> RemoteNodeUnavailableError:
        """Count and log a node's failure (its breaker, a slot-map refresh); the error its keys read as."""
        breaker = self.breakers.get(name)
        if isinstance(exc, (self._rexc.TimeoutError, TimeoutError)):
            breaker.trip()  # one caller paid the whole timeout: skip the node for the back-off
        else:
            breaker.failure()
        self._count("node_errors")
        hint = ""
        if isinstance(exc, self._rexc.ClusterDownError):
            hint = " (set cluster-require-full-coverage no on the servers, so one shard down leaves the rest serving)"
        err = RemoteNodeUnavailableError(f"{self.describe()}: node {name}: {type(exc).__name__}: {exc}{hint}")
        with self._lock:
            first = name not in self._down
            self._down.add(name)
        if first:
            log.warning("remote cluster node %s failing (%s): the chunks in its slots are misses, the other nodes "
                        "still serve; looking for a failover", name, err)
        self._want_refresh()
        return err

    def _node_answered(self, name: str) -> None:
        self.breakers.get(name).success()
        with self._lock:
            if name not in self._down:
                return
            self._down.discard(name)
        log.info("remote cluster node %s answers again", name)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    # ------------------------------------------------------------------ slot-map refresh (background)
    def _want_refresh(self) -> None:
        with self._refresh:
            if self._closed:
                return
            self._refresh_wanted = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._refresh_loop, name="pcr-cache-cluster-slots",
                                                daemon=True)
                self._thread.start()
            self._refresh.notify_all()

    def _refresh_loop(self) -> None:
        while True:
            with self._refresh:
                while not self._closed and not self._refresh_wanted:
                    self._refresh.wait()
                if self._closed:
                    return
                wait = self._last_refresh + self.refresh_interval_s - time.monotonic()
                if wait > 0:
                    self._refresh.wait(wait)
                    continue
                self._refresh_wanted = False
            self._refresh_once()
            if self.failing_owners():  # a failover may come later: look again next interval
                with self._refresh:
                    self._refresh_wanted = True

    def _refresh_once(self) -> None:
        nodes = self._nodes
        try:
            if nodes is not None:
                nodes.initialize()
                self._count("slot_map_refreshes")
        except Exception as exc:  # noqa: BLE001 - any failure keeps the current map; the next interval retries
            log.debug("remote cluster %s: slot map refresh failed: %s: %s", self.describe(), type(exc).__name__, exc)
        finally:
            self._last_refresh = time.monotonic()

    def failing_owners(self) -> list[str]:
        """Nodes that own slots in the current map and whose breaker is open or half-open."""
        nodes = self._nodes
        if nodes is None:
            return []
        return self.breakers.not_closed(n.name for n in nodes.get_nodes_by_server_type("primary"))

    def node_of(self, name: str) -> str | None:
        """``host:port`` of the node that owns ``name``'s slot in this client's slot map (None before first use)."""
        nodes = self._nodes
        if nodes is None:
            return None
        return nodes.get_node_from_slot(_slot(name)).name

    # ------------------------------------------------------------------ RemoteStore
    def _values(self, ops: Sequence[_Op], pick: Any) -> list[bytes | None]:
        failed = [op.result for op in ops if isinstance(op.result, RemoteNodeUnavailableError)]
        if ops and len(failed) == len(ops):  # nothing answered: an error (the tier's breaker ignores it)
            skipped = all(e.skipped for e in failed)
            raise RemoteNodeUnavailableError(str(failed[0]), skipped=skipped)
        return [None if isinstance(op.result, Exception) else pick(op.result) for op in ops]

    def probe(self, names: Sequence[str], nbytes: int) -> list[bytes | None]:
        ops = [_Op(n, ("GETRANGE", n, 0, nbytes - 1)) for n in names]
        self._execute(ops)
        return self._values(ops, lambda r: r if isinstance(r, bytes) and r else None)

    def get_many(self, names: Sequence[str], max_bytes: int | None = None) -> list[bytes | None]:
        if max_bytes is not None:
            return self.probe(names, max_bytes)
        ops = [_Op(n, ("GET", n)) for n in names]
        self._execute(ops)
        return self._values(ops, lambda r: r if isinstance(r, bytes) else None)

    def _one(self, name: str, args: tuple[Any, ...]) -> Any:
        op = _Op(name, args)
        self._execute([op])
        if isinstance(op.result, RemoteNodeUnavailableError):
            raise op.result
        if isinstance(op.result, Exception):  # an error reply (out of memory, a second MOVED)
            raise RemoteNodeUnavailableError(f"{self.describe()}: {type(op.result).__name__}: {op.result}")
        return op.result

    def set_nx(self, name: str, value: bytes, ttl_s: float) -> bool:
        px = ("PX", int(ttl_s * 1000)) if ttl_s > 0 else ()
        return self._one(name, ("SET", name, value, "NX", *px)) is not None

    def delete(self, name: str) -> None:
        self._one(name, ("DEL", name))

    def scan(self, prefix: str, limit: int, max_calls: int) -> tuple[list[str], bool]:
        """`RemoteStore.scan` over every primary of the slot map, ``max_calls`` SCAN round trips in all."""
        manager = self._client()
        names: dict[str, None] = {}
        complete = True
        calls = 0
        answered = 0
        failed: list[RemoteNodeUnavailableError] = []
        for node in manager.get_nodes_by_server_type("primary"):
            if calls >= max_calls or len(names) >= limit:
                complete = False
                break
            if not self.breakers.get(node.name).allow():
                self._count("node_skipped")
                failed.append(RemoteNodeUnavailableError(f"{self.describe()}: node {node.name} skipped: its "
                                                         f"circuit breaker is open", skipped=True))
                complete = False
                continue
            if node.redis_connection is None:
                manager.create_redis_connections([node])
            try:
                got, whole, made = scan_client(_direct, node.redis_connection, prefix, limit - len(names),
                                               max_calls - calls)
            except self._io_errors as exc:
                failed.append(self._fail_node(node.name, exc))
                complete = False
                calls += 1
                continue
            self._node_answered(node.name)
            answered += 1
            calls += made
            names.update(dict.fromkeys(got))
            complete = complete and whole
        if failed and not answered:
            raise RemoteNodeUnavailableError(str(failed[0]), skipped=all(e.skipped for e in failed))
        return list(names)[:limit], complete

    def describe(self) -> str:
        scheme = str(self.config.url).partition("://")[0]
        auth = "***@" if self.spec.password is not None else ""
        return f"{scheme}://{auth}" + ",".join(f"{h}:{p}" for h, p in self.spec.seeds)

    def node_counters(self) -> dict[str, float]:
        """``NODE_COUNTERS`` and, now: ``nodes`` (primaries in the slot map), ``nodes_open`` (those whose breaker
        is open or half-open), ``node_breaker_trips`` (times any node's breaker opened)."""
        with self._lock:
            out: dict[str, float] = dict(self._counts)
        nodes = self._nodes
        primaries = nodes.get_nodes_by_server_type("primary") if nodes is not None else []
        out["nodes"] = len(primaries)
        out["nodes_open"] = len(self.breakers.not_closed(n.name for n in primaries))
        out["node_breaker_trips"] = self.breakers.trips
        return out

    def close(self) -> None:
        with self._refresh:
            self._closed = True
            self._refresh.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=self.config.connect_timeout_s + self.config.timeout_s + 1.0)
        with self._open_lock:
            self._closed = True
            nodes, self._nodes = self._nodes, None
        if nodes is not None:
            nodes.close()
