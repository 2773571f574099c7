"""Per-document sharing scopes over HTTP: with a tenant per API key, documents sent as ``{"text", "scope":
"shared"}`` (or with a parallel ``scopes`` list) are reused across tenants, an unmarked or private one never is, the
answers equal the local engine's token for token, and the announce route passes the scopes to the engine."""

from __future__ import annotations

import httpx
import pytest

from pcr_rag import Doc, PCREngine
from pcr_rag.requests import ChatPrompt, FlatPrompt, SamplingParams
from pcr_rag.server import ServerSettings, ServerThread

PUBLIC = ("The Rhine flows from the Swiss Alps to the North Sea through Germany and the Netherlands. " * 3,
          "Photosynthesis converts light energy into chemical energy stored in glucose molecules. " * 3)
SECRET_A = "Tenant A's merger with Initech closes on the ninth of March at a price of forty dollars a share. " * 3
SECRET_B = "Tenant B keeps its payroll in the basement safe, whose code is the year the company was founded. " * 3
KEYS = ("key-tenant-a", "key-tenant-b")


@pytest.fixture(scope="module")
def tenants(tiny, tmp_path_factory, h):
    model, tokenizer = tiny
    engine = PCREngine(model, tokenizer, config=h.engine_config(tmp_path_factory.mktemp("scopes")))
    srv = ServerThread(engine, ServerSettings(port=0, api_keys=KEYS, tenant_per_key=True), owns_engine=True)
    with srv:
        clients = [httpx.Client(base_url=srv.base_url, headers={"Authorization": f"Bearer {k}"}, timeout=60)
                   for k in KEYS]
        yield srv, clients
        for c in clients:
            c.close()


