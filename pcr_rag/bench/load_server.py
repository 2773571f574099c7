"""Load test of `pcr-rag serve`: many concurrent streaming clients for a bounded time, in identical rounds.

    python -m pcr_rag.bench.load_server --tiny --clients 64 --duration 20 --rounds 2
    python -m pcr_rag.bench.load_server --base-url http://127.0.0.1:8000 --api-key KEY

Each client loops until the round's deadline: a streamed chat completion over one of ``--topics`` document sets
(drawn with Zipf popularity, the documents passed in the ``documents`` extension), a fresh question each time. Per
round the report gives requests, errors (HTTP errors, error events, streams without ``[DONE]``), p50/p99 TTFT
(client side: request sent -> first token event), p50 ITL, generated tokens/s, and the server's RSS at the start
and the end (``process_resident_memory_bytes`` from ``/metrics``) plus ``pinned_chunks`` once the server is idle
again. Rounds are identical (same seeds), so RSS after round 2 should equal RSS after round 1: the check is
``rss_end[last] - rss_end[first] <= SERVER_LOAD_RSS_GROWTH_MAX x rss_end[first]``, zero errors and 0 pinned chunks.

Without ``--base-url`` a server is started as a subprocess (`ServerProcess`) on a free loopback port and stopped
with SIGTERM at the end. Every loop is bounded in time (``--duration`` per round, ``--request-timeout`` per
request, bounded idle waits). Clients and server share this machine's cores: note its load with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pcr_rag.bench.server_proc import ServerEngineOptions, ServerProcess, scrape
from pcr_rag.bench.targets import SERVER_LOAD_RSS_GROWTH_MAX
from pcr_rag.metrics import percentile
from pcr_rag.rag.corpus import load_corpus, split_passages
from pcr_rag.testing import save_tiny_model

log = logging.getLogger(__name__)

__all__ = ["LoadConfig", "RoundResult", "run_load", "topics_from_corpus"]


@dataclass(frozen=True)
class LoadConfig:
    """One load test: ``clients`` concurrent streams for ``duration_s`` seconds per round, ``rounds`` rounds."""

    clients: int = 64
    duration_s: float = 30.0
    rounds: int = 2
    max_tokens: int = 16
    topics: int = 16
    docs_per_topic: int = 3
    words_per_doc: int = 120
    request_timeout_s: float = 300.0
    idle_timeout_s: float = 120.0
    seed: int = 0


@dataclass
class RoundResult:
    """What one round measured (seconds, bytes, tokens)."""

    round: int
    requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    ttft_p50_s: float = float("nan")
    ttft_p99_s: float = float("nan")
    itl_p50_s: float = float("nan")
    tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    rss_start_bytes: float = 0.0
    rss_end_bytes: float = 0.0
    pinned_chunks_after: float = 0.0
    idle_after: bool = False


def topics_from_corpus(config: LoadConfig) -> list[list[str]]:
    """``topics`` document sets of ``docs_per_topic`` passages each, from the built-in stdlib corpus."""
    need = config.topics * config.docs_per_topic
    passages: list[str] = []
    max_docs = 4
    while len(passages) < need and max_docs <= 256:
        docs = load_corpus(max_docs=max_docs)
        passages = [p.text for p in split_passages(docs, tokens_per_passage=config.words_per_doc)]
        max_docs *= 2
    if len(passages) < need:
        raise ValueError(f"the corpus has {len(passages)} passages, {need} are needed; lower --topics")
    return [passages[i * config.docs_per_topic:(i + 1) * config.docs_per_topic] for i in range(config.topics)]


def _zipf(n: int) -> list[float]:
    return [1.0 / (i + 1) for i in range(n)]


class _Round:
    def __init__(self, index: int) -> None:
        self.result = RoundResult(index)
        self.ttfts: list[float] = []
        self.itls: list[float] = []

    def error(self, kind: str) -> None:
        self.result.errors += 1
        self.result.error_kinds[kind] = self.result.error_kinds.get(kind, 0) + 1


async def _one_request(client: httpx.AsyncClient, model: str, docs: list[str], question: str, config: LoadConfig,
                       rnd: _Round) -> None:
    context = "\n\n".join(docs)
    body = {"model": model, "max_tokens": config.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "documents": docs,
            "messages": [{"role": "system", "content": "Answer from the context."},
                         {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]}
    t0 = time.perf_counter()
    last: float | None = None
    done = False
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 timeout=config.request_timeout_s) as response:
            if response.status_code != 200:
                await response.aread()
                rnd.error(f"http_{response.status_code}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rnd.error(f"event_{event['error'].get('code')}")
                    return
                usage = event.get("usage") or usage
                choices = event.get("choices") or ()
                if choices and choices[0].get("token_ids"):
                    now = time.perf_counter()
                    if last is None:
                        rnd.ttfts.append(now - t0)
                    else:
                        rnd.itls.append(now - last)
                    last = now
                    rnd.result.tokens += len(choices[0]["token_ids"])
    except (httpx.HTTPError, ValueError) as exc:
        rnd.error(type(exc).__name__)
        return
    if not done or usage is None:
        rnd.error("incomplete_stream")
        return
    rnd.result.requests += 1
    rnd.result.prompt_tokens += usage["prompt_tokens"]
    rnd.result.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]


async def _client(cid: int, client: httpx.AsyncClient, model: str, topics: list[list[str]], config: LoadConfig,
                  rnd: _Round, deadline: float) -> None:
    rng = random.Random(config.seed * 1000 + cid)
    weights = _zipf(len(topics))
    n = 0
    while time.perf_counter() < deadline:
        docs = rng.choices(topics, weights)[0]
        await _one_request(client, model, docs, f"client {cid} question {n}: what does this cover?", config, rnd)
        n += 1


async def _round(url: str, headers: dict[str, str], scrape_headers: dict[str, str], model: str,
                 topics: list[list[str]], config: LoadConfig, index: int) -> RoundResult:
    rnd = _Round(index)
    rnd.result.rss_start_bytes = scrape(url, scrape_headers).get_value("process_resident_memory_bytes")
    limits = httpx.Limits(max_connections=config.clients + 4, max_keepalive_connections=config.clients + 4)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits) as client:
        deadline = t0 + config.duration_s
        await asyncio.gather(*(_client(c, client, model, topics, config, rnd, deadline)
                               for c in range(config.clients)))
    res = rnd.result
    res.wall_s = time.perf_counter() - t0
    res.tokens_per_s = res.tokens / res.wall_s if res.wall_s else 0.0
    res.ttft_p50_s = percentile(rnd.ttfts, 50)
    res.ttft_p99_s = percentile(rnd.ttfts, 99)
    res.itl_p50_s = percentile(rnd.itls, 50)
    res.idle_after = _wait_idle(url, scrape_headers, config.idle_timeout_s)
    samples = scrape(url, scrape_headers)
    res.pinned_chunks_after = samples.get_value("pcr:cache_pinned_chunks")
    res.rss_end_bytes = samples.get_value("process_resident_memory_bytes")
    return res


def _wait_idle(url: str, headers: dict[str, str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = scrape(url, headers)
        if (s.get_value("pcr:num_requests_running") == 0 and s.get_value("pcr:num_requests_waiting") == 0
                and s.get_value("pcr:cache_pinned_chunks") == 0):
            return True
        time.sleep(0.2)
    return False


def run_load(url: str, config: LoadConfig, *, api_key: str | None = None,
             metrics_key: str | None = None) -> dict[str, Any]:
    """Run ``config.rounds`` identical rounds against the server at ``url``; returns the report dict. ``api_key``
    sends the requests, ``metrics_key`` scrapes ``/metrics`` (a server with API keys refuses tenant keys there)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    scrape_headers = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else headers
    model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    topics = topics_from_corpus(config)
    rounds = []
    for i in range(config.rounds):
        res = asyncio.run(_round(url, headers, scrape_headers, model, topics, config, i + 1))
        log.info("round %d: %d requests, %d errors, TTFT p50 %.3f s p99 %.3f s, RSS %.0f MiB", res.round,
                 res.requests, res.errors, res.ttft_p50_s, res.ttft_p99_s, res.rss_end_bytes / 2**20)
        rounds.append(res)
    first, last = rounds[0], rounds[-1]
    growth = last.rss_end_bytes - first.rss_end_bytes
    checks = {
        "zero_errors": all(r.errors == 0 for r in rounds),
        "pinned_chunks_zero": all(r.pinned_chunks_after == 0 and r.idle_after for r in rounds),
        f"rss_growth<={SERVER_LOAD_RSS_GROWTH_MAX:g}x": growth <= SERVER_LOAD_RSS_GROWTH_MAX * first.rss_end_bytes,
    }
    return {"schema": "pcr-rag-load/1", "url": url, "model": model, "config": asdict(config),
            "cpu_count": os.cpu_count(), "loadavg_start": _loadavg(),
            "rounds": [asdict(r) for r in rounds], "rss_growth_bytes": growth, "checks": checks,
            "passed": all(checks.values())}


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def format_report(report: dict[str, Any]) -> str:
    lines = [f"load test: {report['config']['clients']} streaming clients x {report['config']['duration_s']:g} s "
             f"x {len(report['rounds'])} rounds against {report['model']} ({report['cpu_count']} CPUs, load avg "
             f"at start {report['loadavg_start']})",
             "round  requests  errors  TTFT p50   TTFT p99   ITL p50   tok/s   cached/prompt  RSS start  RSS end"
             "  pinned after"]
    for r in report["rounds"]:
        lines.append(f"{r['round']:>5}  {r['requests']:>8}  {r['errors']:>6}  {r['ttft_p50_s']:>7.3f} s "
                     f"{r['ttft_p99_s']:>7.3f} s  {r['itl_p50_s'] * 1000:>6.1f} ms {r['tokens_per_s']:>7.1f}  "
                     f"{r['cached_tokens']:>6}/{r['prompt_tokens']:<7} {r['rss_start_bytes'] / 2**20:>6.0f} MiB "
                     f"{r['rss_end_bytes'] / 2**20:>6.0f} MiB  {r['pinned_chunks_after']:>4.0f}")
    lines.append(f"RSS growth between the first and last round: {report['rss_growth_bytes'] / 2**20:+.1f} MiB")
    lines.append("checks: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in report["checks"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcr_rag.bench.load_server", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="an existing server (default: start one)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--metrics-key", default=None, help="the server's --metrics-key, to scrape /metrics")
    parser.add_argument("--model", default=None, help="model of the started server (alias or HF dir)")
    parser.add_argument("--tiny", action="store_true", help="start the server on a tiny random model")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--topics", type=int, default=16)
    parser.add_argument("--max-active", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = LoadConfig(clients=args.clients, duration_s=args.duration, rounds=args.rounds,
                        max_tokens=args.max_tokens, topics=args.topics)
    server: ServerProcess | None = None
    tmp: tempfile.TemporaryDirectory | None = None
    try:
        url = args.base_url
        if url is None:
            model = args.model
            if args.tiny:
                tmp = tempfile.TemporaryDirectory(prefix="pcr-tiny-")
                model = str(save_tiny_model(Path(tmp.name) / "tiny-llama"))
            options = ServerEngineOptions(model=model, chunk_size=args.chunk_size, max_new_tokens=args.max_tokens,
                                          max_active=args.max_active, dram="1GiB", ssd="2GiB")
            server = ServerProcess(options)
            url = server.url
        report = run_load(url.rstrip("/"), config, api_key=args.api_key, metrics_key=args.metrics_key)
    finally:
        if server is not None:
            status = server.stop()
            log.info("server stopped with status %s", status)
        if tmp is not None:
            tmp.cleanup()
    print(format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
