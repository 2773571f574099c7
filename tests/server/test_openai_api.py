"""The official openai client against a real server (loopback, in-process uvicorn): sync, async and streaming for
both endpoints, cached_tokens on a repeated document set, answers identical to a local engine's."""

from __future__ import annotations

import asyncio
import functools
import json
import re

import httpx
import openai
import pytest

from pcr_rag.request import ChatPrompt, FlatPrompt, SamplingParams


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def local(reference, prompt, max_tokens=8):
    return reference.submit(prompt, SamplingParams(max_new_tokens=max_tokens)).result()


def test_models_lists_the_served_model(client, engine) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [engine.loaded.name]
    assert models[0].max_model_len == engine.max_model_len


def test_chat_matches_the_local_engine_and_reports_cached_tokens(client, engine, reference, h) -> None:
    docs = [d + " (chat)" for d in h.DOCS[:2]]
    messages = h.rag_messages(docs)
    want = local(reference, ChatPrompt(messages, docs))
    answers = []
    for _ in range(2):
        r = client.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=8,
                                           extra_body={"documents": docs, "return_token_ids": True})
        answers.append(r)
    first, second = answers
    for r in answers:
        assert r.choices[0].message.content == want.text
        assert r.choices[0].model_extra["token_ids"] == want.token_ids
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # present, 0 included
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    pcr = second.usage.model_extra["pcr"]
    assert sum(pcr["reused_by_tier"].values()) == second.usage.prompt_tokens_details.cached_tokens
    assert pcr["documents_found"] == 2 and pcr["ttft_s"] > 0 and pcr["queue_s"] >= 0


