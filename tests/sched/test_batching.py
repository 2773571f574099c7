"""Batched serving: a request's tokens under any concurrency, chunking and cache state equal its tokens alone."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from pcr_rag import ConfigError, EngineConfig, PCREngine, PromptTooLongError, RequestCancelledError
from pcr_rag.errors import RequestFailedError
from pcr_rag.request import RagPrompt, SamplingParams
from pcr_rag.sched.admission import AGING_TOKENS_PER_S
from pcr_rag.testing import TEST_DEVICE, tiny_model

DOCS = [
    "Alpha centauri is the closest star system to the Sun at about four light years away. " * 4,
    "The mitochondrion is the powerhouse of the cell and makes ATP for everything else. " * 3,
    "TCP retransmits lost segments and delivers bytes in order to the application layer. " * 5,
    "Merge sort splits a list in two halves, sorts both of them and merges the results. " * 2,
]
QUESTIONS = [("Which star is closest?", (0, 1)), ("What makes ATP?", (1, 2)), ("Is TCP ordered?", (2, 3, 0)),
             ("How does merge sort work?", (3,)), ("Closest star again?", (0, 1)), ("And the cell?", (1,))]


def _engine(model, tok, path, **kw) -> PCREngine:
    cfg = dict(cache_dir=path, chunk_size=16, dram_capacity="32MiB", ssd_capacity="64MiB", max_new_tokens=10,
               device=TEST_DEVICE, prefill_chunk_tokens=24)
    cfg.update(kw)
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg))


def _alone(model, tok, path, **kw):
    """Each request alone: no cache, one row, run one after the other."""
    with _engine(model, tok, path, enable_cache=False, max_active=kw.pop("max_active", 4), **kw) as eng:
        return [eng.generate(q, [DOCS[i] for i in d]) for q, d in QUESTIONS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tokens_under_concurrency_equal_tokens_alone(arch, dtype, tmp_path):
    model, tok = tiny_model(arch, dtype=dtype)
    ref = _alone(model, tok, tmp_path / "alone", dtype=dtype)
    generated = 0
    with _engine(model, tok, tmp_path / "busy", dtype=dtype, max_active=4) as eng:
        for _ in range(2):  # cold, then everything cached
            handles = [eng.submit(RagPrompt(q, tuple(DOCS[i] for i in d))) for q, d in QUESTIONS]
            got = [h.result(timeout=300) for h in handles]
            generated += sum(len(r.token_ids) for r in got)
            for a, b in zip(ref, got):
                assert a.token_ids == b.token_ids
                assert torch.equal(a.first_token_logits, b.first_token_logits)
        assert eng.executor.decode_steps < 0.7 * generated, "decode must be batched"
        assert eng.stats().cache.pinned_chunks == 0


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 4096])
def test_prefill_chunking_never_changes_the_answer(chunk_tokens, tmp_path):
    model, tok = tiny_model("gemma3", dtype=torch.bfloat16)
    ref = _alone(model, tok, tmp_path / "ref", dtype=torch.bfloat16)
    with _engine(model, tok, tmp_path / "c", dtype=torch.bfloat16, prefill_chunk_tokens=chunk_tokens) as eng:
        got = [eng.generate(q, [DOCS[i] for i in d]) for q, d in QUESTIONS]
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids and torch.equal(a.first_token_logits, b.first_token_logits)


def test_cancel_mid_decode_frees_the_row_and_spares_the_others(tmp_path):
    model, tok = tiny_model("llama")
    ref = _alone(model, tok, tmp_path / "ref")
    with _engine(model, tok, tmp_path / "c", max_active=3) as eng:
        eng.executor.eos_ids = frozenset()  # the long request must still be decoding when cancelled
        long = eng.submit(RagPrompt("talk at length", (DOCS[0],)), SamplingParams(max_new_tokens=400))
        for chunk in long:
            if chunk.index >= 3:
                break
        others = [eng.submit(RagPrompt(q, tuple(DOCS[i] for i in d))) for q, d in QUESTIONS[:3]]
        assert long.cancel()
        with pytest.raises(RequestCancelledError):
            long.result(timeout=60)
        got = [h.result(timeout=120) for h in others]
        deadline = time.monotonic() + 10
        while eng.executor.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.executor.free_rows == 3
        assert eng.stats().cache.pinned_chunks == 0
    for a, b in zip(ref[:3], got):
        assert a.token_ids == b.token_ids


def test_a_failing_request_fails_alone(tmp_path):
    model, tok = tiny_model("llama")
    ref = _alone(model, tok, tmp_path / "ref")
    with _engine(model, tok, tmp_path / "c") as eng:
        good = [eng.stream(q, [DOCS[i] for i in d]) for q, d in QUESTIONS[:3]]
        bad = eng.stream("this one's consumer explodes", [DOCS[3]])
        bad._source.request.on_token = lambda *_: (_ for _ in ()).throw(RuntimeError("consumer exploded"))
        with pytest.raises(RequestFailedError, match="failed during decode: RuntimeError: consumer exploded"):
            bad.result(timeout=120)
        got = [h.result(timeout=120) for h in good]
        assert eng.stats().cache.pinned_chunks == 0
    for a, b in zip(ref[:3], got):
        assert a.token_ids == b.token_ids


def test_long_prefill_does_not_freeze_streaming(tmp_path):
    """While a long cold prompt prefills, a decoding request keeps getting a token every engine step."""
    model, tok = tiny_model("llama")
    with _engine(model, tok, tmp_path / "c", prefill_chunk_tokens=16, max_active=2) as eng:
        eng.executor.eos_ids = frozenset()
        streaming = eng.submit(RagPrompt("stream please", (DOCS[3],)), SamplingParams(max_new_tokens=60))
        it = iter(streaming)
        next(it)
        steps_before = eng.executor.prefill_steps
        long = eng.submit(RagPrompt("long cold prompt", tuple(DOCS) * 3), SamplingParams(max_new_tokens=2))
        stamps = [time.perf_counter() for _ in it]
        m = long.result(timeout=120).metrics
        assert eng.executor.prefill_steps - steps_before >= 10, "the long prompt must span many prefill steps"
        summary = eng.stats().requests
        assert 0.0 < summary["prefill_compute"]["mean"] < summary["prefill"]["mean"]
    assert len(stamps) >= 50
    # its time holding a row splits into its own steps and the decode steps run between them
    assert 0.0 <= m.load_wait_s <= m.prefill_compute_s < m.prefill_s <= m.ttft_s
    assert m.prefill_compute_s > 0.0
    assert eng.executor.decode_steps >= 59


def _before_each_layer(eng: PCREngine, before) -> None:
    """Wrap the engine's `FastForward.prefill_layers` so that ``before(row, start)`` runs (on the executor thread)
    before each layer of every prefill step."""
    prefill_layers = eng.forward.prefill_layers

    def spy(row, token_ids, start, **kwargs):
        inner = prefill_layers(row, token_ids, start, **kwargs)

        def counted():
            while True:
                before(row, start)
                try:
                    value = next(inner)
                except StopIteration as stop:
                    return stop.value
                yield value
        return counted()

    eng.forward.prefill_layers = spy


def test_prefill_pauses_between_layers_while_rows_decode(tmp_path):
    """Under the ITL budget an engine step with decoding rows runs only some of a prefill step's layers (here one:
    a budget of barely one decode step fits no more) and the step resumes at the next engine step. The engine's
    warm-up measured a prefill and a decode step, so the budget holds from the first request on (before, a new
    engine's first steps ran whole). The answer is the same as with whole steps."""
    model, tok = tiny_model("llama")
    docs = tuple(DOCS) * 3
    with _engine(model, tok, tmp_path / "ref", enable_cache=False, prefill_chunk_tokens=128,
                 itl_budget_steps=None) as eng:
        ref = eng.generate("long cold prompt", docs, max_new_tokens=4)
    with _engine(model, tok, tmp_path / "c", prefill_chunk_tokens=128, max_active=2, itl_budget_steps=1.001) as eng:
        layers = len(eng.forward.layers)
        per_step: Counter[tuple[int, bool, bool]] = Counter()  # (engine step, rows decoding, decode measured)
        # -> prefill layers run

        def count(row, start):
            decoding = any(a.decode is not None for a in eng.executor._active.values())
            measured = eng.executor.budget.decode_step_s is not None
            per_step[eng.executor.steps, decoding, measured] += 1

        _before_each_layer(eng, count)
        eng.executor.eos_ids = frozenset()
        streaming = eng.submit(RagPrompt("stream please", (DOCS[3],)), SamplingParams(max_new_tokens=40))
        it = iter(streaming)
        next(it)
        got = eng.submit(RagPrompt("long cold prompt", docs), SamplingParams(max_new_tokens=4)).result(timeout=120)
        list(it)
        assert eng.stats().step_budget["layers_per_step"] == 1
    during = [count for (_, decoding, _), count in per_step.items() if decoding]
    before = [count for (_, _, measured), count in per_step.items() if not measured]
    capped = [count for (_, _, measured), count in per_step.items() if measured]
    assert len(during) >= 30 and set(during) == {1}, per_step
    assert set(capped) == {1} and not before, per_step
    assert layers > 1
    assert got.token_ids[:len(ref.token_ids)] == ref.token_ids
    assert torch.equal(got.first_token_logits, ref.first_token_logits)


def _hit_during_cold(tmp_path, *, hold_at, hold_s: float, aging: float, **engine_kw):
    """A cold prompt (every document, twice) and a cache hit (the first two documents) on one engine with a
    one-layer ITL budget: the executor is held inside the cold prompt's first prefill layer whose step start
    ``hold_at(start, prompt_tokens)`` accepts, for ``hold_s`` seconds of its service and until the hit has been
    submitted. Both answers must equal each request alone. Returns the layer log: (which request, its step's
    start) per layer run, in order."""
    model, tok = tiny_model("llama")
    cold_docs, hit_docs = tuple(DOCS) * 2, (DOCS[0], DOCS[1])
    with _engine(model, tok, tmp_path / "ref", enable_cache=False) as eng:
        ref_cold = eng.generate("cold question", cold_docs, max_new_tokens=4)
        ref_hit = eng.generate("hit question", hit_docs, max_new_tokens=4)
    total = len(ref_cold.prompt_token_ids)
    with _engine(model, tok, tmp_path / "c", itl_budget_steps=1.001, prefetch=False, **engine_kw) as eng:
        eng.generate("warm the hit's documents", hit_docs, max_new_tokens=3)  # measures a decode and a prefill step
        _age_at(eng, aging)
        layers: list[tuple[str, int]] = []
        held, hit_waiting = threading.Event(), threading.Event()

        def log_layer(row, start):
            req = next(a.request for a in eng.executor._active.values()
                       if a.prefill is not None and a.prefill.row is row)
            who = "cold question" if req.token_ids == ref_cold.prompt_token_ids else "hit question"
            layers.append((who, start))
            if who == "cold question" and hold_at(start, total) and not held.is_set():
                time.sleep(hold_s)  # inside the cold prompt's step: its service
                held.set()
                assert hit_waiting.wait(30)

        _before_each_layer(eng, log_layer)
        cold = eng.submit(RagPrompt("cold question", cold_docs), SamplingParams(max_new_tokens=4))
        assert held.wait(30)
        hit = eng.submit(RagPrompt("hit question", hit_docs), SamplingParams(max_new_tokens=4))
        hit_waiting.set()
        got_cold, got_hit = cold.result(timeout=120), hit.result(timeout=120)
    assert got_hit.metrics.reused_tokens > 0 and got_cold.metrics.reused_tokens < got_cold.metrics.prompt_tokens
    assert got_hit.token_ids == ref_hit.token_ids and got_cold.token_ids == ref_cold.token_ids
    assert torch.equal(got_hit.first_token_logits, ref_hit.first_token_logits)
    assert torch.equal(got_cold.first_token_logits, ref_cold.first_token_logits)
    return layers


@pytest.mark.parametrize("schedule", ["cache-aware", "fcfs"])
def test_a_hit_admitted_during_a_cold_step_with_nothing_decoding(schedule, tmp_path):
    """Nothing decodes, a cold prompt's prefill step is under way, and a cache hit arrives: the step pauses within
    the budget (here one layer), the hit is admitted and ranked against it, and under ``cache-aware`` the hit's
    prefill runs to its end while the cold step waits; under ``fcfs`` the older cold prompt finishes first. Both
    answers equal each request alone. (Aging is held at a token per second: the test pauses the executor, and at
    the tiny model's speed any wait would otherwise age the cold prompt past the hit.)"""
    layers = _hit_during_cold(tmp_path, hold_at=lambda start, total: True, hold_s=0.0, aging=1.0,
                              schedule=schedule)
    whose = [who for who, _ in layers]
    first_hit, last_hit = whose.index("hit question"), len(whose) - 1 - whose[::-1].index("hit question")
    first_step = [i for i, (who, start) in enumerate(layers) if who == "cold question" and start == layers[0][1]]
    if schedule == "cache-aware":
        assert first_step[0] < first_hit and last_hit < first_step[-1], \
            f"the hit ran inside the cold prompt's first step: {layers}"
    else:
        assert last_hit > first_hit > max(i for i, w in enumerate(whose) if w == "cold question"), \
            f"fcfs: the cold prompt finished first: {layers}"


def test_a_hit_overtakes_a_cold_prompt_late_in_its_prefill(tmp_path):
    """A hit arrives once a lone cold prompt has computed three quarters of its tokens and has been computed for
    over 0.6 s (held inside a layer): its service does not count as waiting against the newcomer, so under
    ``cache-aware`` the hit's prefill runs before the cold prompt's remaining steps. Counting it (the single key:
    0.6 s at 2,000 tokens/s outweighs the ~470 tokens left) would hold the hit behind the whole cold prompt. Both
    answers equal each request alone."""
    layers = _hit_during_cold(tmp_path, hold_at=lambda start, total: start > 3 * total // 4, hold_s=0.6,
                              aging=AGING_TOKENS_PER_S)
    cold_starts = sorted({start for who, start in layers if who == "cold question"})
    last_hit = max(i for i, (who, _) in enumerate(layers) if who == "hit question")
    last_cold_step = min(i for i, (who, start) in enumerate(layers) if who == "cold question"
                         and start == cold_starts[-1])
    assert len(cold_starts) >= 3 and last_hit < last_cold_step, f"the hit ran before the cold prompt's end: {layers}"


def test_bad_config_and_oversized_requests(tmp_path):
    model, tok = tiny_model("llama")
    with pytest.raises(ConfigError, match="max_active"):
        EngineConfig(max_active=0)
    with pytest.raises(ConfigError, match="schedule"):
        EngineConfig(schedule="lifo")
    with pytest.raises(ConfigError, match=r"weights.*int8"):
        EngineConfig(weights="fp4")
    with pytest.raises(ConfigError, match="compile must be True or False"):
        EngineConfig(compile="max-autotune")
    with _engine(model, tok, tmp_path / "c", max_model_len=64) as eng:
        with pytest.raises(PromptTooLongError, match="max_model_len"):
            eng.generate("q", [DOCS[2]])
        assert eng.executor.free_rows == eng.config.max_active


def test_sixty_four_concurrent_requests_are_exact_and_release_everything(tmp_path):
    model, tok = tiny_model("qwen2")
    ref = _alone(model, tok, tmp_path / "ref")
    dram = 256 * 1024
    with _engine(model, tok, tmp_path / "c", dram_capacity=dram, max_active=8) as eng:
        results: dict[int, list[int]] = {}

        def worker(i: int) -> None:
            q, d = QUESTIONS[i % len(QUESTIONS)]
            results[i] = eng.generate(q, [DOCS[j] for j in d]).token_ids

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        stats = eng.stats().cache
    assert len(results) == 64
    assert all(results[i] == ref[i % len(QUESTIONS)].token_ids for i in range(64))
    assert stats.bytes_high_water["dram"] <= dram and stats.pinned_chunks == 0


def test_streamed_text_is_the_result_text_even_mid_character(tmp_path):
    """The tiny tokenizer is byte-level: tokens often end inside a multi-byte character. Streamed deltas add up
    to the final text, and a half character is held back (not streamed as U+FFFD and then changed)."""
    model, tok = tiny_model("llama")
    with _engine(model, tok, tmp_path / "c", max_new_tokens=40) as eng:
        eng.executor.eos_ids = frozenset()
        for q in ("héllo wörld ✓", "日本語のテキスト", "emoji 🙂 please"):
            handle = eng.stream(q, ["Ünïcödé dócümént ✓✓ " * 4])
            deltas = [c.text for c in handle if not c.is_final]
            result = handle.result()
            assert "".join(deltas) == result.text
            full = tok.decode(result.token_ids, skip_special_tokens=True)
            assert full.startswith(result.text) and set(full[len(result.text):]) <= {"\ufffd"}


def test_the_schedule_ages_at_the_measured_prefill_speed(tmp_path):
    """Prefill steps feed the engine's measured speed, which the scheduler and the executor rank with and stats
    report: the warm-up's timed prefill tile before the first request (the default without a warm-up), then the
    requests' own steps."""
    model, tok = tiny_model("llama")
    with _engine(model, tok, tmp_path / "cold", warmup=False) as eng:
        assert eng.scheduler.speed.tokens_per_s == AGING_TOKENS_PER_S
        assert eng.executor.budget.cost() is None and eng.executor.budget.decode_step_s is None
        q, d = QUESTIONS[1]
        eng.generate(q, [DOCS[i] for i in d])
        assert eng.scheduler.speed.tokens_per_s != AGING_TOKENS_PER_S, "the request's prefill steps measured it"
        assert eng.executor.budget.cost() is not None and eng.executor.budget.decode_step_s > 0
    with _engine(model, tok, tmp_path / "c") as eng:
        assert eng.scheduler.speed is eng.executor.ctx.speed  # one measurement ranks admission and prefills
        at_start = eng.scheduler.speed.tokens_per_s
        assert at_start != AGING_TOKENS_PER_S and at_start > 0, "the warm-up measured it"
        assert eng.executor.budget.cost() is not None and eng.executor.budget.decode_step_s > 0
        q, d = QUESTIONS[0]
        eng.generate(q, [DOCS[i] for i in d])
        speed = eng.stats().prefill_tokens_per_s
        assert speed > 0 and speed != AGING_TOKENS_PER_S
        assert eng.scheduler.speed.tokens_per_s == speed


def _age_at(eng: PCREngine, tokens_per_s: float) -> None:
    """Hold the schedule's aging rate at ``tokens_per_s`` (the tiny model's measured speed, ~10^5 tokens/s, would
    make any wait outweigh any difference in work)."""
    speed = eng.executor.ctx.speed
    speed.tokens_per_s = tokens_per_s
    speed.record = lambda tokens, seconds: None


@pytest.mark.parametrize("schedule", ["cache-aware", "fcfs"])
def test_a_prefill_others_wait_on_runs_first(schedule, tmp_path):
    """Three requests admitted together: A and B share two documents, C is a lone, shorter cold prompt submitted
    first. One of A and B computes the documents; the other waits for its chunks rather than computing them twice,
    and reuses them. The one computing ranks by its group's work per request (cache-aware: about half its own plus
    the other's few tokens, less than C's) or by the oldest arrival it serves (fcfs: C is older, so C first): under
    cache-aware C no longer overtakes the prefill that another request waits on."""
    model, tok = tiny_model("llama")
    with _engine(model, tok, tmp_path / "c", max_active=3, schedule=schedule) as eng:
        _age_at(eng, AGING_TOKENS_PER_S)
        with eng.scheduler._cond:  # hold admission until all three are queued: one admission round
            handles = {name: eng.submit(RagPrompt(q, docs), SamplingParams(max_new_tokens=2))
                       for name, q, docs in [("C", "lone question", (DOCS[2],)),
                                             ("A", "first question on both", (DOCS[0], DOCS[1])),
                                             ("B", "second one on both", (DOCS[0], DOCS[1]))]}
        m = {name: h.result(timeout=120).metrics for name, h in handles.items()}
    first, second = sorted("AB", key=lambda k: m[k].ttft_s)
    assert m[first].reused_tokens < 40 and m[second].computed_tokens <= 40, "one computes the documents, one reuses"
    assert m[second].reused_tokens > m["C"].prompt_tokens > 0
    assert m["C"].computed_tokens < m[first].computed_tokens, "C alone is less work than the shared prefill"
    order = sorted("ABC", key=lambda k: m[k].ttft_s)
    assert order == ([first, second, "C"] if schedule == "cache-aware" else ["C", first, second]), (order, m)


@pytest.mark.parametrize("schedule", ["cache-aware", "fcfs"])
def test_waiting_requests_that_share_documents_are_admitted_as_a_group(schedule, tmp_path):
    """One row, three waiting requests: C, a lone cold prompt submitted first, is less work than A or B, which share
    two documents. Under cache-aware the waiting queue ranks A and B by their group's work per request (about half
    of one's prompt), less than C's, so the pair is served first and the second of them reuses the first's
    documents; C goes last. Under fcfs the queue stays in arrival order. (Before the queue ranked groups, C went
    first under cache-aware too.)"""
    model, tok = tiny_model("llama")
    with _engine(model, tok, tmp_path / "c", max_active=1, schedule=schedule) as eng:
        _age_at(eng, AGING_TOKENS_PER_S)
        with eng.scheduler._cond:  # hold admission until all three are queued
            handles = {name: eng.submit(RagPrompt(q, docs), SamplingParams(max_new_tokens=2))
                       for name, q, docs in [("C", "lone question", (DOCS[2],)),
                                             ("A", "first question on both", (DOCS[0], DOCS[1])),
                                             ("B", "second one on both", (DOCS[0], DOCS[1]))]}
        m = {name: h.result(timeout=120).metrics for name, h in handles.items()}
    assert m["C"].computed_tokens < min(m["A"].prompt_tokens, m["B"].prompt_tokens), "C alone is the least work"
    order = sorted("ABC", key=lambda k: m[k].ttft_s)
    assert order == (["A", "B", "C"] if schedule == "cache-aware" else ["C", "A", "B"]), (order, m)
    assert m["B"].computed_tokens <= 40 and m["B"].reused_tokens > m["C"].prompt_tokens, "B reuses A's documents"
