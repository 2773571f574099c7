"""Blend mode's gate (issue 48 item 2): sampled blended requests are run again exactly as shadows and compared;
a namespace whose window breaches its bound falls back to exact, and its later requests are exact."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from pcr_rag import PCREngine
from pcr_rag.sched.blend_gate import BlendGate, Verification, compare, first_token_kl

DOCS = [
    "Kafka stores ordered records in partitions that consumers read at their own pace. " * 3,
    "Gradient descent follows the negative gradient to reduce the loss function step by step. " * 3,
    "The Rhine rises in the Swiss Alps and flows north to the North Sea through six countries. " * 3,
]
QUESTION = "what do the documents say?"


def _v(kl: float, identical: bool | None = True) -> Verification:
    return Verification(kl, identical, None if identical is None else float(identical), 0.01, 100)


def test_the_gate_trips_once_a_full_window_breaches_a_bound():
    gate = BlendGate(verify=1.0, window=3, min_identical=0.6, max_kl=0.2)
    root, other = b"a" * 16, b"b" * 16
    assert not gate.record(root, _v(0.9))
    assert not gate.record(root, _v(0.9))  # a window not yet full never trips
    assert gate.allows(root)
    assert gate.record(root, _v(0.9))      # median KL 0.9 > 0.2
    assert not gate.allows(root) and gate.allows(other)
    assert not gate.record(root, _v(0.9))  # tripped once, counted once
    for _ in range(3):
        gate.record(other, _v(0.01, identical=False))
    assert not gate.allows(other)          # identical 0% < 60%
    snap = gate.snapshot()
    assert snap["fallbacks"] == 2 and snap["namespaces_exact"] == 2 and snap["verified"] == 7
    assert snap["identical"] == 4 and snap["greedy_verified"] == 7


def test_a_healthy_window_and_unreproducible_samples_do_not_trip():
    gate = BlendGate(verify=1.0, window=2, min_identical=0.5, max_kl=0.2)
    root = b"a" * 16
    for v in (_v(0.05), _v(0.1, identical=False), _v(0.01), _v(0.0, identical=None)):
        assert not gate.record(root, v)
    assert gate.allows(root)
    assert gate.snapshot()["token_agreement_mean"] == pytest.approx(2 / 3)


def test_sampling_verifies_every_nth_blended_request():
    gate = BlendGate(verify=0.25, window=4, min_identical=0.5, max_kl=1.0)
    assert [gate.sample() for _ in range(8)] == [False, False, False, True] * 2
    assert not any(BlendGate(verify=0.0, window=4, min_identical=0.5, max_kl=1.0).sample() for _ in range(9))


def test_compare_measures_kl_identity_and_agreement():
    class R:
        def __init__(self, tokens, logits):
            self.token_ids, self.first_token_logits, self.prompt_token_ids = tokens, logits, [1, 2, 3]

    logits = torch.tensor([2.0, 1.0, 0.0])
    same = compare(R([1, 2, 3], logits), R([1, 2, 3], logits), True, 0.5)
    assert same.identical and same.token_agreement == 1.0 and same.first_token_kl == 0.0
    off = compare(R([1, 9, 3], torch.tensor([0.0, 1.0, 2.0])), R([1, 2, 3, 4], logits), True, 0.5)
    assert not off.identical and off.token_agreement == 0.5 and off.first_token_kl > 0.5
    assert compare(R([7], logits), R([1], logits), False, 0.5).identical is None
    p, q = torch.tensor([0.3, -1.0], dtype=torch.float64), torch.tensor([1.0, 0.2], dtype=torch.float64)
    want = sum(a * (torch.log(a) - torch.log(b)) for a, b in zip(p.softmax(0), q.softmax(0)))
    assert first_token_kl(p, q) == pytest.approx(float(want), rel=1e-9)


@pytest.fixture
def engine(tiny_engine):
    """Blend engines that verify every blended request, with a window of 2."""
    return functools.partial(tiny_engine, reuse="blend", blend_verify=1.0, blend_gate_window=2)


def _orders():
    for i in range(3):
        yield DOCS[i:] + DOCS[:i]


def _wait_verified(eng: PCREngine, n: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = eng.stats().blend
        if snap["verified"] >= n:
            return snap
        time.sleep(0.02)
    raise AssertionError(f"only {eng.stats().blend['verified']} of {n} shadows verified in {timeout} s")


def test_harmful_blending_trips_the_fallback_within_its_window_and_later_requests_are_exact(engine, tmp_path):
    """Recompute 0 on a random model: placed KV moves the first token's distribution far from exact (KL well
    above the bound), so the gate trips after its window of 2 verified requests, and every later blend request
    of the namespace is served exactly - the tokens of a cache-off engine."""
    with engine(tmp_path / "off", enable_cache=False) as off:
        want = [off.generate(QUESTION, docs) for docs in _orders()]
    with engine(tmp_path / "c", blend_recompute=0.0, blend_gate_max_kl=0.01) as eng:
        first = [eng.generate(QUESTION, docs) for docs in list(_orders())[:2]]
        assert all(r.metrics.reuse == "blend" for r in first) and first[1].metrics.blended_tokens > 0
        snap = _wait_verified(eng, 2)
        assert snap["fallbacks"] == 1 and snap["namespaces_exact"] == 1
        assert snap["first_token_kl_median"] > 0.01
        later = [eng.generate(QUESTION, docs) for docs in _orders()]
        other = eng.generate(QUESTION, DOCS, namespace="tenant-b")  # another namespace keeps blending
        requests = eng.stats().requests
    for got, w in zip(later, want):
        assert got.metrics.reuse == "exact" and got.metrics.blended_tokens == 0
        assert got.token_ids == w.token_ids and torch.equal(got.first_token_logits, w.first_token_logits)
    assert other.metrics.reuse == "blend"
    assert requests["requests_finished"] == 6  # the two shadows are not user requests
    assert snap["shadow_requests"] == 2 and snap["shadow_prompt_tokens"] > 0 and snap["shadow_seconds"] > 0


def test_blending_that_places_nothing_never_trips(engine, tmp_path):
    """Control: with every document token recomputed, blend requests equal exact ones (KL 0, same answers)."""
    with engine(tmp_path / "c", blend_recompute=1.0, blend_gate_max_kl=1e-9,
                 blend_gate_min_identical=1.0) as eng:
        results = [eng.generate(QUESTION, docs) for docs in _orders()]
        snap = _wait_verified(eng, 3)
    assert all(r.metrics.reuse == "blend" and r.metrics.blended_tokens == 0 for r in results)
    assert snap["fallbacks"] == 0 and snap["identical"] == 3 and snap["first_token_kl_median"] == 0.0


def test_backfill_makes_a_blended_prompt_that_comes_back_exact(engine, tmp_path):
    """KV computed after a placed document never enters the exact tree, so without backfill a blended prompt that
    comes back is blended again; with it, its exact twin is prefilled on idle capacity and the prompt is then
    served by exact reuse - as much as exact PCR reuses for it."""
    order = [DOCS[1], DOCS[2], DOCS[0]]
    with engine(tmp_path / "pcr", reuse="exact", blend_verify=0.0) as eng:
        eng.generate(QUESTION, DOCS)
        eng.generate(QUESTION, order)
        pcr = eng.generate(QUESTION, order).metrics
    results = {}
    for backfill in (False, True):
        with engine(tmp_path / f"b{backfill}", blend_verify=0.0, blend_backfill=backfill) as eng:
            eng.generate(QUESTION, DOCS)
            first = eng.generate(QUESTION, order)
            assert first.metrics.blended_tokens > 0
            if backfill:
                deadline = time.monotonic() + 30
                while eng.stats().blend["backfills"] < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert eng.stats().blend["backfills"] == 2
                assert eng.stats().requests["requests_finished"] == 2  # backfills are not user requests
            results[backfill] = eng.generate(QUESTION, order).metrics
    assert results[False].reuse == "blend" and results[False].blended_tokens > 0
    assert results[False].reused_tokens < pcr.reused_tokens  # blended again
    assert results[True].reused_tokens == pcr.reused_tokens > results[False].reused_tokens
    assert results[True].blended_tokens == 0
