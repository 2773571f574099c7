"""`pcr_rag.client.http.HTTPEngine` against a real server: the `PCREngine` surface the integrations use, over HTTP."""

from __future__ import annotations

import asyncio

import pytest

from pcr_rag.client.http import HTTPEngine, RemoteAuthError, RemoteEngineError
from pcr_rag.errors import InvalidRequestError, RequestCancelledError
from pcr_rag.request import ChatPrompt, FlatPrompt, SamplingParams
from pcr_rag.server import ServerSettings, ServerThread


@pytest.fixture(scope="module")
def remote(base_url):
    with HTTPEngine(base_url) as r:
        yield r


def test_result_stream_and_async_match_the_local_engine(remote, engine, reference, h) -> None:
    docs = [d + " (remote)" for d in h.DOCS[:2]]
    prompt = ChatPrompt(h.rag_messages(docs), docs)
    params = SamplingParams(max_new_tokens=6)
    want = reference.submit(prompt, params).result()
    got = remote.submit(prompt, params).result()
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert got.prompt_token_ids == want.prompt_token_ids and got.documents_found == 2
    assert got.metrics.prompt_tokens == want.metrics.prompt_tokens and got.metrics.ttft_s > 0
    pieces = list(remote.submit(prompt, params))
    assert [p.token_id for p in pieces[:-1]] == want.token_ids and pieces[-1].is_final
    final = pieces[-1].result
    assert final.token_ids == want.token_ids and final.metrics.reused_tokens > 0

    flat = FlatPrompt("Q: " + docs[0] + "\nA:", (docs[0],), chat=False)
    want_flat = reference.submit(flat, params).result()

    async def run():
        awaited = await remote.submit(flat, params)
        streamed = [p async for p in remote.submit(flat, params)]
        return awaited, streamed

    awaited, streamed = asyncio.run(run())
    assert awaited.text == want_flat.text
    assert [p.token_id for p in streamed[:-1]] == want_flat.token_ids


def test_model_info_tokenizer_and_announcements(remote, engine, h) -> None:
    assert remote.loaded.name == engine.loaded.name
    assert remote.config.max_new_tokens == engine.config.max_new_tokens
    assert remote.context_window == engine.context_window and remote.max_model_len == engine.max_model_len
    text = "pathlib joins paths"
    assert remote.tokenizer(text)["input_ids"] == engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert remote.count_tokens(text) == engine.count_tokens(text)
    ticket = remote.announce(list(h.DOCS), query="what?")
    assert ticket.chunks > 0 and engine.stats().prefetch["pending_announcements"] == 1
    assert remote.cancel_announcement(ticket) is True
    assert engine.stats().prefetch["pending_announcements"] == 0
    assert remote.cancel_announcement(ticket) is False


def test_errors_cancel_and_timeout(remote, engine, h) -> None:
    with pytest.raises(InvalidRequestError, match="exceeds"):
        remote.submit(ChatPrompt(h.rag_messages()), SamplingParams(max_new_tokens=engine.max_model_len)).result()
    with pytest.raises(InvalidRequestError, match="ChatPrompt, a FlatPrompt or a RagPrompt"):
        remote.submit(("q", h.DOCS))  # type: ignore[arg-type]  # a RagPrompt travels: test_system_tail_http.py
    long = ChatPrompt([{"role": "user", "content": "a long story"}])
    handle = remote.submit(long, SamplingParams(max_new_tokens=900))
    first = next(iter(handle))
    assert first.token_id >= 0
    assert handle.cancel() is True
    with pytest.raises(RequestCancelledError):
        handle.result()
    with pytest.raises(TimeoutError):
        remote.submit(long, SamplingParams(max_new_tokens=900), timeout=0.2).result()

    async def cancel_async():
        h2 = remote.submit(long, SamplingParams(max_new_tokens=900))
        task = asyncio.ensure_future(h2.aresult())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_async())
    assert h.wait_until(lambda: h.idle(engine), timeout=10)
    with pytest.raises(RemoteEngineError, match="cannot reach"):
        HTTPEngine("http://127.0.0.1:9", connect_timeout=1).submit(long).result()


def test_api_key(engine, h) -> None:
    with ServerThread(engine, ServerSettings(port=0, api_keys=("sk-remote",))) as url:
        with pytest.raises(RemoteAuthError):
            HTTPEngine(url, api_key="wrong").loaded  # noqa: B018
        ok = HTTPEngine(url, api_key="sk-remote")
        assert ok.submit(ChatPrompt(h.rag_messages()), SamplingParams(max_new_tokens=2)).result().token_ids
        ok.close()
