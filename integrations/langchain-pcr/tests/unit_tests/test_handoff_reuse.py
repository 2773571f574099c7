"""`pcr_rag.client.handoff`'s reuse mode, shared by both hooks: which mode an engine used by several models is announced
in, that a mode reaches ``announce`` (and only when set, so an engine whose ``announce`` predates blend mode still
works), and that a re-announcement (a cache-aware reorder) keeps the mode. Engine doubles record the calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pcr_rag.client.handoff import Announcement, announcement_reuse


class _Engine:
    """Records ``announce`` calls; ``modern`` takes ``reuse=`` (an engine or client from before blend mode does
    not)."""

    def __init__(self, modern: bool = True) -> None:
        self.calls: list[tuple[tuple[str, ...], dict]] = []
        self.withdrawn = 0
        if modern:
            self.announce = self._announce_with_reuse

    def announce(self, documents, query=None):
        self.calls.append((tuple(documents), {}))
        return SimpleNamespace(claimed=False, expired=False)

    def _announce_with_reuse(self, documents, query=None, **reuse):  # records whether ``reuse=`` was passed
        assert set(reuse) <= {"reuse"}
        self.calls.append((tuple(documents), reuse))
        return SimpleNamespace(claimed=False, expired=False)

    def cancel_announcement(self, ticket) -> bool:
        self.withdrawn += 1
        return True


@pytest.mark.parametrize("modes, want", [
    ((), None), ((None,), None), (("exact",), "exact"), (("blend",), "blend"), (("exact", "blend"), "blend"),
    ((None, "blend"), "blend"), (("exact", None), None), (("exact", "exact"), "exact"),
])
def test_models_that_differ_on_one_engine_get_the_widest_prefetch(modes, want) -> None:
    assert announcement_reuse(modes) == want


def test_the_mode_reaches_announce_per_engine_and_a_reannouncement_keeps_it() -> None:
    blend, exact, default, old = _Engine(), _Engine(), _Engine(), _Engine(modern=False)
    ann = Announcement(documents=("D1", "D2"), query="q?", origin="run", ancestors=())
    ann.announce_to([blend, exact, default, old], {id(blend): "blend", id(exact): "exact"})
    assert blend.calls == [(("D1", "D2"), {"reuse": "blend"})]
    assert exact.calls == [(("D1", "D2"), {"reuse": "exact"})]
    assert default.calls == [(("D1", "D2"), {})] and old.calls == [(("D1", "D2"), {})]  # None: no argument
    assert set(ann.tickets) == {id(blend), id(exact), id(default), id(old)}
    assert ann.reannounce(("D2", "D1"))
    assert blend.calls[-1] == (("D2", "D1"), {"reuse": "blend"}) and blend.withdrawn == 1
    assert exact.calls[-1] == (("D2", "D1"), {"reuse": "exact"})
    one = Announcement(documents=("D1",), query=None, origin="run", ancestors=())
    one.announce_to([exact], "blend")  # one mode for every engine
    assert exact.calls[-1] == (("D1",), {"reuse": "blend"}) and one.reuse_modes == {id(exact): "blend"}
