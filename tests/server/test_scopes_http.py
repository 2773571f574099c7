"""Per-document sharing scopes over HTTP: with a tenant per API key, documents sent as ``{"text", "scope":
"shared"}`` (or with a parallel ``scopes`` list) are reused across tenants, an unmarked or private one never is, the
answers equal the local engine's token for token, and the announce route passes the scopes to the engine."""

from __future__ import annotations

import httpx
import pytest

from pcr_rag import Doc, PCREngine
from pcr_rag.request import ChatPrompt, FlatPrompt, SamplingParams
from pcr_rag.server import ServerSettings, ServerThread

PUBLIC = ("The Rhine flows from the Swiss Alps to the North Sea through Germany and the Netherlands. " * 3,
          "Photosynthesis converts light energy into chemical energy stored in glucose molecules. " * 3)
SECRET_A = "Tenant A's merger with Initech closes on the ninth of March at a price of forty dollars a share. " * 3
SECRET_B = "Tenant B keeps its payroll in the basement safe, whose code is the year the company was founded. " * 3
KEYS = ("key-tenant-a", "key-tenant-b")
GUESSERS = ("key-guess-1", "key-guess-2", "key-guess-3", "key-guess-4")


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


@pytest.fixture(scope="module")
def victim_and_guessers(tiny, tmp_path_factory, h):
    """A server with a tenant per key: the victim (tenant A) and one tenant per guess, so that each guess's
    ``cached_tokens`` counts only what other tenants left (never the guesser's own earlier guesses)."""
    model, tokenizer = tiny
    engine = PCREngine(model, tokenizer, config=h.engine_config(tmp_path_factory.mktemp("guesses")))
    keys = (KEYS[0], *GUESSERS)
    srv = ServerThread(engine, ServerSettings(port=0, api_keys=keys, tenant_per_key=True), owns_engine=True)
    with srv:
        clients = [httpx.Client(base_url=srv.base_url, headers={"Authorization": f"Bearer {k}"}, timeout=60)
                   for k in keys]
        yield srv, clients[0], clients[1:]
        for c in clients:
            c.close()


def context_messages(texts) -> list[dict[str, str]]:
    """The documents in the system turn, the question in the user turn: a user turn's text is never shared across
    tenants, so documents shared across tenants go in the system turn (or open the user turn)."""
    return [{"role": "system", "content": "Answer from the context.\n\n" + "\n\n".join(texts)},
            {"role": "user", "content": "What does the first document say?"}]


def chat(client: httpx.Client, model: str, h, texts, documents, **extra) -> dict:
    r = client.post("/v1/chat/completions", json={"model": model, "messages": context_messages(texts),
                                                  "max_tokens": 6, "documents": documents,
                                                  "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def local_ids(reference: PCREngine, h, texts, docs) -> list[int]:
    prompt = ChatPrompt(context_messages(texts), docs)
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
    prompt = f"{PUBLIC[1]}\nQ: what is photosynthesis?\nA:"  # a raw prompt's text before a document is private

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


def _guess_cached(victim_and_guessers, request_for, secret: str, wrong: tuple[str, ...]) -> tuple[int, list[int]]:
    """The victim sends ``request_for(secret)``; each guesser (a tenant of its own) replays it with one guess.
    Returns (cached tokens of the right guess, cached tokens of each wrong guess)."""
    srv, victim, guessers = victim_and_guessers
    model = srv.state.model_name

    def send(client: httpx.Client, text: str) -> dict:
        r = client.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, **request_for(text)})
        assert r.status_code == 200, r.text
        return r.json()

    send(victim, secret)
    send(victim, secret)  # the victim's own repeat is what makes its chunks stay hot; nothing about the guesses
    assert len(wrong) < len(guessers)
    got = [cached(send(g, text)) for g, text in zip(guessers, (*wrong, secret))]
    return got[-1], got[:-1]


def test_a_guess_of_user_text_before_a_shared_document_earns_no_cached_tokens(victim_and_guessers) -> None:
    """Issue 47's chat-head probe: tenant A's user turn holds a secret before a document marked shared. Text of a
    user turn is never provably shared, so another tenant's right guess gets no more cached tokens than a wrong
    one (before the fix, everything before the first document was keyed under the shared root)."""

    def request_for(pin: str) -> dict:
        return {"messages": [{"role": "user",
                              "content": f"My bank PIN is {pin}. Context: {PUBLIC[0]} Question: Where does it flow?"}],
                "documents": [{"text": PUBLIC[0], "scope": "shared"}]}

    right, wrong = _guess_cached(victim_and_guessers, request_for, "4821", ("1111", "9999", "4820"))
    assert right <= min(wrong), f"the right PIN got {right} cached tokens, the wrong ones {wrong}"


def test_a_private_document_placed_before_a_shared_one_is_never_shared(victim_and_guessers) -> None:
    """Issue 47's second probe: documents=[PUBLIC (shared), SECRET (private)], but the prompt has SECRET first (in
    the system turn, which rides on the shared root when ``system_prompt_scope`` is "shared"). Located in list
    order from a moving cursor, SECRET was "not found" and stayed in the shared head; a document found out of order
    now makes everything from its position on private, so a right guess earns nothing a wrong one does not."""

    def request_for(secret: str) -> dict:
        return {"messages": [{"role": "system", "content": f"Answer from these notes.\n\n{secret}\n\n{PUBLIC[0]}"},
                             {"role": "user", "content": "Where does the river flow?"}],
                "documents": [{"text": PUBLIC[0], "scope": "shared"}, {"text": secret, "scope": "private"}]}

    secret = "The vault under the north office opens with the code 7391, known to the two directors only."
    wrong = tuple(secret.replace("7391", code) for code in ("1111", "9999", "7390"))
    right, wrong_cached = _guess_cached(victim_and_guessers, request_for, secret, wrong)
    assert right <= min(wrong_cached), f"the right secret got {right} cached tokens, the wrong ones {wrong_cached}"


def test_a_private_document_the_prompt_does_not_hold_is_a_400(tenants, h) -> None:
    """Where a private document's text is in the prompt cannot be decided when the prompt does not hold it
    verbatim: the request is refused with a 400 that says so, rather than shared by a guess."""
    srv, (a, _) = tenants
    r = a.post("/v1/chat/completions", json={"model": srv.state.model_name, "messages": context_messages(PUBLIC),
                                             "documents": [{"text": PUBLIC[0], "scope": "shared"},
                                                           {"text": SECRET_A, "scope": "private"}]})
    assert r.status_code == 400, r.text
    assert "marked private but does not occur" in r.json()["error"]["message"]
