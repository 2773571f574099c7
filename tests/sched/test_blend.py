"""Blend mode (issue 48): documents reuse their position-independent KV in any position, opt-in.

Checked here: the span plan; the key rotation against a fresh computation (float32: to rounding; bfloat16: within
one extra rounding); that exact mode does no blend work and stays exact after blend traffic on the same cache; that
nothing computed after a placed document enters the exact prefix tree; that placed KV survives the compute steps'
zero-fill; that a document seen for the first time is computed once, in isolation; and what each response reports.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache import blend_root
from pcr_rag.errors import ConfigError, InvalidRequestError
from pcr_rag.model.forward import FastForward
from pcr_rag.sched.blend import BlendDocument, Span, blend_spans
from pcr_rag.testing import tiny_loaded_model

# stripped, as retrievers return them: a document's segment then starts with the same separator in every position
DOC_A = ("Kafka stores ordered records in partitions that consumers read at their own pace. " * 3).strip()
DOC_B = ("Gradient descent follows the negative gradient to reduce the loss function step by step. " * 3).strip()
DOC_C = ("The Rhine rises in the Swiss Alps and flows north to the North Sea through six countries. " * 3).strip()
QUESTION = "what do the documents say?"


def _docs(*bounds: tuple[int, int]) -> list[BlendDocument]:
    return [BlendDocument(a, b, b"r" * 16) for a, b in bounds]


# ------------------------------------------------------------------------------------------------- span plan
def test_spans_place_each_document_after_its_recomputed_head_and_compute_the_rest():
    docs = _docs((10, 30), (30, 50))
    spans = blend_spans(60, 10, docs, [0, 1], 0.1)
    assert spans == (Span(10, 12), Span(12, 30, 0), Span(30, 32), Span(32, 50, 1), Span(50, 60))
    assert spans[0].start == 10 and spans[-1].end == 60 and not spans[-1].placed
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))


def test_spans_start_after_the_exact_prefix_and_keep_the_last_token_computed():
    docs = _docs((10, 30), (30, 50))
    # the exact prefix ends inside document 0: its rest is placed (its head is exact already)
    assert blend_spans(60, 20, docs, [0, 1], 0.0) == (Span(20, 30, 0), Span(30, 50, 1), Span(50, 60))
    assert blend_spans(60, 20, docs, [0, 1], 0.25) == (Span(20, 30, 0), Span(30, 35), Span(35, 50, 1),
                                                       Span(50, 60))
    assert blend_spans(60, 30, docs, [0, 1], 0.0) == (Span(30, 50, 1), Span(50, 60))
    # a document that ends the prompt: its last token is computed (its logits pick the first output token)
    assert blend_spans(50, 10, docs, [0, 1], 0.0) == (Span(10, 30, 0), Span(30, 49, 1), Span(49, 50))
    # recompute everything: nothing placed
    assert blend_spans(60, 10, docs, [0, 1], 1.0) == (Span(10, 60),)
    # only the placeable documents are placed
    assert blend_spans(60, 10, docs, [1], 0.0) == (Span(10, 30), Span(30, 50, 1), Span(50, 60))


# ----------------------------------------------------------------------------------------------- rotation
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 1.6e-2)])
def test_shifted_keys_match_keys_computed_at_the_new_position(dtype, tolerance):
    """Layer 0's keys depend only on the token and its position, so keys computed after ``p`` filler tokens and
    shifted by ``q - p`` must equal keys computed after ``q`` filler tokens: bit-near in float32, and within one
    extra bfloat16 rounding (relative error of the pair rotation, stated: 1.6e-2 of the key's norm) in bf16."""
    loaded = tiny_loaded_model("llama", dtype=dtype, num_layers=2)
    fwd = FastForward(loaded, weights="bf16", batch_rows=2,
                      max_positions=512)
    arena = fwd.new_arena(2, 512)
    doc = torch.arange(40, 80)
    p, q = 7, 300
    for row, lead in ((0, p), (1, q)):
        fwd.prefill(arena.row(row), torch.cat([torch.full((lead,), 5), doc]), 0)
    here = arena.row(0).keys(0, p, p + 40)
    there = arena.row(1).keys(0, q, q + 40)
    moved = fwd.rope_shift.shift(here, fwd.layers[0].rope, q - p)
    err = (moved.float() - there.float()).norm(dim=-1) / there.float().norm(dim=-1)
    assert err.max().item() < tolerance
    back = fwd.rope_shift.shift(moved.float(), fwd.layers[0].rope, p - q)
    assert (back - here.float()).abs().max().item() < 2e-2 * here.float().abs().max().item()
    assert fwd.rope_shift.shift(here, fwd.layers[0].rope, 0) is here


def test_each_rotary_kind_of_gemma3_shifts_with_its_own_table():
    """Gemma 3 has two rotary bases (sliding and full layers): each layer's keys move with its own."""
    loaded = tiny_loaded_model("gemma3", dtype=torch.float32, num_layers=6)
    fwd = FastForward(loaded, weights="bf16", batch_rows=2, max_positions=512)
    kinds = {lw.rope for lw in fwd.layers}
    assert len(kinds) == 2
    rotary = loaded.model.model.rotary_emb
    torch.manual_seed(0)
    raw = torch.randn(3, fwd.head_dim)
    for kind in kinds:
        def at(pos: int, kind=kind) -> torch.Tensor:
            c, s = rotary(raw, torch.tensor([[pos]]), kind)
            c, s = c[0, 0], s[0, 0]
            half = raw.shape[-1] // 2
            rot = torch.cat((-raw[:, half:], raw[:, :half]), -1)
            return raw * c + rot * s
        moved = fwd.rope_shift.shift(at(11), kind, 250 - 11)
        assert torch.allclose(moved, at(250), atol=1e-4), kind
    c_sliding, _ = fwd.rope_shift.table(sorted(kinds)[0], 100)
    c_full, _ = fwd.rope_shift.table(sorted(kinds)[1], 100)
    assert not torch.allclose(c_sliding, c_full)


# ------------------------------------------------------------------------------------------------ engine
@pytest.fixture
def engine(tiny_engine):
    """Engines with one KV row (the tests read row 0)."""
    return functools.partial(tiny_engine, max_active=1, blend_backfill=False)


def _blend_chunks(eng: PCREngine) -> int:
    """Chunks of the cache's tree that chain from the engine's blend root."""
    from pcr_rag.cache.tiers.remote import root_of

    root = blend_root(eng.root_key)
    return sum(1 for node in eng.cache._index.tree.iter_nodes() if not node.is_root and root_of(node) == root)


def _count_computed(eng: PCREngine) -> list[int]:
    """Wrap the engine's forward so that every prefill step's token count is recorded."""
    counts: list[int] = []
    inner = eng.forward.prefill_layers

    def counting(row, token_ids, start, **kw):
        counts.append(int(token_ids.shape[0]))
        return inner(row, token_ids, start, **kw)

    eng.forward.prefill_layers = counting
    return counts


def test_config_and_requests_validate_the_mode(engine, tmp_path):
    with pytest.raises(ConfigError, match="reuse"):
        EngineConfig(reuse="fuzzy")
    with pytest.raises(ConfigError, match="blend_recompute"):
        EngineConfig(blend_recompute=1.5)
    with engine(tmp_path / "c") as eng:
        with pytest.raises(InvalidRequestError, match="reuse"):
            eng.generate(QUESTION, [DOC_A], reuse="approximate")
        assert eng.stats().requests["requests_finished"] == 0


def test_new_orders_reuse_documents_and_report_blended_tokens(engine, tmp_path):
    with engine(tmp_path / "c", reuse="blend", blend_recompute=0.1) as eng:
        first = eng.generate(QUESTION, [DOC_A, DOC_B, DOC_C])
        again = eng.generate(QUESTION, [DOC_C, DOC_A, DOC_B])
        exact = eng.generate(QUESTION, [DOC_B, DOC_C, DOC_A], reuse="exact")
    m1, m2, m3 = first.metrics, again.metrics, exact.metrics
    for m in (m1, m2):
        assert m.reuse == "blend"
        assert m.computed_tokens + m.reused_tokens + m.blended_tokens == m.prompt_tokens
    # first sight: DOC_A (right after the exact head) computed in context, DOC_B and DOC_C once in isolation and
    # placed - all computed by this request, none reused
    assert m1.blended_tokens == 0 and m1.computed_tokens == m1.prompt_tokens
    # a new order: DOC_C and DOC_B come from their cached isolated KV, ~90% of each placed (DOC_A has none yet:
    # it is computed in isolation now and placed)
    doc_tokens = sum(len(eng.tokenizer(d, add_special_tokens=False)["input_ids"]) for d in (DOC_B, DOC_C))
    assert m2.blended_tokens >= 0.8 * doc_tokens
    assert m3.reuse == "exact" and m3.blended_tokens == 0


def test_exact_requests_do_no_blend_work_and_stay_exact_after_blend_traffic(engine, tmp_path):
    docs = [DOC_A, DOC_B, DOC_C]
    with engine(tmp_path / "off", enable_cache=False) as off:
        want = [off.generate(QUESTION, docs[i:] + docs[:i]) for i in range(3)]
    with engine(tmp_path / "exact") as eng:
        got = [eng.generate(QUESTION, docs[i:] + docs[:i]) for i in range(3)]
        assert _blend_chunks(eng) == 0  # exact mode never computes a position-independent chain
        assert all(g.metrics.reuse == "exact" and g.metrics.blended_tokens == 0 for g in got)
    shared = tmp_path / "shared"
    with engine(shared, reuse="blend") as eng:
        for i in range(3):
            eng.generate(QUESTION, docs[i:] + docs[:i])
        assert _blend_chunks(eng) > 0
        after = [eng.generate(QUESTION, docs[i:] + docs[:i], reuse="exact") for i in range(3)]
        eng.cache.flush()
    with engine(shared) as eng:  # a restart on the blend traffic's cache directory
        restarted = [eng.generate(QUESTION, docs[i:] + docs[:i]) for i in range(3)]
    for w, g, a, r in zip(want, got, after, restarted):
        assert g.token_ids == w.token_ids and a.token_ids == w.token_ids and r.token_ids == w.token_ids
        assert torch.equal(a.first_token_logits, w.first_token_logits)
        assert torch.equal(r.first_token_logits, w.first_token_logits)


def test_nothing_computed_after_a_placed_document_enters_the_exact_tree(engine, tmp_path):
    with engine(tmp_path / "c", reuse="blend", blend_recompute=0.0) as eng:
        eng.generate(QUESTION, [DOC_C, DOC_A])            # DOC_A's isolated KV (and the head) cached
        blended = eng.generate(QUESTION, [DOC_B, DOC_A])  # DOC_B computed in context, DOC_A placed after it
        assert blended.metrics.blended_tokens > 0
        plan = eng.plan_for(QUESTION, [DOC_B, DOC_A])
        matched = eng.cache.match([c.key for c in plan])
        doc_a_start = next(c.start for c in plan if c.segment == 2)
        # DOC_B (computed in place after the head, before anything placed) may be exact; DOC_A and the question
        # after it (computed after placed KV) are not in the exact tree
        assert matched.num_tokens <= doc_a_start


def test_placed_kv_survives_the_compute_steps_and_equals_exact_where_no_shift_is_needed(engine, tmp_path):
    """The default system prompt's head is the anchor, so the first document's isolated KV sits where the request
    needs it (a shift of 0): placed, it must be bit-identical to the exact computation - unless a later compute
    step's zero-fill wiped it (the high-water-mark invariant) or placement wrote the wrong positions."""
    with engine(tmp_path / "off", enable_cache=False) as off:
        want = off.generate(QUESTION, [DOC_A])
        reference = off.arena.row(0)
        n = want.metrics.prompt_tokens
        ref_k = [reference.keys(li, 0, n).clone() for li in range(len(off.forward.layers))]
    with engine(tmp_path / "c", reuse="blend", blend_recompute=0.0, prefill_chunk_tokens=8) as eng:
        eng.generate(QUESTION, [DOC_B, DOC_A])  # computes DOC_A's isolated KV (DOC_B, first, in context)
        got = eng.generate(QUESTION, [DOC_A])  # places it from DRAM, at the anchor's position
        row = eng.arena.row(0)
        assert got.metrics.blended_tokens > 0
        for li in range(len(eng.forward.layers)):
            assert torch.equal(row.keys(li, 0, n), ref_k[li]), li
    assert got.token_ids == want.token_ids
    assert torch.equal(got.first_token_logits, want.first_token_logits)


@pytest.mark.parametrize("step_tokens", [8, 512])
def test_a_later_compute_step_never_wipes_placed_kv(engine, tmp_path, step_tokens):
    """A document's recomputed head is a compute step that starts after earlier placed spans and before its
    own placed rest: the step's zero-fill of never-written positions (up to its attention block's end) must not
    wipe the placed KV ahead of it. Run on a row that was never written (NaN, high-water mark 0) and on a warm
    row: the same logits."""
    with engine(tmp_path / "c", reuse="blend", blend_recompute=0.25, prefill_chunk_tokens=step_tokens) as eng:
        eng.generate(QUESTION, [DOC_A, DOC_B])  # DOC_B's isolated KV cached (DOC_A, first, computed in context)
        eng.generate(QUESTION, [DOC_B, DOC_A])  # ... and DOC_A's
        warm = eng.generate(QUESTION, [DOC_B, DOC_A])
        arena = eng.arena
        for t in (*arena.k, *arena.v):
            t[0].fill_(float("nan"))
        arena._finite_upto[0] = 0
        cold = eng.generate(QUESTION, [DOC_B, DOC_A])
    assert cold.metrics.blended_tokens == warm.metrics.blended_tokens > 0
    assert torch.equal(cold.first_token_logits, warm.first_token_logits)
    assert cold.token_ids == warm.token_ids


def test_a_new_document_is_computed_once_in_isolation(engine, tmp_path):
    """First sight of two documents in blend mode: each is computed once, on its own behind the anchor, and
    placed - never also in context. So the prefill computes the prompt's tokens at most once, plus the anchor's
    (cached once, under the blend root) and the last token of each isolated prompt (its lease ends there)."""
    with engine(tmp_path / "c", reuse="blend", blend_recompute=0.0) as eng:
        counts = _count_computed(eng)
        got = eng.generate(QUESTION, [DOC_B, DOC_C])
        anchor = len(eng._blend_anchor())
    assert got.metrics.blended_tokens == 0  # computed by this request (in isolation), so counted as computed
    assert sum(counts) <= got.metrics.prompt_tokens + anchor + 2


def test_an_announcement_prefetches_the_documents_position_independent_kv(engine, tmp_path, caplog):
    """Layer-wise overlap and prefetch apply to blended documents: after a restart their isolated KV is on SSD
    only; a blend announcement puts their chains in the prefetch window and the prefetcher loads them to DRAM,
    so the request places them from memory."""
    import time

    path = tmp_path / "c"
    with engine(path, reuse="blend") as eng:
        eng.generate(QUESTION, [DOC_C, DOC_A, DOC_B])  # DOC_C (first) computed in context, the others isolated
        eng.cache.flush()
    with engine(path, reuse="blend", prefetch=True) as eng:
        # the blend root has its manifest: the restart finds no chunks "of unknown origin"
        assert "cannot use" not in caplog.text
        ticket = eng.announce([DOC_C, DOC_B, DOC_A], QUESTION)
        assert len(ticket.chains) == 3
        cached = [c for c in ticket.chains if len(eng.cache.match(list(c)).keys) == len(c)]
        assert len(cached) == 2  # DOC_A's and DOC_B's chains (DOC_C has none: it was computed in context)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            tiers = [t for c in cached for t in eng.cache.match(list(c)).tiers]
            if all(t.value in ("dram", "device") for t in tiers):
                break
            time.sleep(0.02)
        assert all(t.value in ("dram", "device") for t in tiers), tiers
        got = eng.generate(QUESTION, [DOC_C, DOC_B, DOC_A])
        assert got.metrics.blended_tokens > 0
        assert eng.stats().prefetch["claimed"] == 1
    with engine(tmp_path / "exact", prefetch=True) as eng:
        assert eng.announce([DOC_A, DOC_B], QUESTION).chains == ()  # an exact announcement has none


def test_a_slow_tier_the_planner_declines_computes_the_document_in_place(engine, tmp_path, caplog):
    """The load-or-recompute planner covers blended documents too: when loading a document's isolated KV from
    its tier is estimated slower than computing it, the document is computed in place (not placed)."""
    from pcr_rag.cache.reuse_planner import ReusePlan

    path = tmp_path / "c"
    with engine(path, reuse="blend") as eng:
        eng.generate(QUESTION, [DOC_A, DOC_B])
        eng.cache.flush()
    with engine(path, reuse="blend", load_planner="measured") as eng:
        planner = eng.cache.planner
        declined = []

        def slow_tier(segments, prompt_tokens, **kw):  # every tier estimated slower than recomputing
            declined.append(len(segments))
            return ReusePlan(0, None, tuple(s.tier for s in segments))

        planner.plan = slow_tier
        got = eng.generate(QUESTION, [DOC_B, DOC_A])
    assert declined and got.metrics.blended_tokens == 0
    assert got.metrics.computed_tokens == got.metrics.prompt_tokens
    assert "computed in place" not in caplog.text  # declined by the planner, not a cache failure


def test_a_scattered_step_over_placed_exact_kv_reproduces_the_whole_prefill():
    """The blend step's forward over several spans with KV in between (`prefill_layers(positions=...)`): when
    the KV between the spans is the exact KV, one scattered step gives the logits and KV of a plain prefill of
    the whole prompt (float32: to rounding; the tiles differ, so not bit for bit)."""
    loaded = tiny_loaded_model("llama", dtype=torch.float32, num_layers=2)
    fwd = FastForward(loaded, weights="bf16", batch_rows=2, max_positions=1024)
    arena = fwd.new_arena(2, 1024)
    ids = torch.randint(5, 200, (700,), generator=torch.Generator().manual_seed(1))
    want = fwd.prefill(arena.row(0), ids, 0)
    full, part = arena.row(0), arena.row(1)
    fwd.prefill(part, ids[:100], 0)
    arena.ensure_finite(1, 100, 768)
    for li in range(len(fwd.layers)):  # "placed": the exact KV of [130, 400) and [420, 690)
        for a, b in ((130, 400), (420, 690)):
            part.keys(li, a, b).copy_(full.keys(li, a, b))
            part.values(li, a, b).copy_(full.values(li, a, b))
    positions = torch.cat([torch.arange(100, 130), torch.arange(400, 420), torch.arange(690, 700)])
    got = fwd.prefill(part, ids[positions], 100, positions=positions)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    for li in range(len(fwd.layers)):
        assert torch.allclose(part.keys(li, 0, 700), full.keys(li, 0, 700), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="strictly increasing"):
        fwd.prefill(part, ids[:3], 5, positions=torch.tensor([5, 9, 7]))


def test_blend_steps_span_placed_kv_instead_of_one_forward_per_document(engine, tmp_path):
    """A document's recomputed head and the next document's are one forward when the step budget holds both."""
    with engine(tmp_path / "c", reuse="blend", blend_recompute=0.1, prefill_chunk_tokens=512) as eng:
        eng.generate(QUESTION, [DOC_A, DOC_B, DOC_C])
        eng.generate(QUESTION, [DOC_C, DOC_A, DOC_B])  # now every document has its isolated KV
        counts = _count_computed(eng)
        got = eng.generate(QUESTION, [DOC_B, DOC_C, DOC_A])
    assert got.metrics.blended_tokens > 0
    assert len(counts) == 1 and counts[0] == got.metrics.computed_tokens


def test_the_first_new_document_after_the_exact_match_is_computed_exactly_and_extends_the_exact_tree(engine, tmp_path):
    """A document that keeps coming first behind the same head (a static system part, a popular first passage)
    must not stay approximate: seen for the first time right after the exact match, it is computed in context,
    and the next request reuses it exactly."""
    with engine(tmp_path / "off", enable_cache=False) as off:
        want = off.generate(QUESTION, [DOC_A, DOC_C])
    with engine(tmp_path / "c", reuse="blend", blend_recompute=0.1) as eng:
        first = eng.generate(QUESTION, [DOC_A, DOC_B])
        second = eng.generate(QUESTION, [DOC_A, DOC_C])
        plan = eng.plan_for(QUESTION, [DOC_A, DOC_C])
    doc_c_start = next(c.start for c in plan if c.segment == 2)
    assert first.metrics.blended_tokens == 0
    assert second.metrics.reused_tokens == doc_c_start  # the head and DOC_A, exact
    # DOC_C is new right after the exact match: computed in context too, so the whole answer is exact
    assert second.metrics.blended_tokens == 0
    assert second.token_ids == want.token_ids and torch.equal(second.first_token_logits, want.first_token_logits)


def test_position_independent_kv_follows_the_sharing_scopes(engine, tmp_path):
    """A private document's position-independent KV is never found by another tenant (its blended_tokens would
    tell that tenant the text was there); a shared document's is, across namespaces."""
    from pcr_rag import Doc

    secret = ("The merger with Initech closes on March 3 at a price of 41 dollars per share. " * 3).strip()
    with engine(tmp_path / "c", reuse="blend", blend_recompute=0.0) as eng:
        # tenant a: the secret (private) and DOC_C (shared) get their isolated KV (DOC_B first: in context)
        eng.generate(QUESTION, [Doc(DOC_B, "shared"), Doc(DOC_C, "shared"), Doc(secret, "private")], namespace="a")
        again = eng.generate(QUESTION, [Doc(DOC_A, "shared"), Doc(secret, "private")], namespace="a")
        # tenant b, the same documents: the shared one is placed from a's KV, the private one is not found; tenant
        # c guesses the secret wrong (each tenant's first sight of its guess)
        guess = eng.generate(QUESTION, [Doc(DOC_A, "shared"), Doc(DOC_C, "shared"), Doc(secret, "private")],
                             namespace="b")
        wrong = eng.generate(QUESTION, [Doc(DOC_A, "shared"), Doc(DOC_C, "shared"),
                                        Doc(secret.replace("41", "42"), "private")], namespace="c")
    assert again.metrics.blended_tokens > 0  # the owner reuses its own private document
    doc_c = len(eng.tokenizer(DOC_C, add_special_tokens=False)["input_ids"])
    assert guess.metrics.blended_tokens >= 0.8 * doc_c  # DOC_C, shared, from tenant a's KV
    # the right guess of the secret gets exactly what a wrong guess gets: DOC_C's shared KV, nothing more
    assert guess.metrics.blended_tokens == wrong.metrics.blended_tokens
