"""Per-document sharing scopes across tenants, per-namespace prompt state and the prompt's character bound, on the
tiny model: a shared prefix is reused across namespaces, nothing at or after a private document ever is, answers
stay bit-identical to a cache-off engine, and a tenant's requests leave no trace another tenant can time."""

from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch

from pcr_rag import Doc, EngineConfig, InvalidRequestError, PCREngine, PromptTooLongError
from pcr_rag.cache import plan_chunks
from pcr_rag.prompt import PromptContext
from pcr_rag.sched.announcements import TICKET_ID_BITS
from pcr_rag.testing import tiny_model

PUBLIC = (
    "The Rhine flows from the Swiss Alps to the North Sea through Germany and the Netherlands. " * 3,
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules. " * 3,
)
SECRET_A = "Tenant A's merger with Initech closes on the ninth of March at a price of forty dollars a share. " * 3
SECRET_B = "Tenant B keeps its payroll in the basement safe, whose code is the year the company was founded. " * 3
QUERY = "What does the first document say?"
SYSTEM = "You are a careful assistant. Answer in one sentence, citing the document you used."


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2)


def _engine(tiny, path, **kw) -> PCREngine:
    model, tok = tiny
    cfg = dict(cache_dir=path, chunk_size=16, dram_capacity="32MiB", ssd_capacity="64MiB", max_new_tokens=6,
               device="cpu")
    cfg.update(kw)
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg))


def _shared_tokens(eng: PCREngine, documents, namespace: str) -> int:
    """Prompt tokens before the request's first private segment (what another namespace may reuse at most)."""
    seg = eng.builder.build_rag(QUERY, documents, SYSTEM, context=PromptContext(namespace))
    assert seg.private_from is not None, "a namespaced request's query is always private"
    return sum(len(s) for s in seg.segments[: seg.private_from])


def test_shared_documents_are_reused_across_tenants_private_ones_never(tiny, tmp_path):
    a_docs = [Doc(PUBLIC[0], "shared"), Doc(PUBLIC[1], "shared"), Doc(SECRET_A)]
    b_docs = [Doc(PUBLIC[0], "shared"), Doc(PUBLIC[1], "shared"), Doc(SECRET_B)]
    with _engine(tiny, tmp_path / "off", enable_cache=False) as off:
        ref = [off.generate(QUERY, docs, system=SYSTEM, namespace=ns)
               for docs, ns in ((a_docs, "a"), (b_docs, "b"), (a_docs, "b"), (a_docs, "a"))]
    with _engine(tiny, tmp_path / "on") as eng:
        first_a = eng.generate(QUERY, a_docs, system=SYSTEM, namespace="a")
        b = eng.generate(QUERY, b_docs, system=SYSTEM, namespace="b")
        b_with_a_secret = eng.generate(QUERY, a_docs, system=SYSTEM, namespace="b")  # A's exact request, as B
        again_a = eng.generate(QUERY, a_docs, system=SYSTEM, namespace="a")
        shared = _shared_tokens(eng, a_docs, "a")
    got = [first_a, b, b_with_a_secret, again_a]
    for r, want in zip(got, ref):
        assert r.prompt_token_ids == want.prompt_token_ids
        assert r.token_ids == want.token_ids
        assert torch.equal(r.first_token_logits, want.first_token_logits)
    assert first_a.metrics.reused_tokens == 0
    assert shared > 0
    # B reuses the shared system prompt and public documents A computed...
    assert 0 < b.metrics.reused_tokens <= shared
    assert b_with_a_secret.metrics.reused_tokens <= shared  # ...and nothing at or after A's private document
    assert b_with_a_secret.metrics.reused_tokens >= b.metrics.reused_tokens
    # within A's namespace its private document is reused (the bound above is not vacuous)
    assert again_a.metrics.reused_tokens > shared


def test_unmarked_documents_are_private_in_a_namespace(tiny, tmp_path):
    """The default keeps today's isolation: plain strings in a namespaced request are private and the shared head
    counts only in front of a shared document, so another tenant sending the very same request reuses nothing;
    with system_prompt_scope "private" not even a shared document is reused across tenants."""
    docs = [PUBLIC[0], SECRET_A]
    with _engine(tiny, tmp_path / "c") as eng:
        eng.generate(QUERY, docs, system=SYSTEM, namespace="a")
        assert eng.generate(QUERY, docs, system=SYSTEM, namespace="b").metrics.reused_tokens == 0
        assert eng.generate(QUERY, docs, system=SYSTEM, namespace="a").metrics.reused_tokens > 0
        eng.generate(QUERY, [Doc(PUBLIC[1], "shared")], system=SYSTEM, namespace="a")
        assert eng.generate(QUERY, [PUBLIC[1]], system=SYSTEM, namespace="c").metrics.reused_tokens == 0
    with _engine(tiny, tmp_path / "p", system_prompt_scope="private") as eng:
        shared = [Doc(PUBLIC[0], "shared"), Doc(PUBLIC[1], "shared")]
        eng.generate(QUERY, shared, system=SYSTEM, namespace="a")
        assert eng.generate(QUERY, shared, system=SYSTEM, namespace="b").metrics.reused_tokens == 0
        assert eng.generate(QUERY, shared, system=SYSTEM, namespace="a").metrics.reused_tokens > 0


