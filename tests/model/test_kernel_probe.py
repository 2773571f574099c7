"""The kernel identity (issue 47): a hash of the KV the engine's own forward computes on fixed probe inputs, folded
into every root and recorded in the SSD manifests. The cross-process test on two kernel paths is
tests/remote/test_kernel_identity.py."""

from __future__ import annotations

import json

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.cache.roots import RootIdentity, RootManifest
from pcr_rag.model import kernel_probe
from pcr_rag.model.kernel_probe import probe_steps
from pcr_rag.testing import tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2)


def _engine(tiny, path, **kw) -> PCREngine:
    model, tok = tiny
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(
        cache_dir=path, chunk_size=16, max_new_tokens=2, device="cpu", dtype="float32", dram_capacity="8MiB",
        ssd_capacity="16MiB", **kw))


def test_the_probe_covers_a_full_tile_and_a_short_tile_over_a_cached_prefix() -> None:
    assert probe_steps(256, (16, 24, 248), 4096) == [(0, 256), (256, 16)]
    assert probe_steps(256, (), 4096) == [(0, 256)]  # no short tiles in the plan: the full tile alone
    assert probe_steps(256, (16,), 273) == [(0, 256), (256, 16)]  # what the context window holds
    assert probe_steps(256, (16,), 272) == [(0, 256)]
    assert probe_steps(256, (16,), 100) == [(0, 99)]
    assert probe_steps(256, (16,), 1) == []


def test_the_identity_is_the_same_with_or_without_the_warm_up_and_names_the_root(tiny, tmp_path) -> None:
    """The warm-up's tile is the probe's first step (it pays nothing twice); computing it afresh gives the same
    hash, and the root hashes it beside the plan."""
    kernel_probe._known.clear()
    with _engine(tiny, tmp_path / "w") as warm:
        warmed = warm.identity
    kernel_probe._known.clear()
    with _engine(tiny, tmp_path / "c", warmup=False) as cold:
        assert cold.identity == warmed and len(warmed.kernels) == kernel_probe.IDENTITY_HEX
        assert cold.root_key == warmed.root() != RootIdentity(**{**warmed.as_dict(), "kernels": ""}).root()
        # two engines on other kernel paths hold different identities, and neither can use the other's roots
        other = RootIdentity(**{**warmed.as_dict(), "kernels": "0" * 16})
        assert not warmed.compatible(other) and other.root() != warmed.root()
        assert "kernels 0000000000000000" in warmed.difference(other)


def test_manifests_record_the_kernel_identity_and_older_ones_count_as_another(tiny, tmp_path) -> None:
    with _engine(tiny, tmp_path / "kv") as eng:
        identity = eng.identity
        eng.generate("What flows?", ["The Rhine flows from the Swiss Alps to the North Sea. " * 4])
        eng.flush()
    manifests = list((tmp_path / "kv" / "roots").glob("*.json"))
    assert manifests
    body = json.loads(manifests[0].read_text())
    assert body["kernels"] == identity.kernels
    root = bytes.fromhex(body["root"])
    assert RootManifest.decode(manifests[0].read_bytes(), root).identity == identity
    del body["kernels"]  # a manifest written before kernel identities were probed
    old = RootManifest.decode(json.dumps(body).encode(), root).identity
    assert old.kernels == "" and not identity.compatible(old) and "kernels unknown" in identity.difference(old)
