"""`HTTPEngine` on the openai SDK against a real `pcr-rag serve`: the same request through the local engine and the
server gives the same tokens (structured output, sync and async streams, scoped documents); a draining server's
503 and a full queue's 429 are retried within the caller's deadline; every sampling field travels or is refused;
an announcement from async LlamaIndex code does not block the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest

from pcr_rag import Doc
from pcr_rag.client.http import HTTPEngine, RemoteEngineError, RemotePromptTooLongError
from pcr_rag.errors import InvalidRequestError, QueueFullError
from pcr_rag.request import ChatPrompt, FlatPrompt, SamplingParams
from pcr_rag.response_format import ResponseFormat
from pcr_rag.server import ServerSettings, ServerThread
from pcr_rag.server.errors import from_engine_error

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                           "ok": {"type": "boolean"}}, "required": ["answer", "ok"]}
FORMATS = [ResponseFormat.json_schema(SCHEMA), ResponseFormat("regex", "[a-c]{3,6}")]


class Interposer:
    """ASGI wrapper around the server's app: the next requests to a path follow ``plan[path]`` (popped in order):
    503 = answered by the server itself while it is draining, 429 = the server's own queue-full answer, a float =
    delayed by that many seconds, then served. ``seen`` lists (path, what happened)."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state
        self.plan: dict[str, list[int | float]] = {}
        self.seen: list[tuple[str, int | float | str]] = []

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        step = self.plan[path].pop(0) if scope["type"] == "http" and self.plan.get(path) else None
        if scope["type"] == "http":
            self.seen.append((path, "served" if step is None else step))
        if step == 503:
            self.state.draining = True
            try:
                await self.app(scope, receive, send)
            finally:
                self.state.draining = False
        elif step == 429:
            error = from_engine_error(QueueFullError("the waiting queue is full (max_queue)"))
            body = json.dumps(error.body()).encode()
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
        else:
            if isinstance(step, float):
                await asyncio.sleep(step)
            await self.app(scope, receive, send)

    def count(self, path: str, what: int | float | str) -> int:
        return sum(1 for p, w in self.seen if p == path and w == what)


@pytest.fixture(scope="module")
def interposed(engine):
    """(base URL, Interposer) of a second server over the module's engine."""
    srv = ServerThread(engine, ServerSettings(port=0))
    wrapper = Interposer(srv.server.config.app, srv.state)
    srv.server.config.app = wrapper
    srv.start()
    yield srv.base_url, wrapper
    srv.stop()


@pytest.fixture(scope="module")
def remote(base_url):
    with HTTPEngine(base_url) as r:
        yield r


def tokens(pieces) -> list[int]:
    assert pieces[-1].is_final
    return [p.token_id for p in pieces[:-1]]


# ------------------------------------------------------------------------------------------------ same tokens
@pytest.mark.parametrize("fmt", FORMATS, ids=["json_schema", "regex"])
def test_structured_output_streams_equal_the_local_engine(remote, reference, h, fmt) -> None:
    prompt = ChatPrompt(h.rag_messages(h.DOCS[:2]), h.DOCS[:2])
    params = SamplingParams(max_new_tokens=16, response_format=fmt)
    want = reference.submit(prompt, params).result()
    assert want.token_ids != reference.submit(prompt, SamplingParams(max_new_tokens=16)).result().token_ids

    async def streamed():
        return [p async for p in remote.submit(prompt, params)]

    sync_pieces = list(remote.submit(prompt, params))
    async_pieces = asyncio.run(streamed())
    assert tokens(sync_pieces) == tokens(async_pieces) == want.token_ids
    assert sync_pieces[-1].result.text == async_pieces[-1].result.text == "".join(p.text for p in sync_pieces)
    assert asyncio.run(remote.submit(prompt, params).aresult()).token_ids == want.token_ids


def test_completions_prompt_with_stop_and_seed_equals_the_local_engine(remote, reference, h) -> None:
    flat = FlatPrompt("Context: " + h.DOCS[0] + "\nQ: what joins paths?\nA:", (h.DOCS[0],), chat=True,
                      system="Answer briefly.")
    free = reference.submit(flat, SamplingParams(max_new_tokens=8)).result()
    stop = free.text[len(free.text) // 2:][:3] or free.text
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=1234, stop=(stop,))
    want = reference.submit(flat, params).result()
    got = remote.submit(flat, params).result()
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert tokens(list(remote.submit(flat, params))) == want.token_ids


