"""Admission policies as pure functions of (candidates, now)."""

from __future__ import annotations

import pytest

from pcr_rag.errors import ConfigError
from pcr_rag.runtime.admission import AGING_TOKENS_PER_S, Candidate, rank


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