def test_keys_without_scopes_are_unchanged(tiny, tmp_path):
    """Requests without scopes key exactly as before, so existing caches stay valid: single-tenant requests (no
    namespace) from the engine's root, namespaced ones wholly from their tenant's root."""
    docs = list(PUBLIC)
    with _engine(tiny, tmp_path / "c") as eng:
        seg = eng.builder.build_rag(QUERY, docs, SYSTEM)
        assert eng.plan_for(QUERY, docs, system=SYSTEM) == plan_chunks(eng.root_key, seg.segments, 16)
        assert eng.plan_for(QUERY, docs, system=SYSTEM, namespace="a") == plan_chunks(eng.root_for("a"),
                                                                                       seg.segments, 16)
        assert eng.plan_for("no documents", system=SYSTEM, namespace="a") == plan_chunks(
            eng.root_for("a"), eng.builder.build_rag("no documents", [], SYSTEM).segments, 16)


def test_a_private_document_of_the_engine_wide_namespace_is_not_shared(tiny, tmp_path):
    """Without a namespace documents are shared (today's keys) unless marked private: then a tenant marking the
    same document shared does not reuse it."""
    with _engine(tiny, tmp_path / "c") as eng:
        eng.generate(QUERY, [Doc(SECRET_A, "private")], system=SYSTEM)
        probe = eng.generate(QUERY, [Doc(SECRET_A, "shared")], system=SYSTEM, namespace="b")
        head = len(eng.builder.build_rag(QUERY, [SECRET_A], SYSTEM).segments[0])
        assert 0 < probe.metrics.reused_tokens <= head  # the shared head, not the private document
        assert eng.generate(QUERY, [Doc(SECRET_A, "private")], system=SYSTEM).metrics.reused_tokens > head


