"""Blend mode over HTTP (issue 48): the ``reuse`` extension field on both generation endpoints, the blended tokens
each response reports (``usage.prompt_tokens_details.blended_tokens``, ``usage.pcr.blended_tokens`` and
``usage.pcr.reuse``, streamed usage too), a bad ``reuse`` refused before any compute, `HTTPEngine` giving the same
tokens and figures as the local engine in both modes, and the blend series on ``/metrics``."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pcr_rag import PCREngine
from pcr_rag.client.http import HTTPEngine
from pcr_rag.errors import InvalidRequestError
from pcr_rag.request import ChatPrompt, FlatPrompt, SamplingParams

DOCS = (
    "Kafka stores ordered records in partitions that consumers read at their own pace. " * 3,
    "Gradient descent follows the negative gradient to reduce the loss function step by step. " * 3,
    "The Rhine rises in the Swiss Alps and flows north to the North Sea through six countries. " * 3,
)
ORDERS = ((0, 1, 2), (2, 0, 1), (1, 2, 0))


def docs_in(order: tuple[int, ...]) -> list[str]:
    return [DOCS[i] for i in order]


def messages(docs: list[str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": "Context:\n" + "\n\n".join(docs) + "\n\nQuestion: what do they say?"}]


def usage_of(body: dict) -> tuple[int, int, int, str]:
    """(prompt, cached, blended, reuse) of a response's usage, checking the two places blended tokens appear agree
    and that the prompt's tokens add up."""
    usage = body["usage"]
    details, pcr = usage["prompt_tokens_details"], usage["pcr"]
    assert details["blended_tokens"] == pcr["blended_tokens"]
    assert details["cached_tokens"] == pcr["reused_tokens"]
    assert pcr["computed_tokens"] + pcr["reused_tokens"] + pcr["blended_tokens"] == usage["prompt_tokens"]
    return usage["prompt_tokens"], details["cached_tokens"], details["blended_tokens"], pcr["reuse"]


