"""Bad input, cancellation, streaming, asyncio and concurrency of the `PCREngine` API on tiny models."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pcr_rag import (
    ChatPrompt,
    ConfigError,
    EngineConfig,
    FlatPrompt,
    InvalidRequestError,
    PCREngine,
    PromptTooLongError,
    RagPrompt,
    RequestCancelledError,
    RequestHandle,
    SamplingParams,
)
from pcr_rag.cache import CacheStats
from pcr_rag.handle import RequestState
from pcr_rag.testing import tiny_model

DOCS = [
    "Alpha centauri is the closest star system to the Sun at about four light years. " * 3,
    "The mitochondrion is the powerhouse of the cell and makes ATP. " * 3,
    "TCP retransmits lost segments and orders bytes for the application. " * 3,
    "Merge sort splits a list, sorts both halves and merges them. " * 3,
]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=2)


def _engine(tiny, path, **kw) -> PCREngine:
    model, tok = tiny
    cfg = dict(cache_dir=path, chunk_size=16, dram_capacity="8MiB", ssd_capacity="64MiB", max_new_tokens=6,
               device="cpu")
    cfg.update(kw)
    return PCREngine(model=model, tokenizer=tok, config=EngineConfig(**cfg))


def test_bad_input_is_rejected_before_compute(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c") as eng:
        with pytest.raises(InvalidRequestError, match="empty request"):
            eng.generate("   ", [])
        with pytest.raises(InvalidRequestError, match="document #1"):
            eng.generate("q", ["ok", 42])
        with pytest.raises(InvalidRequestError, match="not a single string"):
            eng.generate("q", "a whole document as one string")
        with pytest.raises(InvalidRequestError, match="query must be a str"):
            eng.generate(None, ["doc"])
        with pytest.raises(PromptTooLongError, match="exceeds the model's context window") as err:
            eng.generate("q", ["word " * (eng.context_window + 10)])
        assert err.value.excess_tokens > 0
        with pytest.raises(InvalidRequestError, match="max_new_tokens"):
            eng.generate("q", [], max_new_tokens=0)
        assert eng.stats().requests["requests_finished"] == 0


def test_invalid_config_errors():
    with pytest.raises(ConfigError, match="chunk_size"):
        EngineConfig(chunk_size=0)
    with pytest.raises(ConfigError, match="dram_capacity"):
        EngineConfig(dram_capacity="lots")
    with pytest.raises(ConfigError, match="eviction"):
        EngineConfig(eviction="random")


@pytest.mark.parametrize("field,value", [
    ("announce_ttl_s", float("nan")), ("announce_ttl_s", float("inf")), ("remote_timeout_s", float("nan")),
    ("remote_ttl_s", float("-inf")), ("enable_cache", "no"), ("layerwise", 1), ("warmup", None),
    ("chunk_size", True), ("max_active", True), ("max_model_len", False), ("namespace", 123),
    ("remote_namespace", None), ("dram_capacity", True), ("itl_budget_steps", float("nan")),
    ("remote_encrypt", "yes"), ("remote_secret", b"bytes-are-not-a-secret-string"),
])
def test_config_rejects_ambiguous_values(field, value):
    """Truthy strings, bools standing for ints and NaN/inf durations are refused before anything starts: each of
    these was accepted and silently meant something else."""
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})


def test_the_remote_fields_are_remote_configs_own():
    """EngineConfig's remote_* fields are RemoteConfig's declarations (type, default, repr), declared once: a
    RemoteConfig field is at once an EngineConfig field, and remote_config passes every one of them on."""
    import dataclasses
    import typing

    from pcr_rag.cache.config import RemoteConfig
    from pcr_rag.config import REMOTE_FIELDS

    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    engine_hints, remote_hints = typing.get_type_hints(EngineConfig), typing.get_type_hints(RemoteConfig)
    for f in dataclasses.fields(RemoteConfig):
        if f.name == "kv_layout":  # the engine derives it from the loaded model
            continue
        name = "remote_capacity" if f.name == "capacity_bytes" else f"remote_{f.name}"
        assert REMOTE_FIELDS[name] == f.name and name in engine, name
        if f.name != "url":  # optional on the engine: no url, no remote tier
            assert engine[name].default == f.default and engine_hints[name] == remote_hints[f.name], name
        assert engine[name].repr == f.repr and engine[name].kw_only, name
    config = EngineConfig(remote_url="memory://x", remote_max_connections=3, remote_write_queue=5,
                          remote_secret="s" * 16, remote_capacity="1GiB")
    remote = config.remote_config
    assert (remote.url, remote.max_connections, remote.write_queue, remote.capacity_bytes) == (
        "memory://x", 3, 5, 2**30)
    assert "s" * 16 not in repr(config)
    with pytest.raises(ConfigError, match="remote_max_connections"):
        EngineConfig(remote_max_connections=0)
    positional = EngineConfig("/tmp/pcr-kv")  # keyword-only: the first positional field is still cache_dir
    assert (str(positional.cache_dir), positional.remote_url) == ("/tmp/pcr-kv", None)


def test_unknown_model_alias_lists_known():
    from pcr_rag.model.model import UnknownModelError

    with pytest.raises(UnknownModelError, match="smollm2-135m-instruct"):
        PCREngine(model="no-such-model", config=EngineConfig(enable_cache=False))


def test_stream_and_stop_strings(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c", max_new_tokens=12) as eng:
        full = eng.generate("tell me", DOCS[:2])
        stream = eng.stream("tell me", DOCS[:2])
        chunks = list(stream)
        assert chunks[-1].is_final and chunks[-1].result.token_ids == full.token_ids
        assert "".join(c.text for c in chunks) == full.text
        if len(full.text) > 3:
            stop = full.text[2:4]
            cut = eng.generate("tell me", DOCS[:2], stop=[stop])
            assert cut.finish_reason == "stop" and stop not in cut.text
            assert full.text.startswith(cut.text)


def test_cancel_releases_pins(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c", max_new_tokens=200) as eng:
        eng.generate("warm", DOCS[:2], max_new_tokens=1)

        async def main():
            task = asyncio.create_task(eng.agenerate("long answer", DOCS[:2], max_new_tokens=200))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        eng.generate("after", DOCS[:1], max_new_tokens=1)  # the executor is still healthy
        assert eng.cache.stats().as_dict()["pinned_chunks"] == 0
        stream = eng.stream("streaming", DOCS[:2], max_new_tokens=200)
        next(iter(stream))
        stream.close()
        with pytest.raises(RequestCancelledError):
            stream.result(timeout=30)
        assert eng.cache.stats().as_dict()["pinned_chunks"] == 0


def test_64_concurrent_requests_threads_and_asyncio(tiny, tmp_path):
    model, tok = tiny
    reqs = [(f"question {i % 5}?", [DOCS[i % 4], DOCS[(i + 1) % 4]]) for i in range(32)]
    with _engine(tiny, tmp_path / "ref", enable_cache=False) as ref:
        expected = {i: ref.generate(q, d).token_ids for i, (q, d) in enumerate(reqs)}
    dram = 96 * 1024  # small enough that chunks are evicted and demoted while requests run
    with _engine(tiny, tmp_path / "c", dram_capacity=dram) as eng:
        results: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                results[i] = eng.generate(*reqs[i], timeout=120).token_ids
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()

        async def amain():
            outs = await asyncio.gather(*(eng.agenerate(*reqs[i]) for i in range(32)))
            return [o.token_ids for o in outs]

        async_out = asyncio.run(amain())
        for t in threads:
            t.join(timeout=180)
        stats = eng.cache.stats().as_dict()
    assert not errors
    assert all(results[i] == expected[i] for i in range(32))
    assert all(async_out[i] == expected[i] for i in range(32))
    assert stats["bytes_high_water"]["dram"] <= dram
    assert stats["hit_tokens"]["dram"] + stats["hit_tokens"]["ssd"] > 0


@pytest.mark.parametrize("max_active", [1, 4])
def test_newcomer_waits_for_prefills_not_whole_answers(tiny, tmp_path, max_active):
    with _engine(tiny, tmp_path / "c", max_active=max_active) as eng:
        eng.executor.eos_ids = frozenset()  # the random tiny model must not stop the long answer early
        long = eng.stream("a long answer please", DOCS[:1], max_new_tokens=150)
        next(iter(long))  # the long request is decoding now
        short = eng.generate("short", DOCS[1:2], max_new_tokens=2)
        long_done_first = long.done()
        rest = list(long)
    assert len(short.token_ids) == 2 and rest[-1].result.metrics.generated_tokens == 150
    # interleaved decode: the short request finished while the long one was still decoding
    assert long_done_first == (max_active == 1)


# ------------------------------------------------------------------------------------------------ submit / handle
def _wait_until(cond, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_submit_result_iteration_and_await_agree_with_the_wrappers(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c", max_new_tokens=8) as eng:
        params = SamplingParams(max_new_tokens=8)
        ref = eng.generate("tell me", DOCS[:2])
        handle = eng.submit(RagPrompt("tell me", DOCS[:2]), params)
        assert isinstance(handle, RequestHandle) and handle.result(timeout=60).token_ids == ref.token_ids
        assert handle.done() and handle.state is RequestState.FINISHED
        chunks = list(eng.submit(RagPrompt("tell me", DOCS[:2]), params))
        assert [c.token_id for c in chunks[:-1]] == ref.token_ids[: len(chunks) - 1]
        assert chunks[-1].is_final and chunks[-1].index == len(chunks) - 1
        assert chunks[-1].result.token_ids == ref.token_ids and "".join(c.text for c in chunks) == ref.text

        flat = "Context: " + DOCS[0] + "\nQuestion: what?"
        messages = [{"role": "user", "content": flat}]
        assert eng.submit(FlatPrompt(flat, DOCS[:1]), params).result().token_ids == \
            eng.generate_prompt(flat, DOCS[:1]).token_ids
        assert eng.submit(ChatPrompt(messages, DOCS[:1]), params).result().token_ids == \
            eng.generate_messages(messages, DOCS[:1]).token_ids

        async def main():
            awaited = await eng.submit(RagPrompt("tell me", DOCS[:2]), params)
            via_method = await eng.submit(RagPrompt("tell me", DOCS[:2]), params).aresult()
            streamed = [c async for c in eng.astream("tell me", DOCS[:2], max_new_tokens=8)]
            return awaited, via_method, streamed

        awaited, via_method, streamed = asyncio.run(main())
        assert awaited.token_ids == via_method.token_ids == ref.token_ids
        assert streamed[-1].result.token_ids == ref.token_ids
        assert [c.token_id for c in streamed[:-1]] == [c.token_id for c in chunks[:-1]]


def test_cancel_a_running_and_a_waiting_request_frees_everything(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c", max_active=1) as eng:
        eng.executor.eos_ids = frozenset()  # the random tiny model must not stop the long answer early
        running = eng.submit(RagPrompt("a long answer", DOCS[:2]), SamplingParams(max_new_tokens=2000))
        next(iter(running))  # decoding now
        waiting = eng.submit(RagPrompt("queued behind it", DOCS[2:]), SamplingParams(max_new_tokens=4))
        assert waiting.cancel() and waiting.state is RequestState.CANCELLED
        with pytest.raises(RequestCancelledError, match="while waiting"):
            waiting.result(timeout=5)
        assert running.cancel()
        with pytest.raises(RequestCancelledError):
            running.result(timeout=30)
        with pytest.raises(RequestCancelledError):
            list(running)  # the rest of the stream ends with the request's error
        assert not running.cancel()  # already finished
        assert eng.stats().cache.pinned_chunks == 0
        assert eng.stats().requests["requests_cancelled"] == 2
        assert len(eng.generate("after", DOCS[:1], max_new_tokens=2).token_ids) == 2  # the executor is healthy


def test_dropping_an_unfinished_handle_cancels_its_request(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c") as eng:
        eng.executor.eos_ids = frozenset()
        handle = eng.submit(RagPrompt("a long answer", DOCS[:1]), SamplingParams(max_new_tokens=2000))
        next(handle)
        request = handle._source.request
        del handle
        assert request.future.exception(timeout=30).__class__ is RequestCancelledError
        assert eng.stats().cache.pinned_chunks == 0


def test_stream_timeouts_cancel_the_request(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c") as eng:
        eng.executor.eos_ids = frozenset()
        stream = eng.stream("a long answer", DOCS[:2], max_new_tokens=2000, timeout=0.3)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="timeout of 0.3 s"):
            for _ in stream:
                pass
        assert time.monotonic() - started < 10
        assert _wait_until(stream.done) and stream.state is RequestState.CANCELLED

        async def consume():
            async for _ in eng.astream_prompt("Context: " + DOCS[0], DOCS[:1], max_new_tokens=2000, timeout=0.3):
                pass

        with pytest.raises(TimeoutError):
            asyncio.run(consume())
        with pytest.raises(TimeoutError):
            asyncio.run(eng.agenerate_messages([{"role": "user", "content": "hi"}], max_new_tokens=2000,
                                               timeout=0.3))
        with pytest.raises(TimeoutError):
            eng.generate("hi", max_new_tokens=2000, timeout=0.3)
        assert _wait_until(lambda: eng.stats().requests["requests_cancelled"] == 4)
        assert eng.stats().cache.pinned_chunks == 0
        # a deadline that is not reached changes nothing
        assert eng.stream("hi", max_new_tokens=3, timeout=60).result().metrics.generated_tokens == 3


def test_sampling_params_validation():
    assert SamplingParams.from_kwargs(max_tokens=5, stop="###").max_new_tokens == 5
    assert SamplingParams.from_kwargs(stop="###").stop == ("###",)
    base = SamplingParams(7, 0.5, 0.9, ["a"], 3)
    assert base.stop == ("a",) and SamplingParams.from_kwargs(base, temperature=None, seed=4) == \
        SamplingParams(7, 0.5, 0.9, ("a",), 4)
    assert SamplingParams.from_kwargs(base) is base
    with pytest.raises(TypeError, match=r"\['bogus', 'min_q'\].*max_new_tokens"):
        SamplingParams.from_kwargs(bogus=1, min_q=0.1, temperature=0.2)
    assert SamplingParams.from_kwargs(min_p=0.1, min_tokens=2, ignore_eos=True).min_p == 0.1
    with pytest.raises(InvalidRequestError, match="disagree"):
        SamplingParams.from_kwargs(max_tokens=3, max_new_tokens=4)
    for bad, match in [(dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=True), "max_new_tokens"),
                       (dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
                       (dict(top_p=0), "top_p"), (dict(top_p="1"), "top_p"), (dict(stop=[1]), "stop"),
                       (dict(seed=1.5), "seed"), (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
                       (dict(min_tokens=-1), "min_tokens"), (dict(ignore_eos=1), "ignore_eos")]:
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams.from_kwargs(**bad)
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams(**bad)


def test_prompt_kinds_and_submit_reject_bad_input(tiny, tmp_path):
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        FlatPrompt("  ")
    with pytest.raises(InvalidRequestError, match="message #0"):
        ChatPrompt([{"content": "no role"}])
    with pytest.raises(InvalidRequestError, match="system must be a str"):
        RagPrompt("q", system=3)
    assert RagPrompt("q", ["d1", "d2"]).documents == ("d1", "d2")
    with _engine(tiny, tmp_path / "c") as eng:
        with pytest.raises(InvalidRequestError, match="RagPrompt, FlatPrompt or ChatPrompt"):
            eng.submit("a bare string")
        with pytest.raises(InvalidRequestError, match="timeout"):
            eng.submit(RagPrompt("q"), timeout=0)
        with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['bogus'\]"):
            eng.stream("q", bogus=1)
        with pytest.raises(TypeError):
            asyncio.run(eng.agenerate("q", min_q=0.1))
        assert eng.stats().requests["requests_finished"] == 0 and eng.scheduler.depth == 0


def test_engine_stats_carry_typed_cache_stats(tiny, tmp_path):
    with _engine(tiny, tmp_path / "c") as eng:
        eng.generate("q", DOCS[:1], max_new_tokens=2)
        stats = eng.stats()
        assert isinstance(stats.cache, CacheStats) and stats.cache.inserts > 0
        assert stats.as_dict()["cache"]["inserts"] == stats.cache.inserts
        assert "pcr_rag_cache_pinned_chunks 0" in stats.prometheus()
    with _engine(tiny, tmp_path / "off", enable_cache=False) as eng:
        eng.generate("q", DOCS[:1], max_new_tokens=2)
        assert eng.stats().cache == CacheStats()
