"""The KV cache survives a restart: a second process (here: a second engine) finds the documents on the SSD tier.

    python examples/persistent_cache.py [--model ALIAS_OR_DIR] [--cache-dir DIR]

Run 1 computes the documents' KV and writes it back to the cache directory. Run 2 is a fresh engine on the same
directory: its DRAM tier is empty, so the same documents come from SSD, verified chunk by chunk, and the answer
is the one run 1 gave.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from pcr_rag import EngineConfig, PCREngine

DATA = Path(__file__).resolve().parent / "data"

QUESTION = "How do I wrap a long paragraph to 40 columns with textwrap?"


def answer(model: str | None, cache_dir: str, documents: list[str]) -> dict:
    with PCREngine(model, config=EngineConfig(cache_dir=cache_dir, max_new_tokens=24)) as engine:
        result = engine.generate(QUESTION, documents=documents)
        engine.flush()  # wait for the SSD write-back before the process would exit
        m = result.metrics
        return {"answer": result.text, "ttft_s": m.ttft_s, "prompt_tokens": m.prompt_tokens,
                "computed": m.computed_tokens, "prefetched_chunks": m.prefetch_hit_chunks,
                **{f"from_{k}": v for k, v in m.reused_by_tier.items()}}


def main(model: str | None = None, cache_dir: str | None = None) -> list[dict]:
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="pcr-persist-")
    documents = [(DATA / name).read_text(encoding="utf-8") for name in ("textwrap.txt", "functools.txt")]
    runs = []
    for run in (1, 2):
        r = answer(model, cache_dir, documents)
        print(f"run {run}: TTFT {r['ttft_s']:.2f} s; prompt {r['prompt_tokens']} tokens: computed {r['computed']}, "
              f"from DRAM {r['from_dram']} ({r['prefetched_chunks']} chunks prefetched off the SSD while queued), "
              f"from SSD {r['from_ssd']}\n        answer: {r['answer'].strip()!r}")
        runs.append(r)
    print(f"same answer after the restart: {runs[0]['answer'] == runs[1]['answer']}; cache in {cache_dir}")
    return runs


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model alias or HF directory (default model if unset)")
    parser.add_argument("--cache-dir", default=None, help="KV cache directory (default: a new temporary one)")
    args = parser.parse_args()
    main(args.model, args.cache_dir)
