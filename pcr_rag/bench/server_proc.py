"""A `pcr-rag serve` subprocess for the server benchmarks, and reading its ``/metrics``.

`ServerProcess` starts the server on a free loopback port with engine options given as `ServerEngineOptions`
(the same options build the local engine the overhead benchmark compares with), waits for ``/health``, and
stops it with SIGTERM (bounded waits everywhere). `scrape` parses Prometheus text into samples.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pcr_rag.config import EngineConfig

__all__ = ["MetricSamples", "ServerEngineOptions", "ServerProcess", "scrape"]


@dataclass(frozen=True)
class ServerEngineOptions:
    """Engine options shared by a served engine and a local one (tokens, bytes as strings like "1GiB")."""

    model: str | None = None
    chunk_size: int = 256
    dram: str = "2GiB"
    ssd: str = "4GiB"
    max_new_tokens: int = 16
    max_active: int = 8
    max_model_len: int = 4096
    dtype: str = "auto"
    weights: str = "bf16"

    def cli_args(self) -> list[str]:
        args = ["--chunk-size", str(self.chunk_size), "--dram", self.dram, "--ssd", self.ssd, "--max-new-tokens",
                str(self.max_new_tokens), "--max-active", str(self.max_active), "--max-model-len",
                str(self.max_model_len), "--dtype", self.dtype, "--weights", self.weights]
        return (["--model", self.model] if self.model else []) + args

    def engine_config(self, cache_dir: str | Path) -> EngineConfig:
        return EngineConfig(cache_dir=cache_dir, chunk_size=self.chunk_size, dram_capacity=self.dram,
                            ssd_capacity=self.ssd, max_new_tokens=self.max_new_tokens, max_active=self.max_active,
                            max_model_len=self.max_model_len, dtype=self.dtype, weights=self.weights)


class ServerProcess:
    """``pcr-rag serve`` in a child process on a free loopback port, with its own temporary cache directory."""

    def __init__(self, options: ServerEngineOptions, *, extra_args: tuple[str, ...] = (),
                 start_timeout_s: float = 600.0) -> None:
        self.options = options
        self._tmp = tempfile.TemporaryDirectory(prefix="pcr-serve-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pcr_rag.cli", "serve", "--port", str(self.port), "--cache-dir",
               str(Path(self._tmp.name) / "kv"), "--log-level", "warning", *options.cli_args(), *extra_args]
        self._log = open(Path(self._tmp.name) / "server.log", "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not come up within {start_timeout_s} s: {self.log_tail()}")
            time.sleep(0.25)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 2000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:]

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM and wait (kill after ``timeout`` seconds); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        self._tmp.cleanup()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MetricSamples(dict):
    """``(name, frozenset(label pairs)) -> value``; `get_value` sums the samples matching some labels."""

    def get_value(self, name: str, **labels: str) -> float:
        want = set(labels.items())
        return sum(v for (n, lab), v in self.items() if n == name and want <= lab)


def scrape(url: str, headers: dict[str, str] | None = None, timeout: float = 30.0) -> MetricSamples:
    """The server's ``/metrics`` as `MetricSamples` (label values unquoted)."""
    text = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=timeout).text
    samples = MetricSamples()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        pairs = frozenset((k, v.strip('"')) for k, _, v in (p.partition("=") for p in labels.rstrip("}").split(",")
                                                            if p))
        samples[(name, pairs)] = float(value)
    return samples
