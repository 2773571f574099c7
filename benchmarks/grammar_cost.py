"""The cost of grammar-constrained decoding: the batched decode step with every row constrained vs none.

Each round runs ``rows`` requests at once on one engine (``max_active=rows``), once without a response format and
once with a JSON schema that cannot complete within ``tokens`` tokens, in alternating order (timings on a shared
machine are noisy; ratios within one run hold). Only decode steps with all ``rows`` rows decoding are timed. EOS is
switched off for the run so that no row leaves early. Reported: the mean step time of each kind, the overhead
``constrained / plain - 1``, and the time spent inside the grammar (mask + advance, summed over the rows of a
step) as a fraction of the plain step.

Run: ``python benchmarks/grammar_cost.py`` (default model, 8 rows) or call `measure_grammar_cost`.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from pcr_rag.config import EngineConfig
from pcr_rag.engine import PCREngine
from pcr_rag.model.grammar import GrammarMatcher
from pcr_rag.request import RagPrompt, SamplingParams
from pcr_rag.response_format import ResponseFormat

log = logging.getLogger(__name__)

# A nested schema whose shortest valid output is longer than any measured run: rows stay constrained throughout.
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "sections": {"type": "array", "minItems": 40, "items": {
            "type": "object",
            "properties": {"heading": {"type": "string"}, "level": {"type": "integer", "minimum": 1, "maximum": 6},
                           "tags": {"type": "array", "items": {"enum": ["intro", "method", "result", "note"]}}},
            "required": ["heading", "level", "tags"], "additionalProperties": False}},
    },
    "required": ["title", "sections"],
    "additionalProperties": False,
}
QUESTIONS = ("Outline a report on coral reefs.", "Outline a report on volcanoes.", "Outline a guide to Python.",
             "Outline a history of Rome.", "Outline a study of tides.", "Outline a manual for a bicycle.",
             "Outline notes on photosynthesis.", "Outline a plan for a garden.", "Outline a talk on caching.",
             "Outline a review of a novel.", "Outline a survey of bridges.", "Outline a guide to chess.")


@dataclass(frozen=True)
class GrammarCost:
    """Seconds per batched decode step (all ``rows`` rows decoding) without and with a grammar on every row."""

    model: str
    rows: int
    tokens: int
    rounds: int
    plain_steps: int
    constrained_steps: int
    plain_step_s: float
    constrained_step_s: float
    grammar_s_per_step: float  # mask + advance of every row in one step

    @property
    def overhead(self) -> float:
        """Constrained step time over plain step time, minus one."""
        return self.constrained_step_s / self.plain_step_s - 1.0

    @property
    def grammar_fraction(self) -> float:
        """Time inside the grammar per step as a fraction of the plain step."""
        return self.grammar_s_per_step / self.plain_step_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "overhead": self.overhead, "grammar_fraction": self.grammar_fraction}


class _StepTimer:
    """Wraps the executor's decode step and the matcher's mask/advance to time them (bench only)."""

    def __init__(self, engine: PCREngine, rows: int) -> None:
        self.rows = rows
        self.steps: list[float] = []
        self.grammar_s = 0.0
        executor = engine.executor
        decode = executor._decode

        def timed_decode(decoding: list) -> bool:
            t0 = time.perf_counter()
            moved = decode(decoding)  # the executor reads it: False = no row moved (a stuck row fails)
            if len(decoding) == self.rows:
                self.steps.append(time.perf_counter() - t0)
            return moved
        executor._decode = timed_decode

    def wrap_matcher(self) -> Callable[[], None]:
        """Time `GrammarMatcher.mask_logits` and `accept`; returns the function that restores them."""
        originals = {name: getattr(GrammarMatcher, name) for name in ("mask_logits", "accept")}

        def timed(fn: Callable) -> Callable:
            def wrapper(*args: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    self.grammar_s += time.perf_counter() - t0
            return wrapper
        for name, fn in originals.items():
            setattr(GrammarMatcher, name, timed(fn))

        def restore() -> None:
            for name, fn in originals.items():
                setattr(GrammarMatcher, name, fn)
        return restore


def measure_grammar_cost(model: Any = None, *, rows: int = 8, tokens: int = 48, rounds: int = 3,
                         engine: PCREngine | None = None) -> GrammarCost:
    """Interleaved A/B of ``rounds`` rounds (see the module docstring)."""
    own = engine is None
    if engine is None:
        engine = PCREngine(model, config=EngineConfig(enable_cache=False, max_active=rows, max_new_tokens=tokens))
    try:
        if engine.config.max_active != rows:
            raise ValueError(f"the engine has max_active={engine.config.max_active}; measure with rows={rows}")
        fmt = ResponseFormat.of(LONG_SCHEMA)
        engine.grammars.matcher(fmt)  # builds the tokenizer's grammar form and compiles once, outside the timing
        engine.executor.eos_ids = frozenset()  # no row leaves early
        timer = _StepTimer(engine, rows)
        plain: list[float] = []
        constrained: list[float] = []
        grammar_s = 0.0

        def run(constrain: bool, offset: int) -> None:
            params = SamplingParams(max_new_tokens=tokens, response_format=fmt if constrain else None)
            handles = [engine.submit(RagPrompt(QUESTIONS[(offset + i) % len(QUESTIONS)]), params)
                       for i in range(rows)]
            for h in handles:
                h.result(timeout=600)

        for r in range(rounds):
            for constrain in ((False, True) if r % 2 == 0 else (True, False)):
                timer.steps = []
                timer.grammar_s = 0.0
                restore = timer.wrap_matcher() if constrain else None
                try:
                    run(constrain, r)
                finally:
                    if restore is not None:
                        restore()
                if constrain:
                    constrained.extend(timer.steps)
                    grammar_s += timer.grammar_s
                else:
                    plain.extend(timer.steps)
                log.info("round %d %s: %d full steps", r, "constrained" if constrain else "plain", len(timer.steps))
        if not plain or not constrained:
            raise RuntimeError("no decode step ran with every row decoding; raise tokens")
        per_row_calls = rounds * rows * tokens  # every token of every constrained row was masked and advanced
        return GrammarCost(
            model=engine.loaded.name, rows=rows, tokens=tokens, rounds=rounds, plain_steps=len(plain),
            constrained_steps=len(constrained), plain_step_s=statistics.mean(plain),
            constrained_step_s=statistics.mean(constrained),
            grammar_s_per_step=grammar_s / per_row_calls * rows,
        )
    finally:
        if own:
            engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model alias or path (default: the default model)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cost = measure_grammar_cost(args.model, rows=args.rows, tokens=args.tokens, rounds=args.rounds)
    print(json.dumps(cost.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
