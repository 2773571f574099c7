"""Tiers (fastest first: device, DRAM, SSD) and their byte budgets.

A ``TierBudget`` is plain accounting, mutated only under the engine lock: ``used`` counts bytes stored plus bytes
reserved for transfers in flight, and never exceeds ``capacity`` (``reserve`` refuses instead); ``high_water``
is the maximum ``used`` ever reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Tier", "TIER_ORDER", "TierBudget", "tier_bit"]


class Tier(str, Enum):
    DEVICE = "device"
    DRAM = "dram"
    SSD = "ssd"

    @property
    def index(self) -> int:
        return _INDEX[self]


TIER_ORDER: tuple[Tier, ...] = (Tier.DEVICE, Tier.DRAM, Tier.SSD)
_INDEX = {t: i for i, t in enumerate(TIER_ORDER)}


def tier_bit(tier: Tier) -> int:
    """Bit of ``tier`` in a node's residency mask."""
    return 1 << _INDEX[tier]


@dataclass
class TierBudget:
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
