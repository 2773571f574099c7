"""Cache-aware document order: the greedy walk (`pcr_rag.reorder`) and `PCREngine.order_for_reuse`."""

from __future__ import annotations

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache import namespace_key, plan_chunks
from pcr_rag.reorder import apply_order, permute_documents, reuse_order
from pcr_rag.testing import tiny_model

ROOT = namespace_key("walk", "float32", 4)
CS = 4
HEAD = (tuple(range(100, 106)),)
RUNS = {0: tuple(range(10, 19)), 1: tuple(range(20, 27)), 2: tuple(range(30, 35)), 3: tuple(range(40, 52))}
SEP = (7, 7)


def run_of(i: int, previous: int | None) -> tuple[int, ...]:
    return RUNS[i] if previous is None else SEP + RUNS[i]


def chain_keys(order, upto: int | None = None) -> set[bytes]:
    """Every chunk key of the prompt [HEAD][doc order[0]][sep + order[1]]... (first ``upto`` documents)."""
    segments = list(HEAD) + [run_of(d, order[i - 1] if i else None) for i, d in enumerate(order[:upto])]
    return {c.key for c in plan_chunks(ROOT, segments, CS)}


def walk(known: set[bytes], n: int = 4, calls: list | None = None):
    def counted(i, previous):
        if calls is not None:
            calls.append((i, previous))
        return run_of(i, previous)
    return reuse_order(n, HEAD, counted, ROOT, CS, known.__contains__)


def test_nothing_cached_keeps_relevance_order() -> None:
    result = walk(set())
    assert result.order == (0, 1, 2, 3) and result.placed == 0 and result.matched_tokens == 0


def test_a_cached_chain_is_replayed_in_its_cached_order() -> None:
    result = walk(chain_keys((2, 0, 3)))
    assert result.order == (2, 0, 3, 1) and result.placed == 3
    assert result.matched_tokens == 6 + len(RUNS[2]) + 2 + len(RUNS[0]) + 2 + len(RUNS[3])


def test_the_walk_stops_where_nothing_extends_the_chain_and_keeps_relevance_order_after() -> None:
    result = walk(chain_keys((3, 1)))
    assert result.order == (3, 1, 0, 2) and result.placed == 2


def test_the_longest_extension_wins_and_relevance_breaks_ties() -> None:
    known = chain_keys((2,)) | chain_keys((3,))  # two one-document chains: 3 is longer
    assert walk(known).order[0] == 3
    known = chain_keys((2, 1)) | chain_keys((2, 0))  # equal extensions after 2: the more relevant (0) goes first
    assert walk(known).order == (2, 0, 1, 3)


def test_a_partly_cached_document_ends_the_walk() -> None:
    plan = plan_chunks(ROOT, list(HEAD) + [run_of(1, None), run_of(0, 1)], CS)
    first_of_0 = next(c.key for c in plan if c.segment == 2)
    result = walk(chain_keys((1,)) | {first_of_0})  # document 0's first chunk after 1, not the rest
    assert result.order == (1, 0, 2, 3) and result.placed == 2


def test_an_uncached_head_means_no_reorder() -> None:
    known = chain_keys((2, 0)) - {plan_chunks(ROOT, list(HEAD), CS)[0].key}
    assert walk(known).order == (0, 1, 2, 3)


def test_the_walk_hashes_at_most_k_k_plus_1_over_2_runs() -> None:
    calls: list = []
    walk(chain_keys((3, 2, 1, 0)), calls=calls)
    assert len(calls) <= 4 * 5 // 2
    calls.clear()
    walk(set(), calls=calls)  # the head misses: no document is looked at
    assert calls == []


