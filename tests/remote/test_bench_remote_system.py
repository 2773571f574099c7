"""`pcr-rag bench`'s ``pcr-remote`` system on a tiny model: a cold replica (empty local tiers every run) reuses
what the warm first replica wrote to the shared Valkey."""

from __future__ import annotations

import json

from pcr_rag.bench.config import BenchConfig
from pcr_rag.bench.serving import run_bench
from pcr_rag.bench.systems import SYSTEMS
from pcr_rag.config import EngineConfig
from pcr_rag.testing import tiny_model


def test_pcr_remote_is_a_cold_replica_behind_the_warm_store(valkey, tmp_path):
    assert SYSTEMS["pcr-remote"].remote and "pcr-remote" in SYSTEMS
    EngineConfig(**SYSTEMS["pcr-remote"].config_kwargs({"cache_dir": tmp_path, "remote_url": valkey.url}))
    words = ["cache", "prefix", "tree", "chunk", "layer", "prefetch", "queue", "window", "tier", "disk"]
    corpus = tmp_path / "docs.jsonl"
    with corpus.open("w") as fh:
        for i in range(8):
            text = "\n\n".join(" ".join(words[(i + j + k) % len(words)] for k in range(25)) for j in range(3))
            fh.write(json.dumps({"id": f"d{i}", "title": f"Doc {i}", "text": text}) + "\n")
    model, tok = tiny_model("llama", seed=0)
    cfg = BenchConfig(corpus=str(corpus), tokens_per_passage=40, num_passages=None, top_k=2, num_topics=3,
                      num_requests=5, warmup_requests=6, rates=(float("inf"),), repeats=2, windows=(),
                      systems=("pcr", "pcr-remote"), max_new_tokens=3, chunk_size=16, threads=1,
                      limit_ratio=False, work_dir=str(tmp_path / "work"), extra={"remote_url": valkey.url})
    report = run_bench(cfg, model=model, tokenizer=tok, progress=False)
    runs = [r for r in report["runs"] if r["system"] == "pcr-remote"]
    assert len(runs) == 1 and runs[0]["repeats"] == 2 and runs[0]["hit_ratio"]["remote"] > 0
    assert all(r["extra"]["failed_requests"] == 0 for r in report["runs"])
