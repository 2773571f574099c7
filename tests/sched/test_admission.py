"""Admission policies as pure functions of (candidates, now)."""

from __future__ import annotations

import pytest

from pcr_rag.errors import ConfigError
from pcr_rag.sched.admission import (
    AGING_TOKENS_PER_S,
    ORDER_HORIZON,
    Candidate,
    PrefillOutlook,
    PrefillSpeed,
    prefill_candidates,
    queue_candidates,
    queue_order,
    rank,
)


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


def test_service_counts_as_waiting_only_against_requests_already_there():
    """A cold prompt that arrived and began at 0 and has been computed for 0.6 s, 127 tokens left, at 400 tokens/s
    of aging: a 26-token hit arriving at 0.65 s goes first (against it the cold prompt waited 0.1 s: 40 tokens of
    credit, not 280); a 300-token request waiting since 0 does not (the cold prompt outranked it when it began, and
    still does); under fcfs arrival order stands."""
    cold = Candidate(0.0, 127, began_s=0.0, served_s=0.6)
    hit, waiter = Candidate(0.65, 26), Candidate(0.0, 300)
    assert cold.waiting_since(0.65) == pytest.approx(0.6) and cold.waiting_since(0.0) == 0.0
    assert rank("cache-aware", [cold, hit], now=0.7, aging=400.0) == [1, 0]
    assert rank("cache-aware", [cold, waiter], now=0.7, aging=400.0) == [0, 1]
    assert rank("cache-aware", [cold, waiter, hit], now=0.7, aging=400.0) == [2, 0, 1]
    assert rank("cache-aware", [Candidate(0.0, 127), hit], now=0.7, aging=400.0) == [0, 1], "no service: one key"
    assert rank("fcfs", [hit, cold], now=0.7) == [1, 0]


def test_a_prefill_preempted_by_hit_after_hit_still_gains_on_the_next():
    """The same cold prompt 2 s after it began, 0.6 s of it computed: it waited 1.4 s, 560 tokens of credit, so a
    hit arriving now waits for it - nothing starves."""
    cold = Candidate(0.0, 127, began_s=0.0, served_s=0.6)
    assert rank("cache-aware", [cold, Candidate(1.95, 26)], now=2.0, aging=400.0) == [0, 1]


def test_without_a_pairwise_winner_the_single_key_decides():
    """A cycle: the cold prompt outranks the 250-token request that was waiting when it began, that request
    outranks the hit (it has waited 0.7 s), and the hit outranks the cold prompt (which has hardly waited):
    no request outranks all the others, so the single key (service counted against all) orders them."""
    cold = Candidate(0.0, 127, began_s=0.0, served_s=0.6)
    waiter, hit = Candidate(0.0, 250), Candidate(0.65, 26)
    assert rank("cache-aware", [hit, waiter, cold], now=0.7, aging=400.0) == [2, 1, 0]


def test_a_group_ages_from_its_own_service_or_its_waiting_dependents():
    """A begun prefill carries when it began and its service; one that a waiting request depends on ages, against
    a newcomer, from that request's arrival when it is earlier than the prefill's own arrival plus service."""
    begun = PrefillOutlook(0.0, 200, {b"a": 100, b"b": 100}, begun=True, began_s=0.0, served_s=0.5)
    assert prefill_candidates("cache-aware", [begun]) == [Candidate(0.0, 200, 0.0, 0.5)]
    waiter = PrefillOutlook(0.2, 150, {b"a": 100, b"b": 100, b"c": 50}, begun=False)
    got = prefill_candidates("cache-aware", [begun, waiter])
    assert got[1] is None and got[0].arrived_s == 0.0 and got[0].waiting_since(1.0) == pytest.approx(0.2)
    assert got[0].waiting_since(0.1) == pytest.approx(0.1), "before the dependent came: its own service"


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


# ------------------------------------------------------------------------------------------ prefills that share
def _chunks(*names: str, tokens: int = 100) -> dict[bytes, int]:
    return {name.encode(): tokens for name in names}


def test_prefills_without_shared_chunks_rank_as_themselves():
    ps = [PrefillOutlook(1.0, 300, _chunks("a", "b", "c"), True), PrefillOutlook(2.0, 100, _chunks("d"), False),
          PrefillOutlook(3.0, 0, {}, False)]
    for schedule in ("fcfs", "cache-aware"):
        assert prefill_candidates(schedule, ps) == [Candidate(1.0, 300), Candidate(2.0, 100), Candidate(3.0, 0)]


