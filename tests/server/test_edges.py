"""The server's edges under hostile clients: the event loop never waits on a large body, slow or too many clients
cannot hold connections, /metrics has its own key, and error paths answer OpenAI-shaped bodies without exception
text or tracebacks."""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from pcr_rag import PCREngine
from pcr_rag.server import ServerSettings, ServerThread, lifecycle
from pcr_rag.server.prompt_bound import PromptCharBound

KEY, OTHER, METRICS_KEY = "sk-tenant-a", "sk-tenant-b", "sk-metrics"


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def counted(url: str, status: int, headers: dict[str, str] | None = None) -> float:
    """``pcr:api_errors_total{status}`` from /metrics (0 when absent)."""
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line.startswith("pcr:api_errors_total{") and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def raw_request(url: str, data: bytes, *, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send ``data`` on a fresh socket, read until the server closes it: (what came back, seconds it took)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        if data:
            sock.sendall(data)
        received = b""
        while True:
            try:
                part = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not part:
                break
            received += part
    return received, time.monotonic() - start


# ------------------------------------------------------------------------------------------------ the event loop
def test_health_stays_fast_while_16_mib_bodies_are_processed(tiny, tmp_path, h) -> None:
    """Bodies just under 16 MiB, one after another, while /health is polled: a prompt over the character bound
    (400 before tokenizing); a prompt that fits max_model_len, padded with documents (tokenized, prefilled, 200); a
    prompt inside the bound but over max_model_len in tokens (tokenized, 400); and, with the server's bound switched
    off, a 2 MiB prompt tokenized in full by /tokenize on a request thread. /health's p99 stays under 100 ms. The engine freezes the garbage collector's old objects, as
    ``pcr-rag serve`` does (a full collection of the loaded process stops every thread, the loop included).
    The bodies are encoded before the clock starts: client and server share this process's GIL."""
    engine = PCREngine(*tiny, config=h.engine_config(tmp_path, freeze_gc=True))
    bound = PromptCharBound.of(engine.tokenizer, engine.max_model_len)
    assert bound is not None and bound.token_chars == max(len(t) for t in engine.tokenizer.get_vocab())
    size = 16 * 2**20 - 4096
    headers = {"content-type": "application/json"}
    over = json.dumps({"model": engine.loaded.name, "prompt": "word " * (size // 5)}).encode()
    # a prompt that fits: max_model_len - 8 of the longest token, padded to 16 MiB with documents it lacks
    longest = max(engine.tokenizer.get_vocab(), key=len)
    fits = json.dumps({"model": engine.loaded.name, "prompt": longest * (engine.max_model_len - 8), "max_tokens": 1,
                       "documents": ["padding " * 1024] * (size // 8192 - 2)}).encode()
    too_many_tokens = json.dumps({"model": engine.loaded.name, "prompt": "word " * (bound.max_chars // 5 - 10),
                                  "documents": ["padding " * 1024] * (size // 8192 - 2)}).encode()
    tokenized = json.dumps({"prompt": "word " * (2 * 2**20 // 5)}).encode()
    assert all(15 * 2**20 < len(b) < 16 * 2**20 for b in (over, fits, too_many_tokens))
    srv = ServerThread(engine, ServerSettings(port=0))
    latencies: list[float] = []
    try:
        with srv as url:
            stop = threading.Event()

            def poll() -> None:
                with httpx.Client(base_url=url, timeout=30) as c:
                    while not stop.is_set():
                        t0 = time.perf_counter()
                        assert c.get("/health").status_code == 200
                        latencies.append(time.perf_counter() - t0)
                        time.sleep(0.005)

            poller = threading.Thread(target=poll)
            poller.start()
            try:
                with httpx.Client(base_url=url, timeout=120, headers=headers) as c:
                    error = assert_error(c.post("/v1/completions", content=over), 400, "context_length_exceeded",
                                         "prompt")
                    assert error["message"].startswith("the prompt's text has")  # the server's bound, no tokens
                    r = c.post("/v1/completions", content=fits)
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["prompt_tokens"] >= engine.max_model_len - 8
                    assert_error(c.post("/v1/completions", content=too_many_tokens), 400, "context_length_exceeded",
                                 "prompt")
                    srv.state.char_bound = None
                    r = c.post("/tokenize", content=tokenized)
                    assert r.status_code == 200 and r.json()["count"] > 2 * 2**20 // 5
            finally:
                stop.set()
                poller.join()
    finally:
        engine.close()
    latencies.sort()
    assert len(latencies) >= 50
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    assert p99 < 0.1, f"/health p99 {p99 * 1e3:.1f} ms over {len(latencies)} polls"
    assert h.wait_until(lambda: h.idle(engine))


def test_char_bound_never_rejects_a_prompt_that_fits(engine) -> None:
    """The longest-token bound is loose enough: the densest text (every token its longest form) at exactly
    max_model_len tokens stays inside it, so only prompts that cannot fit are refused before tokenizing."""
    bound = PromptCharBound.of(engine.tokenizer, engine.max_model_len)
    longest = max(engine.tokenizer.get_vocab(), key=len)
    text = longest * engine.max_model_len
    assert len(engine.tokenizer(text, add_special_tokens=False)["input_ids"]) == engine.max_model_len
    assert len(text) <= bound.max_chars
    assert bound.min_tokens(bound.max_chars + 1) > engine.max_model_len


def test_announce_and_tokenize_refuse_text_over_the_bound_before_tokenizing(served, engine) -> None:
    bound = PromptCharBound.of(engine.tokenizer, engine.max_model_len)
    half = "x" * (bound.max_chars // 2 + 1)
    error = assert_error(httpx.post(served + "/v1/pcr/announce", json={"documents": [half, half]}), 400,
                         "context_length_exceeded", "documents")
    assert error["message"].startswith("the prompt's text has")
    assert_error(httpx.post(served + "/tokenize", json={"prompt": half * 2}), 400, "context_length_exceeded",
                 "prompt")
    assert engine.stats().prefetch["pending_announcements"] == 0


@pytest.mark.parametrize("bad", [{"header_timeout_s": 0}, {"body_timeout_s": float("inf")},
                                 {"keep_alive_timeout_s": -1}, {"max_connections": 0}, {"request_threads": True},
                                 {"max_header_bytes": 100}, {"metrics_key": " "}, {"metrics_public": "yes"}])
def test_settings_refuse_bad_limits(bad) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ServerSettings(**bad)


# ------------------------------------------------------------------------------------------------ slow clients
@pytest.fixture(scope="module", params=["httptools", "h11"])
def guarded(engine, request):
    """A server with short deadlines, on each of uvicorn's HTTP parsers (h11 is what an install without
    httptools runs)."""
    settings = ServerSettings(port=0, header_timeout_s=0.5, body_timeout_s=0.5, max_connections=3,
                              max_header_bytes=4096)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lifecycle, "guarded_protocol", functools.partial(lifecycle.guarded_protocol, impl=request.param))
        srv = ServerThread(engine, settings)
    assert type(srv.server.config.http).__name__ == "type" and request.param.lower() in (
        srv.server.config.http.__name__.lower())
    with srv as url:
        yield url


def test_partial_headers_are_answered_408_and_closed_within_the_timeout(guarded) -> None:
    received, took = raw_request(guarded, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert received.startswith(b"HTTP/1.1 408") and took < 3.0
    received, took = raw_request(guarded, b"")  # connected, sends nothing
    assert received.startswith(b"HTTP/1.1 408") and took < 3.0
    # a complete request on the same kind of connection is served
    received, _ = raw_request(guarded, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 200")


def test_a_trickled_body_is_cut_and_counted_408(guarded, engine) -> None:
    before = counted(guarded, 408)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    received, took = raw_request(guarded, head + b'{"model": ')
    assert took < 3.0 and not received.startswith(b"HTTP/1.1 200")
    assert wait_for(lambda: counted(guarded, 408) == before + 1)


def test_oversized_headers_get_431(guarded) -> None:
    received, _ = raw_request(guarded, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 431")


def test_connections_beyond_the_limit_get_503(guarded) -> None:
    host, port = guarded.removeprefix("http://").rsplit(":", 1)
    held = []
    try:
        for _ in range(3):  # the limit: each holds an idle kept-alive connection after one request
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            held.append(sock)
        received, _ = raw_request(guarded, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert received.startswith(b"HTTP/1.1 503")
        held.pop().close()
        assert wait_for(lambda: raw_request(guarded, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close"
                                                     b"\r\n\r\n")[0].startswith(b"HTTP/1.1 200"))
    finally:
        for sock in held:
            sock.close()


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


# ------------------------------------------------------------------------------------------------ /metrics
def test_tenant_keys_cannot_read_metrics_by_default(engine) -> None:
    with ServerThread(engine, ServerSettings(port=0, api_keys=(KEY, OTHER), tenant_per_key=True)) as url:
        assert_error(httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}), 403,
                     "metrics_forbidden")
        assert_error(httpx.get(url + "/metrics"), 401, "invalid_api_key")
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert_error(httpx.get(url + "/openapi.json"), 401)  # it names the served model, as /v1/models does
        assert httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_only_the_metrics_key_reads_metrics(engine) -> None:
    settings = ServerSettings(port=0, api_keys=(KEY,), metrics_key=METRICS_KEY)
    with ServerThread(engine, settings) as url:
        ok = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"})
        assert ok.status_code == 200 and "pcr:num_requests_running" in ok.text
        assert_error(httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}), 403)
        assert_error(httpx.get(url + "/metrics", headers={"Authorization": "Bearer wrong"}), 401)
        # the metrics key is no API key
        assert_error(httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {METRICS_KEY}"}), 401)
    with ServerThread(engine, ServerSettings(port=0, metrics_key=METRICS_KEY)) as url:  # no API keys at all
        assert_error(httpx.get(url + "/metrics"), 401)
        assert httpx.get(url + "/v1/models").status_code == 200


def test_public_metrics_is_an_explicit_choice(engine) -> None:
    with ServerThread(engine, ServerSettings(port=0, api_keys=(KEY,), metrics_public=True)) as url:
        assert httpx.get(url + "/metrics").status_code == 200
        assert_error(httpx.get(url + "/v1/models"), 401)
    with pytest.raises(ValueError, match="exclude"):
        ServerSettings(metrics_key=METRICS_KEY, metrics_public=True)
    with pytest.raises(ValueError, match="differ"):
        ServerSettings(api_keys=(KEY,), metrics_key=KEY)


# ------------------------------------------------------------------------------------------------ error paths
@pytest.fixture(scope="module")
def server_thread(engine):
    srv = ServerThread(engine, ServerSettings(port=0))
    with srv:
        yield srv


@pytest.fixture(scope="module")
def served(server_thread) -> str:
    return server_thread.base_url


def test_a_non_streamed_client_disconnect_counts_499_without_a_traceback(served, engine, h, caplog) -> None:
    before = counted(served, 499)
    body = json.dumps({"model": engine.loaded.name, "messages": h.rag_messages(), "max_tokens": 600,
                       "response_format": {"type": "regex", "regex": "(ab){300}"}}).encode()
    host, port = served.removeprefix("http://").rsplit(":", 1)
    with caplog.at_level(logging.INFO):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert h.wait_until(lambda: engine.stats().running == 1)
        assert wait_for(lambda: counted(served, 499) == before + 1)
        assert h.wait_until(lambda: h.idle(engine))
    assert counted(served, 500) == 0
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], caplog.text


def test_malformed_and_deeply_nested_json_get_openai_400s(served, engine) -> None:
    post = httpx.Client(base_url=served).post
    headers = {"content-type": "application/json"}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/pcr/announce", "/tokenize"):
        assert_error(post(path, content=b"{not json", headers=headers), 400)
        assert_error(post(path, content=b"[" * 100_000 + b"]" * 100_000, headers=headers), 400)
    nested = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "metadata": %s%s}' % (
        engine.loaded.name.encode(), b'{"a": ' * 50_000 + b"1", b"}" * 50_000)
    error = assert_error(post("/v1/chat/completions", content=nested, headers=headers), 400)
    assert "recursion" in error["message"]
    assert counted(served, 500) == 0


def test_integers_are_integers(served, engine, h) -> None:
    post = httpx.Client(base_url=served).post

    def chat(**extra):
        return post("/v1/chat/completions", json={"model": engine.loaded.name, "messages": h.rag_messages(),
                                                  "max_tokens": 2, **extra})

    assert_error(chat(n=True), 400, param="n")
    assert_error(chat(n=1.0), 400, param="n")
    assert_error(chat(max_tokens=True), 400, param="max_tokens")
    assert_error(chat(seed=2**63), 400, param="seed")
    assert_error(chat(seed=-(2**63) - 1), 400, param="seed")
    assert_error(chat(seed="7"), 400, param="seed")
    assert_error(chat(stream="yes"), 400, param="stream")
    assert chat(n=1, seed=2**63 - 1).status_code == 200


def test_a_vanishing_temperature_samples_greedily(served, engine, h) -> None:
    """Found by the fuzzer: temperature=1.4e-45 divided the logits into inf and failed the decode with a 500."""
    def chat(temperature):
        r = httpx.post(served + "/v1/chat/completions", json={
            "model": engine.loaded.name, "messages": h.rag_messages(), "max_tokens": 4, "temperature": temperature,
            "seed": 3, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    assert chat(1.401298464324817e-45) == chat(0.0)


def test_500s_carry_a_request_id_not_the_exception(served, engine, h, caplog, monkeypatch) -> None:
    secret = "RuntimeError /srv/secret/prompt-store"

    def broken(*_args, **_kwargs):
        raise RuntimeError(secret)

    monkeypatch.setattr(engine, "submit", broken)
    monkeypatch.setattr(engine, "announce", broken)
    with caplog.at_level(logging.ERROR):
        for path, body in (("/v1/chat/completions", {"model": engine.loaded.name, "messages": h.rag_messages()}),
                           ("/v1/pcr/announce", {"documents": ["a document"]})):
            r = httpx.post(served + path, json=body)
            error = assert_error(r, 500, "internal_error")
            assert "secret" not in r.text and "RuntimeError" not in r.text
            request_id = error["message"].split("request id ")[1].split(")")[0]
            logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
            assert logged and logged[0].exc_info and secret in str(logged[0].exc_info[1])


def test_an_unexpected_exception_anywhere_is_a_json_500(server_thread, caplog, monkeypatch) -> None:
    def broken(*_args):
        raise KeyError("internal detail")

    monkeypatch.setattr(server_thread.state.metrics_guard, "check", broken)
    with caplog.at_level(logging.ERROR):
        r = httpx.get(server_thread.base_url + "/metrics")
    assert_error(r, 500, "internal_error")
    assert "internal detail" not in r.text
    assert any(rec.exc_info for rec in caplog.records)


# ------------------------------------------------------------------------------------------------ the schema
def test_openapi_publishes_the_request_models(served) -> None:
    schema = httpx.get(served + "/openapi.json").json()
    components = schema["components"]["schemas"]
    chat = components["ChatCompletionRequest"]
    assert set(chat["required"]) == {"model", "messages"}
    n = chat["properties"]["n"]
    assert {"type": "integer", "minimum": 1} in n["anyOf"]
    seed = next(s for s in chat["properties"]["seed"]["anyOf"] if s.get("type") == "integer")
    assert seed["minimum"] == -(2**63) and seed["maximum"] == 2**63 - 1
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/ChatCompletionRequest")
    for path in ("/v1/completions", "/v1/pcr/announce", "/tokenize", "/v1/models", "/metrics", "/health"):
        assert path in schema["paths"]