def chat(client: httpx.Client, model: str, h, texts, documents, **extra) -> dict:
    r = client.post("/v1/chat/completions", json={"model": model, "messages": h.rag_messages(texts),
                                                  "max_tokens": 6, "documents": documents,
                                                  "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def local_ids(reference: PCREngine, h, texts, docs) -> list[int]:
    prompt = ChatPrompt(h.rag_messages(texts), docs)
    return reference.submit(prompt, SamplingParams(max_new_tokens=6)).result().token_ids


def test_shared_documents_are_reused_across_tenants_private_ones_never(tenants, reference, h) -> None:
    srv, (a, b) = tenants
    model = srv.state.model_name
    shared = [{"text": PUBLIC[0], "scope": "shared"}, {"text": PUBLIC[1], "scope": "shared"}]
    a_texts, b_texts = [*PUBLIC, SECRET_A], [*PUBLIC, SECRET_B]
    first_a = chat(a, model, h, a_texts, [*shared, SECRET_A])
    b_objects = chat(b, model, h, b_texts, [*shared, {"text": SECRET_B, "scope": None}])
    assert cached(first_a) == 0
    assert cached(b_objects) > 0, "B must reuse the public documents A computed"
    assert b_objects["usage"]["pcr"]["documents_found"] == 3
    # the same request with the scopes as a parallel list: the same reuse, the same answer
    b_list = chat(b, model, h, b_texts, [*PUBLIC, SECRET_B], scopes=["shared", "shared", None])
    assert cached(b_list) >= cached(b_objects)
    # B sends A's exact request: the shared head at most, never A's private document
    b_with_a = chat(b, model, h, a_texts, [*shared, SECRET_A])
    assert cached(b_with_a) <= cached(b_objects) + 16  # + at most the chunk the two requests share at the cut
    assert cached(b_with_a) < first_a["usage"]["prompt_tokens"] - len(SECRET_A) // 8
    # a private-only request: A's own repeat reuses it, B's identical one reuses nothing
    secret = [{"text": SECRET_A, "scope": "private"}]
    mine = chat(a, model, h, [SECRET_A], secret)
    again = chat(a, model, h, [SECRET_A], secret)
    theirs = chat(b, model, h, [SECRET_A], secret)
    assert cached(mine) == 0 and cached(again) > 0 and cached(theirs) == 0
    for body, texts, docs in ((first_a, a_texts, [Doc(PUBLIC[0], "shared"), Doc(PUBLIC[1], "shared"), SECRET_A]),
                              (b_objects, b_texts, [Doc(PUBLIC[0], "shared"), Doc(PUBLIC[1], "shared"), SECRET_B]),
                              (b_list, b_texts, [*PUBLIC, SECRET_B]), (b_with_a, a_texts, [*PUBLIC, SECRET_A]),
                              (theirs, [SECRET_A], [SECRET_A])):
        assert body["choices"][0]["token_ids"] == local_ids(reference, h, texts, docs)


def test_completions_take_document_scopes(tenants, reference) -> None:
    srv, (a, b) = tenants
    model = srv.state.model_name
    prompt = f"Context: {PUBLIC[1]}\nQ: what is photosynthesis?\nA:"

    def complete(client: httpx.Client) -> dict:
        r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                 "documents": [{"text": PUBLIC[1], "scope": "shared"}],
                                                 "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()

    first, other = complete(a), complete(b)
    assert cached(other) > 0
    want = reference.submit(FlatPrompt(prompt, (PUBLIC[1],), chat=False), SamplingParams(max_new_tokens=6)).result()
    assert first["choices"][0]["token_ids"] == other["choices"][0]["token_ids"] == want.token_ids


def test_bad_scopes_are_400s_naming_the_field(tenants, h) -> None:
    srv, (a, _) = tenants
    model = srv.state.model_name
    engine = srv.state.engine
    before = engine.stats().requests["requests_finished"]

    def param(body: dict, path: str = "/v1/chat/completions") -> str:
        r = a.post(path, json=body)
        assert r.status_code == 400, r.text
        return r.json()["error"]["param"]

    def body(documents, **extra) -> dict:
        return {"model": model, "messages": h.rag_messages(PUBLIC), "documents": documents, **extra}

    assert param(body([{"text": PUBLIC[0], "scope": "public"}])) == "documents"
    assert param(body([{"scope": "shared"}])) == "documents"
    assert param(body([{"text": 3}])) == "documents"
    assert param(body(list(PUBLIC), scopes=["shared"])) == "scopes"
    assert param(body(list(PUBLIC), scopes=["shared", "everyone"])) == "scopes"
    assert param(body([{"text": PUBLIC[0], "scope": "private"}, PUBLIC[1]], scopes=["shared", None])) == "scopes"
    assert param({"model": model, "messages": h.rag_messages(PUBLIC), "scopes": ["shared"]}) == "scopes"
    assert param({"model": model, "prompt": "hi", "documents": [{"text": "hi", "scope": 1}]},
                 "/v1/completions") == "documents"
    assert param({"documents": [{"text": PUBLIC[0], "scope": "world"}]}, "/v1/pcr/announce") == "documents"
    assert param({"documents": list(PUBLIC), "scopes": [None]}, "/v1/pcr/announce") == "scopes"
    assert engine.stats().requests["requests_finished"] == before  # nothing reached the engine


def test_announce_passes_the_scopes_to_the_engine(tenants, monkeypatch) -> None:
    srv, (a, _) = tenants
    engine = srv.state.engine
    seen: list = []
    announce = engine.announce

    def spy(documents, *args, **kwargs):
        seen.append((list(documents), kwargs.get("namespace")))
        return announce(documents, *args, **kwargs)

    monkeypatch.setattr(engine, "announce", spy)
    r = a.post("/v1/pcr/announce", json={"documents": [{"text": PUBLIC[0], "scope": "shared"}, SECRET_A],
                                         "query": "What flows?"})
    assert r.status_code == 200, r.text
    assert r.json()["documents"] == 2 and r.json()["chunks"] > 0
    r = a.post("/v1/pcr/announce", json={"documents": [PUBLIC[1], SECRET_A], "scopes": ["shared", "private"]})
    assert r.status_code == 200, r.text
    (first, ns1), (second, ns2) = seen
    assert first == [Doc(PUBLIC[0], "shared"), Doc(SECRET_A, None)]
    assert second == [Doc(PUBLIC[1], "shared"), Doc(SECRET_A, "private")]
    assert ns1 == ns2 and ns1  # the tenant's namespace