def test_a_prefill_waits_for_chunks_a_running_one_computes_and_lends_it_its_arrival():
    """B (oldest) needs chunk "a" that A is computing: B waits (None) and A inherits B's arrival, so under fcfs A
    now outranks C, which arrived between them; a begun prefill is never made to wait."""
    a = PrefillOutlook(5.0, 300, _chunks("a", "b", "c"), True)
    b = PrefillOutlook(1.0, 320, {**_chunks("a", "b"), b"q": 20}, False)
    c = PrefillOutlook(2.0, 100, _chunks("z"), False)
    cands = prefill_candidates("fcfs", [a, b, c])
    assert cands[1] is None
    assert cands[0] == Candidate(1.0, 300, waiting_s=1.0) and cands[2] == Candidate(2.0, 100)
    assert rank("fcfs", [cands[0], cands[2]], now=6.0) == [0, 1]


def test_cache_aware_work_is_the_groups_work_per_request():
    """A cold 1,000-token prefill whose chunks two others would reuse (residuals 40 and 60 tokens) ranks at
    (1000 + 40 + 60) / 3 = 367 tokens, ahead of a lone 500-token one; a dependent with a large residual is left
    out of the mean when it would raise it (min over k)."""
    shared = _chunks("a", "b", "c", "d", "e", tokens=200)
    cold = PrefillOutlook(0.0, 1000, shared, False)
    dep1 = PrefillOutlook(0.1, 1040, {**shared, b"x": 40}, False)
    dep2 = PrefillOutlook(0.2, 1060, {**shared, b"y": 60}, False)
    lone = PrefillOutlook(0.3, 500, _chunks("z", tokens=500), False)
    far = PrefillOutlook(0.4, 2200, {**_chunks("a", tokens=200), b"w": 2000}, False)  # shares only chunk "a"
    cands = prefill_candidates("cache-aware", [cold, dep1, dep2, lone, far])
    assert cands[0].work_tokens == round((1000 + 40 + 60) / 3)
    assert cands[3] == Candidate(0.3, 500)
    assert rank("cache-aware", [c for c in cands if c is not None], now=0.4)[0] == 0
    alone = prefill_candidates("cache-aware", [cold, far])
    assert alone[0].work_tokens == 1000, "a 2,000-token residual would raise the mean: k = 0"


def test_the_groups_work_ages_from_its_oldest_counted_request():
    """The prefill inherits the arrival of the dependents its work counts, so aging serves the group's oldest
    request; uncounted dependents that do not wait on it lend nothing."""
    shared = _chunks("a", "b", tokens=400)
    newer = PrefillOutlook(10.0, 800, shared, False)
    older_dep = PrefillOutlook(1.0, 830, {**shared, b"x": 30}, False)
    cands = prefill_candidates("cache-aware", [newer, older_dep])
    assert cands[0] == Candidate(1.0, round((800 + 30) / 2), waiting_s=1.0)


def test_prefill_candidates_reject_an_unknown_schedule():
    with pytest.raises(ConfigError, match="fcfs"):
        prefill_candidates("random", [PrefillOutlook(0.0, 1, {}, False)])


def test_waiting_requests_rank_as_themselves_without_flight_or_sharing():
    ws = [PrefillOutlook(1.0, 300, _chunks("a", "b", "c"), False), PrefillOutlook(2.0, 100, _chunks("d"), False),
          PrefillOutlook(3.0, 0, {}, False)]
    for schedule in ("fcfs", "cache-aware"):
        assert queue_candidates(schedule, ws, in_flight=set()) == [Candidate(1.0, 300), Candidate(2.0, 100),
                                                                  Candidate(3.0, 0)]
    assert queue_candidates("fcfs", ws, in_flight={b"a", b"d"})[0].arrived_s == 1.0


def test_a_waiting_request_does_not_count_chunks_an_admitted_prefill_computes():
    """Documents an admitted prefill is computing are reuse for the waiting request (it waits for them once
    admitted): its work is its own tail, so it outranks a lone request with less work than its whole prompt."""
    follower = PrefillOutlook(0.0, 840, {**_chunks("a", "b", tokens=400), b"q": 40}, False)
    lone = PrefillOutlook(0.0, 300, _chunks("z", tokens=300), False)
    cands = queue_candidates("cache-aware", [follower, lone], in_flight={b"a", b"b"})
    assert cands == [Candidate(0.0, 40), Candidate(0.0, 300)]
    assert rank("cache-aware", cands, now=0.0) == [0, 1]
    assert rank("cache-aware", queue_candidates("cache-aware", [follower, lone], set()), now=0.0) == [1, 0]


