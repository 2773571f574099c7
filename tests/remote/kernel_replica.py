"""One engine process for tests/remote/test_kernel_identity.py (not collected by pytest).

    python kernel_replica.py REQUESTS_JSON OUT_PT --cache-dir DIR --url URL

Builds `PCREngine` on the tiny test model in float32 (what an AVX2-only host runs; the CPU kernels torch and oneDNN
dispatch to follow ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` caps in the environment), answers every request of REQUESTS_JSON ([[question, [documents...]], ...]) first with
the cache off, then with the SSD directory and the remote store, and saves both runs' answers, the reuse, the
kernel identity, the remote counters (the census of the store's root manifests included) and the start-up warnings to OUT_PT (``torch.save``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.testing import tiny_model


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("requests")
    p.add_argument("out")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--url", required=True)
    args = p.parse_args()
    with open(args.requests) as f:
        requests = json.load(f)
    warnings = _Warnings()
    logging.getLogger("pcr_rag").addHandler(warnings)
    model, tok = tiny_model("llama", num_layers=2)
    common = dict(chunk_size=16, max_new_tokens=6, device="cpu", dtype="float32", dram_capacity="64MiB")
    with PCREngine(model=model, tokenizer=tok, config=EngineConfig(enable_cache=False, **common)) as off:
        reference = [off.generate(q, docs) for q, docs in requests]
    cfg = EngineConfig(cache_dir=args.cache_dir, ssd_capacity="64MiB", remote_url=args.url, remote_timeout_s=2.0,
                       load_planner="always-load", prefetch=False, **common)
    with PCREngine(model=model, tokenizer=tok, config=cfg) as eng:
        results = [eng.generate(q, docs) for q, docs in requests]
        eng.flush(timeout=30)
        deadline = time.monotonic() + 30  # the start-up census of the store's root manifests runs in the background
        while eng.cache.remote.tier.roots is None and time.monotonic() < deadline:
            time.sleep(0.05)
        torch.save({
            "kernels": eng.identity.kernels,
            "off": [(r.token_ids, r.first_token_logits) for r in reference],
            "on": [(r.token_ids, r.first_token_logits) for r in results],
            "reused": [r.metrics.reused_tokens for r in results],
            "remote_io": dict(eng.stats().cache.remote_io),
            "warnings": warnings.lines,
        }, args.out)


if __name__ == "__main__":
    main()