def test_scoped_documents_travel_and_are_shared_across_tenants_only_when_shared(engine, reference, h) -> None:
    keys = ("sk-tenant-a", "sk-tenant-b")
    with ServerThread(engine, ServerSettings(port=0, api_keys=keys, tenant_per_key=True)) as url, \
            HTTPEngine(url, api_key=keys[0]) as a, HTTPEngine(url, api_key=keys[1]) as b:
        reused = {}
        for scope in ("shared", "private"):
            docs = [f"{d} ({scope} copy)" for d in h.DOCS[:2]]
            # the documents sit in the system turn: a user turn's text before a document is private (issue 47),
            # so only a document after template or system text can be shared across tenants
            messages = [{"role": "system", "content": "Answer from the context.\n\n" + "\n\n".join(docs)},
                        {"role": "user", "content": "Question: what joins paths?"}]
            prompt = ChatPrompt(messages, [Doc(d, scope) for d in docs])
            params = SamplingParams(max_new_tokens=4)
            want = reference.submit(prompt, params).result()
            first = a.submit(prompt, params).result()
            second = b.submit(prompt, params).result()
            assert first.token_ids == second.token_ids == want.token_ids and second.documents_found == 2
            reused[scope] = second.metrics.reused_tokens
        assert reused["shared"] > 0 and reused["private"] == 0, reused
        ticket = a.announce([Doc(h.DOCS[2], "shared"), h.DOCS[0]], query="what?")
        assert ticket.documents == (h.DOCS[2], h.DOCS[0]) and ticket.chunks > 0
        assert a.cancel_announcement(ticket) is True


def wire_view(logprobs, chat: bool) -> list:
    """Logprobs as they survive OpenAI's shapes: token, value (-inf as -9999), the alternatives' text and value
    (their ids do not travel); chat also the bytes, while the legacy completions shape has none and keys the
    alternatives by text (two tokens of one text keep one entry)."""
    def value(x: float) -> float:
        return -9999.0 if x == float("-inf") else x

    def alternatives(e):
        pairs = [(t.token, value(t.logprob)) for t in e.top_logprobs]
        return pairs if chat else dict(pairs)

    return [(e.token_id, e.token, e.bytes if chat else None, value(e.logprob), alternatives(e)) for e in logprobs]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_new_sampling_fields_and_logprobs_equal_the_local_engine(remote, reference, h, chat) -> None:
    prompt = (ChatPrompt(h.rag_messages(h.DOCS[:2]), h.DOCS[:2]) if chat
              else FlatPrompt("Context: " + h.DOCS[0] + "\nQ: what joins paths?\nA:", (h.DOCS[0],), chat=False))
    params = SamplingParams(max_new_tokens=8, temperature=0.9, seed=7, top_k=5, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.3, logprobs=True, top_logprobs=2)
    want = reference.submit(prompt, params).result()
    plain = reference.submit(prompt, SamplingParams(max_new_tokens=8, temperature=0.9, seed=7)).result()
    assert plain.token_ids != want.token_ids, "the options must change the tiny model's answer, or this proves nothing"
    got = remote.submit(prompt, params).result()
    assert got.token_ids == want.token_ids and got.text == want.text
    assert wire_view(got.logprobs, chat) == wire_view(want.logprobs, chat) and len(want.logprobs) == len(want.token_ids)
    pieces = list(remote.submit(prompt, params))
    assert tokens(pieces) == want.token_ids
    assert wire_view([p.logprobs for p in pieces[:-1]], chat) == wire_view(want.logprobs, chat)


# ------------------------------------------------------------------------------------------------ retries
def test_a_draining_server_503_is_retried_sync_async_and_streamed(interposed, reference, h) -> None:
    url, wrapper = interposed
    prompt = ChatPrompt(h.rag_messages(), h.DOCS)
    params = SamplingParams(max_new_tokens=4)
    want = reference.submit(prompt, params).result()
    path = "/v1/chat/completions"
    with HTTPEngine(url, max_retries=2) as r:
        assert r.loaded.name
        wrapper.plan[path] = [503, 503]
        assert r.submit(prompt, params).result().token_ids == want.token_ids
        wrapper.plan[path] = [503]
        assert asyncio.run(r.submit(prompt, params).aresult()).token_ids == want.token_ids
        wrapper.plan[path] = [503]
        assert tokens(list(r.submit(prompt, params))) == want.token_ids
        assert wrapper.count(path, 503) == 4 and wrapper.count(path, "served") == 3
        wrapper.plan[path] = [503, 503, 503]
        with pytest.raises(RemoteEngineError, match="503"):
            r.submit(prompt, params).result()


