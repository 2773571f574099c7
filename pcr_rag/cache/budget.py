"""``TierBudget``: the byte accounting of one tier, in total and per tenant, mutated only under the engine lock."""

from __future__ import annotations

from dataclasses import dataclass, field

from pcr_rag.cache.tiers.base import UNATTRIBUTED, Tier

__all__ = ["TierBudget"]


@dataclass
class TierBudget:
    """Byte accounting of one tier: ``used`` counts bytes stored plus bytes reserved for transfers in flight and
    never exceeds ``capacity`` (``reserve`` refuses instead); ``high_water`` is the maximum ``used`` reached.

    ``by_tenant`` splits ``used`` by the tenant each byte is charged to (``CacheNode.tenant``: whose request
    computed the chunk; `UNATTRIBUTED` for chunks of no known tenant) when ``per_tenant`` (every tier but the
    shared remote store, whose copies belong to no engine's tenants). Invariant: with ``per_tenant``, the values
    of ``by_tenant`` are > 0 and sum to ``used``; a reservation is released under the tenant it was made for."""

    tier: Tier
    capacity: int
    used: int = 0
    high_water: int = 0
    chunks: int = 0
    per_tenant: bool = True
    by_tenant: dict[bytes, int] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def owned(self, tenant: bytes) -> int:
        """Bytes charged to ``tenant`` (stored and reserved)."""
        return self.by_tenant.get(tenant, 0)

    def reserve(self, nbytes: int, tenant: bytes = UNATTRIBUTED) -> bool:
        """Take ``nbytes`` for ``tenant`` if they fit; return False (and take nothing) otherwise."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve {nbytes} bytes")
        if self.used + nbytes > self.capacity:
            return False
        self.take(nbytes, tenant)
        return True

    def take(self, nbytes: int, tenant: bytes = UNATTRIBUTED) -> None:
        """Charge ``nbytes`` to ``tenant`` even past the capacity (restart recovery, which trims afterwards)."""
        self.used += nbytes
        if self.per_tenant and nbytes:
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + nbytes
        if self.used > self.high_water:
            self.high_water = self.used

    def release(self, nbytes: int, tenant: bytes = UNATTRIBUTED) -> None:
        if nbytes < 0 or nbytes > self.used:
            raise AssertionError(f"{self.tier.value}: releasing {nbytes} bytes with only {self.used} used")
        if self.per_tenant and nbytes:
            left = self.by_tenant.get(tenant, 0) - nbytes
            if left < 0:
                raise AssertionError(f"{self.tier.value}: releasing {nbytes} bytes of a tenant charged "
                                     f"{left + nbytes}")
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]
        self.used -= nbytes
