"""Sampling options over HTTP through the official openai SDK: top_k, repetition_penalty (vLLM's, in extra_body),
presence / frequency penalties and logprobs give the tokens and logprobs of the local engine with the same
`SamplingParams`; streamed logprobs reassemble to the non-streamed ones, every token's exactly once; bad values are
400s naming the field; ``chat_template_kwargs`` reaches the template."""

from __future__ import annotations

import openai
import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.request import ChatPrompt, FlatPrompt, SamplingParams, chat_logprobs, completion_logprobs
from pcr_rag.server import ServerSettings, ServerThread

MAX_TOKENS = 12
# (SamplingParams, the SDK arguments that ask for the same); each on both endpoints
OPTIONS = {
    "top_k": (dict(temperature=1.2, top_k=3, seed=7), dict(temperature=1.2, seed=7, extra={"top_k": 3})),
    "repetition_penalty": (dict(repetition_penalty=1.8), dict(extra={"repetition_penalty": 1.8})),
    "penalties": (dict(presence_penalty=1.5, frequency_penalty=-0.5),
                  dict(presence_penalty=1.5, frequency_penalty=-0.5)),
    "sampled_all": (dict(temperature=0.9, top_p=0.9, top_k=20, repetition_penalty=1.3, frequency_penalty=1.0,
                         seed=11, logprobs=True, top_logprobs=4),
                    dict(temperature=0.9, top_p=0.9, seed=11, frequency_penalty=1.0, logprobs=4,
                         extra={"top_k": 20, "repetition_penalty": 1.3})),
}


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _chat_args(sdk: dict) -> dict:
    """Completions-style arguments (``logprobs: n``) as chat's (``logprobs: true, top_logprobs: n``)."""
    args = {k: v for k, v in sdk.items() if k != "extra"}
    if "logprobs" in args:
        args["top_logprobs"] = args.pop("logprobs")
        args["logprobs"] = True
    return args


def _chat(client, engine, h, sdk: dict, **more):
    return client.chat.completions.create(
        model=engine.loaded.name, messages=h.rag_messages(), max_tokens=MAX_TOKENS, **_chat_args(sdk), **more,
        extra_body={"documents": list(h.DOCS), "return_token_ids": True, **sdk.get("extra", {})})


def _completion(client, engine, h, sdk: dict, **more):
    args = {k: v for k, v in sdk.items() if k != "extra"}
    return client.completions.create(
        model=engine.loaded.name, prompt=h.rag_messages()[1]["content"], max_tokens=MAX_TOKENS, **args, **more,
        extra_body={"documents": list(h.DOCS), "return_token_ids": True, **sdk.get("extra", {})})


def _local(reference, h, kind: str, params: dict):
    prompt = (ChatPrompt(h.rag_messages(), h.DOCS) if kind == "chat"
              else FlatPrompt(h.rag_messages()[1]["content"], h.DOCS, chat=False))
    return reference.submit(prompt, SamplingParams(max_new_tokens=MAX_TOKENS, **params)).result(timeout=120)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_answers_as_the_local_engine_on_both_endpoints(name, client, engine, reference, h) -> None:
    params, sdk = OPTIONS[name]
    plain_chat = _local(reference, h, "chat", {})
    want = _local(reference, h, "chat", params)
    assert want.token_ids != plain_chat.token_ids, "the option must change the answer, or the test proves nothing"
    got = _chat(client, engine, h, sdk).choices[0]
    assert got.model_extra["token_ids"] == want.token_ids and got.message.content == want.text
    if params.get("logprobs"):
        assert got.logprobs.model_dump() == chat_logprobs(want.logprobs)
        assert len(got.logprobs.content) == len(want.token_ids)
        assert all(len(e.top_logprobs) == params["top_logprobs"] for e in got.logprobs.content)
    else:
        assert got.logprobs is None

    want = _local(reference, h, "completion", params)
    got = _completion(client, engine, h, sdk).choices[0]
    assert got.model_extra["token_ids"] == want.token_ids and got.text == want.text
    if params.get("logprobs"):
        assert got.logprobs.model_dump() == completion_logprobs(want.logprobs)
    else:
        assert got.logprobs is None


def test_completions_logprobs_zero_is_the_sampled_tokens_logprob_alone(client, engine, reference, h) -> None:
    """Legacy semantics: ``logprobs: 0`` returns each token's logprob with no alternatives."""
    want = _local(reference, h, "completion", dict(logprobs=True))
    got = _completion(client, engine, h, dict(logprobs=0)).choices[0]
    assert got.logprobs.token_logprobs == [e.logprob for e in want.logprobs]
    assert got.logprobs.top_logprobs == [{}] * len(want.token_ids)
    assert got.logprobs.text_offset[0] == 0


