"""No request can wedge the engine: bad input is refused before compute, and any failure while a request moves
between phases (admission, lease, prefill step, prefill -> decode, decode, finish) fails that request alone,
frees its row within the engine step that failed, and leaves the loop asleep rather than spinning."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable

import pytest

from pcr_rag import EngineClosedError, EngineConfig, InvalidRequestError, PCREngine
from pcr_rag.errors import RequestFailedError
from pcr_rag.request import RagPrompt, SamplingParams
from pcr_rag.sched import batch, runner, scheduler
from pcr_rag.testing import tiny_model

DOCS = [
    "Alpha centauri is the closest star system to the Sun at about four light years away. " * 3,
    "The mitochondrion is the powerhouse of the cell and makes ATP for everything else. " * 3,
    "TCP retransmits lost segments and delivers bytes in order to the application layer. " * 3,
]
GOOD = ("Which star is closest?", (DOCS[0], DOCS[1]))
VICTIM = ("Does TCP keep bytes in order?", (DOCS[2], DOCS[1]))
PHASES = ("admission", "lease", "prefill step", "prefill->decode", "decode", "finish")
WAIT_S = 60.0  # generous on a loaded 2-core host; a wedged request never finishes at all


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2)


def _engine(tiny, path, **kw) -> PCREngine:
    model, tok = tiny
    cfg = dict(cache_dir=path, chunk_size=16, dram_capacity="8MiB", ssd_capacity="64MiB", max_new_tokens=6,
               device="cpu", max_active=2, prefill_chunk_tokens=16)
    cfg.update(kw)
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg))


def _unchecked_seed(seed: int, **kw) -> SamplingParams:
    """Sampling params whose seed skipped validation: a request whose token sampler cannot be built (torch's
    ``manual_seed`` raises) only once its prefill is done - the original wedge, at the prefill -> decode step."""
    params = SamplingParams(max_new_tokens=6, temperature=0.8, **kw)  # complete: submit does not rebuild it
    object.__setattr__(params, "seed", seed)
    return params


def _cpu_share(seconds: float, settle: float = 0.2) -> float:
    """This process's CPU time over ``seconds`` of wall time, as a share of one core, after ``settle`` seconds
    (the failed request's logging and callbacks are done by then; a spinning loop is a whole core)."""
    time.sleep(settle)
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


def _wait_idle(eng: PCREngine, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while eng.executor.active and time.monotonic() < deadline:
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------------ the seed
def test_seeds_outside_signed_64_bits_are_refused_and_every_seed_inside_samples(tiny, tmp_path):
    for bad in (2**63, 2**64, -(2**63) - 1, 10**30, True, False, 1.0, "7"):
        with pytest.raises(InvalidRequestError, match="seed"):
            SamplingParams(temperature=0.8, seed=bad)
        with pytest.raises(InvalidRequestError, match="seed"):
            SamplingParams.from_kwargs(seed=bad)
    with _engine(tiny, tmp_path / "c") as eng:
        for seed in (-(2**63), -1, 0, 1, 2**63 - 1):
            first = eng.generate(GOOD[0], GOOD[1], temperature=0.9, seed=seed, timeout=WAIT_S)
            again = eng.generate(GOOD[0], GOOD[1], temperature=0.9, seed=seed, timeout=WAIT_S)
            assert first.token_ids == again.token_ids and len(first.token_ids) > 0
        assert eng.stats().requests["requests_finished"] == 10


def test_the_original_probe_eight_huge_seeds_are_refused_before_compute(tiny, tmp_path):
    """Eight requests with seed=2**64 once held every row; now each is refused up front, nothing is queued, and
    another tenant's request runs at once."""
    with _engine(tiny, tmp_path / "c", max_active=8) as eng:
        ref = eng.generate(*GOOD, timeout=WAIT_S).token_ids
        for _ in range(8):
            with pytest.raises(InvalidRequestError, match=r"seed must be an int in \[-2\*\*63, 2\*\*63\)"):
                eng.submit(RagPrompt(*VICTIM), SamplingParams.from_kwargs(temperature=0.7, seed=2**64))
        with pytest.raises(InvalidRequestError, match="seed"):
            eng.generate(*VICTIM, temperature=0.7, seed=2**64)
        assert eng.scheduler.depth == 0 and eng.executor.free_rows == 8
        assert eng.generate(*GOOD, timeout=10).token_ids == ref


# ------------------------------------------------------------------------------------------- phase faults
def _inject(monkeypatch, eng: PCREngine, phase: str, victim: Callable[[list[int]], bool]) -> None:
    """Make the request whose prompt ``victim(token_ids)`` recognises raise at ``phase``; every other request
    runs through the real code."""

    def fault() -> RuntimeError:
        return RuntimeError(f"injected fault at {phase}")

    if phase == "admission":
        make_task = batch.PrefillTask

        def task(req, row, ctx):
            if victim(req.token_ids):
                raise fault()
            return make_task(req, row, ctx)
        monkeypatch.setattr(batch, "PrefillTask", task)
    elif phase == "lease":
        acquire = eng.cache.acquire
        victim_keys = [c.key for c in eng.plan_for(*VICTIM)]

        def leased(plan, *args, **kwargs):
            if [c.key for c in plan] == victim_keys:
                raise fault()
            return acquire(plan, *args, **kwargs)
        monkeypatch.setattr(eng.cache, "acquire", leased)
    elif phase == "prefill step":
        prefill_layers = eng.forward.prefill_layers

        def layers(row, token_ids, start, **kwargs):
            inner = prefill_layers(row, token_ids, start, **kwargs)
            if not victim(eng.executor._active[row.row].request.token_ids):
                return inner

            def failing_after_one_layer():
                yield next(inner)  # one layer computed (a step in flight), then the fault
                raise fault()
            return failing_after_one_layer()
        monkeypatch.setattr(eng.forward, "prefill_layers", layers)
    elif phase == "prefill->decode":
        decode_row = batch.DecodeRow

        def row(request, *args, **kwargs):
            if victim(request.token_ids):
                raise fault()
            return decode_row(request, *args, **kwargs)
        monkeypatch.setattr(batch, "DecodeRow", row)
    elif phase == "decode":
        accept = runner.DecodeRow.accept

        def accepting(self, logits):
            if victim(self.request.token_ids) and len(self.tokens) >= 2:
                raise fault()
            return accept(self, logits)
        monkeypatch.setattr(runner.DecodeRow, "accept", accepting)
    elif phase == "finish":
        result = batch.GenerationResult

        def finished(**kwargs):
            if victim(kwargs["prompt_token_ids"]):
                raise fault()
            return result(**kwargs)
        monkeypatch.setattr(batch, "GenerationResult", finished)
    else:
        raise AssertionError(phase)


# a lease fault no longer fails the request: it recomputes (issue 47 item 7, tests/engine/test_cache_failure_recompute.py)
@pytest.mark.parametrize("phase", [p for p in PHASES if p != "lease"])
def test_a_fault_at_any_phase_fails_that_request_alone_and_frees_its_row(phase, tiny, tmp_path, monkeypatch):
    with _engine(tiny, tmp_path / "c", max_active=2, warmup=False) as eng:
        eng.executor.eos_ids = frozenset()  # every request decodes its max_new_tokens: each phase is reached
        ref_good = eng.generate(*GOOD, timeout=WAIT_S).token_ids
        ref_victim = eng.generate(*VICTIM, timeout=WAIT_S).token_ids
        victim_ids = RagPrompt(*VICTIM).segment(eng.builder).token_ids
        _inject(monkeypatch, eng, phase, lambda token_ids: list(token_ids) == victim_ids)
        good = eng.stream(*GOOD, timeout=WAIT_S)
        bad = eng.stream(*VICTIM, timeout=WAIT_S)
        held_at_failure: list[bool] = []  # read on the executor thread, as the error is delivered
        bad._source.request.future.add_done_callback(
            lambda _f: held_at_failure.append(any(a.request is bad._source.request for a in eng.executor._active.values())))
        with pytest.raises(RequestFailedError, match=f"injected fault at {phase}") as err:
            for _ in bad:  # the stream ends with the error
                pass
        assert isinstance(err.value.__cause__, RuntimeError)
        assert held_at_failure == [False], "the failed request's row is free when its error is delivered"
        assert good.result(timeout=WAIT_S).token_ids == ref_good
        _wait_idle(eng)
        assert eng.executor.free_rows == 2 and eng.executor.active == 0
        assert eng.stats().cache.pinned_chunks == 0
        assert eng.stats().requests["requests_failed"] == 1
        # still usable: the good prompt again, and the victim's own prompt once the fault is gone
        assert eng.generate(*GOOD, timeout=WAIT_S).token_ids == ref_good
        monkeypatch.undo()
        assert eng.generate(*VICTIM, timeout=WAIT_S).token_ids == ref_victim


def test_when_every_row_is_wedged_a_normal_request_still_completes_promptly(tiny, tmp_path):
    """Every row taken by requests whose sampler cannot be built (seeds past validation): each fails on its own,
    and a normal request queued behind them completes within seconds with its usual tokens."""
    with _engine(tiny, tmp_path / "c", max_active=2) as eng:
        ref = eng.generate(*GOOD, timeout=WAIT_S).token_ids
        wedges = [eng.submit(RagPrompt(*VICTIM), _unchecked_seed(2**64)) for _ in range(4)]
        started = time.perf_counter()
        normal = eng.submit(RagPrompt(*GOOD))
        assert normal.result(timeout=10).token_ids == ref
        assert time.perf_counter() - started < 10
        for handle in wedges:
            with pytest.raises(RequestFailedError, match="seed") as err:
                handle.result(timeout=1)
            assert "prefill->decode" in str(err.value)
        _wait_idle(eng)
        assert eng.executor.free_rows == 2 and eng.stats().cache.pinned_chunks == 0


def test_the_engine_sleeps_when_idle_and_after_a_wedge(tiny, tmp_path):
    """Idle, the process stays under 5% of a core; a request that cannot progress fails instead of leaving the
    executor loop spinning over its row."""
    with _engine(tiny, tmp_path / "c", max_active=2) as eng:
        eng.generate(*GOOD, timeout=WAIT_S)
        assert _cpu_share(1.0) < 0.05, "an idle engine must sleep"
        wedged = eng.submit(RagPrompt(*VICTIM), _unchecked_seed(-(2**63) - 1))
        concurrent.futures.wait([wedged._source.request.future], timeout=5)  # before the fix: never done
        share = _cpu_share(1.0)
        assert share < 0.05, f"the executor loop spun at {share:.0%} of a core"
        with pytest.raises(RequestFailedError, match="seed"):
            wedged.result(timeout=0)
        assert eng.executor.free_rows == 2


def test_a_row_that_cannot_progress_fails_instead_of_spinning(tiny, tmp_path, monkeypatch):
    """A schedule that never lets an admitted prefill run (a bug that must not wedge): the request fails within a
    step with a clear error, the loop sleeps, and the next request runs once the schedule is sane again."""
    with _engine(tiny, tmp_path / "c", max_active=2) as eng:
        ref = eng.generate(*GOOD, timeout=WAIT_S).token_ids
        monkeypatch.setattr(batch, "prefill_candidates", lambda schedule, prefills: [None] * len(prefills))
        stuck = eng.submit(RagPrompt(*VICTIM))
        with pytest.raises(RequestFailedError, match="could not make progress"):
            stuck.result(timeout=10)
        assert _cpu_share(1.0) < 0.05
        monkeypatch.undo()
        assert eng.generate(*GOOD, timeout=WAIT_S).token_ids == ref
        assert eng.executor.free_rows == 2


def test_a_failing_queue_ranking_does_not_kill_the_executor(tiny, tmp_path, monkeypatch):
    """Ranking the waiting queue reads the cache; if that raises, requests are admitted in arrival order instead
    of the executor thread dying with every caller waiting forever."""
    with _engine(tiny, tmp_path / "c", max_active=1, schedule="cache-aware") as eng:
        ref = eng.generate(*GOOD, timeout=WAIT_S).token_ids

        def broken(*args, **kwargs):
            raise OSError("cache index unreadable")
        monkeypatch.setattr(scheduler, "queue_order", broken)
        handles = [eng.submit(RagPrompt(*GOOD)) for _ in range(3)]
        assert [h.result(timeout=WAIT_S).token_ids for h in handles] == [ref] * 3
        assert eng.scheduler._thread.is_alive()


def test_a_step_that_fails_outside_any_request_fails_the_admitted_ones_and_serving_goes_on(tiny, tmp_path,
                                                                                          monkeypatch):
    """The prefill schedule itself raising (no request to blame): the admitted requests fail with the error, their
    rows come back, and requests after the fault run normally."""
    with _engine(tiny, tmp_path / "c", max_active=2) as eng:
        ref = eng.generate(*GOOD, timeout=WAIT_S).token_ids

        def broken(*args, **kwargs):
            raise ZeroDivisionError("schedule bug")
        monkeypatch.setattr(batch, "rank", broken)
        caught = eng.submit(RagPrompt(*VICTIM))
        with pytest.raises(RequestFailedError, match="ZeroDivisionError: schedule bug"):
            caught.result(timeout=10)
        assert _cpu_share(1.0) < 0.05
        monkeypatch.undo()
        assert eng.generate(*GOOD, timeout=WAIT_S).token_ids == ref
        assert eng.executor.free_rows == 2 and eng.stats().cache.pinned_chunks == 0


def test_if_the_executor_loop_dies_every_caller_gets_an_error(tiny, tmp_path, monkeypatch):
    """The last resort: whatever kills the executor thread, waiting and admitted requests fail with
    `EngineClosedError` (not a wait forever), and new submissions are refused."""
    with _engine(tiny, tmp_path / "c", max_active=1) as eng:
        eng.executor.eos_ids = frozenset()
        running = eng.stream(*GOOD, max_new_tokens=200)
        next(iter(running))  # admitted and decoding
        waiting = eng.submit(RagPrompt(*VICTIM))

        def dies():
            raise SystemExit("executor thread killed")
        monkeypatch.setattr(eng.executor, "step", dies)
        for handle in (running, waiting):
            with pytest.raises(EngineClosedError, match="executor stopped"):
                handle.result(timeout=10)
        with pytest.raises(EngineClosedError):
            eng.generate(*GOOD)
        assert eng.executor.free_rows == 1
