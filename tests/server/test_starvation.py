"""No request or client starves the rest (issue 47, item 3): each test replays an audit's attack against a real
server on the tiny model. Stop strings and formats are bounded before any compute, a refused request fills no
grammar cache, a client that stops reading loses its request and its slot, a large answer is encoded off the
event loop, and the announcement board stays within the server's tickets."""

from __future__ import annotations

import functools
import json
import socket
import threading

import httpx
import pytest

from pcr_rag import response_format
from pcr_rag.limits import DEFAULT_LIMITS
from pcr_rag.server import ServerSettings, ServerThread, lifecycle

MODEL = "tiny-llama"


def _chat(url: str, timeout: float = 30.0, **body) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 2}
    payload.update(body)
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=timeout)


@pytest.fixture(scope="module")
def url(engine):
    with ServerThread(engine, ServerSettings(port=0, served_model_name=MODEL)) as base:
        yield base


# ------------------------------------------------------------------------------------------------ stop strings
def test_fifty_thousand_stop_strings_are_refused_before_any_compute(url, engine) -> None:
    r = _chat(url, stop=[f"stop-{i}" for i in range(50_000)])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop" and "16" in r.json()["error"]["message"]
    long_one = _chat(url, stop=["x" * (DEFAULT_LIMITS.max_stop_bytes + 1)])
    assert long_one.status_code == 400 and long_one.json()["error"]["param"] == "stop"
    # multi-byte characters count as bytes: 100 euro signs are 300 bytes
    assert _chat(url, stop=["\u20ac" * 100]).status_code == 400
    ok = _chat(url, stop=[f"s{i}" for i in range(DEFAULT_LIMITS.max_stop_sequences)])
    assert ok.status_code == 200, ok.text


def test_the_engine_refuses_what_the_server_would(engine) -> None:
    from pcr_rag import InvalidRequestError
    from pcr_rag.request import RagPrompt, SamplingParams

    with pytest.raises(InvalidRequestError, match="stop holds 17 sequences"):
        engine.submit(RagPrompt("q", ()), SamplingParams(stop=[str(i) for i in range(17)]))


# ------------------------------------------------------------------------------------------------ grammars
def _big_schema(properties: int) -> dict:
    return {"type": "object", "properties": {f"field_{i:06d}": {"type": "integer"} for i in range(properties)}}


def test_a_refused_request_validates_and_caches_no_grammar(url, monkeypatch) -> None:
    """The audit's thirty 4 MiB schemas sent under a wrong model name each grew the validation cache; now the
    model is checked before any grammar is built, and a schema over the bound is refused by its size."""
    built = []
    real = response_format._grammar_text
    monkeypatch.setattr(response_format, "_grammar_text", lambda kind, source: built.append(kind) or real(kind, source))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _big_schema(200)}}
    for _ in range(3):
        r = _chat(url, model="no-such-model", response_format=fmt)
        assert r.status_code == 404, r.text
    assert built == []
    huge = {"type": "json_schema", "json_schema": {"name": "x", "schema": _big_schema(12_000)}}
    assert len(json.dumps(huge)) > DEFAULT_LIMITS.max_format_bytes
    r = _chat(url, response_format=huge)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert built == []


def test_tools_over_the_bound_are_refused(url) -> None:
    tool = {"type": "function", "function": {"name": "big", "parameters": _big_schema(12_000)}}
    r = _chat(url, tools=[tool])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


# ------------------------------------------------------------------------------------------------ slow readers
def _stream_request(port: int) -> bytes:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                       "stream": True, "n": 8, "logprobs": True, "top_logprobs": 20, "max_tokens": 300})
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}").encode()


@pytest.mark.parametrize("impl", ["httptools", "h11"])
def test_clients_that_never_read_lose_their_requests_and_slots(engine, h, impl) -> None:
    """The audit's attack: streamed n=8, top_logprobs=20 answers to sockets that never read stayed tracked, and
    with max_connections=2 a third client's /health got 503."""
    settings = ServerSettings(port=0, max_connections=2, write_timeout_s=1.0, write_buffer_bytes=4096,
                              served_model_name=MODEL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lifecycle, "guarded_protocol", functools.partial(lifecycle.guarded_protocol, impl=impl))
        srv = ServerThread(engine, settings)
    held: list[socket.socket] = []
    with srv as url:
        port = int(url.rsplit(":", 1)[1])
        try:
            for _ in range(2):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
                sock.connect(("127.0.0.1", port))
                sock.sendall(_stream_request(port))
                held.append(sock)  # never read
            assert h.wait_until(lambda: len(srv.state.inflight) > 0, timeout=10)
            assert h.wait_until(lambda: not srv.state.inflight and h.idle(engine), timeout=60), (
                f"{len(srv.state.inflight)} requests still tracked")
            health = httpx.get(f"{url}/health", timeout=5)
            assert health.status_code == 200
        finally:
            for sock in held:
                sock.close()


def test_write_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="write_timeout_s"):
        ServerSettings(write_timeout_s=0)
    with pytest.raises(ValueError, match="write_buffer_bytes"):
        ServerSettings(write_buffer_bytes=10)


# ------------------------------------------------------------------------------------------------ large answers
def test_a_large_answer_is_encoded_off_the_event_loop(url, monkeypatch) -> None:
    """The audit's n=8, top_logprobs=20 answer was built and encoded on the loop (/health waited for it)."""
    from pcr_rag.server import generation as app_module

    threads: list[str] = []
    real = app_module.chat_response

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(app_module, "chat_response", recording)
    r = _chat(url, n=8, logprobs=True, top_logprobs=20, max_tokens=16)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    assert threads and all(name.startswith("pcr-request") for name in threads), threads


# ------------------------------------------------------------------------------------------------ announcements
def test_the_board_holds_no_more_than_the_servers_tickets(engine) -> None:
    """The audit: with max_tickets=16, 1,500 announces left 16 tickets in the server and 1,500 on the board."""
    board = engine.board
    start = len(board)
    with ServerThread(engine, ServerSettings(port=0, max_tickets=16, served_model_name=MODEL)) as url, httpx.Client() as client:
        for i in range(60):
            r = client.post(f"{url}/v1/pcr/announce", json={"model": MODEL, "documents": [f"document number {i}"]})
            assert r.status_code == 200, r.text
        assert len(board) - start <= 16
    engine.board.expire()
