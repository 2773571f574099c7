"""Bad input gets OpenAI-shaped errors before anything reaches the engine: 400/401/404/413, and no pinned chunk."""

from __future__ import annotations

import httpx
import openai
import pytest

from pcr_rag.server import ServerSettings, ServerThread

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c


def chat_body(engine, h, **extra):
    return {"model": engine.loaded.name, "messages": h.rag_messages(), "max_tokens": 4, **extra}


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def test_every_bad_request_is_rejected_before_the_engine(http, engine, h) -> None:
    before = engine.stats().requests
    post = http.post
    assert_error(post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(post("/v1/chat/completions", content=b""), 400)
    assert_error(post("/v1/chat/completions", json=[1, 2]), 400)
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, model="gpt-4o")), 404, "model_not_found",
                 "model")
    assert_error(post("/v1/completions", json={"model": "nope", "prompt": "hi"}), 404, "model_not_found")
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, max_tokens=-3)), 400, param="max_tokens")
    assert_error(post("/v1/completions", json={"model": engine.loaded.name, "prompt": "hi", "max_tokens": 0}), 400,
                 param="max_tokens")
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, documents=["ok", 3])), 400,
                 param="documents")
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, documents="one string")), 400,
                 param="documents")
    too_long = chat_body(engine, h, max_tokens=engine.max_model_len)
    assert_error(post("/v1/chat/completions", json=too_long), 400, "context_length_exceeded", "messages")
    assert_error(post("/v1/completions", json={"model": engine.loaded.name, "prompt": "x " * 600, "max_tokens": 500}),
                 400, "context_length_exceeded", "prompt")
    error = assert_error(post("/v1/chat/completions", json=chat_body(engine, h, n=9)), 400, param="n")
    assert "send several requests" in error["message"]
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, tools=[{"type": "function"}])), 400,
                 param="tools[0].function")
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, logit_bias={"5": 1.0})), 400,
                 param="logit_bias")
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, top_logprobs=2)), 400, param="top_logprobs")
    no_schema = {"type": "json_schema", "json_schema": {"name": "no schema"}}
    error = assert_error(post("/v1/chat/completions", json=chat_body(engine, h, response_format=no_schema)), 400,
                         param="response_format")
    assert "needs the schema" in error["message"]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, response_format=bad_schema)), 400,
                 param="response_format")
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, response_format="json")), 400,
                 param="response_format")
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, temperature=3)), 400, param="temperature")
    assert_error(post("/v1/chat/completions", json=chat_body(engine, h, stream_options={"include_usage": True})),
                 400, param="stream_options")
    assert_error(post("/v1/chat/completions", json={"model": engine.loaded.name, "messages": []}), 400,
                 param="messages")
    assert_error(post("/v1/chat/completions", json={"model": engine.loaded.name,
                                                    "messages": [{"role": "tool", "content": "x"}]}), 400)
    assert_error(post("/v1/completions", json={"model": engine.loaded.name, "prompt": [1, 2, 3]}), 400,
                 param="prompt")
    big = {"model": engine.loaded.name, "prompt": "word " * 20_000}  # ~100 KB > the fixture's 64 KiB limit
    assert_error(post("/v1/completions", json=big), 413, "request_too_large")
    assert_error(post("/v1/pcr/announce", json={"documents": [1]}), 400, param="documents")
    assert_error(post("/v1/pcr/announce", json={"documents": []}), 400, param="documents")
    assert_error(http.delete("/v1/pcr/announce/999999"), 404, "announcement_not_found")
    assert_error(http.get("/v1/no-such-route"), 404)
    after = engine.stats()
    assert after.requests["requests_finished"] == before["requests_finished"]  # nothing reached the engine
    assert after.requests["requests_failed"] == before["requests_failed"]
    assert after.cache.pinned_chunks == 0 and after.queue_depth == 0 and after.running == 0


def test_openai_client_sees_typed_errors(base_url, engine, h) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=h.rag_messages())
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=engine.loaded.name, messages=h.rag_messages(),
                                       max_tokens=engine.max_model_len)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=engine.loaded.name, messages=h.rag_messages(), n=9)
    assert engine.stats().cache.pinned_chunks == 0


def test_api_key_guards_every_endpoint_but_health(engine, h) -> None:
    with ServerThread(engine, ServerSettings(port=0, api_keys=(KEY,))) as url, httpx.Client(base_url=url) as c:
        assert c.get("/health").status_code == 200
        for method, path, body in (("GET", "/v1/models", None), ("GET", "/metrics", None),
                                   ("POST", "/v1/chat/completions", chat_body(engine, h)),
                                   ("POST", "/v1/completions", {"model": engine.loaded.name, "prompt": "hi"}),
                                   ("POST", "/v1/pcr/announce", {"documents": ["a"]}),
                                   ("POST", "/tokenize", {"prompt": "hi"})):
            assert_error(c.request(method, path, json=body), 401, "invalid_api_key")
            assert_error(c.request(method, path, json=body, headers={"Authorization": "Bearer wrong"}), 401)
            assert_error(c.request(method, path, json=body, headers={"Authorization": KEY}), 401)
        ok = c.post("/v1/chat/completions", json=chat_body(engine, h), headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
        client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        assert openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0).models.list().data
    assert h.wait_until(lambda: h.idle(engine))