@pytest.mark.parametrize("return_token_ids", [False, True])
def test_streamed_logprobs_reassemble_to_the_non_streamed_ones(return_token_ids, client, engine, h) -> None:
    """Every token's logprob comes exactly once, in order, also when a token adds no text (it rides on the next
    chunk that is sent); the legacy offsets go on across chunks."""
    sdk = dict(temperature=1.0, seed=3, logprobs=5)
    extra = {} if return_token_ids else {"return_token_ids": False}
    whole = _chat(client, engine, h, sdk).choices[0]
    chunks = list(_chat(client, engine, h, {**sdk, "extra": extra}, stream=True))
    content = [e for c in chunks for ch in c.choices if ch.logprobs is not None for e in ch.logprobs.content]
    assert [e.model_dump() for e in content] == [e.model_dump() for e in whole.logprobs.content]
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == whole.message.content
    sizes = [len(ch.logprobs.content) for c in chunks for ch in c.choices if ch.logprobs is not None]
    if return_token_ids:  # one chunk per token
        assert set(sizes) == {1}
    else:  # this seed's answer has tokens inside multi-byte characters: their logprobs wait for the next text
        assert max(sizes) > 1

    whole = _completion(client, engine, h, sdk).choices[0].logprobs
    chunks = list(_completion(client, engine, h, {**sdk, "extra": extra}, stream=True))
    lps = [ch.logprobs for c in chunks for ch in c.choices if ch.logprobs is not None]
    assert len(lps) > 1
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for lp in lps for x in getattr(lp, field)] == getattr(whole, field), field


def test_n_choices_with_penalties_each_equal_a_single_request_with_its_seed(client, engine, reference, h) -> None:
    params = dict(temperature=0.8, presence_penalty=1.0, repetition_penalty=1.2, top_k=10, logprobs=True,
                  top_logprobs=1)
    sdk = dict(temperature=0.8, presence_penalty=1.0, seed=5, logprobs=1,
               extra={"repetition_penalty": 1.2, "top_k": 10})
    r = _chat(client, engine, h, sdk, n=2)
    assert len(r.choices) == 2
    for i, choice in enumerate(r.choices):
        want = _local(reference, h, "chat", {**params, "seed": 5 + i})
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.logprobs.model_dump() == chat_logprobs(want.logprobs)
    assert r.choices[0].model_extra["token_ids"] != r.choices[1].model_extra["token_ids"]


@pytest.mark.parametrize("endpoint, fields, param", [
    ("chat", {"top_k": -2}, "top_k"),
    ("chat", {"top_k": 1.5}, "top_k"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"repetition_penalty": 1e-300}, "repetition_penalty"),
    ("chat", {"repetition_penalty": 100.5}, "repetition_penalty"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: the engine's rule, named all the same
    ("chat", {"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    ("chat", {"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
    ("chat", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("chat", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"logprobs": -1}, "logprobs"),
    ("completion", {"logprobs": True}, "logprobs"),
    ("completion", {"top_k": -5}, "top_k"),
    ("completion", {"repetition_penalty": 0.001}, "repetition_penalty"),
])
def test_a_bad_value_is_a_400_naming_the_field_before_the_engine(endpoint, fields, param, client, engine, h) -> None:
    before = engine.stats().requests["requests_finished"]
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=engine.loaded.name, messages=h.rag_messages(), max_tokens=2,
                                           extra_body=fields)
        else:
            client.completions.create(model=engine.loaded.name, prompt="Once upon a time", max_tokens=2,
                                      extra_body=fields)
    assert info.value.param == param, info.value.body
    assert engine.stats().requests["requests_finished"] == before


def test_neutral_penalties_and_logprobs_off_are_accepted(client, engine, reference, h) -> None:
    """What OpenAI clients send by default (0 penalties, logprobs false) is no longer refused."""
    want = _local(reference, h, "chat", {})
    got = _chat(client, engine, h, dict(presence_penalty=0, frequency_penalty=0.0),
                logprobs=False, top_logprobs=0).choices[0]
    assert got.model_extra["token_ids"] == want.token_ids and got.logprobs is None


# ------------------------------------------------------------------------------------------ chat_template_kwargs
TEMPLATE = ("{% for m in messages %}[{{ m.role }}|{{ greeting | default('none') }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def templated(tiny, tmp_path_factory, h):
    """A server whose engine renders chats with `TEMPLATE` (a ``greeting`` variable, default 'none')."""
    model, tokenizer = tiny
    config = h.engine_config(tmp_path_factory.mktemp("templated"), chat_template=TEMPLATE,
                             chat_template_kwargs={"greeting": "server"})
    srv = ServerThread(PCREngine(model, tokenizer, config=config), ServerSettings(port=0), owns_engine=True)
    with srv:
        yield srv


def test_chat_template_kwargs_reach_the_template_over_the_servers_own(templated, tiny, tmp_path) -> None:
    engine = templated.state.engine
    messages = [{"role": "user", "content": "Say hi."}]
    with openai.OpenAI(base_url=templated.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        def prompt(**extra) -> str:
            r = c.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=2,
                                          extra_body={"return_token_ids": True, **extra})
            return engine.tokenizer.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=True)

        assert "[user|server]Say hi." in prompt()
        assert "[user|hello]Say hi." in prompt(chat_template_kwargs={"greeting": "hello"})
        model, tokenizer = tiny
        local = PCREngine(model, tokenizer, config=EngineConfig(
            cache_dir=tmp_path / "local", chat_template=TEMPLATE,
            chat_template_kwargs={"greeting": "server"}, dtype="float32", max_new_tokens=2, ssd_capacity=0))
        with local:
            want = local.submit(ChatPrompt(messages, chat_template_kwargs={"greeting": "hello"})).result(timeout=60)
        r = c.chat.completions.create(model=engine.loaded.name, messages=messages, max_tokens=2,
                                      extra_body={"return_token_ids": True,
                                                  "chat_template_kwargs": {"greeting": "hello"}})
        assert r.model_extra["prompt_token_ids"] == want.prompt_token_ids
