"""Per-request instructions after the documents over HTTP (issue 48 item 3): ``POST /v1/completions`` with
``layout: "rag"`` lays out ``[system + instruction][documents][system_tail][question]`` as `PCREngine.generate`
does, so two requests whose tails differ reuse the documents and each equals a cache-off engine's answer; a
``system_tail`` the server cannot place (chat messages, a flat prompt) or of the wrong type is a 400 before any
compute; `HTTPEngine` sends a `RagPrompt` there and gives the local engine's tokens and reuse figures."""

from __future__ import annotations

import httpx
import pytest

from pcr_rag import PCREngine
from pcr_rag.client.http import HTTPEngine
from pcr_rag.client.routing import ROUTE_HEADER, routing_key
from pcr_rag.request import RagPrompt, SamplingParams

DOCS = (
    "Kafka stores ordered records in partitions that consumers read at their own pace. " * 3,
    "Gradient descent follows the negative gradient to reduce the loss function step by step. " * 3,
)
BASE = "Answer from the documents."
USERS = ("Today is 2026-12-06. The user is Ana, a data engineer in Lisbon.",
         "Today is 2026-12-07. The user is Bo, a student in Oslo who prefers short answers.")
QUESTION = "what do the documents say?"
CHUNK = 16  # the fixtures' chunk_size: a chunk the tail cuts into is computed again


def rag_body(model: str, tail: str | None, **extra) -> dict:
    body = {"model": model, "prompt": QUESTION, "documents": list(DOCS), "system": BASE, "layout": "rag",
            "max_tokens": 6, "return_token_ids": True, **extra}
    return body if tail is None else {**body, "system_tail": tail}


def test_documents_are_reused_across_tails_and_answers_equal_a_cache_off_engine(fresh, tiny, tmp_path, h) -> None:
    engine, url = fresh()
    model, tokenizer = tiny
    with PCREngine(model, tokenizer, config=h.engine_config(tmp_path / "off", enable_cache=False)) as off:
        want = {u: off.generate(QUESTION, DOCS, system=BASE, system_tail=u, max_new_tokens=6) for u in USERS}
        plain = off.generate(QUESTION, DOCS, system=BASE, max_new_tokens=6)
    doc_tokens = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in DOCS)
    with httpx.Client(base_url=url, timeout=60) as client:
        answers = {}
        for u in USERS:
            r = client.post("/v1/completions", json=rag_body(engine.loaded.name, u))
            assert r.status_code == 200, r.text
            assert "X-PCR-Ignored-Fields" not in r.headers  # layout and system_tail are fields of the API
            answers[u] = r.json()
        r = client.post("/v1/completions", json=rag_body(engine.loaded.name, None))  # no tail: generate's layout
        assert r.status_code == 200, r.text
        no_tail = r.json()
    for u in USERS:
        choice = answers[u]["choices"][0]
        assert choice["token_ids"] == want[u].token_ids and choice["text"] == want[u].text
        assert choice["prompt_token_ids"] == want[u].prompt_token_ids  # the same prompt, laid out by the server
    assert no_tail["choices"][0]["token_ids"] == plain.token_ids
    first, second = (answers[u]["usage"] for u in USERS)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # the second tail differs from the first: the head and both documents are reused (all but the chunk the tail
    # cuts into), the tail and the question computed
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached >= doc_tokens - CHUNK and second["pcr"]["documents_found"] == len(DOCS)
    assert second["pcr"]["computed_tokens"] + cached == second["prompt_tokens"]


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"system_tail": USERS[0]}, "system_tail"),     # the caller lays out messages
    ("/v1/completions", {"layout": "flat", "system_tail": USERS[0]}, "system_tail"),
    ("/v1/completions", {"system_tail": USERS[0]}, "system_tail"),          # flat is the default layout
    ("/v1/completions", {"layout": "rag", "system_tail": 3}, "system_tail"),
    ("/v1/completions", {"layout": "rag", "system_tail": True}, "system_tail"),
    ("/v1/completions", {"layout": "rag", "system_tail": ["a", "b"]}, "system_tail"),
    ("/v1/completions", {"layout": "rag", "system_tail": {"text": "a"}}, "system_tail"),
    ("/v1/completions", {"layout": "tree", "system_tail": "a"}, "layout"),
    ("/v1/completions", {"layout": "rag", "chat_template": False, "system_tail": "a"}, "chat_template"),
])
def test_a_tail_the_server_cannot_place_or_of_the_wrong_type_is_a_400_before_any_compute(
        server, engine, h, path, extra, param) -> None:
    before = engine.stats().requests
    body = {"model": engine.loaded.name, "documents": list(h.DOCS[:2]), "max_tokens": 2, **extra}
    body.update({"messages": h.rag_messages(h.DOCS[:2])} if path.endswith("chat/completions")
                else {"prompt": "Context:\n" + "\n\n".join(h.DOCS[:2]) + "\n\nQuestion: what is json?"})
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if param == "system_tail" and isinstance(extra["system_tail"], str):
        assert "rag" in error["message"] and "after the documents" in error["message"]
    after = engine.stats().requests
    assert (after["requests_finished"], after["prompt_tokens"]) == (before["requests_finished"],
                                                                     before["prompt_tokens"])
    assert h.idle(engine)