def test_a_full_queue_429_is_retried_then_raises_queue_full(interposed, reference, h) -> None:
    url, wrapper = interposed
    prompt = ChatPrompt(h.rag_messages(), h.DOCS)
    params = SamplingParams(max_new_tokens=4)
    path = "/v1/chat/completions"
    with HTTPEngine(url, max_retries=1) as r:
        assert r.loaded.name
        before = len(wrapper.seen)
        wrapper.plan[path] = [429, 429]
        with pytest.raises(QueueFullError, match="retry later"):
            r.submit(prompt, params).result()
        assert [w for _, w in wrapper.seen[before:]] == [429, 429]  # the first answer and one retry
        wrapper.plan[path] = [429]
        assert r.submit(prompt, params).result().token_ids == reference.submit(prompt, params).result().token_ids


def test_no_retry_starts_after_the_callers_deadline(interposed, h) -> None:
    url, wrapper = interposed
    path = "/v1/chat/completions"
    with HTTPEngine(url, max_retries=8) as r:
        assert r.loaded.name
        before = len(wrapper.seen)
        wrapper.plan[path] = [503] * 8
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            r.submit(ChatPrompt(h.rag_messages()), SamplingParams(max_new_tokens=2), timeout=0.3).result()
        assert time.monotonic() - start < 2.0  # 8 retries with backoff would take many seconds
        assert len(wrapper.seen) - before <= 2
        wrapper.plan[path] = []


# ------------------------------------------------------------------------------------------------ what travels
def capture(chat: bool = True, **choice_fields):
    """A HTTPEngine whose requests land in a list (MockTransport answering an empty completion, or one token
    with ``choice_fields``; a stream when asked)."""
    bodies: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        text = {"message": {"role": "assistant", "content": ""}} if chat else {"text": ""}
        choice = {"index": 0, "finish_reason": "length", "token_ids": [], **text, **choice_fields}
        data = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice],
                "usage": {"prompt_tokens": 1}}
        if not body.get("stream"):
            return httpx.Response(200, json=data)
        if chat:
            choice["delta"] = choice.pop("message")
        events = [{**data, "usage": None}, {**data, "choices": []}]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=sse.encode())

    return HTTPEngine("http://pcr.invalid", model="m", transport=httpx.MockTransport(answer)), bodies


# field -> (a non-default value, (chat body key, completion body key)); None: not in that body. New
# SamplingParams fields must be added here (the completeness test fails otherwise).
WIRE = {
    "max_new_tokens": (7, ("max_tokens", "max_tokens")),
    "temperature": (0.5, ("temperature", "temperature")),
    "top_p": (0.9, ("top_p", "top_p")),
    "stop": (("\n",), ("stop", "stop")),
    "seed": (42, ("seed", "seed")),
    "response_format": (ResponseFormat("regex", "[ab]+"), ("response_format", "response_format")),
    "top_k": (5, ("top_k", "top_k")),
    "repetition_penalty": (1.2, ("repetition_penalty", "repetition_penalty")),
    "presence_penalty": (0.5, ("presence_penalty", "presence_penalty")),
    "frequency_penalty": (0.5, ("frequency_penalty", "frequency_penalty")),
    "logprobs": (True, ("logprobs", "logprobs")),
    "top_logprobs": (3, ("top_logprobs", "logprobs")),
    "min_p": (0.1, ("min_p", "min_p")),
    "min_tokens": (2, ("min_tokens", "min_tokens")),
    "ignore_eos": (True, ("ignore_eos", "ignore_eos")),
}
FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def test_every_sampling_field_has_a_wire_name() -> None:
    assert set(FIELDS) <= set(WIRE), f"teach HTTPEngine (and WIRE) to send {sorted(set(FIELDS) - set(WIRE))}"


