"""vLLM's utility endpoints, in vLLM's response shapes, through the openai SDK's raw calls (``client.post``) and
plain httpx: ``/tokenize`` with a ``prompt`` or with chat ``messages`` (the chat template applied, as
/v1/chat/completions renders them), ``/detokenize`` and ``/version``."""

from __future__ import annotations

import httpx
import openai
import pytest

import pcr_rag
from pcr_rag.request import ChatPrompt, SamplingParams


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _post(client, path: str, body: dict) -> dict:
    return client.post(path, body=body, cast_to=httpx.Response).json()


def test_tokenize_a_prompt_in_vllms_shape(client, base_url, engine) -> None:
    text = "Path objects join with the slash operator."
    got = _post(client, "/tokenize", {"model": engine.loaded.name, "prompt": text})
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert got == {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
    strs = httpx.post(base_url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == engine.tokenizer.convert_ids_to_tokens(ids)


def test_tokenize_messages_gives_the_prompt_tokens_a_chat_request_runs(client, base_url, engine, h) -> None:
    """The chat template applied: the count equals the prompt_tokens /v1/chat/completions reports, and the tokens
    the engine runs for the same conversation."""
    messages = h.rag_messages()
    got = _post(client, "/tokenize", {"model": engine.loaded.name, "messages": messages})
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as v1:
        usage = v1.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=1).usage
    assert got["count"] == usage.prompt_tokens == len(got["tokens"])
    result = engine.submit(ChatPrompt(messages), SamplingParams(max_new_tokens=1)).result(timeout=60)
    assert got["tokens"] == list(result.prompt_token_ids)
    assert got["count"] > len(engine.tokenizer(messages[1]["content"], add_special_tokens=False)["input_ids"])
    kwargs = _post(client, "/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs["count"] >= got["count"]  # a template may ignore a variable, never fail on one


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "either 'prompt' or 'messages'"),
    ({}, "prompt", "either 'prompt' or 'messages'"),
    ({"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": False}, "add_generation_prompt",
     "not supported"),
    ({"messages": [{"role": "user", "content": "b"}], "continue_final_message": True}, "continue_final_message",
     "not supported"),
    ({"prompt": "a", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs", "applies to 'messages' only"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "user", "content": "b"}], "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs", "messages"),
])
def test_tokenize_refuses_what_it_cannot_honour(body, param, message, base_url) -> None:
    r = httpx.post(base_url + "/tokenize", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_detokenize_round_trips_tokenize(client, base_url, engine) -> None:
    text = "heapq implements a binary heap on a plain list."
    ids = _post(client, "/tokenize", {"prompt": text})["tokens"]
    assert _post(client, "/detokenize", {"model": engine.loaded.name, "tokens": ids}) == {"prompt": text}
    assert httpx.post(base_url + "/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    for tokens, message in (([len(engine.tokenizer)], "is not a token id"), ([-1], "is not a token id"),
                            ([1] * (engine.max_model_len + 1), "more than this server's max_model_len")):
        r = httpx.post(base_url + "/detokenize", json={"tokens": tokens})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and message in r.text
    bad_model = httpx.post(base_url + "/detokenize", json={"model": "other", "tokens": [1]})
    assert bad_model.status_code == 404


def test_version_names_the_installed_pcr_rag(client, base_url) -> None:
    assert client.get("/version", cast_to=httpx.Response).json() == {"version": pcr_rag.__version__}
    assert httpx.get(base_url + "/version").json() == {"version": pcr_rag.__version__}


def test_unknown_fields_of_the_utility_endpoints_are_disclosed(base_url) -> None:
    r = httpx.post(base_url + "/tokenize", json={"prompt": "a", "truncate_prompt_tokens": 3})
    assert r.status_code == 200 and r.headers["X-PCR-Ignored-Fields"] == "truncate_prompt_tokens"


def test_the_schema_lists_the_new_routes(base_url) -> None:
    paths = httpx.get(base_url + "/openapi.json").json()["paths"]
    assert {"/tokenize", "/detokenize", "/version"} <= set(paths)
