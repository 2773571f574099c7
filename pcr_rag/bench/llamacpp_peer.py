"""The llama.cpp peer row of the kernel bench: the same GGUF file, the same threads, the same prompt tokens.

Optional: it runs only when ``llama_cpp`` (llama-cpp-python) is importable, which `make install` never installs.
`find_gguf` locates the GGUF a known model alias ships (the file `pcr_rag.model.model` converts), so the peer runs
the very weights our model was converted from (for SmolLM2-135M: Q4_1, i.e. 4-bit - compare with the int4 rows).

Measured, A/B interleaved by the caller: `LlamaCppPeer.prefill_s` (``eval`` of the whole prompt on an empty
context, llama.cpp's own ``n_batch`` splitting) and `LlamaCppPeer.decode_step_s` (one ``eval`` of one token over a
context of ``context`` prompt tokens; the context is truncated back after each try).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pcr_rag.model.model import DEFAULT_MODEL, KNOWN_MODELS, ModelError

log = logging.getLogger(__name__)


def available() -> bool:
    """True when llama-cpp-python is importable."""
    return importlib.util.find_spec("llama_cpp") is not None


def find_gguf(model: object) -> Path | None:
    """The GGUF file behind ``model`` when it is a known alias (None = the default) or a .gguf path, else None.
    Multi-part GGUFs (split across packages) are not supported by the peer and give None."""

    if model is None:
        model = DEFAULT_MODEL
    if not isinstance(model, str):
        return None
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    spec = KNOWN_MODELS.get(model.strip().lower())
    if spec is None:
        return None
    try:
        source = spec.locate()
    except ModelError as exc:
        log.info("no GGUF for the llama.cpp peer: %s", exc)
        return None
    return source.parts[0] if len(source.parts) == 1 else None


class PeerError(RuntimeError):
    """The llama.cpp worker process failed (crashed, e.g. SIGILL from a build for another CPU, or timed out)."""


class LlamaCppPeer:
    """llama.cpp on one GGUF with ``threads`` threads and room for ``n_ctx`` tokens, in a worker process (a
    llama.cpp build that crashes - an illegal instruction, an abort - fails the peer row, not the bench). Every
    call has a timeout of ``timeout_s`` seconds; timings are taken inside the worker."""

    def __init__(self, gguf: Path, *, threads: int, n_ctx: int, timeout_s: float = 600.0) -> None:
        self.gguf = Path(gguf)
        self.threads = threads
        self.timeout_s = timeout_s
        self._proc = subprocess.Popen([sys.executable, "-m", "pcr_rag.bench.llamacpp_peer"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        info = self._call({"op": "init", "gguf": str(gguf), "threads": threads, "n_ctx": n_ctx})
        self.n_vocab = int(info["n_vocab"])
        self.n_batch = int(info["n_batch"])

    def _call(self, request: dict) -> dict:
        proc = self._proc
        if proc.poll() is not None:
            raise PeerError(f"the llama.cpp worker exited with status {proc.returncode}")
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except OSError as exc:
            raise PeerError(f"the llama.cpp worker is gone: {exc}") from None
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            if not ready:
                proc.kill()
            code = proc.wait(timeout=10)
            why = f"signal {-code}" if code < 0 else f"status {code}"
            raise PeerError(f"the llama.cpp worker died ({why}) during {request['op']!r}" if ready else
                            f"the llama.cpp worker timed out after {self.timeout_s:.0f} s during {request['op']!r}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(f"llama.cpp failed during {request['op']!r}: {reply['error']}")
        return reply

    def prefill_s(self, token_ids: Sequence[int]) -> float:
        """Seconds to evaluate ``token_ids`` on an empty context."""
        return float(self._call({"op": "prefill", "ids": list(map(int, token_ids))})["seconds"])

    def prepare_decode(self, context_ids: Sequence[int]) -> None:
        """Evaluate the context that decode steps run over (untimed)."""
        self._call({"op": "prepare_decode", "ids": list(map(int, context_ids))})

    def decode_steps_s(self, token: int, steps: int) -> list[float]:
        """Seconds of each of ``steps`` one-token evals after the prepared context (then truncated back to it)."""
        return [float(t) for t in self._call({"op": "decode", "token": int(token), "steps": int(steps)})["times"]]

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait(timeout=10)


def _serve() -> None:
    """The worker: one JSON request per stdin line, one JSON reply per stdout line."""
    llm = None
    context = 0
    for line in sys.stdin:
        req = json.loads(line)
        try:
            op = req["op"]
            if op == "init":
                from llama_cpp import Llama

                llm = Llama(model_path=req["gguf"], n_ctx=req["n_ctx"], n_threads=req["threads"],
                            n_threads_batch=req["threads"], verbose=False)
                reply = {"n_vocab": int(llm.n_vocab()), "n_batch": int(llm.n_batch)}
            elif op == "prefill":
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(req["ids"])
                reply = {"seconds": time.perf_counter() - t0}
            elif op == "prepare_decode":
                llm.reset()
                llm.eval(req["ids"])
                context = len(req["ids"])
                reply = {}
            elif op == "decode":
                times = []
                for _ in range(req["steps"]):
                    t0 = time.perf_counter()
                    llm.eval([req["token"]])
                    times.append(time.perf_counter() - t0)
                llm.n_tokens = context  # the next eval drops the KV of these steps (kv_cache_seq_rm)
                reply = {"times": times}
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the peer row
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