@pytest.mark.parametrize("name", FIELDS)
def test_each_sampling_field_travels(name) -> None:
    value, (chat_key, completion_key) = WIRE[name]
    params = SamplingParams(**{name: value, **({"logprobs": True} if name == "top_logprobs" else {})})
    for chat, key in ((True, chat_key), (False, completion_key)):
        eng, bodies = capture(chat)
        prompt = (ChatPrompt([{"role": "user", "content": "q"}], [Doc("d", "shared"), "e"]) if chat
                  else FlatPrompt("q d e", ["d", Doc("e", "private")], chat=False))
        eng.submit(prompt, params).result()
        body = bodies[-1]
        sent = body[key]
        if name == "response_format":
            assert sent == value.to_openai()
        elif name == "stop":
            assert sent == list(value)
        elif name in ("logprobs", "top_logprobs") and not chat:
            assert sent == (value if name == "top_logprobs" else 0)
        else:
            assert sent == value
        assert body["documents"] == ([{"text": "d", "scope": "shared"}, "e"] if chat
                                     else ["d", {"text": "e", "scope": "private"}])
        assert body["return_token_ids"] is True


def test_logprobs_come_back_as_token_logprobs_from_both_endpoints_and_streams() -> None:
    from pcr_rag.request import TokenLogprob, TopLogprob

    want = [TokenLogprob(5, "a", (97,), -0.5, (TopLogprob(-1, "b", (98,), -1.25),))]
    chat_lp = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97],
                            "top_logprobs": [{"token": "b", "logprob": -1.25, "bytes": [98]}]}]}
    legacy_lp = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"b": -1.25}], "text_offset": [0]}
    params = SamplingParams(logprobs=True, top_logprobs=1)
    for chat, lp in ((True, chat_lp), (False, legacy_lp)):
        eng, _ = capture(chat, token_ids=[5], logprobs=lp)
        prompt = ChatPrompt([{"role": "user", "content": "q"}]) if chat else FlatPrompt("q", chat=False)
        assert eng.submit(prompt, params).result().logprobs == want
        pieces = list(eng.submit(prompt, params))
        assert [p.logprobs for p in pieces[:-1]] == want and pieces[-1].result.logprobs == want
    eng, _ = capture(True, token_ids=[5])
    assert eng.submit(ChatPrompt([{"role": "user", "content": "q"}])).result().logprobs is None


def test_an_unknown_sampling_field_is_refused_not_dropped(monkeypatch) -> None:
    @dataclasses.dataclass(frozen=True)
    class Future(SamplingParams):
        typical_p: float = 1.0

    eng, bodies = capture()
    with pytest.raises(InvalidRequestError, match="typical_p"):
        eng.submit(ChatPrompt([{"role": "user", "content": "q"}]), Future(typical_p=0.5))
    assert bodies == []


def test_errors_map_onto_the_projects(remote, engine, h) -> None:
    with pytest.raises(RemotePromptTooLongError, match="exceeds") as info:
        remote.submit(ChatPrompt(h.rag_messages()), SamplingParams(max_new_tokens=engine.max_model_len)).result()
    assert isinstance(info.value, InvalidRequestError) and info.value.excess_tokens is None
    with pytest.raises(InvalidRequestError, match="does not exist"):
        HTTPEngine(remote.base_url, model="no-such-model").submit(ChatPrompt(h.rag_messages())).result()
    with pytest.raises(InvalidRequestError, match="not a str"):
        remote.announce([3])


def test_no_openai_key_from_the_environment_reaches_the_server(monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    monkeypatch.setenv("OPENAI_ORG_ID", "org-secret")
    seen: list[httpx.Headers] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"tokens": [1, 2], "count": 2})

    with HTTPEngine("http://pcr.invalid", transport=httpx.MockTransport(answer)) as eng:
        assert eng.tokenize("ab") == [1, 2]
    assert "authorization" not in seen[0] and "openai-organization" not in seen[0]
    with HTTPEngine("http://pcr.invalid", api_key="sk-pcr", transport=httpx.MockTransport(answer)) as eng:
        eng.count_tokens("ab")
    assert seen[1]["authorization"] == "Bearer sk-pcr"