def test_scopes_argument_and_bad_scopes(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c") as eng:
        by_doc = eng.plan_for(QUERY, [Doc(PUBLIC[0], "shared"), SECRET_A], system=SYSTEM, namespace="a")
        by_arg = eng.plan_for(QUERY, [PUBLIC[0], SECRET_A], system=SYSTEM, namespace="a",
                              scopes=["shared", None])
        assert by_doc == by_arg
        for bad in ({"scopes": ["public", None]}, {"scopes": ["shared"]}, {"scopes": "shared"}):
            with pytest.raises(InvalidRequestError):
                eng.generate(QUERY, [PUBLIC[0], SECRET_A], **bad)
        with pytest.raises(InvalidRequestError):
            eng.generate(QUERY, [Doc(PUBLIC[0], "shared")], scopes=["private"])
        with pytest.raises(InvalidRequestError):
            Doc(PUBLIC[0], "public")


def test_announcements_follow_the_scopes_and_ids_are_random(tiny, tmp_path):
    docs = [Doc(PUBLIC[0], "shared"), Doc(SECRET_A)]
    with _engine(tiny, tmp_path / "c") as eng:
        ticket = eng.announce(docs, QUERY, system=SYSTEM, namespace="a")
        plan = eng.plan_for(QUERY, docs, system=SYSTEM, namespace="a")
        assert list(ticket.keys) == [c.key for c in plan]
        other = eng.announce(docs, QUERY, system=SYSTEM, namespace="b")
        shared = sum(1 for c in plan if c.end <= _shared_tokens(eng, docs, "a"))
        assert ticket.keys[:shared] == other.keys[:shared]
        assert set(ticket.keys[shared:]).isdisjoint(other.keys)
        ids = [ticket.ticket_id, other.ticket_id] + [eng.announce([PUBLIC[1]]).ticket_id for _ in range(6)]
    assert len(set(ids)) == len(ids) and all(0 < i < 2**TICKET_ID_BITS for i in ids)
    assert sorted(ids) != list(range(min(ids), min(ids) + len(ids))), "ids are not a sequence"


def test_flat_layout_is_learned_per_namespace(tiny, tmp_path):
    """Tenant A's flat prompts change how A's announcements are keyed ("auto" layout), never B's."""
    docs = list(PUBLIC)
    template = "Context follows.\n---\n{}\n---\nQuestion: " + QUERY
    with _engine(tiny, tmp_path / "c") as eng:
        before_b = eng.announce(docs, namespace="b").keys
        before_a = eng.announce(docs, namespace="a").keys
        eng.generate_prompt(template.format("\n\n".join(docs)), docs, namespace="a")
        assert eng.builder.learned_flat_layout("a") and not eng.builder.learned_flat_layout("b")
        assert eng.announce(docs, namespace="b").keys == before_b
        assert eng.announce(docs, namespace="a").keys != before_a


def test_order_for_reuse_walks_the_namespace_keys(tiny, tmp_path):
    """A tenant's cache-aware order sees its own private chunks and the shared ones, never another tenant's."""
    docs = [PUBLIC[0], SECRET_A, SECRET_B]
    with _engine(tiny, tmp_path / "c") as eng:
        eng.generate(QUERY, [SECRET_B, SECRET_A], namespace="a")
        assert eng.order_for_reuse(docs, namespace="a", layout="rag") == [SECRET_B, SECRET_A, PUBLIC[0]]
        assert eng.order_for_reuse(docs, namespace="b", layout="rag") == docs
        shared = [Doc(d, "shared") for d in docs]
        eng.generate(QUERY, shared[::-1], namespace="c")
        assert eng.order_for_reuse(shared, namespace="b", layout="rag") == shared[::-1]  # the same Doc objects
        mixed = [Doc(PUBLIC[0], "shared"), Doc(SECRET_B), Doc(SECRET_A)]
        assert eng.order_for_reuse(mixed, namespace="a", layout="rag") == mixed
        own = [Doc(d, "private") for d in docs]  # explicitly private in the engine-wide namespace
        assert eng.order_for_reuse(own, layout="rag") == own
        eng.generate(QUERY, own[::-1])
        assert eng.order_for_reuse(own, layout="rag") == own[::-1]
        # unmarked, the same texts are the engine-wide (shared) chain: tenant c's shared order, not the private one
        assert eng.order_for_reuse(docs, layout="rag") == docs[::-1]
        eng.generate(QUERY, [own[1], own[0], own[2]])
        assert eng.order_for_reuse(docs, layout="rag") == docs[::-1]


def _rss_bytes() -> int:
    """Resident bytes after a full collection, with freed heap handed back to the OS (glibc keeps freed blocks
    otherwise, and a long test process would show them as growth)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _CountingTokenizer:
    """Delegates to a tokenizer and counts the texts it tokenizes, by length."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.lengths: list[int] = []

    def __call__(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        return self._inner(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS read from /proc")
def test_huge_prompts_are_rejected_before_tokenizing_and_leave_nothing_behind(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c") as eng:
        counting = _CountingTokenizer(eng.builder.tokenizer)
        eng.builder.tokenizer = counting
        bound = eng.builder.max_prompt_chars(eng.max_model_len)
        assert bound is not None
        eng.generate(QUERY, [PUBLIC[0]], namespace="a")  # warm: allocations of a first request are not a leak
        cached = eng.builder.token_cache_bytes
        gc.collect()
        before = _rss_bytes()
        for i in range(10):
            huge = (f"{i} " + "All work and no play makes Jack a dull boy. " * 120_000)[: 5 * 2**20]
            with pytest.raises(PromptTooLongError, match="characters"):
                eng.generate(QUERY, [huge], namespace="a")
            with pytest.raises(PromptTooLongError):
                eng.announce([huge], namespace="a")
            del huge
        gc.collect()
        grown = _rss_bytes() - before
        assert grown < 100 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"
        assert max(counting.lengths) <= bound, "a 5 MB prompt reached the tokenizer"
        assert eng.builder.token_cache_bytes == cached


def test_a_prompt_rejected_for_its_token_count_is_not_cached(tiny, tmp_path):
    """Under the character bound but over the token budget: rejected after tokenizing, and none of its pieces
    enter the token cache (nor does it teach a layout)."""
    with _engine(tiny, tmp_path / "c", max_model_len=256) as eng:
        long_doc = "Tokens add up quickly in a long document about many things. " * 12
        assert len(long_doc) < eng.builder.max_prompt_chars(256 - 6)
        with pytest.raises(PromptTooLongError):
            eng.generate(QUERY, [long_doc], namespace="a")
        with pytest.raises(PromptTooLongError):
            eng.generate_prompt("Context: " + long_doc + " Question: " + QUERY, [long_doc], namespace="a")
        assert not eng.builder.is_cached(" " + long_doc.strip(), "a")
        assert not any(eng.builder.is_cached(text, "a") for text in (long_doc, "\n\n" + long_doc.strip()))
        assert eng.builder.token_cache_bytes == 0
        assert not eng.builder.learned_flat_layout("a")
        short = PUBLIC[0][:80]
        eng.generate(QUERY, [short], namespace="a")
        assert eng.builder.token_cache_bytes > 0
        assert eng.builder.is_cached("\n\n" + short.strip(), "a") or eng.builder.is_cached(" " + short.strip(), "a")
        assert not eng.builder.is_cached("\n\n" + short.strip(), "b")


def test_order_for_reuse_does_not_tokenize_documents_no_prompt_can_hold(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c") as eng:
        counting = _CountingTokenizer(eng.builder.tokenizer)
        eng.builder.tokenizer = counting
        huge = "All work and no play makes Jack a dull boy. " * 20_000
        docs = [huge, PUBLIC[0]]
        assert eng.order_for_reuse(docs) == docs
        assert counting.lengths == [] and eng.builder.token_cache_bytes == 0
