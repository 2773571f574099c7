"""A Hugging Face repo id loads from the local HF cache with no network, and is downloaded only when allowed."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.errors import ConfigError
from pcr_rag.model import hub
from pcr_rag.model.model import UnknownModelError, load_model
from pcr_rag.testing import save_tiny_model

REPO = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _lay_out_cache(home: Path, repo: str = REPO, seed: int = 0) -> Path:
    """``$HF_HOME/hub/models--org--name/{refs/main, snapshots/<rev>/...}``: the layout huggingface_hub writes."""
    entry = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = save_tiny_model(entry / "snapshots" / REVISION, "llama", seed=seed)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_a_repo_id_in_the_local_hf_cache_loads_offline(hf_home):
    snapshot = _lay_out_cache(hf_home)
    assert hub.hub_cache_dir() == hf_home / "hub"
    loaded = load_model(REPO, dtype="float32")
    direct = load_model(snapshot, dtype="float32")
    assert loaded.name == REPO and loaded.source == f"hf:{REPO}@{REVISION}"
    assert loaded.fingerprint == direct.fingerprint  # the very weights of the snapshot refs/main names
    assert loaded.has_chat_template


def test_the_engine_serves_a_cached_repo_id(hf_home, tmp_path):
    _lay_out_cache(hf_home)
    cfg = EngineConfig(cache_dir=tmp_path / "kv", ssd_capacity=0, device="cpu", dtype="float32", max_new_tokens=4,
                       max_active=1, enable_cache=False, warmup=False)
    with PCREngine(REPO, config=cfg) as eng:
        assert eng.loaded.name == REPO
        assert len(eng.generate("Hello?").token_ids) == 4


def test_a_repo_that_is_not_cached_is_refused_with_what_to_do(hf_home, monkeypatch):
    _lay_out_cache(hf_home)
    calls = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    with pytest.raises(UnknownModelError, match="allow_download=True") as info:
        load_model("other-org/missing-model")
    assert str(hf_home / "hub") in str(info.value) and "hf download other-org/missing-model" in str(info.value)
    assert isinstance(info.value.__cause__, hub.ModelNotCachedError)
    assert [kw["local_files_only"] for kw in calls] == [True]  # nothing but the cache was looked at


def test_allow_download_fetches_through_huggingface_hub_unless_the_user_set_offline(hf_home, tmp_path, monkeypatch):
    seen = []

    def fake_download(repo_id, *, revision, cache_dir, local_files_only, allow_patterns=None):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        seen.append((repo_id, Path(cache_dir), allow_patterns))
        return str(save_tiny_model(tmp_path / "downloaded", "llama", seed=1))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    offline_before = huggingface_hub.constants.HF_HUB_OFFLINE
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UnknownModelError, match="HF_HUB_OFFLINE=1 is set"):
        load_model("new-org/new-model", allow_download=True)
    assert not seen
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    loaded = load_model("new-org/new-model", allow_download=True, dtype="float32")
    assert loaded.name == "new-org/new-model"
    assert seen == [("new-org/new-model", hf_home / "hub", list(hub.DOWNLOAD_PATTERNS))]
    assert huggingface_hub.constants.HF_HUB_OFFLINE is offline_before  # pcr-rag never flips the hub's setting


def test_allow_download_is_a_real_bool():
    with pytest.raises(ConfigError, match="allow_download"):
        EngineConfig(allow_download="yes")


@pytest.mark.parametrize("text, ok", [("org/name", True), ("gpt2", True), ("a/b/c", False), ("org/na--me", False),
                                      ("../x", False), ("org/name.git", False), ("", False), ("org/ name", False)])
def test_repo_id_shape(text, ok):
    assert hub.looks_like_repo_id(text) is ok
