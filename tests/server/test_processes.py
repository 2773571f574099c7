"""Real OS processes: `pcr-rag serve` shuts down on SIGTERM (in-flight stream finishes within --shutdown-timeout,
or is cut after it; exit status 0; lock released, SSD cache intact on restart), and two client processes share one
server's KV with identical answers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.testing import save_tiny_model

START_TIMEOUT_S = 180.0  # a cold interpreter importing torch + transformers on a busy 2-core machine


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tiny_dir: Path, cache_dir: Path, shutdown_timeout: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pcr_rag.cli", "serve", "--model", str(tiny_dir), "--port", str(port),
           "--cache-dir", str(cache_dir), "--chunk-size", "16", "--dram", "64MiB", "--ssd", "64MiB",
           "--max-new-tokens", "8", "--max-model-len", "1024", "--max-active", "4", "--dtype", "float32",
           "--shutdown-timeout", str(shutdown_timeout), "--log-level", "warning",
           "--load-planner", "always-load"]  # on the tiny model computing beats any read, so the measured planner would rightly skip the SSD this test is about
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server did not come up within {START_TIMEOUT_S} s:\n{proc.stdout.read()}")


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[int, float]:
    """SIGTERM, then wait (bounded); returns (exit status, seconds it took)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"server ignored SIGTERM for {timeout} s") from None
    return code, time.monotonic() - t0


def chat(url: str, model: str, docs: list[str], max_tokens: int = 8) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "documents": docs,
            "messages": [{"role": "user", "content": "Context:\n" + "\n\n".join(docs) + "\n\nQuestion: what?"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_in_thread(url: str, model: str, max_tokens: int, out: dict) -> threading.Thread:
    """A streaming request on a thread; ``out`` gets 'first' (an event: first content seen), 'events', 'error'."""
    out["first"] = threading.Event()
    out["events"] = []

    def run():
        body = {"model": model, "max_tokens": max_tokens, "stream": True,
                "messages": [{"role": "user", "content": "tell me a long story"}]}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        out["events"].append(line[5:].strip())
                        if len(out["events"]) >= 3:
                            out["first"].set()
        except httpx.HTTPError as exc:
            out["error"] = exc
        finally:
            out["first"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_sigterm_lets_the_stream_finish_then_a_restart_finds_the_ssd_cache(tiny_dir, tmp_path) -> None:
    cache = tmp_path / "kv"
    docs = ["pathlib offers classes for filesystem paths. Path objects join with the slash operator.",
            "json encodes Python objects as JSON text. json.dumps returns a str and json.loads parses one."]
    proc, url = start_server(tiny_dir, cache, shutdown_timeout=30)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        first = chat(url, model, docs)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        out: dict = {}
        thread = stream_in_thread(url, model, 200, out)
        assert out["first"].wait(60) and "error" not in out
        code, _ = stop(proc)  # in flight: the stream gets to finish
        thread.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, proc.stdout.read()
    assert "error" not in out and out["events"][-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in out["events"][:-1]
              if json.loads(e).get("choices")]
    assert finish[-1] == "length"  # all 200 tokens came out after SIGTERM
    assert _lock_is_free(cache / ".lock")
    # a restart (here: an engine with the server's configuration) opens the directory and finds the cache intact
    config = EngineConfig(cache_dir=cache, chunk_size=16, dram_capacity="64MiB", ssd_capacity="64MiB",
                          max_new_tokens=8, max_model_len=1024, max_active=4, dtype="float32",
                          load_planner="always-load")  # on the tiny model computing beats any read, so the measured planner would rightly skip the SSD this test is about
    with PCREngine(model=str(tiny_dir), config=config) as restarted:
        messages = [{"role": "user", "content": "Context:\n" + "\n\n".join(docs) + "\n\nQuestion: what?"}]
        again = restarted.generate_messages(messages, docs)
    assert again.text == first["choices"][0]["message"]["content"]
    assert again.metrics.reused_tokens == first["usage"]["prompt_tokens"] - 1  # all but the recomputed last token
    assert again.metrics.reused_by_tier["ssd"] + again.metrics.prefetch_hit_chunks > 0  # DRAM was empty


def _lock_is_free(path: Path) -> bool:
    import fcntl

    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


CLIENT = """
import json, sys, openai
url, model, docs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
messages = [{"role": "user", "content": "Context:\\n" + "\\n\\n".join(docs) + "\\n\\nQuestion: what?"}]
c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
r = c.chat.completions.create(model=model, messages=messages, max_tokens=8, extra_body={"documents": docs})
print(json.dumps({"text": r.choices[0].message.content, "cached": r.usage.prompt_tokens_details.cached_tokens}))
"""


def test_two_client_processes_share_the_servers_kv(base_url, engine, h) -> None:
    docs = [d + " (two processes)" for d in h.DOCS]
    outs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CLIENT, base_url, engine.loaded.name, json.dumps(docs)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = outs
    assert first["cached"] == 0 and second["cached"] > 0
    assert first["text"] == second["text"]
