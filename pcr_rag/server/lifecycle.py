"""Running the app: `serve` (the ``pcr-rag serve`` foreground process) and `ServerThread` (in-process, for tests
and benchmarks).

Shutdown (SIGTERM or SIGINT): new requests get 503 at once (`ServerState.begin_drain`), uvicorn stops accepting
connections, in-flight requests get ``shutdown_timeout_s`` to finish, then uvicorn cancels their tasks (which
cancels their engine requests); the lifespan's end cancels anything left and closes the engine (write-back flushed,
cache directory's lock released), so a restart finds the SSD cache intact. The process then exits with status 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from types import FrameType

import uvicorn

from pcr_rag.engine import PCREngine
from pcr_rag.server.app import ServerState, create_app
from pcr_rag.server.settings import ServerSettings

log = logging.getLogger(__name__)

__all__ = ["ServerThread", "bind_socket", "serve"]


class _DrainingServer(uvicorn.Server):
    """A uvicorn server that tells the app to refuse new requests the moment a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.pcr_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.pcr_state.begin_drain()
        super().handle_exit(sig, frame)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one, read it from ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _server(engine: PCREngine, settings: ServerSettings, *, owns_engine: bool,
            log_level: str) -> _DrainingServer:
    app = create_app(engine, settings, owns_engine=owns_engine)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=settings.shutdown_timeout_s, lifespan="on")
    return _DrainingServer(config, app.state.pcr)


def serve(engine: PCREngine, settings: ServerSettings, *, log_level: str = "info") -> None:
    """Serve ``engine`` until SIGTERM/SIGINT, then shut down gracefully (see the module docstring); the app owns
    the engine and closes it. Blocks; call from the main thread."""
    if not settings.loopback and not settings.api_keys:
        log.warning("listening on %s without an API key: anyone who can reach it can use the model; pass "
                    "--api-key (or PCR_RAG_API_KEY)", settings.host)
    sock = bind_socket(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    server = _server(engine, settings, owns_engine=True, log_level=log_level)
    # uvicorn re-raises the signal it caught once its graceful shutdown is done; by then everything is closed, so
    # the re-raised signal must only end `serve` (exit status 0), not kill the process or raise KeyboardInterrupt
    previous = {sig: signal.signal(sig, _after_shutdown) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
        if not engine.closed:  # startup failed before the lifespan could close it
            engine.close()


def _after_shutdown(sig: int, frame: FrameType | None) -> None:
    log.info("shut down after signal %d", sig)


class ServerThread:
    """The app on a background thread, on a free loopback port: ``with ServerThread(engine) as url: ...``.

    The engine stays the caller's unless ``owns_engine``. `stop` shuts down as a signal would."""

    def __init__(self, engine: PCREngine, settings: ServerSettings | None = None, *, owns_engine: bool = False,
                 log_level: str = "warning") -> None:
        settings = settings or ServerSettings(port=0)
        self._sock = bind_socket(settings.host, settings.port)
        host, port = self._sock.getsockname()[:2]
        self.base_url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        self.server = _server(engine, settings, owns_engine=owns_engine, log_level=log_level)
        self.state: ServerState = self.server.pcr_state
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="pcr-server", daemon=True)

    def start(self, timeout: float = 30.0) -> str:
        """Start serving; returns the base URL (``http://127.0.0.1:PORT``) once the server accepts requests."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        return self.base_url

    def stop(self, timeout: float = 60.0) -> None:
        """Drain and stop (in-flight requests get the settings' shutdown timeout), then join the thread."""
        self.state.begin_drain()
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"the server thread did not stop within {timeout} s")

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