def test_blend_requests_report_blended_tokens_exact_ones_report_zero(fresh, h) -> None:
    engine, url = fresh()
    model = engine.loaded.name
    with httpx.Client(base_url=url, timeout=60) as client:
        def chat(order, **extra) -> dict:
            r = client.post("/v1/chat/completions", json={"model": model, "messages": messages(docs_in(order)),
                                                          "documents": docs_in(order), "max_tokens": 4, **extra})
            assert r.status_code == 200, r.text
            return r.json()

        first = chat(ORDERS[0], reuse="blend")
        again = chat(ORDERS[1], reuse="blend")       # a new order: the documents come from their isolated KV
        exact = chat(ORDERS[2], reuse="exact")
        default = chat(ORDERS[1])                    # no field: the server's default (exact)
        null = chat(ORDERS[1], reuse=None)
        assert usage_of(first)[3] == "blend"         # first sight: its documents' KV is computed, whatever counts
        _, _, blended, reuse = usage_of(again)
        assert reuse == "blend" and blended > 0      # documents seen before, placed in their new positions
        assert usage_of(exact)[2:] == (0, "exact")
        for body in (default, null):
            assert usage_of(body)[2:] == (0, "exact")
            assert usage_of(body)[1] > 0             # the same prompt as `again`, whose exact prefix is cached now

        # the legacy endpoint takes the field too
        r = client.post("/v1/completions", json={"model": model, "prompt": messages(docs_in(ORDERS[2]))[1]["content"],
                                                 "documents": docs_in(ORDERS[2]), "max_tokens": 4, "reuse": "blend"})
        assert r.status_code == 200, r.text
        assert usage_of(r.json())[2] > 0 and usage_of(r.json())[3] == "blend"

        # a stream's usage chunk carries the same report
        order = (0, 2, 1)
        events = []
        with client.stream("POST", "/v1/chat/completions", json={
                "model": model, "messages": messages(docs_in(order)), "documents": docs_in(order), "max_tokens": 4,
                "reuse": "blend", "stream": True, "stream_options": {"include_usage": True}}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        tail = events[-1]
        assert tail["choices"] == [] and usage_of(tail)[2] > 0 and usage_of(tail)[3] == "blend"
        assert all(e["usage"] is None for e in events[:-1])
    stats = engine.stats().requests
    assert stats["blended_requests"] == 4
    assert stats["blended_tokens"] == sum(usage_of(b)[2] for b in (first, again, r.json(), tail))


@pytest.mark.parametrize("value", ["fuzzy", "Blend", "", 1, True, ["blend"], {"mode": "blend"}])
def test_a_bad_reuse_is_a_400_naming_the_field_before_any_compute(server, engine, h, value) -> None:
    before = engine.stats().requests
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for path, body in (("/v1/chat/completions", {"messages": h.rag_messages()}),
                           ("/v1/completions", {"prompt": "Q: what is json?"})):
            r = client.post(path, json={"model": engine.loaded.name, "documents": list(h.DOCS[:1]), **body,
                                        "reuse": value, "max_tokens": 2})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "reuse" and "'exact'" in error["message"] and "'blend'" in error["message"]
    after = engine.stats().requests
    assert after["requests_finished"] == before["requests_finished"]
    assert after["prompt_tokens"] == before["prompt_tokens"]
    assert h.idle(engine)


def test_the_openapi_schema_and_model_card_publish_the_field(server, engine) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        schema = client.get("/openapi.json").json()["components"]["schemas"]
        card = client.get("/v1/models").json()["data"][0]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        field = schema[name]["properties"]["reuse"]
        values = {v for option in field["anyOf"] for v in option.get("enum", ())}
        assert values == {"exact", "blend"} and {"type": "null"} in field["anyOf"]
        assert "approximate" in field["description"]
    assert card["pcr"]["reuse"] == engine.config.reuse == "exact"


def test_remote_engine_gives_the_local_engine_s_tokens_and_report_in_both_modes(fresh, tiny, tmp_path, h) -> None:
    """One behaviour, every path: the same requests in the same order, to a local engine and through
    `HTTPEngine` to a server's engine (each on a fresh cache), give the same tokens, the same reuse figures and
    the same mode, blend and exact, chat and completions, result and stream."""
    served, url = fresh()
    model, tokenizer = tiny
    steps = [(ORDERS[0], "blend", True), (ORDERS[1], "blend", True), (ORDERS[2], "exact", True),
             (ORDERS[1], None, True), (ORDERS[2], "blend", False), ((0, 2, 1), "blend", True)]
    params = SamplingParams(max_new_tokens=5)
    with PCREngine(model, tokenizer, config=h.engine_config(tmp_path / "local")) as local, \
            HTTPEngine(url) as remote:
        for i, (order, reuse, chat) in enumerate(steps):
            docs = docs_in(order)
            prompt = ChatPrompt(messages(docs), docs) if chat else FlatPrompt(messages(docs)[1]["content"], docs)
            want = local.submit(prompt, params, reuse=reuse).result()
            handle = remote.submit(prompt, params, reuse=reuse)
            if i % 2:  # every other one streamed: the usage chunk carries the report
                pieces = list(handle)
                got = pieces[-1].result
                assert "".join(p.text for p in pieces) == got.text
            else:
                got = handle.result()
            assert got.token_ids == want.token_ids, i
            assert got.text == want.text, i
            w, g = want.metrics, got.metrics
            assert (g.reuse, g.blended_tokens, g.reused_tokens, g.computed_tokens, g.prompt_tokens) == (
                w.reuse, w.blended_tokens, w.reused_tokens, w.computed_tokens, w.prompt_tokens), i
            assert g.reuse == (reuse or "exact")
        assert got.metrics.blended_tokens > 0
        with pytest.raises(InvalidRequestError, match="reuse"):
            remote.submit(ChatPrompt(messages(docs_in(ORDERS[0])), docs_in(ORDERS[0])), params, reuse="fuzzy")
    assert served.stats().requests["requests_finished"] == len(steps)


def _series(url: str) -> dict[str, float]:
    """``/metrics`` as {sample name with its non-model labels: value}."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def test_metrics_expose_blended_tokens_requests_and_the_gate(fresh) -> None:
    engine, url = fresh(blend_verify=1.0)  # every blended request also run exactly, as an idle-time shadow
    before = _series(url)
    assert before["pcr:blended_tokens_total"] == 0 and before["pcr:blended_requests_total"] == 0
    assert before["pcr:blend_verified_requests_total"] == 0 and before["pcr:blend_verify_fraction"] == 1.0
    # no verification yet: the mean and the median have no value, and no series
    assert "pcr:blend_token_agreement_mean" not in before and "pcr:blend_first_token_kl_median" not in before
    with HTTPEngine(url) as remote:
        for order, reuse in ((ORDERS[0], "blend"), (ORDERS[1], "blend"), (ORDERS[2], "exact")):
            remote.submit(ChatPrompt(messages(docs_in(order)), docs_in(order)), SamplingParams(max_new_tokens=4),
                          reuse=reuse).result()
    deadline = time.monotonic() + 60
    while engine.stats().blend["verified"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.stats()
    req, gate = stats.requests, stats.blend
    assert gate["verified"] == 2 and req["blended_requests"] == 2 and req["blended_tokens"] > 0
    after = _series(url)
    assert after["pcr:blended_tokens_total"] == req["blended_tokens"]
    assert after["pcr:blended_requests_total"] == 2
    sources = {k: v for k, v in after.items() if k.startswith("pcr:prompt_tokens_by_source_total{")}
    assert sources["pcr:prompt_tokens_by_source_total{source=blended}"] == req["blended_tokens"]
    assert sum(sources.values()) == after["pcr:prompt_tokens_total"] == req["prompt_tokens"]  # shadows apart
    for key, name in (("verified", "pcr:blend_verified_requests_total"),
                      ("greedy_verified", "pcr:blend_greedy_verified_requests_total"),
                      ("identical", "pcr:blend_identical_answers_total"),
                      ("fallbacks", "pcr:blend_fallbacks_total"),
                      ("shadow_requests", "pcr:blend_shadow_requests_total"),
                      ("shadow_prompt_tokens", "pcr:blend_shadow_prompt_tokens_total"),
                      ("namespaces_exact", "pcr:blend_namespaces_exact"),
                      ("token_agreement_mean", "pcr:blend_token_agreement_mean"),
                      ("first_token_kl_median", "pcr:blend_first_token_kl_median")):
        assert after[name] == pytest.approx(gate[key]), name
    assert after["pcr:blend_shadow_seconds_total"] > 0 and after["pcr:blend_shadow_prompt_tokens_total"] > 0
    assert after["pcr:blend_pending_shadows"] == 0



def test_announce_takes_reuse_and_a_blend_announcement_prefetches_the_documents_chains(fresh) -> None:
    """``POST /v1/pcr/announce`` with ``reuse: "blend"`` puts each document's position-independent chain into the
    prefetch window besides the predicted prefix (`PCREngine.window_snapshot`); an exact one only the prefix; a bad
    mode is a 400 naming the field, and `HTTPEngine` refuses it before sending."""
    engine, url = fresh()
    docs = docs_in(ORDERS[1])
    with HTTPEngine(url) as remote:
        remote.announce(docs, query="what do they say?")
        assert len(engine.window_snapshot()) == 1
        remote.announce(docs_in(ORDERS[2]), query="what do they say?", reuse="blend")
        window = engine.window_snapshot()
        assert len(window) == 1 + 1 + len(docs) and all(window)
        with pytest.raises(InvalidRequestError, match="reuse"):
            remote.announce(docs, reuse="fuzzy")
    r = httpx.post(url + "/v1/pcr/announce", json={"documents": docs, "reuse": "approximate"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reuse"
    assert engine.stats().prefetch["announced"] == 2