# ------------------------------------------------------------------------------------------------ async announce
def test_llamaindex_aquery_with_base_url_does_not_block_the_loop_on_announce(interposed, reference, h) -> None:
    pytest.importorskip("llama_index.llms.pcr")
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.llms.pcr import PCRLLM, retrieval_hook

    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=TextNode(text=d), score=1.0) for d in h.DOCS[:2]]

    url, wrapper = interposed
    delay = 2.5
    llm = PCRLLM(base_url=url, max_new_tokens=4)
    qe = RetrieverQueryEngine.from_args(retriever=Fixed(), llm=llm)
    want = qe.query("What does pathlib do?").response  # warm: model card, tokenizer round trips
    announced, delayed = wrapper.count("/v1/pcr/announce", "served"), wrapper.count("/v1/pcr/announce", delay)

    async def run():
        loop = asyncio.get_running_loop()
        lags: list[float] = []
        done = asyncio.Event()

        async def ticker():
            last = loop.time()
            while not done.is_set():
                await asyncio.sleep(0.01)
                lags.append(loop.time() - last)
                last = loop.time()

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)  # the ticker runs (a block before its first tick would go unseen)
        wrapper.plan["/v1/pcr/announce"] = [delay]
        response = await qe.aquery("What does pathlib do?")
        deadline = loop.time() + 10
        while wrapper.count("/v1/pcr/announce", delay) == delayed and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(delay + 0.5)  # the delayed announce completes on this loop
        done.set()
        await tick
        return response.response, max(lags)

    answer, lag = asyncio.run(run())
    assert answer == want
    assert wrapper.count("/v1/pcr/announce", delay) == delayed + 1 and announced >= 1
    assert lag < delay / 2, f"the event loop stalled {lag:.2f} s: announce ran synchronously on it"
    # the model call took the ticket while it was on its way: nothing is left for the hook to withdraw, and the
    # server's announcement, which arrived after the call and can never be claimed, was withdrawn on arrival
    assert retrieval_hook().tracked_sizes()["orphans"] == 0
    assert wrapper.state.engine.stats().prefetch["pending_announcements"] == 0


def test_an_announce_task_withdrawn_on_its_way_is_withdrawn_when_it_arrives(interposed, engine, h) -> None:
    url, wrapper = interposed

    before = engine.stats().prefetch["pending_announcements"]

    async def run():
        with HTTPEngine(url) as r:
            wrapper.plan["/v1/pcr/announce"] = [0.5]
            ticket = r.announce_task([Doc(h.DOCS[1], "shared")], query="heap?")
            assert ticket.ticket_id is None and r.cancel_announcement(ticket) is False
            done = await r.aannounce(list(h.DOCS[:1]), query="pathlib?")  # not delayed: arrives first
            assert done.ticket_id is not None and done.chunks > 0
            assert engine.stats().prefetch["pending_announcements"] == before + 1
            deadline = time.monotonic() + 10
            while ticket.ticket_id is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # its withdrawal goes out right after
            assert ticket.ticket_id is not None and ticket.expired
            assert r.cancel_announcement(done) is True
            return engine.stats().prefetch["pending_announcements"]

    assert asyncio.run(run()) == before
    with pytest.raises(RuntimeError):
        HTTPEngine(url).announce_task(list(h.DOCS[:1]))


def test_langchain_ainvoke_with_base_url_announces_off_the_loop_and_claims_it(interposed, h) -> None:
    pytest.importorskip("langchain_pcr")
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import RunnablePassthrough
    from langchain_pcr import ChatPCR, PCRRetrievalCallback

    class Fixed(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager):
            return [Document(page_content=d) for d in h.DOCS[:2]]

    url, wrapper = interposed
    engine = wrapper.state.engine
    delay = 2.5
    llm = ChatPCR(base_url=url, max_tokens=4)
    template = ChatPromptTemplate.from_messages([("system", "Answer from the context."),
                                                 ("human", "Context:\n{context}\n\nQuestion: {question}")])
    chain = ({"context": Fixed() | (lambda docs: "\n\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()} | template | llm)
    config = {"callbacks": [PCRRetrievalCallback(llm)]}
    want = chain.invoke("What does pathlib do?", config=config).content

    async def run():
        loop = asyncio.get_running_loop()
        lags: list[float] = []
        done = asyncio.Event()

        async def ticker():
            last = loop.time()
            while not done.is_set():
                await asyncio.sleep(0.01)
                lags.append(loop.time() - last)
                last = loop.time()

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.05)
        wrapper.plan["/v1/pcr/announce"] = [delay]
        answer = await chain.ainvoke("What does pathlib do?", config=config)
        done.set()
        await tick
        return answer.content, max(lags)

    claimed, delayed = engine.stats().prefetch["claimed"], wrapper.count("/v1/pcr/announce", delay)
    answer, lag = asyncio.run(run())
    assert answer == want and wrapper.count("/v1/pcr/announce", delay) == delayed + 1
    assert lag < delay / 2, f"the event loop stalled {lag:.2f} s on announce"
    # announced before the call, then claimed by it
    assert engine.stats().prefetch["claimed"] == claimed + 1, engine.stats().prefetch
