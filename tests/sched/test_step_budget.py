"""The ITL budget: prefill layers per engine step (pure policy, fed with times by hand)."""

from __future__ import annotations

import pytest

from pcr_rag import ConfigError, EngineConfig
from pcr_rag.sched.step_budget import StepBudget, StepCost


def _budget(steps: float | None = 3.0, decode_s: float = 0.1, prefill: tuple[tuple[int, float], ...] = ((256, 0.7),)
            ) -> StepBudget:
    budget = StepBudget(30, steps)
    budget.record_decode(decode_s)
    for n, t in prefill:
        budget.record_prefill(n, t)
    return budget


def test_no_budget_or_nothing_measured_runs_every_layer():
    assert _budget(None).layers(256) == 30
    assert StepBudget(30, 3.0).layers(256) == 30, "nothing measured yet"
    only_prefill = StepBudget(30, 3.0)
    only_prefill.record_prefill(256, 0.7)
    assert only_prefill.layers(256) == 30, "no decode step measured yet"


def test_one_size_measured_assumes_a_decode_step_of_fixed_cost():
    budget = _budget(prefill=((256, 0.74),))
    assert budget.cost() == StepCost(0.1, pytest.approx(0.64 / 256))
    # a 256-token step: 0.74 s over 30 layers; allowed (3 - 1) * 0.1 s = 0.2 s -> 8 layers (0.197 s)
    assert budget.layers(256) == 8
    assert _budget(4.0, prefill=((256, 0.74),)).layers(256) == 12
    # a hit's short step fits whole: 0.1 + 0.0025 * 24 = 0.16 s
    assert budget.layers(24) == 30
    assert budget.as_dict()["layers_per_step"] == 30


def test_a_line_is_fitted_once_sizes_spread():
    budget = _budget(decode_s=0.05, prefill=tuple((n, 0.12 + 0.002 * n) for n in (32, 256, 64, 256, 128)))
    cost = budget.cost()
    assert cost.fixed_s == pytest.approx(0.12) and cost.per_token_s == pytest.approx(0.002)
    # allowed 0.1 s; a 256-token step 0.632 s = 21 ms a layer -> 4 layers
    assert budget.layers(256) == 4
    assert _budget(1.01, decode_s=0.05, prefill=((256, 0.7),)).layers(256) == 1, \
        "at least one layer, so a prompt always advances"


def test_an_unbounded_budget_runs_every_layer():
    assert _budget(float("inf")).layers(256) == 30


def test_one_slow_decode_step_does_not_move_the_budget():
    budget = _budget()
    for _ in range(4):
        budget.record_decode(0.1)
    before = budget.layers(256)
    budget.record_decode(5.0)
    assert budget.decode_step_s == pytest.approx(0.1)
    assert budget.layers(256) == before


def test_bad_budgets_are_config_errors():
    for bad in (1.0, 0.5, -2, True, "3"):
        with pytest.raises(ConfigError, match="itl_budget_steps"):
            EngineConfig(itl_budget_steps=bad)
    for bad in (1.0, "3", False):
        with pytest.raises(ConfigError, match="itl_budget_steps"):
            StepBudget(30, bad)
    assert EngineConfig(itl_budget_steps=None).itl_budget_steps is None
