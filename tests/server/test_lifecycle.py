"""Lifecycle: a client that disconnects (mid-stream or while waiting) cancels its request and frees its row and
pins; announcements enter the prefetch window and can be withdrawn; tenants never share KV."""

from __future__ import annotations

import httpx
import openai

from pcr_rag.request import ChatPrompt, SamplingParams
from pcr_rag.server import ServerSettings, ServerThread

LONG = 900  # tokens: long enough that the request is still running when the client leaves


def long_body(engine, h, **extra):
    return {"model": engine.loaded.name, "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": LONG, **extra}


def test_disconnect_mid_stream_cancels_the_request(base_url, engine, h) -> None:
    cancelled = engine.stats().requests["requests_cancelled"]
    with httpx.Client(base_url=base_url, timeout=30) as c, \
            c.stream("POST", "/v1/chat/completions", json=long_body(engine, h, stream=True)) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = 0
        for line in lines:  # bounded: we leave after a few content events
            seen += line.startswith("data:")
            if seen >= 3:
                break
        assert engine.stats().running == 1
    # the connection is closed: the server cancels the request at its next engine step
    assert h.wait_until(lambda: h.idle(engine), timeout=10)
    stats = engine.stats()
    assert stats.requests["requests_cancelled"] == cancelled + 1
    assert stats.cache.pinned_chunks == 0


def test_disconnect_while_waiting_for_a_non_streamed_answer_cancels_it(base_url, engine, h) -> None:
    cancelled = engine.stats().requests["requests_cancelled"]
    with httpx.Client(base_url=base_url, timeout=httpx.Timeout(0.3, connect=5)) as c:
        try:
            c.post("/v1/chat/completions", json=long_body(engine, h))
            raise AssertionError("the request should still run after 0.3 s")
        except httpx.ReadTimeout:
            pass
    assert h.wait_until(lambda: h.idle(engine), timeout=10)
    assert engine.stats().requests["requests_cancelled"] == cancelled + 1


def test_announce_enters_the_prefetch_window_and_is_claimed_or_withdrawn(base_url, engine, h) -> None:
    docs = [d + " (announced)" for d in h.DOCS[:2]]
    with httpx.Client(base_url=base_url, timeout=30) as c:
        ticket = c.post("/v1/pcr/announce", json={"documents": docs, "query": "what?"}).json()
        assert ticket["object"] == "pcr.announcement" and ticket["chunks"] > 0
        assert len(engine.window_snapshot()) == 1 and engine.stats().prefetch["pending_announcements"] == 1
        r = c.post("/v1/chat/completions", json={"model": engine.loaded.name, "messages": h.rag_messages(docs),
                                                 "max_tokens": 4, "documents": docs}).json()
        assert r["usage"]["pcr"]["announcement_claimed"] is True
        assert engine.stats().prefetch["pending_announcements"] == 0
        assert c.delete(f"/v1/pcr/announce/{ticket['id']}").status_code == 404  # claimed: nothing to withdraw
        other = c.post("/v1/pcr/announce", json={"documents": docs}).json()
        assert engine.stats().prefetch["pending_announcements"] == 1
        assert c.delete(f"/v1/pcr/announce/{other['id']}").json()["withdrawn"] is True
        assert engine.stats().prefetch["pending_announcements"] == 0


def test_tenants_never_share_kv(engine, reference, h) -> None:
    keys = ("sk-tenant-a", "sk-tenant-b")
    docs = [d + " (tenants)" for d in h.DOCS]
    messages = h.rag_messages(docs)
    want = reference.submit(ChatPrompt(messages, docs), SamplingParams(max_new_tokens=6)).result()
    settings = ServerSettings(port=0, api_keys=keys, tenant_per_key=True)
    with ServerThread(engine, settings) as url:
        a, b = (openai.OpenAI(base_url=url + "/v1", api_key=k, max_retries=0) for k in keys)

        def ask(client):
            r = client.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=6,
                                               extra_body={"documents": docs})
            return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

        first_a, second_a, first_b = ask(a), ask(a), ask(b)
        assert first_a[1] == 0 and second_a[1] > 0  # a tenant reuses its own KV
        assert first_b[1] == 0  # ... but never another tenant's
        assert first_a[0] == second_a[0] == first_b[0] == want.text
        ticket = httpx.post(url + "/v1/pcr/announce", json={"documents": docs},
                            headers={"Authorization": f"Bearer {keys[0]}"}).json()
        gone = httpx.delete(url + f"/v1/pcr/announce/{ticket['id']}", headers={"Authorization": f"Bearer {keys[1]}"})
        assert gone.status_code == 404  # b cannot see (or withdraw) a's announcement
        assert engine.stats().prefetch["pending_announcements"] == 1
        assert httpx.delete(url + f"/v1/pcr/announce/{ticket['id']}",
                            headers={"Authorization": f"Bearer {keys[0]}"}).json()["withdrawn"] is True
    # the engine-level contract under it
    assert engine.root_for("x") != engine.root_for("y") != engine.root_key == engine.root_for(None)
    plan_a = engine.plan_for("q", docs, namespace="x")
    assert {c.key for c in plan_a}.isdisjoint(c.key for c in engine.plan_for("q", docs, namespace="y"))
    t = engine.announce(docs, namespace="x")
    handle = engine.submit(ChatPrompt(messages, docs), SamplingParams(max_new_tokens=2), namespace="y")
    assert handle.result().metrics.announced is False and not t.claimed  # another namespace's ticket stays
    assert engine.submit(ChatPrompt(messages, docs), SamplingParams(max_new_tokens=2),
                         namespace="x").result().metrics.announced is True
    assert h.wait_until(lambda: h.idle(engine))


def test_shutdown_cancels_what_outlives_the_shutdown_timeout(engine, h) -> None:
    import threading
    import time

    srv = ServerThread(engine, ServerSettings(port=0, shutdown_timeout_s=0.3))
    url = srv.start()
    events: list[str] = []
    started = threading.Event()

    def consume():
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=long_body(engine, h, stream=True),
                              timeout=30) as r:
                for line in r.iter_lines():
                    events.append(line)
                    started.set()
        except httpx.HTTPError:
            events.append("<connection closed>")
        finally:
            started.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    assert started.wait(30)
    t0 = time.monotonic()
    srv.stop()  # drains like SIGTERM: the request may run 0.3 s, then it is cancelled
    assert time.monotonic() - t0 < 15
    thread.join(30)
    assert "data: [DONE]" not in events or any('"error"' in e for e in events)
    assert h.wait_until(lambda: h.idle(engine), timeout=10)
    assert not engine.closed  # the app did not own it
