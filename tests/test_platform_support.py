"""The engine states the platforms it runs on and refuses others at start, before any work (issue 46)."""

from __future__ import annotations

import sys

import pytest

from pcr_rag.platform_support import UnsupportedPlatformError, check_engine_platform


@pytest.mark.parametrize("platform", ["darwin", "win32", "freebsd14"])
def test_other_systems_are_refused_with_what_to_do(platform) -> None:
    with pytest.raises(UnsupportedPlatformError, match="Linux only") as info:
        check_engine_platform(platform)
    assert "base_url=" in str(info.value) and platform in str(info.value)


def test_linux_runs_the_engine() -> None:
    check_engine_platform("linux")


def test_an_engine_on_another_system_fails_before_loading_a_model(monkeypatch) -> None:
    from pcr_rag import PCREngine
    from pcr_rag import engine as engine_module

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model loaded on an unsupported platform")

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(engine_module, "load_model", must_not_load)
    with pytest.raises(UnsupportedPlatformError):
        PCREngine()
