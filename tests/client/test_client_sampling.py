"""`HTTPEngine` sends every sampling option and gets the local engine's answer: each `SamplingParams` field
(top_k, repetition_penalty, presence / frequency penalties, logprobs) through a live server gives the tokens and
logprobs of the same request on a local engine, result and stream, chat and completions; ``chat_template_kwargs``
travels; the integrations refuse a chat template text with ``base_url`` instead of ignoring it."""

from __future__ import annotations

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.client.http import HTTPEngine
from pcr_rag.request import ChatPrompt, FlatPrompt, SamplingParams, completion_logprobs
from pcr_rag.server import ServerSettings, ServerThread

OPTIONS = {
    "top_k": SamplingParams(max_new_tokens=10, temperature=1.3, top_k=2, seed=9),
    "repetition_penalty": SamplingParams(max_new_tokens=10, repetition_penalty=2.0),
    "presence_penalty": SamplingParams(max_new_tokens=10, presence_penalty=2.0),
    "frequency_penalty": SamplingParams(max_new_tokens=10, frequency_penalty=2.0),
    "logprobs": SamplingParams(max_new_tokens=10, temperature=0.7, seed=2, logprobs=True, top_logprobs=3),
    "all": SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95, top_k=30, seed=4, repetition_penalty=1.2,
                          presence_penalty=0.5, frequency_penalty=0.5, logprobs=True, top_logprobs=0),
}


@pytest.fixture(scope="module")
def remote(base_url):
    with HTTPEngine(base_url) as r:
        yield r


def _prompts(h):
    return {"chat": ChatPrompt(h.rag_messages(), h.DOCS),
            "completion": FlatPrompt(h.rag_messages()[1]["content"], h.DOCS, chat=False)}


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_through_the_remote_engine_equals_the_local_engine(name, kind, remote, reference, h) -> None:
    prompt, params = _prompts(h)[kind], OPTIONS[name]
    want = reference.submit(prompt, params).result(timeout=120)
    if name != "logprobs":  # the option changes the answer, so sending it is what makes the tokens equal
        assert want.token_ids != reference.submit(prompt, SamplingParams(max_new_tokens=10)).result().token_ids
    got = remote.submit(prompt, params).result(timeout=120)
    pieces = list(remote.submit(prompt, params))
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    assert [p.token_id for p in pieces[:-1]] == want.token_ids and pieces[-1].result.token_ids == want.token_ids
    if not params.logprobs:
        assert got.logprobs is None and all(p.logprobs is None for p in pieces)
        return
    assert [e.token_id for e in got.logprobs] == want.token_ids
    streamed = [p.logprobs for p in pieces[:-1]]
    if kind == "chat":  # chat's shape carries everything but the alternatives' ids
        assert [e.as_openai() for e in got.logprobs] == [e.as_openai() for e in want.logprobs]
        assert [e.as_openai() for e in streamed] == [e.as_openai() for e in want.logprobs]
    else:  # the legacy shape: texts and logprobs (alternatives keyed by their text)
        assert completion_logprobs(got.logprobs) == completion_logprobs(want.logprobs)
        assert completion_logprobs(streamed) == completion_logprobs(want.logprobs)
    assert all(len(e.top_logprobs) <= params.top_logprobs for e in got.logprobs)


def test_n_requests_with_penalties_through_the_remote_engine(remote, reference, h) -> None:
    """Several sampled requests in flight at once, each with its own seed: each equals its local twin."""
    prompt = _prompts(h)["chat"]
    params = [SamplingParams(max_new_tokens=8, temperature=0.9, seed=s, presence_penalty=1.0,
                             repetition_penalty=1.3, logprobs=True) for s in (1, 2)]
    handles = [remote.submit(prompt, p) for p in params]
    got = [hd.result(timeout=120) for hd in handles]
    for g, p in zip(got, params):
        want = reference.submit(prompt, p).result(timeout=120)
        assert g.token_ids == want.token_ids
        assert [e.logprob for e in g.logprobs] == [e.logprob for e in want.logprobs]


TEMPLATE = "{% for m in messages %}<{{ m.role }}:{{ mood | default('plain') }}>{{ m.content }}{% endfor %}"


def test_chat_template_kwargs_travel_to_the_server(tiny, tmp_path, h) -> None:
    model, tokenizer = tiny
    config = h.engine_config(tmp_path / "served", chat_template=TEMPLATE)
    local = PCREngine(model, tokenizer, config=EngineConfig(cache_dir=tmp_path / "local", chat_template=TEMPLATE,
                                                             dtype="float32", ssd_capacity=0, max_new_tokens=3))
    prompt = ChatPrompt([{"role": "user", "content": "Tell me."}], chat_template_kwargs={"mood": "cheerful"})
    server = ServerThread(PCREngine(model, tokenizer, config=config), ServerSettings(port=0), owns_engine=True)
    with server as url, HTTPEngine(url) as r, local:
        got = r.submit(prompt, SamplingParams(max_new_tokens=3)).result(timeout=60)
        want = local.submit(prompt, SamplingParams(max_new_tokens=3)).result(timeout=60)
        plain = local.submit(ChatPrompt(prompt.messages), SamplingParams(max_new_tokens=3)).result(timeout=60)
    assert got.prompt_token_ids == want.prompt_token_ids != plain.prompt_token_ids
    assert "<user:cheerful>" in tokenizer.decode(got.prompt_token_ids)


def test_integrations_refuse_a_chat_template_text_with_base_url(base_url) -> None:
    """The server renders with its own template: a template given to a remote model would be silently ignored."""
    langchain_pcr = pytest.importorskip("langchain_pcr")
    pcr_llms = pytest.importorskip("llama_index.llms.pcr")
    with pytest.raises(ValueError, match="chat_template"):
        langchain_pcr.ChatPCR(base_url=base_url, chat_template="{{ messages }}")
    with pytest.raises(ValueError, match="chat_template"):
        pcr_llms.PCRLLM(base_url=base_url, chat_template="{{ messages }}")
    chat = langchain_pcr.ChatPCR(base_url=base_url, chat_template_kwargs={"enable_thinking": False})
    assert chat.get_engine().base_url.startswith(base_url)
    assert langchain_pcr.PCRLLM(base_url=base_url, chat_template=False).get_engine() is not None  # a bool: fine
    assert pcr_llms.PCRLLM(base_url=base_url, chat_template=True) is not None