def test_waiting_requests_that_share_documents_rank_as_a_group():
    """Two waiting requests on the same cold 800 tokens (tails 30 and 50) rank at (830 + 50) / 2 = 440 tokens per
    request served, ahead of a lone 500-token request that alone ranks ahead of either of them (aging set aside);
    under fcfs the queue stays in arrival order."""
    shared = _chunks("a", "b", tokens=400)
    first = PrefillOutlook(0.2, 830, {**shared, b"x": 30}, False)
    second = PrefillOutlook(0.3, 850, {**shared, b"y": 50}, False)
    lone = PrefillOutlook(0.1, 500, _chunks("z", tokens=500), False)
    cands = queue_candidates("cache-aware", [first, second, lone], set())
    assert cands[0].work_tokens == 440 and cands[2] == Candidate(0.1, 500)
    assert rank("cache-aware", cands, now=0.3, aging=1.0)[0] == 0
    assert rank("cache-aware", queue_candidates("cache-aware", [first, lone], set()), now=0.3, aging=1.0) == [1, 0]
    assert rank("fcfs", queue_candidates("fcfs", [first, second, lone], set()), now=0.3) == [2, 0, 1]


def test_a_not_begun_outlook_is_the_prompt_less_the_caches_match():
    """One definition for the queue, the executor and the simulator: without a cache all the work and no chunks;
    with a match of the first two chunks, the rest of the prompt and the chunks after them."""
    from types import SimpleNamespace

    plan = [SimpleNamespace(key=k.encode(), num_tokens=t) for k, t in (("s", 32), ("a", 256), ("b", 200), ("q", 12))]
    assert PrefillOutlook.not_begun(1.0, 500, plan, None) == PrefillOutlook(1.0, 500, {}, False)
    match = SimpleNamespace(num_chunks=2, num_tokens=288)
    assert PrefillOutlook.not_begun(1.0, 500, plan, match) == PrefillOutlook(1.0, 212, {b"b": 200, b"q": 12}, False)


def test_prefill_step_sizes_are_the_tasks_steps():
    """The sizes `pcr-rag simulate` models are `PrefillTask`'s: at most the budget, cut at attention blocks after
    a partial hit, summing to the tokens left."""
    from pcr_rag.sched.runner import prefill_step_sizes

    assert prefill_step_sizes(0, 600, 256, 128) == [256, 256, 88]
    assert prefill_step_sizes(33, 600, 256, 128) == [223, 256, 88]  # realigned to the block after 33 cached
    assert prefill_step_sizes(600, 600, 256, 128) == [] and prefill_step_sizes(599, 600, 256, 128) == [1]
    assert prefill_step_sizes(0, 100, 48, 128) == [48, 48, 4]  # a budget below the block: plain budget steps


def _queue(n: int) -> list[PrefillOutlook]:
    """``n`` waiting requests in arrival order: work falls with arrival (the newest is cheapest), and every third
    shares its first uncached chunk with the next one."""
    return [PrefillOutlook(float(i), 1000 - i, {bytes([i // 3 * 3]): 64, bytes([0xFF, i]): 200}, begun=False)
            for i in range(n)]


def test_queue_order_within_the_horizon_is_rank_of_queue_candidates():
    waiting = _queue(40)
    expected = rank("cache-aware", queue_candidates("cache-aware", waiting, {b"\x03"}), 50.0, 0.0)
    got = queue_order("cache-aware", len(waiting), waiting.__getitem__, {b"\x03"}, now=50.0, aging=0.0)
    assert got == expected and got != list(range(40))  # cache-aware reorders here


def test_queue_order_ranks_only_the_oldest_horizon_and_asks_no_more_outlooks():
    """Past the horizon, later arrivals wait in arrival order behind the ranked oldest ones - however little work
    they have - and their outlooks (a cache match each) are never computed."""
    waiting = _queue(ORDER_HORIZON + 50)
    asked: list[int] = []

    def outlook(i: int) -> PrefillOutlook:
        asked.append(i)
        return waiting[i]

    got = queue_order("cache-aware", len(waiting), outlook, (), now=0.0, aging=0.0)
    assert sorted(asked) == list(range(ORDER_HORIZON))
    assert sorted(got[:ORDER_HORIZON]) == list(range(ORDER_HORIZON))
    assert got[ORDER_HORIZON:] == list(range(ORDER_HORIZON, len(waiting)))
    head = rank("cache-aware", queue_candidates("cache-aware", waiting[:ORDER_HORIZON], ()), 0.0, 0.0)
    assert got[:ORDER_HORIZON] == head
    assert queue_order("cache-aware", 10, outlook, (), now=0.0, aging=0.0, horizon=4)[4:] == list(range(4, 10))


def test_queue_order_fcfs_is_arrival_order_without_outlooks():
    def outlook(i: int) -> PrefillOutlook:
        raise AssertionError("fcfs needs no outlook")

    assert queue_order("fcfs", 300, outlook, (), now=0.0, aging=1.0) == list(range(300))
    with pytest.raises(ConfigError, match="schedule must be one of"):
        queue_order("lifo", 3, outlook, (), now=0.0, aging=1.0)
