"""Running the app: `serve` (the ``pcr-rag serve`` foreground process) and `ServerThread` (in-process, for tests
and benchmarks).

Shutdown (SIGTERM or SIGINT): new requests get 503 at once (`ServerState.begin_drain`), uvicorn stops accepting
connections, in-flight requests get ``shutdown_timeout_s`` to finish, then uvicorn cancels their tasks (which
cancels their engine requests); the lifespan's end cancels anything left and closes the engine (write-back flushed,
cache directory's lock released), so a restart finds the SSD cache intact. The process then exits with status 0.

Slow clients (`ServerSettings`): uvicorn bounds idle kept-alive connections (``keep_alive_timeout_s``) and
connections (``max_connections``: a request on a connection beyond it gets 503), but it has no deadline for a
request's headers or body, so a client that sends half a request holds its connection for ever. `guarded_protocol`
adds them at the protocol level, where bytes arrive: a request's headers must be complete within
``header_timeout_s`` of its first byte (or of the connection, for its first request) and fit
``max_header_bytes``, else the server answers 408 / 431 and closes the connection; its body must be complete within
``body_timeout_s`` of its headers, else the connection is closed and the request (which sees a disconnect) is
counted as 408. A client that stops reading its response cannot hold its connection either: the connection's
output beyond the kernel's buffers is bounded by ``write_buffer_bytes`` (above it the response waits), and when
none of it is read for ``write_timeout_s`` the connection is dropped, which cancels its requests.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

from pcr_rag.engine import PCREngine
from pcr_rag.server.app import create_app
from pcr_rag.server.body import BODY_TIMEOUT_STATE
from pcr_rag.server.settings import ServerSettings
from pcr_rag.server.state import ServerState

log = logging.getLogger(__name__)

__all__ = ["ServerThread", "bind_socket", "guarded_protocol", "serve"]


class _DeadlineGuard:
    """Header and body deadlines for a uvicorn HTTP protocol (mixed in before uvicorn's class).

    A connection is in one phase at a time: ``headers`` (connected, or a request's first byte came, and its headers
    are not complete), ``body`` (headers complete, body not), or ``idle`` (the request is complete: the app is
    answering, or the connection waits under uvicorn's keep-alive timeout). Entering ``headers`` or ``body`` arms
    one timer; leaving it cancels the timer. Subclasses say which phase the parser is in (`_parser_phase`)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 * 1024
    write_timeout_s: float = 30.0
    write_buffer_bytes: int = 256 * 1024

    _phase: str = "idle"
    _timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None
    _unsent: int = 0
    _header_bytes: int = 0
    _tail: bytes = b""

    def _parser_phase(self) -> str:
        raise NotImplementedError

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        transport.set_write_buffer_limits(high=self.write_buffer_bytes)
        self._enter("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._cancel_write()
        self._phase = "closed"
        super().connection_lost(exc)  # type: ignore[misc]

    # ------------------------------------------------------------------ a client that stops reading
    def pause_writing(self) -> None:
        """The transport's buffer passed ``write_buffer_bytes`` (the response now waits): arm the write deadline."""
        super().pause_writing()  # type: ignore[misc]
        if self._write_timer is None:
            self._arm_write()

    def resume_writing(self) -> None:
        self._cancel_write()
        super().resume_writing()  # type: ignore[misc]

    def _arm_write(self) -> None:
        self._unsent = self.transport.get_write_buffer_size()  # type: ignore[attr-defined]
        self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_expired)  # type: ignore[attr-defined]

    def _cancel_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_expired(self) -> None:
        """No byte of the buffered output left for ``write_timeout_s``: drop the connection (``abort``, not
        ``close``, which would wait for the buffer to drain). Its response sees a disconnect, which cancels its
        requests. A client that reads, however slowly, re-arms the deadline."""
        self._write_timer = None
        transport = self.transport  # type: ignore[attr-defined]
        if transport.is_closing() and transport.get_write_buffer_size() == 0:
            return
        if transport.get_write_buffer_size() < self._unsent:
            self._arm_write()  # progress: the client reads
            return
        log.info("dropping a connection whose client read none of its response for %g s", self.write_timeout_s)
        transport.abort()

    def data_received(self, data: bytes) -> None:
        cycle = getattr(self, "cycle", None)
        if self._phase == "idle" and (cycle is None or cycle.response_complete):
            self._enter("headers")  # the first bytes of a kept-alive connection's next request
        if self._phase == "headers" and self._headers_too_large(data):
            log.info("closing a connection whose request headers passed %d bytes", self.max_header_bytes)
            self._reject(431, b"Request Header Fields Too Large")
            return
        super().data_received(data)  # type: ignore[misc]
        if self.transport.is_closing():  # type: ignore[attr-defined]
            self._cancel()
            return
        self._enter(self._parser_phase())

    def _headers_too_large(self, data: bytes) -> bool:
        """Counts the bytes of the request's line and headers (up to the blank line) before the parser sees them."""
        seen = self._tail + data
        end = seen.find(b"\r\n\r\n")
        if end < 0:
            self._header_bytes += len(data)
            self._tail = seen[-3:]
            return self._header_bytes > self.max_header_bytes
        size = self._header_bytes + end + 4 - len(self._tail)
        self._header_bytes, self._tail = 0, b""
        return size > self.max_header_bytes

    def _enter(self, phase: str) -> None:
        if phase == self._phase:
            return
        self._cancel()
        self._phase = phase
        self._header_bytes, self._tail = 0, b""
        if phase in ("headers", "body"):
            timeout = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._timer = self.loop.call_later(timeout, self._expired, phase)  # type: ignore[attr-defined]

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, phase: str) -> None:
        self._timer = None
        if phase != self._phase or self.transport.is_closing():  # type: ignore[attr-defined]
            return
        if phase == "headers":
            log.info("closing a connection that did not send complete request headers within %g s",
                     self.header_timeout_s)
            self._reject(408, b"Request Timeout")
            return
        log.info("closing a connection that did not send its request body within %g s", self.body_timeout_s)
        scope = getattr(self, "scope", None)
        if isinstance(scope, dict) and isinstance(scope.get("state"), dict):
            scope["state"][BODY_TIMEOUT_STATE] = True
        self.transport.close()  # type: ignore[attr-defined]

    def _reject(self, status: int, reason: bytes) -> None:
        """Answer ``status`` and close; only while no response of this connection is under way."""
        self._cancel()
        self._phase = "closed"
        cycle = getattr(self, "cycle", None)
        if cycle is None or cycle.response_complete:
            body = reason + b"\n"
            self.transport.write(  # type: ignore[attr-defined]
                b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, reason, len(body), body))
        self.transport.close()  # type: ignore[attr-defined]


