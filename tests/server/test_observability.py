"""The server's traces and logs: server spans join the client's W3C ``traceparent`` (plain HTTP and `HTTPEngine`,
announce included) and the engine's request spans are their children; every request's log lines carry its request
id, echoed in ``X-Request-Id``; ``pcr-rag serve --log-format json`` writes one JSON object per line."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from pcr_rag import logs, tracing
from pcr_rag.client.http import HTTPEngine
from pcr_rag.request import ChatPrompt, SamplingParams

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    try:
        yield provider, exporter
    finally:
        tracing.use_tracer_provider(None)


def spans_named(exporter: InMemorySpanExporter, *names: str, timeout: float = 10.0) -> dict[str, ReadableSpan]:
    """The newest finished span of each name, once all are there (engine spans end in a done-callback)."""
    deadline = time.monotonic() + timeout
    while True:
        found = {s.name: s for s in exporter.get_finished_spans() if s.name in names}
        if len(found) == len(names) or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def test_server_span_joins_a_plain_http_traceparent(base_url, engine, provider, h) -> None:
    _, exporter = provider
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    body = {"model": engine.loaded.name, "messages": h.rag_messages(), "max_tokens": 3}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200
    request_span = f"chat {engine.loaded.name}"
    found = spans_named(exporter, "POST /v1/chat/completions", request_span)
    server, request = found["POST /v1/chat/completions"], found[request_span]
    assert server.kind is SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert format(server.parent.span_id, "016x") == PARENT_ID and server.parent.is_remote
    assert server.attributes["http.response.status_code"] == 200
    assert request.context.trace_id == server.context.trace_id and request.parent.span_id == server.context.span_id
    usage = response.json()["usage"]
    assert request.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert request.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]


def test_remote_engine_carries_the_callers_trace_to_the_server_announce_included(base_url, engine, provider,
                                                                                 h) -> None:
    tracer_provider, exporter = provider
    app = tracer_provider.get_tracer("app")
    docs = ["A retrieved passage about tracing RAG pipelines end to end, from retriever to LLM. " * 2]
    with HTTPEngine(base_url) as remote, app.start_as_current_span("query") as query:
        with app.start_as_current_span("retrieve"):
            remote.announce(docs, query="what is traced?")
        with app.start_as_current_span("llm"):
            remote.submit(ChatPrompt([{"role": "user", "content": f"{docs[0]}\nwhat is traced?"}], docs),
                          SamplingParams(max_new_tokens=2)).result()
    trace_id = query.get_span_context().trace_id
    request_span = f"chat {engine.loaded.name}"
    spans_named(exporter, request_span, "POST /v1/chat/completions")
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in spans}

    def path(span: ReadableSpan) -> list[str]:
        out = []
        while span.parent is not None and span.parent.span_id in by_id:
            span = by_id[span.parent.span_id]
            out.append(span.name)
        return out

    announces = [s for s in spans if s.name == "pcr_rag.announce"]
    client = next(s for s in announces if s.kind is SpanKind.CLIENT)
    local = next(s for s in announces if s.kind is SpanKind.INTERNAL)
    assert path(client) == ["retrieve", "query"]
    assert path(local) == ["POST /v1/pcr/announce", "pcr_rag.announce", "retrieve", "query"]
    (request,) = [s for s in spans if s.name == request_span]
    assert path(request) == ["POST /v1/chat/completions", "llm", "query"]
    assert [link.context.span_id for link in request.links] == [local.context.span_id]  # retrieval -> prefill
    (prefill,) = [s for s in spans if s.name == "pcr_rag.prefill"]
    assert path(prefill)[0] == request_span


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    root = logging.getLogger()
    level, previous = root.level, logs._installed
    handler = logs.install("json", logging.DEBUG, stream=stream)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        logs._installed = previous


def test_every_log_line_of_a_request_carries_its_id(base_url, engine, json_log, h) -> None:
    body = {"model": engine.loaded.name, "messages": h.rag_messages(), "max_tokens": 2}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers={"X-Request-Id": "client-id-7"},
                          timeout=60)
    assert response.status_code == 200 and response.headers["x-request-id"] == "client-id-7"
    h.wait_until(lambda: "pcr_rag.server.observability" in json_log.getvalue())
    records = [json.loads(line) for line in json_log.getvalue().splitlines()]
    mine = [r for r in records if r["request_id"] == "client-id-7"]
    loggers = {r["logger"] for r in mine}
    # the access line (event loop) and the engine's line about the request (executor thread) carry the same id
    assert {"pcr_rag.server.observability", "pcr_rag.sched.batch"} <= loggers, records
    for r in records:
        if r["logger"] in loggers and "client-id-7" not in r["request_id"]:
            assert not r["message"].startswith(("POST /v1/chat/completions", "request "))

    insane = "x" * 200  # over MAX_REQUEST_ID_CHARS: replaced, never logged
    again = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers={"X-Request-Id": insane}, timeout=60)
    assert again.headers["x-request-id"].startswith("req-") and insane not in json_log.getvalue()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_log_format_json_writes_json_lines(tmp_path) -> None:
    from pcr_rag.testing import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny-llama")
    port = _free_port()
    cmd = [sys.executable, "-m", "pcr_rag.cli", "-v", "serve", "--model", str(model_dir), "--port", str(port),
           "--cache-dir", str(tmp_path / "kv"), "--max-new-tokens", "2", "--max-model-len", "512",
           "--dtype", "float32", "--log-format", "json", "--no-warmup"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        response = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "json-1"}, timeout=60)
        assert response.status_code == 200, response.text
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    not_json = [line for line in lines if not line.startswith("{")]
    assert not not_json, not_json[:5]
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert {"timestamp", "level", "logger", "message", "request_id"} <= set(records[0])
    assert any(r["logger"].startswith("uvicorn") for r in records)  # uvicorn's own lines too
    access = [r for r in records if r["request_id"] == "json-1"]
    assert any(r["message"].startswith("POST /v1/chat/completions -> 200") for r in access)
    assert any(r["logger"] == "pcr_rag.sched.batch" for r in access)


def test_log_format_is_a_serve_setting_checked_before_the_model_loads(capsys) -> None:
    import argparse

    from pcr_rag.errors import ConfigError
    from pcr_rag.server.cli import ServeOptions, add_arguments, serve_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert serve_config(parser.parse_args(["--log-format", "json"]), environ={}).options.log_format == "json"
    assert serve_config(parser.parse_args([]), environ={"PCR_RAG_LOG_FORMAT": "json"}).options.log_format == "json"
    assert serve_config(parser.parse_args([]), environ={}).options.log_format == "text"
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])
    assert "json" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="log_format must be one of"):
        ServeOptions(log_format="xml")
