"""Outside baselines for ``pcr-rag bench``: what a user gets without pcr-rag, served like the engine's requests.

Both run behind `SerialServer`: one FIFO queue and one worker thread that serves requests one at a time, fed
from the same arrival trace by the bench's request threads. TTFT counts from submission (queueing included), as
for the engine. Each request's prompt is the engine's own rendering of it (`PromptBuilder.build_rag(...).text`:
the chat template, the system prompt, the documents in the order given), tokenized whole by the model's
tokenizer, the way LlamaIndex's ``HuggingFaceLLM`` tokenizes a prompt.

- `TransformersServer`: plain ``model.generate`` on that prompt (one-shot prefill, greedy, no reuse across
  requests), with the same model object, weights and dtype as the engine systems.
- `LlamaCppServer`: llama-cpp-python on the model's GGUF file (the quantized weights it ships as), one
  sequence (one slot: requests one at a time, the context keeps the previous prompt for prefix reuse) plus a
  ``LlamaRAMCache`` of whole-context states keyed by token prefix, `LLAMA_CPP_CACHE_BYTES` large (the
  llama-cpp-python server's default). Greedy, the same threads as torch, the same prompt token ids. Only when
  ``llama_cpp`` is importable; it is never installed by ``make install``.
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from pcr_rag.engine import GenerationResult
from pcr_rag.metrics import TIERS, RequestMetrics
from pcr_rag.model.model import DEFAULT_MODEL, KNOWN_MODELS, LoadedModel
from pcr_rag.prompt import PromptBuilder

log = logging.getLogger(__name__)

__all__ = [
    "LLAMA_CPP_CACHE_BYTES",
    "LlamaCppServer",
    "SerialServer",
    "TransformersServer",
    "llama_cpp_unavailable",
    "locate_gguf",
]

#: Bytes of llama.cpp context states the RAM cache keeps (LRU); llama-cpp-python's server default (2 GiB).
LLAMA_CPP_CACHE_BYTES = 2 << 30
#: llama.cpp context size at most (tokens); the bench's prompts are far shorter.
_LLAMA_CPP_MAX_CTX = 4096


@dataclass
class _Job:
    question: str
    documents: tuple[str, ...]
    system: str | None
    max_new_tokens: int
    submitted: float
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class _Served:
    """What a backend produced for one job: generated ids and text, prompt ids, and clock readings (seconds):
    when serving started, when each generated token arrived."""

    token_ids: list[int]
    text: str
    prompt_ids: list[int]
    started: float
    token_times: list[float]
    reused_tokens: int = 0
    finish_reason: str = "length"


class SerialServer:
    """A FIFO queue served one request at a time by one worker thread; ``generate`` blocks until its request is
    done. The subset of `PCREngine`'s interface the bench uses: ``generate``, ``flush``, ``close``, ``cache``
    (None: no pcr-rag cache)."""

    cache = None

    def __init__(self, name: str, builder: PromptBuilder, clock: Callable[[], float] = time.perf_counter) -> None:
        self.name = name
        self.builder = builder
        self.clock = clock
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"bench-{name}", daemon=True)
        self._thread.start()

    def generate(self, query: str, documents: Sequence[str] = (), *, system: str | None = None,
                 max_new_tokens: int = 32, temperature: float = 0.0) -> GenerationResult:
        """Greedy answer to ``query`` over ``documents`` (``temperature`` must be 0: the bench compares greedy
        answers)."""
        if temperature != 0.0:
            raise ValueError(f"{self.name} baseline serves greedy requests only (temperature=0)")
        if self._closed:
            raise RuntimeError(f"the {self.name} baseline is closed")
        job = _Job(query, tuple(documents), system, max_new_tokens, self.clock())
        self._queue.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def flush(self, timeout: float | None = None) -> None:
        """Nothing is written behind the requests' backs."""

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                prompt = self.builder.build_rag(job.question, job.documents, job.system).text
                job.result = self._result(job, self._serve(prompt, job.max_new_tokens))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, the server goes on
                job.error = exc
            finally:
                job.done.set()

    def _serve(self, prompt: str, max_new_tokens: int) -> _Served:
        raise NotImplementedError

    def _result(self, job: _Job, served: _Served) -> GenerationResult:
        times = served.token_times
        first = times[0] if times else self.clock()
        n = len(served.prompt_ids)
        reused = min(served.reused_tokens, n)
        by_tier = dict.fromkeys(TIERS, 0)
        by_tier["dram"] = reused
        metrics = RequestMetrics(
            ttft_s=first - job.submitted, e2e_s=(times[-1] if times else first) - job.submitted,
            queue_s=served.started - job.submitted, prefill_s=first - served.started,
            prefill_compute_s=first - served.started,
            itl_s=[b - a for a, b in zip(times, times[1:], strict=False)], prompt_tokens=n,
            computed_tokens=n - reused, reused_tokens=reused, reused_by_tier=by_tier,
            generated_tokens=len(served.token_ids))
        return GenerationResult(served.text, list(served.token_ids), list(served.prompt_ids), metrics,
                                served.finish_reason)