def test_a_tail_past_the_prompt_bound_is_refused_before_tokenizing(server, engine, h) -> None:
    """The tail's characters count in the prompt's character bound (`PromptCharBound`), as every text field's."""
    bound = engine.max_model_len * 12  # the tiny tokenizer's longest token: 12 characters (test_prompt_bound)
    before = engine.stats().requests["prompt_tokens"]
    tail = "z" * (bound - len(QUESTION) - 1)
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={"model": engine.loaded.name, "prompt": QUESTION, "documents": ["a short document"],
                         "layout": "rag", "system_tail": tail, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert engine.stats().requests["prompt_tokens"] == before


def test_the_openapi_schema_publishes_the_fields(server) -> None:
    schema = httpx.get(server.base_url + "/openapi.json", timeout=30).json()["components"]["schemas"]
    completion = schema["CompletionRequest"]["properties"]
    assert {"type": "string"} in completion["system_tail"]["anyOf"]
    assert "after the" in completion["system_tail"]["description"]
    layouts = {v for option in completion["layout"]["anyOf"] for v in option.get("enum", ())}
    assert layouts == {"flat", "rag"}
    chat = schema["ChatCompletionRequest"]["properties"]["system_tail"]
    assert "400" in chat["description"]  # published, with where it is refused


def test_remote_engine_sends_a_rag_prompt_and_gives_the_local_engine_s_tokens(fresh, tiny, tmp_path, h) -> None:
    """The same RAG requests (tails differing, one announced first, one streamed) to a local engine and through
    `HTTPEngine` to a server's engine, each on a fresh cache: the same tokens and the same reuse figures."""
    served, url = fresh()
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=5)
    steps = [(USERS[0], False), (USERS[1], True), (None, False), ("  ", True)]
    with PCREngine(model, tokenizer, config=h.engine_config(tmp_path / "local")) as local, \
            HTTPEngine(url) as remote:
        for i, (tail, stream) in enumerate(steps):
            prompt = RagPrompt(QUESTION, DOCS, BASE, system_tail=tail)
            want = local.submit(prompt, params).result()
            handle = remote.submit(prompt, params)
            if stream:
                pieces = list(handle)
                got = pieces[-1].result
                assert "".join(p.text for p in pieces) == got.text
            else:
                got = handle.result()
            assert got.token_ids == want.token_ids and got.text == want.text, i
            assert got.prompt_token_ids == want.prompt_token_ids, i
            w, g = want.metrics, got.metrics
            assert (g.reused_tokens, g.computed_tokens, g.prompt_tokens) == (
                w.reused_tokens, w.computed_tokens, w.prompt_tokens), i
            assert got.documents_found == want.documents_found == len(DOCS)
        assert got.metrics.reused_tokens > 0
        # an announcement made before the tail is known is claimed by the request with it, as locally
        ticket = remote.announce(list(DOCS), query=QUESTION, system=BASE)
        assert ticket.chunks > 0
        got = remote.submit(RagPrompt(QUESTION, DOCS, BASE, system_tail="Today is 2026-12-08."), params).result()
        assert got.metrics.announced
        # the route names the first document after the system text: the tail never moves a request elsewhere
        _, args = remote.request_arguments(RagPrompt(QUESTION, DOCS, BASE, system_tail=USERS[0]), params)
        assert args["extra_headers"][ROUTE_HEADER] == routing_key(DOCS[:1], system=BASE)
        assert args["extra_body"]["layout"] == "rag" and args["extra_body"]["system_tail"] == USERS[0]
    assert served.stats().requests["requests_finished"] == len(steps) + 1
