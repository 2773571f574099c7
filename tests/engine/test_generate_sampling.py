"""generate / generate_prompt / generate_messages take every sampling keyword stream* and agenerate* take (one path:
`SamplingParams.from_kwargs`), so the same call gives the same tokens whichever method makes it."""

from __future__ import annotations

import asyncio

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.errors import InvalidRequestError
from pcr_rag.request import ChatPrompt, FlatPrompt, RagPrompt, SamplingParams
from pcr_rag.testing import tiny_model

DOC = "The mitochondrion is the powerhouse of the cell and makes ATP for everything else."
QUESTION = "What makes ATP?"
MESSAGES = [{"role": "user", "content": f"{DOC}\n\n{QUESTION}"}]
OPTIONS = dict(max_tokens=10, temperature=0.9, top_k=5, seed=4, repetition_penalty=1.4, presence_penalty=0.5,
               frequency_penalty=0.5, logprobs=True, top_logprobs=2)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    model, tok = tiny_model("llama")
    config = EngineConfig(cache_dir=tmp_path_factory.mktemp("gen"), chunk_size=16, ssd_capacity=0, device="cpu",
                          dtype="float32", max_new_tokens=6, max_active=2, warmup=False)
    with PCREngine(model, tok, config=config) as engine:
        yield engine


CALLS = {
    "generate": (lambda e, **kw: e.generate(QUESTION, (DOC,), **kw), RagPrompt(QUESTION, (DOC,))),
    "generate_prompt": (lambda e, **kw: e.generate_prompt(MESSAGES[0]["content"], (DOC,), **kw),
                        FlatPrompt(MESSAGES[0]["content"], (DOC,))),
    "generate_messages": (lambda e, **kw: e.generate_messages(MESSAGES, (DOC,), **kw), ChatPrompt(MESSAGES, (DOC,))),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_generate_takes_every_sampling_option_as_submit_does(name, eng) -> None:
    call, prompt = CALLS[name]
    want = eng.submit(prompt, SamplingParams.from_kwargs(**OPTIONS)).result(timeout=120)
    got = call(eng, **OPTIONS)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert len(got.logprobs) == len(got.token_ids) and all(len(e.top_logprobs) == 2 for e in got.logprobs)
    plain = call(eng, max_new_tokens=10)
    assert plain.logprobs is None and plain.token_ids != got.token_ids  # the options did something
    agen = getattr(eng, "a" + name)
    args = (QUESTION, (DOC,)) if name == "generate" else ((MESSAGES[0]["content"], (DOC,)) if name ==
                                                          "generate_prompt" else (MESSAGES, (DOC,)))
    assert asyncio.run(agen(*args, **OPTIONS)).token_ids == want.token_ids


def test_generate_keeps_its_own_keywords_and_refuses_unknown_ones(eng) -> None:
    r = eng.generate(QUESTION, (DOC,), system="Be brief.", timeout=60, namespace="tenant-a", max_new_tokens=3)
    assert len(r.token_ids) <= 3
    with pytest.raises(TypeError, match="top_kk"):
        eng.generate(QUESTION, (DOC,), top_kk=3)
    with pytest.raises(TypeError, match="min_q"):
        eng.generate_messages(MESSAGES, min_q=0.1)
    with pytest.raises(InvalidRequestError, match="repetition_penalty"):
        eng.generate_prompt("Once upon a time", chat=False, repetition_penalty=0)
    with pytest.raises(InvalidRequestError, match="disagree"):
        eng.generate(QUESTION, max_tokens=3, max_new_tokens=4)
    thinking = eng.generate_messages(MESSAGES, chat_template_kwargs={"enable_thinking": False}, max_tokens=2)
    assert len(thinking.token_ids) <= 2
