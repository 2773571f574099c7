"""Bad input, cancellation, streaming, asyncio and concurrency of the `PCREngine` API on tiny models."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pcr_rag import (
    ConfigError,
    EngineConfig,
    InvalidRequestError,
    PCREngine,
    PromptTooLongError,
    RequestCancelledError,
)
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


def test_unknown_model_alias_lists_known():
    from pcr_rag.runtime.model import UnknownModelError

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
