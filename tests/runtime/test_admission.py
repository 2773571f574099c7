"""Admission policies as pure functions of (candidates, now)."""

from __future__ import annotations

import pytest

from pcr_rag.errors import ConfigError
from pcr_rag.runtime.admission import AGING_TOKENS_PER_S, Candidate, PrefillSpeed, rank


def test_fcfs_is_arrival_order():
    cands = [Candidate(3.0, 10), Candidate(1.0, 5000), Candidate(2.0, 0)]
    assert rank("fcfs", cands, now=10.0) == [1, 2, 0]


def test_cache_aware_prefers_least_uncached_work():
    cands = [Candidate(0.0, 2000), Candidate(0.1, 50), Candidate(0.2, 900)]
    assert rank("cache-aware", cands, now=0.2) == [1, 2, 0]


def test_cache_aware_ages_so_nothing_starves():
    """A request with 3000 uncached tokens loses to a fully cached newcomer only until it has waited
    3000 / AGING_TOKENS_PER_S seconds; after that it outranks any newcomer."""
    patience = 3000 / AGING_TOKENS_PER_S
    old = Candidate(0.0, 3000)
    early, late = 0.5 * patience, 1.5 * patience
    assert rank("cache-aware", [old, Candidate(early, 0)], now=early) == [1, 0]
    assert rank("cache-aware", [old, Candidate(late, 0)], now=late) == [0, 1]


def test_ties_keep_arrival_order():
    cands = [Candidate(2.0, 100), Candidate(1.0, 100)]
    assert rank("cache-aware", cands, now=2.0)[0] == 1


def test_unknown_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="fcfs"):
        rank("random", [Candidate(0.0, 1)], now=0.0)


def test_aging_follows_the_given_rate():
    """At the aging rate of a slow machine (300 tokens/s) a cold request that has waited a second still yields to
    a hit; at 2,000 tokens/s it would not."""
    cold, hit = Candidate(0.0, 1100), Candidate(1.0, 50)
    assert rank("cache-aware", [cold, hit], now=1.0, aging=300.0) == [1, 0]
    assert rank("cache-aware", [cold, hit], now=1.0, aging=2000.0) == [0, 1]
    assert rank("cache-aware", [cold, hit], now=1.0) == rank("cache-aware", [cold, hit], now=1.0, aging=2000.0)


def test_prefill_speed_weighs_steps_by_their_length():
    """Tokens over seconds of decayed sums: a short step's fixed cost barely moves the rate; until a step is
    recorded the rate is the default; empty steps are ignored."""
    speed = PrefillSpeed()
    assert speed.tokens_per_s == AGING_TOKENS_PER_S
    speed.record(0, 0.1)
    speed.record(10, 0.0)
    assert speed.tokens_per_s == AGING_TOKENS_PER_S
    speed.record(256, 0.8)
    assert speed.tokens_per_s == pytest.approx(320.0)
    speed.record(18, 0.135)  # a hit's step: 133 tokens/s on its own
    assert 290 < speed.tokens_per_s < 320
    for _ in range(200):  # the machine got faster: the rate follows
        speed.record(256, 0.256)
    assert speed.tokens_per_s == pytest.approx(1000.0, rel=1e-3)
