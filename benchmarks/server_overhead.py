"""Server overhead: TTFT and inter-token latency through `pcr-rag serve` against a local engine, same requests.

    python benchmarks/server_overhead.py                  # the default model
    python benchmarks/server_overhead.py --tiny --rounds 3

One run: a server subprocess and a local `PCREngine` built from the same `ServerEngineOptions` (so the same
weights, dtype, chunk size and rows) get the same request sequence - RAG chat requests over ``--topics`` document
sets, one warm-up pass (documents computed and cached on both), then ``--rounds`` passes with fresh questions. The
two are interleaved request by request, alternating which goes first, so load on the machine hits both alike, with a pause of ``--gap`` seconds before each request (the other
mode's worker threads spin for a while after their last forward). Both
are timed at the consumer: TTFT = request issued -> first token received (`RequestHandle` iteration locally, the
first SSE token event through the server), ITL = gaps between consecutive tokens received. The server stream asks
for ``return_token_ids`` so every token is one event, and the token ids of each pair are compared (they must be
equal: same request, same cache state). Targets: `SERVER_TTFT_OVERHEAD_MAX`, `SERVER_ITL_OVERHEAD_MAX` (means).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pcr_rag.bench.load_server import LoadConfig, topics_from_corpus
from pcr_rag.bench.server_proc import ServerEngineOptions, ServerProcess
from pcr_rag.bench.targets import SERVER_ITL_OVERHEAD_MAX, SERVER_TTFT_OVERHEAD_MAX
from pcr_rag.engine import PCREngine
from pcr_rag.metrics import summarize
from pcr_rag.request import ChatPrompt, SamplingParams
from pcr_rag.testing import save_tiny_model

log = logging.getLogger(__name__)

__all__ = ["Timings", "measure_overhead"]


@dataclass
class Timings:
    """Consumer-side times of one mode (seconds)."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    def add(self, t0: float, arrivals: list[float]) -> None:
        if arrivals:
            self.ttft.append(arrivals[0] - t0)
            self.itl.extend(b - a for a, b in zip(arrivals, arrivals[1:]))


def _messages(docs: list[str], question: str) -> list[dict[str, str]]:
    context = "\n\n".join(docs)
    return [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]


def _local(engine: PCREngine, docs: list[str], question: str, max_tokens: int) -> tuple[float, list[float], list[int]]:
    t0 = time.perf_counter()
    handle = engine.submit(ChatPrompt(_messages(docs, question), docs), SamplingParams(max_new_tokens=max_tokens))
    arrivals, ids = [], []
    for piece in handle:
        if not piece.is_final:
            arrivals.append(time.perf_counter())
            ids.append(piece.token_id)
    return t0, arrivals, ids


def _served(client: httpx.Client, model: str, docs: list[str], question: str,
            max_tokens: int) -> tuple[float, list[float], list[int]]:
    body = {"model": model, "messages": _messages(docs, question), "documents": docs, "max_tokens": max_tokens,
            "stream": True, "return_token_ids": True}
    arrivals, ids = [], []
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"the server failed a request: {event['error']}")
            choices = event.get("choices") or ()
            if choices and choices[0].get("token_ids"):
                arrivals.append(time.perf_counter())
                ids.extend(choices[0]["token_ids"])
    return t0, arrivals, ids


def measure_overhead(options: ServerEngineOptions, *, topics: int = 6, rounds: int = 3, max_tokens: int = 16,
                     gap_s: float = 0.2) -> dict[str, Any]:
    """Run the comparison (see the module docstring); returns the report dict."""
    docs_sets = topics_from_corpus(LoadConfig(topics=topics))
    local_t, served_t = Timings(), Timings()
    mismatches = 0
    with tempfile.TemporaryDirectory(prefix="pcr-overhead-") as tmp, ServerProcess(options) as server, \
            PCREngine(model=options.model, config=options.engine_config(Path(tmp) / "kv")) as engine, \
            httpx.Client(base_url=server.url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for r in range(rounds + 1):  # round 0 warms both up (documents computed and cached)
            for i, docs in enumerate(docs_sets):
                question = f"round {r}: what does part {i} describe?"
                order = ("local", "served") if (r + i) % 2 == 0 else ("served", "local")
                got = {}
                for mode in order:
                    time.sleep(gap_s)  # let the other mode's worker threads go idle first
                    if mode == "local":
                        got[mode] = _local(engine, docs, question, max_tokens)
                    else:
                        got[mode] = _served(client, model, docs, question, max_tokens)
                mismatches += got["local"][2] != got["served"][2]
                if r > 0:
                    local_t.add(*got["local"][:2])
                    served_t.add(*got["served"][:2])
            log.info("round %d done", r)
    local_s = {"ttft": summarize(local_t.ttft), "itl": summarize(local_t.itl)}
    served_s = {"ttft": summarize(served_t.ttft), "itl": summarize(served_t.itl)}
    ttft_ratio = served_s["ttft"]["mean"] / local_s["ttft"]["mean"]
    itl_ratio = served_s["itl"]["mean"] / local_s["itl"]["mean"]
    return {
        "schema": "pcr-rag-server-overhead/1", "model": model, "requests_per_mode": len(local_t.ttft),
        "max_tokens": max_tokens, "local": local_s, "served": served_s,
        "ttft_ratio_mean": ttft_ratio, "itl_ratio_mean": itl_ratio,
        "ttft_ratio_p50": served_s["ttft"]["p50"] / local_s["ttft"]["p50"],
        "itl_ratio_p50": served_s["itl"]["p50"] / local_s["itl"]["p50"],
        "token_mismatches": mismatches,
        "checks": {f"ttft<={SERVER_TTFT_OVERHEAD_MAX:g}x": ttft_ratio <= SERVER_TTFT_OVERHEAD_MAX,
                   f"itl<={SERVER_ITL_OVERHEAD_MAX:g}x": itl_ratio <= SERVER_ITL_OVERHEAD_MAX,
                   "identical_tokens": mismatches == 0},
    }


def format_report(report: dict[str, Any]) -> str:
    lo, sv = report["local"], report["served"]
    rows = [f"server overhead on {report['model']}: {report['requests_per_mode']} requests per mode, "
            f"{report['max_tokens']} tokens each",
            "               mean        p50         p95",
            *(f"{label:<14} {s[k]['mean'] * 1000:>8.2f} ms {s[k]['p50'] * 1000:>8.2f} ms {s[k]['p95'] * 1000:>8.2f} ms"
              for k in ("ttft", "itl") for label, s in ((f"{k} local", lo), (f"{k} server", sv))),
            f"TTFT server/local: mean {report['ttft_ratio_mean']:.3f}x, p50 {report['ttft_ratio_p50']:.3f}x",
            f"ITL  server/local: mean {report['itl_ratio_mean']:.3f}x, p50 {report['itl_ratio_p50']:.3f}x",
            f"token mismatches: {report['token_mismatches']}",
            "checks: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in report["checks"].items())]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/server_overhead.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="alias or HF dir (default: the default model)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead")
    parser.add_argument("--topics", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--gap", type=float, default=0.2, help="seconds of pause before each request")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="pcr-tiny-") as tmp:
        model = str(save_tiny_model(Path(tmp) / "tiny-llama")) if args.tiny else args.model
        options = ServerEngineOptions(model=model, chunk_size=args.chunk_size, max_new_tokens=args.max_tokens,
                                      dram="1GiB", ssd="2GiB")
        report = measure_overhead(options, topics=args.topics, rounds=args.rounds, max_tokens=args.max_tokens,
                                  gap_s=args.gap)
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
