"""``TierBudget``: the byte accounting of one tier, mutated only under the engine lock."""

from __future__ import annotations

from dataclasses import dataclass

from pcr_rag.cache.tiers.base import Tier

__all__ = ["TierBudget"]


@dataclass
class TierBudget:
    """Byte accounting of one tier: ``used`` counts bytes stored plus bytes reserved for transfers in flight and
    never exceeds ``capacity`` (``reserve`` refuses instead); ``high_water`` is the maximum ``used`` reached."""

    tier: Tier
    capacity: int
    used: int = 0
    high_water: int = 0
    chunks: int = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit; return False (and take nothing) otherwise."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve {nbytes} bytes")
        if self.used + nbytes > self.capacity:
            return False
        self.used += nbytes
        if self.used > self.high_water:
            self.high_water = self.used
        return True

    def release(self, nbytes: int) -> None:
        if nbytes < 0 or nbytes > self.used:
            raise AssertionError(f"{self.tier.value}: releasing {nbytes} bytes with only {self.used} used")
        self.used -= nbytes
