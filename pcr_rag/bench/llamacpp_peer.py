"""The llama.cpp peer row of the kernel bench: the same GGUF file, the same threads, the same prompt tokens.

Optional: it runs only when ``llama_cpp`` (llama-cpp-python) is importable, which `make install` never installs.
`find_gguf` locates the GGUF a known model alias ships (the file `pcr_rag.runtime.model` converts), so the peer runs
the very weights our model was converted from (for SmolLM2-135M: Q4_1, i.e. 4-bit - compare with the int4 rows).

Measured, A/B interleaved by the caller: `LlamaCppPeer.prefill_s` (``eval`` of the whole prompt on an empty
context, llama.cpp's own ``n_batch`` splitting) and `LlamaCppPeer.decode_step_s` (one ``eval`` of one token over a
context of ``context`` prompt tokens; the context is truncated back after each try).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def available() -> bool:
    """True when llama-cpp-python is importable."""
    return importlib.util.find_spec("llama_cpp") is not None


def find_gguf(model: object) -> Path | None:
    """The GGUF file behind ``model`` when it is a known alias (None = the default) or a .gguf path, else None.
    Multi-part GGUFs (split across packages) are not supported by the peer and give None."""
    from pcr_rag.runtime.model import DEFAULT_MODEL, KNOWN_MODELS, ModelError

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
    return source.paths[0] if len(source.paths) == 1 else None


class LlamaCppPeer:
    """llama.cpp on one GGUF with ``threads`` threads and room for ``n_ctx`` tokens."""

    def __init__(self, gguf: Path, *, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.gguf = Path(gguf)
        self.threads = threads
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.n_batch = int(self.llm.n_batch)

    @property
    def n_vocab(self) -> int:
        return int(self.llm.n_vocab())

    def prefill_s(self, token_ids: Sequence[int]) -> float:
        """Seconds to evaluate ``token_ids`` on an empty context."""
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(list(token_ids))
        return time.perf_counter() - t0

    def prepare_decode(self, context_ids: Sequence[int]) -> None:
        """Evaluate the context that decode steps run over (untimed)."""
        self.llm.reset()
        self.llm.eval(list(context_ids))
        self._context = len(context_ids)

    def decode_steps_s(self, token: int, steps: int) -> list[float]:
        """Seconds of each of ``steps`` one-token evals after the prepared context (then truncated back to it)."""
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.llm.eval([token])
            times.append(time.perf_counter() - t0)
        self.llm.n_tokens = self._context  # the next eval drops the KV of the steps (kv_cache_seq_rm)
        return times

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()
