"""Workload traces: reproducibility, Zipf skew, Poisson/gamma arrivals, working set and tier sizing."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from pcr_rag.bench.workload import (
    Request,
    arrival_times,
    make_requests,
    requests_from_retrieval,
    tier_capacities,
    working_set,
    zipf_weights,
)

DOCS = [f"doc{i}" for i in range(50)]


def test_same_seed_same_trace_different_seed_differs():
    a = make_requests(DOCS, num_requests=40, top_k=3, rate=2.0, seed=7)
    b = make_requests(DOCS, num_requests=40, top_k=3, rate=2.0, seed=7)
    c = make_requests(DOCS, num_requests=40, top_k=3, rate=2.0, seed=8)
    assert a == b
    assert a != c
    assert all(len(set(r.doc_ids)) == 3 for r in a)
    assert len({r.question for r in a}) == 40  # every question distinct
    assert [r.request_id for r in a] == list(range(40))


def test_popularity_seed_shares_ranking_across_traces():
    a = make_requests(DOCS, num_requests=2000, top_k=1, seed=1, popularity_seed=99)
    b = make_requests(DOCS, num_requests=2000, top_k=1, seed=2, popularity_seed=99)
    top_a = Counter(r.doc_ids[0] for r in a).most_common(1)[0][0]
    top_b = Counter(r.doc_ids[0] for r in b).most_common(1)[0][0]
    assert top_a == top_b
    assert a != b


def test_zipf_skew_is_measurable():
    w = zipf_weights(50, 1.0)
    assert w.sum() == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx(2.0)
    reqs = make_requests(DOCS, num_requests=5000, top_k=1, zipf_exponent=1.0, seed=3)
    counts = sorted(Counter(r.doc_ids[0] for r in reqs).values(), reverse=True)
    # Rank-1 share close to its Zipf probability (1 / H_50 ~ 0.222), far above uniform (0.02).
    assert counts[0] / 5000 == pytest.approx(w[0], abs=0.03)
    # Log-log slope of rank vs frequency over the head ~ -1.
    ranks = np.arange(1, 11)
    slope = np.polyfit(np.log(ranks), np.log(counts[:10]), 1)[0]
    assert -1.3 < slope < -0.7
    uniform = make_requests(DOCS, num_requests=5000, top_k=1, zipf_exponent=0.0, seed=3)
    assert max(Counter(r.doc_ids[0] for r in uniform).values()) / 5000 < 0.05


def test_poisson_mean_interarrival_and_burstiness():
    rate = 4.0
    t = arrival_times(20001, rate, rng=0)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:], strict=False))
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    bursty = np.diff(arrival_times(20001, rate, burstiness=0.25, rng=0))
    assert bursty.mean() == pytest.approx(1 / rate, rel=0.06)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # gamma CV = 1/sqrt(shape)
    assert arrival_times(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError):
        arrival_times(3, 1.0, burstiness=0)


def test_trace_rate_is_applied():
    reqs = make_requests(DOCS, num_requests=2001, rate=0.5, seed=0)
    assert reqs[-1].arrival_s / 2000 == pytest.approx(2.0, rel=0.06)


def test_requests_from_retrieval():
    reqs = requests_from_retrieval([("q1", ["a", "b"]), ("q2", ["b"])], rate=math.inf)
    assert reqs == [Request(0, 0.0, ("a", "b"), "q1"), Request(1, 0.0, ("b",), "q2")]
    with pytest.raises(ValueError):
        requests_from_retrieval([("q", [])])


def test_working_set_counts_distinct_prefixes():
    reqs = [Request(0, 0, ("a", "b"), "q"), Request(1, 0, ("a", "c"), "q"), Request(2, 0, ("a", "b"), "q"),
            Request(3, 0, ("c", "a"), "q")]
    tokens = {"a": 10, "b": 20, "c": 30}
    ws = working_set(reqs, tokens, bytes_per_token=100, system_tokens=5)
    assert ws.unique_docs == 3
    assert ws.doc_tokens == 60
    # prefixes: (a), (a,b), (a,c), (c), (c,a) -> 10 + 20 + 30 + 30 + 10, plus the system prompt once
    assert ws.prefix_tokens == 100 + 5
    assert ws.requested_tokens == 30 + 40 + 30 + 40
    assert ws.bytes == 105 * 100
    assert ws.reuse_upper_bound == pytest.approx(1 - 100 / 140)
    with pytest.raises(KeyError):
        working_set([Request(0, 0, ("zzz",), "q")], tokens)


def test_tier_capacities():
    assert tier_capacities(1000) == (250, 1000)
    assert tier_capacities(1000, dram_fraction=0.5, ssd_fraction=0) == (500, 0)
    assert tier_capacities(100, dram_fraction=0.01, min_bytes=64) == (64, 100)
    with pytest.raises(ValueError):
        tier_capacities(100, dram_fraction=-1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        make_requests(DOCS[:2], num_requests=1, top_k=3)
    with pytest.raises(ValueError, match="unique"):
        make_requests(["a", "a"], num_requests=1, top_k=1)


def test_topic_mode_repeats_whole_retrieval_lists():
    reqs = make_requests(DOCS, num_requests=400, top_k=3, num_topics=10, seed=5)
    lists = {r.topic: r.doc_ids for r in reqs}
    assert len(lists) <= 10
    assert all(lists[r.topic] == r.doc_ids for r in reqs)  # one fixed list per topic
    counts = Counter(r.topic for r in reqs).most_common()
    assert counts[0][1] / 400 == pytest.approx(zipf_weights(10, 1.0)[0], abs=0.06)
    # Topic lists come from the popularity ranking, not the request seed.
    other = make_requests(DOCS, num_requests=400, top_k=3, num_topics=10, seed=6, popularity_seed=5)
    assert {r.topic: r.doc_ids for r in other} == {t: lists[t] for t in {r.topic for r in other}}
    # A prefix cache can reuse far more in topic mode than with independent draws.
    tokens = dict.fromkeys(DOCS, 100)
    per_request = make_requests(DOCS, num_requests=400, top_k=3, seed=5)
    assert working_set(reqs, tokens).reuse_upper_bound > 0.9
    assert working_set(per_request, tokens).reuse_upper_bound < 0.6
    with pytest.raises(ValueError, match="num_topics"):
        make_requests(DOCS, num_requests=1, num_topics=0)


def test_with_rate_rescales_a_unit_trace():
    from pcr_rag.bench.workload import with_rate

    unit = make_requests(DOCS, num_requests=20, rate=1.0, seed=4)
    direct = make_requests(DOCS, num_requests=20, rate=4.0, seed=4)
    scaled = with_rate(unit, 4.0)
    assert [r.doc_ids for r in scaled] == [r.doc_ids for r in direct]
    assert [r.arrival_s for r in scaled] == pytest.approx([r.arrival_s for r in direct])
    assert all(r.arrival_s == 0.0 for r in with_rate(unit, math.inf))


def test_working_set_suffix_tokens_count_in_bytes():
    ws = working_set([Request(0, 0, ("a",), "q")], {"a": 10}, bytes_per_token=2, suffix_tokens=5)
    assert ws.bytes == 30 and ws.suffix_tokens == 5


def test_given_topics_are_picked_with_zipf_popularity():
    topics = [(f"question {i}?", (f"doc{i}", f"doc{i + 1}")) for i in range(8)]
    reqs = make_requests([], num_requests=600, topics=topics, seed=2, popularity_seed=9)
    assert reqs == make_requests([], num_requests=600, topics=topics, seed=2, popularity_seed=9)
    assert all(r.doc_ids == topics[r.topic][1] for r in reqs)
    assert all(r.question == f"Request {r.request_id}: {topics[r.topic][0]}" for r in reqs)
    top_share = Counter(r.topic for r in reqs).most_common(1)[0][1] / 600
    assert top_share == pytest.approx(zipf_weights(8, 1.0)[0], abs=0.06)
    with pytest.raises(ValueError, match="not both"):
        make_requests([], num_requests=1, topics=topics, num_topics=3)
    with pytest.raises(ValueError):
        make_requests([], num_requests=1, topics=[("q", ())])


def test_popular_topics_agree_with_traces():
    from pcr_rag.bench.workload import popular_topics

    kw = {"top_k": 3, "zipf_exponent": 1.0, "popularity_seed": 11}
    pop = popular_topics(DOCS, num_topics=8, **kw)
    assert [t for t, _, _ in pop] == list(range(8))
    reqs = make_requests(DOCS, num_requests=800, num_topics=8, seed=1, **kw)
    lists = dict((t, ids) for t, ids, _ in pop)
    assert all(r.doc_ids == lists[r.topic] for r in reqs)
    counts = Counter(r.topic for r in reqs)
    assert counts.most_common(1)[0][0] == pop[0][0]
    given = [(f"q{i}", (f"doc{i}",)) for i in range(6)]
    gpop = popular_topics([], topics=given, **kw)
    greqs = make_requests([], num_requests=800, topics=given, seed=1, **kw)
    assert Counter(r.topic for r in greqs).most_common(1)[0][0] == gpop[0][0]
    assert gpop[0][2] == given[gpop[0][0]][0]
    assert popular_topics(DOCS, **kw) == []