def test_apply_order_and_permute_documents() -> None:
    items = ["n0", "n1", "n2", "n3"]
    texts = ["a", "b", "a", "c"]
    assert apply_order(items, texts, ["c", "a", "b", "a"]) == ["n3", "n0", "n1", "n2"]
    assert apply_order(items, texts, ["b"]) == ["n1", "n0", "n2", "n3"]
    with pytest.raises(ValueError):
        apply_order(items, texts, ["z"])
    text = "Context:\nAAA\n\nBBB\n\nCCC\nQ: a?"
    assert permute_documents(text, ["AAA", "BBB", "CCC"], ["CCC", "AAA", "BBB"]) == "Context:\nCCC\n\nAAA\n\nBBB\nQ: a?"
    assert permute_documents("only AAA here", ["AAA", "BBB"], ["BBB", "AAA"]) is None
    with pytest.raises(ValueError):
        permute_documents(text, ["AAA"], ["BBB"])


# ------------------------------------------------------------------------------------------------ engine
DOCS = [
    "pathlib offers classes for filesystem paths; Path objects join with the slash operator.",
    "json encodes Python objects as JSON text and json.loads parses it back.",
    "heapq implements a binary heap on a plain list: heappush and heappop.",
    "bisect keeps a sorted list sorted; bisect_left finds the insertion point.",
]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=0)


@pytest.fixture
def engine(tiny, tmp_path):
    model, tokenizer = tiny
    with PCREngine(model, tokenizer, config=EngineConfig(cache_dir=tmp_path / "kv", chunk_size=16, max_new_tokens=3,
                                                         dram_capacity="64MiB", ssd_capacity="64MiB",
                                                         announce_ttl_s=60.0)) as eng:
        yield eng


def test_engine_orders_cached_documents_first_and_the_prompt_reuses_them(engine) -> None:
    a, b, c, d = DOCS
    assert engine.order_for_reuse([a, b, c]) == [a, b, c]  # nothing cached
    engine.generate("Which module sorts?", [c, a])
    order = engine.order_for_reuse([a, b, c])
    assert order == [c, a, b]
    reordered = engine.generate("How do heaps work?", order)
    plan = engine.plan_for("How do heaps work?", order)
    doc_tokens = sum(s.num_tokens for s in plan if s.segment <= 2)  # head, c and a
    assert reordered.metrics.reused_tokens == doc_tokens  # the head and both cached documents
    relevance = engine.generate("How do heaps work, again?", [a, b, c])
    assert relevance.metrics.reused_tokens < reordered.metrics.reused_tokens


def test_announced_chunks_count_and_the_callers_own_announcement_can_be_excluded(engine) -> None:
    a, b, c, _ = DOCS
    engine.generate("warm the head", [d for d in DOCS[3:]])  # caches the head (system + instruction) only
    ticket = engine.announce([b, a])
    assert engine.order_for_reuse([a, b, c]) == [b, a, c]
    assert engine.order_for_reuse([a, b, c], exclude=[ticket]) == [a, b, c]
    engine.cancel_announcement(ticket)
    assert engine.order_for_reuse([a, b, c]) == [a, b, c]


def test_flat_layout_is_walked_once_learned(engine) -> None:
    a, b, c, _ = DOCS
    template = "Context information is below.\n---------------------\n{}\n---------------------\nQuery: {}\nAnswer: "
    engine.generate_prompt(template.format("\n\n".join([c, b]), "what sorts?"), [c, b])
    assert engine.order_for_reuse([a, b, c]) == [c, b, a]
    assert engine.order_for_reuse([a, b, c], layout="rag") == [a, b, c]  # the engine's own layout: not cached
    with pytest.raises(Exception, match="layout"):
        engine.order_for_reuse([a, b], layout="nope")


def test_order_for_reuse_on_an_engine_without_cache(tiny, tmp_path) -> None:
    model, tokenizer = tiny
    with PCREngine(model, tokenizer, config=EngineConfig(enable_cache=False, chunk_size=16, max_new_tokens=2,
                                                         announce_ttl_s=60.0)) as eng:
        a, b, c, _ = DOCS
        assert eng.order_for_reuse([a, b, c]) == [a, b, c]
        eng.announce([c, b])
        assert eng.order_for_reuse([a, b, c]) == [c, b, a]  # announced chunks count even without a cache
        assert eng.order_for_reuse([a]) == [a] and eng.order_for_reuse([]) == []
