"""Remote-tier profiles for the simulator: the network between a replica and the shared store (Valkey/Redis).

A `RemoteLink` is a read bandwidth (bytes/s, what one replica gets from the store) and a round trip (seconds);
fetching ``n`` bytes of chunks in one pipelined batch costs ``rtt_s + n / bytes_per_s``. The shipped links are
typical effective figures, not datasheet peaks (a single Redis connection rarely fills a fast NIC).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REMOTE_LINKS", "RemoteLink", "get_link"]


@dataclass(frozen=True)
class RemoteLink:
    """Replica <-> store network: effective read bandwidth (bytes/s) and round trip (s)."""

    name: str
    bytes_per_s: float
    rtt_s: float
    description: str = ""

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0 or self.rtt_s < 0:
            raise ValueError(f"link {self.name!r}: need bytes_per_s > 0 and rtt_s >= 0")

    def fetch_s(self, nbytes: float) -> float:
        """Seconds to fetch ``nbytes`` in one pipelined batch."""
        return self.rtt_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


REMOTE_LINKS: dict[str, RemoteLink] = {
    link.name: link
    for link in (
        RemoteLink("loopback", 1.5e9, 100e-6, "store on the same host (one redis-py connection, measured-order)"),
        RemoteLink("100gbe", 6e9, 50e-6, "100 GbE in one rack, several connections"),
        RemoteLink("25gbe", 2.5e9, 150e-6, "25 GbE, same availability zone"),
        RemoteLink("10gbe", 1e9, 300e-6, "10 GbE, same availability zone"),
        RemoteLink("1gbe", 110e6, 500e-6, "1 GbE: slower than recomputing on a fast GPU"),
    )
}


def get_link(name: str) -> RemoteLink:
    """A shipped link by name."""
    try:
        return REMOTE_LINKS[name]
    except KeyError:
        raise ValueError(f"unknown remote link {name!r}; known: {', '.join(REMOTE_LINKS)}") from None