class _TimingStreamer(BaseStreamer):
    """Records when ``generate`` hands over each new token (the first ``put`` is the prompt)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(self.clock())

    def end(self) -> None:
        pass


class TransformersServer(SerialServer):
    """Plain transformers: ``model.generate`` on the whole prompt, greedy, no reuse (module docstring)."""

    def __init__(self, loaded: LoadedModel, clock: Callable[[], float] = time.perf_counter) -> None:
        self.loaded = loaded
        super().__init__("transformers", PromptBuilder(loaded.tokenizer), clock)

    def _serve(self, prompt: str, max_new_tokens: int) -> _Served:
        tok = self.loaded.tokenizer
        started = self.clock()
        enc = tok(prompt, return_tensors="pt")
        ids = enc["input_ids"].to(self.loaded.device)
        streamer = _TimingStreamer(self.clock)
        eos = list(self.loaded.eos_token_ids) or None
        with torch.inference_mode():
            out = self.loaded.model.generate(
                input_ids=ids, attention_mask=enc["attention_mask"].to(self.loaded.device),
                max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                eos_token_id=eos, pad_token_id=tok.pad_token_id, streamer=streamer)
        new = out[0, ids.shape[1]:].tolist()
        finish = "stop" if new and eos and new[-1] in eos else "length"
        if finish == "stop":
            new = new[:-1]
        text = tok.decode(new, skip_special_tokens=True)
        return _Served(new, text, ids[0].tolist(), started, streamer.times, 0, finish)


def llama_cpp_unavailable() -> str | None:
    """Why the llama-cpp system cannot run here (None when ``llama_cpp`` is importable)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama_cpp is not importable (pip install llama-cpp-python to compare; make install never "
                "installs it)")
    return None


def locate_gguf(model: Any) -> Path | None:
    """The GGUF file behind a bench model argument: a known alias (None = the default model) or a ``.gguf``
    path; None for a model object or an HF directory."""
    name = DEFAULT_MODEL if model is None else model
    if isinstance(name, (str, Path)):
        text = str(name)
        if text.strip().lower() in KNOWN_MODELS:
            parts = KNOWN_MODELS[text.strip().lower()].locate().parts
            return Path(parts[0]) if len(parts) == 1 else None
        path = Path(text).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            return path
    return None


class LlamaCppServer(SerialServer):
    """llama-cpp-python with a one-sequence context and a ``LlamaRAMCache`` (module docstring). ``n_ctx``:
    context tokens; ``threads``: compute threads (the bench's torch threads)."""

    def __init__(self, gguf: Path, tokenizer: Any, *, n_ctx: int, threads: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        import llama_cpp  # optional dependency: only this baseline needs it

        self._llama_cpp = llama_cpp
        self.tokenizer = tokenizer
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=min(n_ctx, _LLAMA_CPP_MAX_CTX), n_threads=threads,
                                   n_threads_batch=threads, seed=0, verbose=False)
        self.llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=LLAMA_CPP_CACHE_BYTES))
        super().__init__("llama-cpp", PromptBuilder(tokenizer), clock)

    def _reusable_tokens(self, prompt_ids: list[int]) -> int:
        """Prompt tokens llama.cpp will not recompute: the longest prefix shared with the context's tokens or with
        the best state in the RAM cache (the rule ``Llama.create_completion`` applies); the last prompt token is
        always evaluated."""
        longest = self._llama_cpp.Llama.longest_token_prefix
        best = longest(self.llm.input_ids[: self.llm.n_tokens].tolist(), prompt_ids)
        try:
            best = max(best, longest(self.llm.cache[prompt_ids].input_ids.tolist(), prompt_ids))
        except KeyError:  # nothing cached yet
            pass
        return max(0, min(best, len(prompt_ids) - 1))

    def _serve(self, prompt: str, max_new_tokens: int) -> _Served:
        started = self.clock()
        ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        reused = self._reusable_tokens(ids)
        times: list[float] = []
        pieces: list[str] = []
        finish = "length"
        for chunk in self.llm.create_completion(ids, max_tokens=max_new_tokens, temperature=0.0, top_k=1,
                                                top_p=1.0, repeat_penalty=1.0, seed=0, stream=True):
            choice = chunk["choices"][0]
            if choice.get("text"):
                times.append(self.clock())
                pieces.append(choice["text"])
            finish = choice.get("finish_reason") or finish
        text = "".join(pieces)
        # The stream carries text, not ids: the answer's ids are its text tokenized again (exact for the
        # length; the bench compares llama.cpp's answers only with themselves).
        tokens = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        return _Served(tokens, text, ids, started, times, reused, finish)