def test_response_format_constrains_the_answer_as_the_local_engine_does(client, engine, reference, h) -> None:
    """``response_format`` (OpenAI's json_schema / json_object) runs the engine's grammar-constrained decoding: the
    content follows the schema and equals the local engine's constrained answer, token for token."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    docs = [d + " (structured)" for d in h.DOCS[:2]]
    messages = h.rag_messages(docs)
    want = reference.submit(ChatPrompt(messages, docs),
                            SamplingParams(max_new_tokens=60, response_format=schema)).result()
    r = client.chat.completions.create(
        model=engine.loaded.name, messages=messages, max_tokens=60, extra_body={"documents": docs},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == "stop" and json.loads(want.text)["answer"] in ("yes", "no")
    r = client.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=60,
                                       extra_body={"documents": docs}, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: what is there is the start of a JSON object
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_completion_matches_the_local_engine(client, engine, reference, h) -> None:
    prompt = "Context: " + h.DOCS[2] + "\nQ: what is heapq?\nA:"
    want = local(reference, FlatPrompt(prompt, (h.DOCS[2],), chat=False))
    r = client.completions.create(model=engine.loaded.name, prompt=prompt, max_tokens=8,
                                  extra_body={"documents": [h.DOCS[2]], "return_token_ids": True})
    assert r.choices[0].text == want.text
    assert r.choices[0].model_extra["token_ids"] == want.token_ids
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.model_extra["pcr"]["documents_found"] == 1
    pcr = r.usage.model_extra["pcr"]
    assert 0.0 <= pcr["load_wait_s"] <= pcr["prefill_compute_s"] <= pcr["prefill_s"] <= pcr["ttft_s"]
    again = client.completions.create(model=engine.loaded.name, prompt=prompt, max_tokens=8,
                                      extra_body={"documents": [h.DOCS[2]]})
    assert again.choices[0].text == want.text and again.usage.prompt_tokens_details.cached_tokens > 0
    # the chat_template extension wraps the prompt as one user turn, as the engine's FlatPrompt(chat=True)
    want_chat = local(reference, FlatPrompt(prompt, (h.DOCS[2],), chat=True, system="Be brief."))
    r = client.completions.create(model=engine.loaded.name, prompt=prompt, max_tokens=8,
                                  extra_body={"documents": [h.DOCS[2]], "chat_template": True, "system": "Be brief."})
    assert r.choices[0].text == want_chat.text


def test_completions_take_response_format_as_the_local_engine(client, engine, reference, h) -> None:
    """vLLM accepts ``response_format`` on /v1/completions; it was silently ignored here before."""
    prompt = "Context: " + h.DOCS[0] + "\nQ: name three letters.\nA:"
    fmt = {"type": "regex", "regex": "[a-c]{3,6}"}
    want = reference.submit(FlatPrompt(prompt, (h.DOCS[0],), chat=False),
                            SamplingParams(max_new_tokens=8, response_format=fmt)).result()
    free = local(reference, FlatPrompt(prompt, (h.DOCS[0],), chat=False))
    assert free.token_ids != want.token_ids, "the tiny model's free answer must differ, or this proves nothing"
    r = client.completions.create(model=engine.loaded.name, prompt=prompt, max_tokens=8,
                                  extra_body={"documents": [h.DOCS[0]], "response_format": fmt,
                                              "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want.token_ids
    assert re.fullmatch("[a-c]{3,6}", r.choices[0].text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    want_json = reference.submit(FlatPrompt(prompt, (h.DOCS[0],), chat=False),
                                 SamplingParams(max_new_tokens=24, response_format=schema)).result()
    r = client.completions.create(model=engine.loaded.name, prompt=prompt, max_tokens=24,
                                  extra_body={"documents": [h.DOCS[0]], "response_format": {
                                      "type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}})
    assert r.choices[0].text == want_json.text
    bad = httpx.post(str(client.base_url) + "completions", json={
        "model": engine.loaded.name, "prompt": prompt, "response_format": {"type": "regex", "regex": "("}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_n_choices_each_equal_a_single_request_with_the_derived_seed(client, engine, reference, h,
                                                                     endpoint) -> None:
    """n > 1: choice i samples with seed + i, so it equals one request sent with that seed (the local engine's
    answer), whatever else decodes beside it; the usage sums the completion tokens; a stream carries each choice
    under its index and reassembles to the same texts."""
    docs = [d + " (n)" for d in h.DOCS[:2]]
    messages = h.rag_messages(docs)
    seed, n, sampling = 11, 3, {"temperature": 1.0, "max_tokens": 8}
    if endpoint == "chat":
        prompt = ChatPrompt(messages, docs)
        make = functools.partial(client.chat.completions.create, messages=messages)
    else:
        text = "Q: " + docs[0] + "\nA:"
        prompt = FlatPrompt(text, (docs[0],), chat=False)
        docs = docs[:1]
        make = functools.partial(client.completions.create, prompt=text)
    wants = [reference.submit(prompt, SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed + i)).result()
             for i in range(n)]
    assert len({tuple(w.token_ids) for w in wants}) > 1, "the seeds must give different samples, or this proves nothing"
    r = make(model=engine.loaded.name, n=n, seed=seed, **sampling,
             extra_body={"documents": docs, "return_token_ids": True})
    assert [c.index for c in r.choices] == list(range(n))
    assert [c.model_extra["token_ids"] for c in r.choices] == [w.token_ids for w in wants]
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in wants)
    assert r.usage.prompt_tokens == len(wants[0].prompt_token_ids)
    texts = [""] * n
    finishes: list[str | None] = [None] * n
    for chunk in make(model=engine.loaded.name, n=n, seed=seed, stream=True, **sampling,
                      extra_body={"documents": docs}):
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if endpoint == "chat" else c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [w.text for w in wants]
    assert finishes == [w.finish_reason for w in wants]
    # the seed wraps within the signed 64-bit range: choice 1 of seed 2**63 - 1 samples with -2**63
    top = make(model=engine.loaded.name, n=2, seed=2**63 - 1, **sampling, extra_body={"return_token_ids": True,
                                                                                      "documents": docs})
    wrapped = reference.submit(prompt, SamplingParams(max_new_tokens=8, temperature=1.0, seed=-(2**63))).result()
    assert top.choices[1].model_extra["token_ids"] == wrapped.token_ids
    assert h.wait_until(lambda: h.idle(engine))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "waiting"])
def test_a_client_leaving_cancels_every_choice(base_url, engine, h, stream) -> None:
    """n > 1 runs n engine requests: a client that disconnects (mid-stream, or while waiting for the answer)
    cancels all of them, and none keeps a row or a pinned chunk."""
    cancelled = engine.stats().requests["requests_cancelled"]
    body = {"model": engine.loaded.name, "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 900, "n": 3, "stream": stream}  # greedy: no choice samples an early end
    if stream:
        with httpx.Client(base_url=base_url, timeout=30) as c, \
                c.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():  # bounded: we leave after a few content events
                seen += line.startswith("data:")
                if seen >= 8:
                    break
            assert engine.stats().running == 3
    else:
        with httpx.Client(base_url=base_url, timeout=httpx.Timeout(0.5, connect=5)) as c, \
                pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=body)
    assert h.wait_until(lambda: h.idle(engine), timeout=10)
    assert engine.stats().requests["requests_cancelled"] == cancelled + 3


def test_streams_match_the_local_stream_and_end_with_usage(client, engine, reference, h) -> None:
    docs = [d + " (stream)" for d in h.DOCS]
    messages = h.rag_messages(docs)
    handle = reference.submit(ChatPrompt(messages, docs), SamplingParams(max_new_tokens=8))
    want_pieces = [p for p in handle if not p.is_final]
    want = handle.result()
    stream = client.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"documents": docs, "return_token_ids": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].model_extra.get("token_ids")]
    assert [c.choices[0].model_extra["token_ids"][0] for c in content] == want.token_ids
    assert "".join(c.choices[0].delta.content or "" for c in content) == "".join(p.text for p in want_pieces)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == [want.finish_reason]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == len(want.token_ids)
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens  # new documents: only the head reused
    # completions stream without token ids: text chunks only, no usage chunk unless asked for
    prompt = "Q: " + docs[0] + "\nA:"
    want_c = reference.submit(FlatPrompt(prompt, (docs[0],), chat=False), SamplingParams(max_new_tokens=8))
    want_text = "".join(p.text for p in want_c if not p.is_final)
    pieces = list(client.completions.create(model=engine.loaded.name, prompt=prompt, max_tokens=8, stream=True,
                                            extra_body={"documents": [docs[0]]}))
    assert all(p.usage is None for p in pieces)
    assert "".join(p.choices[0].text for p in pieces if p.choices) == want_text


def test_async_client_both_endpoints_and_streams(base_url, engine, reference, h) -> None:
    docs = [d + " (async)" for d in h.DOCS[:2]]
    messages = h.rag_messages(docs)
    want = local(reference, ChatPrompt(messages, docs))
    prompt = "Q: " + docs[1] + "\nA:"
    want_c = local(reference, FlatPrompt(prompt, (docs[1],), chat=False))

    async def run():
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as c:
            chat = c.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=8,
                                             extra_body={"documents": docs})
            comp = c.completions.create(model=engine.loaded.name, prompt=prompt, max_tokens=8,
                                        extra_body={"documents": [docs[1]]})
            chat_r, comp_r = await asyncio.gather(chat, comp)
            stream = await c.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=8,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body={"documents": docs})
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                usage = chunk.usage or usage
            cstream = await c.completions.create(model=engine.loaded.name, prompt=prompt, max_tokens=8,
                                                 stream=True, extra_body={"documents": [docs[1]]})
            ctext = "".join([chunk.choices[0].text async for chunk in cstream if chunk.choices])
            return chat_r, comp_r, text, usage, ctext

    chat_r, comp_r, text, usage, ctext = asyncio.run(run())
    assert chat_r.choices[0].message.content == want.text
    assert comp_r.choices[0].text == want_c.text
    assert usage.prompt_tokens_details.cached_tokens > 0  # the non-streamed chat call cached the documents
    assert text and ctext  # decoded pieces (the text equality of streams is checked above)


def test_concurrent_requests_are_each_identical_to_the_local_answer(client, engine, reference, h) -> None:
    from concurrent.futures import ThreadPoolExecutor

    questions = [f"question {i}: what is in the documents?" for i in range(6)]
    wants = [local(reference, ChatPrompt(h.rag_messages(h.DOCS, q), h.DOCS)).text for q in questions]

    def ask(q):
        r = client.chat.completions.create(model=engine.loaded.name, messages=h.rag_messages(h.DOCS, q),
                                           max_tokens=8, extra_body={"documents": list(h.DOCS)})
        return r.choices[0].message.content

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, questions))
    assert got == wants
    assert h.wait_until(lambda: h.idle(engine))


def test_health_and_metrics(base_url, client, engine, h) -> None:
    assert httpx.get(base_url + "/health").json() == {"status": "ok"}
    client.chat.completions.create(model=engine.loaded.name, messages=h.rag_messages(), max_tokens=4,
                                   extra_body={"documents": list(h.DOCS)})
    assert h.wait_until(lambda: h.idle(engine))
    text = httpx.get(base_url + "/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            pairs = frozenset(tuple(p.split("=", 1)) for p in labels.rstrip("}").split(",") if p)
            samples[(name, pairs)] = float(value)
    model = engine.loaded.name

    def sample(name: str, **labels: str) -> float:
        return samples[(name, frozenset((k, f'"{v}"') for k, v in {**labels, "model_name": model}.items()))]

    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_prefill_compute_time_seconds"):
        assert sample(f"pcr:{hist}_count") > 0
    assert sample("pcr:prompt_tokens_by_source_total", source="dram") > 0
    assert sample("pcr:prompt_tokens_by_source_total", source="computed") > 0
    assert sample("pcr:prefix_cache_hits_total") > 0
    assert sample("pcr:prefix_cache_queries_total") >= sample("pcr:prefix_cache_hits_total")
    assert sample("pcr:num_requests_running") == 0 and sample("pcr:num_requests_waiting") == 0
    assert sample("pcr:prefill_tokens_per_second") == engine.stats().prefill_tokens_per_s > 0
    budget = engine.stats().step_budget
    assert budget["decode_step_ms"] > 0
    assert sample("pcr:decode_step_seconds") == pytest.approx(budget["decode_step_ms"] / 1e3)
    assert 1 <= sample("pcr:prefill_layers_per_step") == budget["layers_per_step"] <= len(engine.forward.layers)
    assert sample("pcr:cache_pinned_chunks") == 0
    assert sample("pcr:cache_usage_bytes", tier="dram") > 0
    assert sample("pcr:cache_capacity_bytes", tier="dram") == 64 * 2**20
    assert sample("pcr:request_success_total", finished_reason="length") > 0
    for counter in ("prefetch_loads_total", "prefetch_hit_chunks_total", "announcements_total"):
        assert sample(f"pcr:{counter}") >= 0
    gcs = engine.stats().gc  # the process's collections (young ones happen while it serves), per generation
    assert sample("pcr:gc_collections_total", generation="0") >= 1
    for gen in ("0", "1", "2"):
        assert sample("pcr:gc_pause_seconds_total", generation=gen) >= sample("pcr:gc_max_pause_seconds",
                                                                              generation=gen) >= 0
    assert sample("pcr:gc_collections_total", generation="2") <= engine.stats().gc["collections"]["2"]
    assert set(gcs) == {"collections", "pause_s", "max_pause_s", "frozen_objects"}
    assert samples[("process_resident_memory_bytes", frozenset())] > 0
