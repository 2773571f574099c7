"""`pcr-rag size` (`pcr_rag.cli.sizing`): KV bytes from a model's config without its weights, and the capacity for a hit
rate over a Zipf corpus, checked against an LRU cache run on a sampled request stream."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest

from pcr_rag import cli
from pcr_rag.bench.workload import zipf_weights
from pcr_rag.cli.sizing import lru_hit_rate, need_for_hit_rate
from pcr_rag.testing import save_tiny_model


def size(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["size", *args])
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama", num_layers=3)


def test_kv_bytes_come_from_the_config(tiny_dir, capsys, monkeypatch) -> None:
    import transformers

    def no_weights(*_a, **_k):
        raise AssertionError("size must not load the model's weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    code, out = size(capsys, "--model", str(tiny_dir), "--documents", "1000", "--tokens-per-doc", "300",
                     "--dtype", "float32", "--chunk-size", "128", "--json")
    assert code == 0, out
    r = json.loads(out)
    # the tiny Llama: 3 layers, 2 KV heads of dim 16; K and V in float32
    assert r["kv"] == {"layers": 3, "kv_heads": 2, "head_dim": 16, "dtype": "float32", "dtype_bytes": 4}
    assert r["bytes_per_token"] == 3 * 2 * 2 * 16 * 4
    assert r["bytes_per_chunk"] == r["bytes_per_token"] * 128
    assert r["chunks_per_document"] == 3 and r["bytes_per_document"] == r["bytes_per_token"] * 300
    assert r["corpus_bytes"] == r["bytes_per_document"] * 1000
    (target,) = [row for row in r["capacity"] if row["hit_rate"] == 0.9]
    assert r["target"]["dram_bytes"] == target["lru_bytes"] == target["lru_documents"] * r["bytes_per_document"]
    assert [row["hit_rate"] for row in r["capacity"]] == [0.5, 0.8, 0.9, 0.95, 0.99]

    code, text = size(capsys, "--model", str(tiny_dir), "--documents", "1000", "--tokens-per-doc", "300",
                      "--dtype", "bfloat16", "--hit-rate", "0.7")
    assert code == 0 and "KV per token:     384 B" in text and "70%" in text and "<- target" in text


def test_bad_input_exits_2_with_a_message(tiny_dir, capsys) -> None:
    code, out = size(capsys, "--model", str(tiny_dir), "--documents", "10", "--tokens-per-doc", "5",
                     "--hit-rate", "1.5")
    assert code == 2 and "hit rate must be in (0, 1)" in out
    code, out = size(capsys, "--model", str(tiny_dir / "missing"), "--documents", "10", "--tokens-per-doc", "5")
    assert code == 2 and "unknown model" in out


def _lru_run(documents: int, zipf: float, capacity: int, requests: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    stream = rng.choice(documents, size=requests, p=zipf_weights(documents, zipf))
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for i, doc in enumerate(stream.tolist()):
        if doc in cache:
            cache.move_to_end(doc)
            hits += i >= requests // 5  # the first fifth warms the cache
        else:
            cache[doc] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / (requests - requests // 5)


@pytest.mark.parametrize("zipf, capacity", [(1.0, 100), (0.8, 400), (1.2, 30)])
def test_lru_hit_rate_matches_an_lru_cache(zipf, capacity) -> None:
    measured = _lru_run(2000, zipf, capacity, 150_000)
    assert lru_hit_rate(2000, zipf, capacity) == pytest.approx(measured, abs=0.015)


def test_capacity_for_a_hit_rate_is_the_smallest_that_serves_it() -> None:
    need = need_for_hit_rate(5000, 1.0, 0.8, document_bytes=10)
    assert lru_hit_rate(5000, 1.0, need.lru_documents) >= 0.8 > lru_hit_rate(5000, 1.0, need.lru_documents - 1)
    top = np.cumsum(zipf_weights(5000, 1.0))
    assert top[need.ideal_documents - 1] >= 0.8 > top[need.ideal_documents - 2]
    assert need.ideal_documents < need.lru_documents and need.lru_bytes == need.lru_documents * 10
    uniform = need_for_hit_rate(1000, 0.0, 0.9, document_bytes=1)
    assert uniform.ideal_documents == 900 and uniform.lru_documents == 900  # no skew: hit rate = fraction held


@pytest.mark.slow
def test_a_gguf_alias_is_sized_from_its_metadata_without_converting(tmp_path, capsys) -> None:
    pytest.importorskip("gguf")
    cache = tmp_path / "models"  # empty: the GGUF's metadata is read, nothing is converted into it
    code, out = size(capsys, "--model", "smollm2-135m-instruct", "--model-cache-dir", str(cache), "--documents",
                     "100", "--tokens-per-doc", "256", "--dtype", "bfloat16", "--json")
    assert code == 0, out
    r = json.loads(out)
    assert (r["kv"]["layers"], r["kv"]["kv_heads"], r["kv"]["head_dim"]) == (30, 3, 64)  # SmolLM2-135M's config
    assert r["bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    assert not cache.exists() or not any(p.is_dir() and not p.name.startswith(".") for p in cache.iterdir())
