"""Choosing a row's next token from its logits: greedy, or temperature / top-p with the request's own generator.

A row's choice depends only on its own logits, its parameters, its seed and its constraint, never on the other
rows of the batch. A `TokenConstraint` (a grammar, see `pcr_rag.runtime.grammar`) masks the logits before the
choice and is told every accepted token.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from pcr_rag.requests import SamplingParams, check_seed


class TokenConstraint(Protocol):
    """Per-request constraint on the next token (e.g. a compiled grammar's matcher)."""

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [vocab]`` (float32) with disallowed tokens at -inf; may modify in place."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (one of the tokens the last mask allowed)."""

    def is_terminated(self) -> bool:
        """True when the constraint is complete and only end-of-sequence may follow."""


class TokenSampler:
    """Picks one token per call from a row's logits (see the module docstring)."""

    def __init__(self, params: SamplingParams, constraint: TokenConstraint | None = None) -> None:
        self.params = params
        self.constraint = constraint
        self._gen: torch.Generator | None = None
        if params.temperature > 0:
            check_seed(params.seed)  # validated with the params; a seed set past validation fails here, clearly
            self._gen = torch.Generator(device="cpu")
            self._gen.manual_seed(params.seed if params.seed is not None else time.time_ns() % (2**31))

    def select(self, logits: torch.Tensor) -> int:
        scores = logits.float()
        if self.constraint is not None:
            scores = self.constraint.mask_logits(scores.clone())
        p = self.params
        if p.temperature <= 0:
            return int(torch.argmax(scores).item())
        probs = torch.softmax(scores / p.temperature, dim=-1).cpu()
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
            sorted_p = sorted_p * keep
            choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=self._gen)
            return int(idx[choice].item())
        return int(torch.multinomial(probs, 1, generator=self._gen).item())

    def accept(self, token_id: int) -> None:
        if self.constraint is not None:
            self.constraint.accept(token_id)
