"""How much prefill runs before the executor comes back to its queue: the inter-token-latency budget, in layers.

An engine step is one decode forward (every decoding row) and then some prefill. A decoding row's next token waits
for both: with a whole 256-token prefill step between two decode steps, that gap is the whole prefill step, many
decode steps long on a slow CPU (so ITL P99 is many times P50). And a request admitted while a prefill step runs
is ranked by the schedule only once that step stops: a cache hit that arrives during a cold 256-token step waits
for all of it, so its TTFT grows by what is left of that step (see
docs/measurements-history.md#figures-moved-from-code-comments).

`StepBudget` caps the prefill *layers* an engine step runs; a prefill step then spans several engine steps
(`FastForward.prefill_layers` pauses between layers), with the same tiles, the same numbers and the same cost per
token as in one go. The cap is the most layers predicted to take at most ``(budget_steps - 1)`` decode steps, at
least one (so a prompt always advances), whether rows decode or not:
- **rows decoding**: an engine step that decodes and prefills takes at most ``budget_steps`` decode steps (the ITL
  P99 / P50 it plans for);
- **nothing decoding**: the executor is back at its queue within ``budget_steps - 1`` decode steps, where a newly
  admitted request competes with the paused step (`BatchExecutor._next_prefill`): under ``cache-aware`` a hit need
  not wait for a cold step's remaining layers; under ``fcfs`` the older step resumes.
Before a decode step and a prefill step have been measured (and with no budget, ``budget_steps`` None) every step
runs whole.

Why layers and not fewer tokens: a short prefill step streams every weight for few rows, so shrinking the step
to fewer tokens holds the gap but multiplies a cold prompt's TTFT; a layer-sliced 256-token step costs what the
whole step costs, plus the decode steps it lets through (at most ``1 / (budget_steps - 1)`` of the prefill time)
(see docs/measurements-history.md#figures-moved-from-code-comments).

The prediction: a prefill step of n tokens takes ``fixed + per_token * n`` seconds, a line fitted (least squares)
to the last `PREFILL_SAMPLES` complete steps, spread evenly over the layers. While those steps have too few
distinct sizes to fit a line, ``fixed`` is the median decode step (a prefill step streams every weight once, as a
decode step does) and ``per_token`` the mean of ``(seconds - fixed) / n``. The decode step is the median of the
last `DECODE_SAMPLES`, so one slow step on a noisy host does not move the budget.

Times come from the caller (`record_decode`, `record_prefill`): no clock here, so the policy is deterministic
under test.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from pcr_rag.errors import ConfigError

PREFILL_SAMPLES = 16  # complete prefill steps the cost line is fitted to (recent ones: cost grows with position)
DECODE_SAMPLES = 16   # decode steps whose median is "a decode step"
_MIN_SPREAD = 0.25    # the sampled sizes' spread (stdev / mean) from which a line is fitted, not assumed


def check_budget_steps(value: object) -> None:
    """Raise `ConfigError` unless ``value`` is None or a number of decode steps > 1 (``itl_budget_steps``)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1:
        raise ConfigError(f"itl_budget_steps must be a number > 1 (decode steps) or None, got {value!r}")


@dataclass(frozen=True)
class StepCost:
    """The predicted seconds of a whole prefill step of ``tokens`` tokens: ``fixed_s + per_token_s * tokens``."""

    fixed_s: float
    per_token_s: float

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


class StepBudget:
    """Prefill layers per engine step under an ITL budget (see the module docstring). Executor thread only.

    Args:
        num_layers: the model's layers (what a whole prefill step runs).
        budget_steps: an engine step that decodes and prefills is planned to take at most this many decode steps
            (> 1); None = no budget (prefill steps always run whole).
    """

    def __init__(self, num_layers: int, budget_steps: float | None = None) -> None:
        check_budget_steps(budget_steps)
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.num_layers = int(num_layers)
        self.budget_steps = budget_steps
        self._decode_s: deque[float] = deque(maxlen=DECODE_SAMPLES)
        self._prefill: deque[tuple[int, float]] = deque(maxlen=PREFILL_SAMPLES)
        self.last_layers = self.num_layers  # the last cap chosen (stats)

    # ------------------------------------------------------------------------------------------- samples
    def record_decode(self, seconds: float) -> None:
        """One decode forward took ``seconds``."""
        if seconds > 0:
            self._decode_s.append(float(seconds))

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """One whole prefill step computed ``tokens`` positions in ``seconds`` of compute (load waits excluded)."""
        if tokens > 0 and seconds > 0:
            self._prefill.append((int(tokens), float(seconds)))

    @property
    def decode_step_s(self) -> float | None:
        """The median of the recent decode steps (seconds), None before the first."""
        return statistics.median(self._decode_s) if self._decode_s else None

    def cost(self) -> StepCost | None:
        """The fitted prefill cost line (see the module docstring); None before a prefill step was recorded (and,
        without a spread of sizes, a decode step)."""
        if not self._prefill:
            return None
        ns = [n for n, _ in self._prefill]
        ts = [t for _, t in self._prefill]
        if len(set(ns)) >= 2 and statistics.pstdev(ns) >= _MIN_SPREAD * statistics.fmean(ns):
            mean_n, mean_t = statistics.fmean(ns), statistics.fmean(ts)
            var = sum((n - mean_n) ** 2 for n in ns)
            slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts)) / var
            if slope > 0:
                return StepCost(max(0.0, mean_t - slope * mean_n), slope)
        fixed = self.decode_step_s
        if fixed is None:
            return None
        fixed = min(fixed, min(ts))  # never more than a whole measured step
        per_token = statistics.fmean((t - fixed) / n for n, t in self._prefill)
        return StepCost(fixed, max(per_token, 1e-9))

    # ------------------------------------------------------------------------------------------- decision
    def layers(self, tokens: int) -> int:
        """Layers of a ``tokens``-token prefill step to run in this engine step: the most predicted to fit
        ``(budget_steps - 1)`` decode steps, at least one; all with no budget or before anything was measured."""
        if self.budget_steps is None:
            return self.num_layers
        cost, decode_s = self.cost(), self.decode_step_s
        if cost is None or decode_s is None:
            return self.num_layers  # nothing measured yet (a decode step follows a request's first prefill)
        per_layer = cost.seconds(tokens) / self.num_layers
        allowed = (self.budget_steps - 1.0) * decode_s
        self.last_layers = max(1, int(min(float(self.num_layers), allowed / per_layer)))
        return self.last_layers

    def as_dict(self) -> dict[str, float | int | None]:
        """The budget's current reading (stats): decode step and prefill cost line in milliseconds."""
        cost, decode_s = self.cost(), self.decode_step_s
        return {
            "budget_steps": self.budget_steps,
            "decode_step_ms": None if decode_s is None else decode_s * 1e3,
            "prefill_fixed_ms": None if cost is None else cost.fixed_s * 1e3,
            "prefill_ms_per_token": None if cost is None else cost.per_token_s * 1e3,
            "layers_per_step": self.last_layers,
        }