def guarded_protocol(settings: ServerSettings, impl: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class with the settings' header and body deadlines and header size limit.
    ``impl``: "httptools", "h11", or "auto" (httptools when installed, else h11, as uvicorn's ``auto``)."""
    limits = {"header_timeout_s": settings.header_timeout_s, "body_timeout_s": settings.body_timeout_s,
              "max_header_bytes": settings.max_header_bytes, "write_timeout_s": settings.write_timeout_s,
              "write_buffer_bytes": settings.write_buffer_bytes}
    if impl == "auto":
        try:
            import httptools  # noqa: F401
        except ImportError:
            impl = "h11"
        else:
            impl = "httptools"
    if impl == "h11":
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol

        def h11_phase(self: Any) -> str:
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                return "body"
            if state is h11.IDLE and (self.conn.trailing_data[0] or self._phase == "headers"):
                return "headers"
            return "idle"

        return type("GuardedH11Protocol", (_DeadlineGuard, H11Protocol), {"_parser_phase": h11_phase, **limits})
    if impl != "httptools":
        raise ValueError(f"impl must be 'auto', 'httptools' or 'h11', got {impl!r}")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(_DeadlineGuard, HttpToolsProtocol):
        _parsed = "headers"

        def _parser_phase(self) -> str:
            return self._parsed

        def on_message_begin(self) -> None:
            self._parsed = "headers"
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._parsed = "body"
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._parsed = "idle"
            super().on_message_complete()

    for name, value in limits.items():
        setattr(GuardedHttpToolsProtocol, name, value)
    return GuardedHttpToolsProtocol


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
    # uvicorn's limit counts the connection the request came on: max_connections + 1 serves max_connections
    # log_config=None: uvicorn's lines go to the root handler (`pcr_rag.logs`: request ids, --log-format json)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level, access_log=False,
                            log_config=None,
                            timeout_graceful_shutdown=settings.shutdown_timeout_s, lifespan="on",
                            http=guarded_protocol(settings), limit_concurrency=settings.max_connections + 1,
                            timeout_keep_alive=settings.keep_alive_timeout_s,
                            h11_max_incomplete_event_size=settings.max_header_bytes)
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
