"""chat_template / chat_template_kwargs: a template given inline or as a file replaces the tokenizer's, template
variables reach it (engine-wide and per request), and a model without a template refuses chats unless asked for
plain text - never a silent "role: content" rendering."""

from __future__ import annotations

import dataclasses

import pytest

from pcr_rag import EngineConfig, PCREngine
from pcr_rag.errors import ConfigError, InvalidRequestError
from pcr_rag.model.model import ChatTemplateError, read_chat_template
from pcr_rag.prompt import ChatTemplateMissingError
from pcr_rag.request import ChatPrompt, FlatPrompt, RagPrompt, SamplingParams
from pcr_rag.testing import tiny_model

TEMPLATE = ("{% for m in messages %}[{{ m.role }}|{{ greeting | default('none') }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
ONE = SamplingParams(max_new_tokens=1)


def _engine(tmp_path, *, template_less: bool = False, **kw) -> PCREngine:
    model, tok = tiny_model("llama")
    if template_less:
        tok.chat_template = None
    cfg = dict(cache_dir=tmp_path / "kv", ssd_capacity=0, device="cpu", dtype="float32", max_active=1,
               enable_cache=False, warmup=False, max_new_tokens=2)
    cfg.update(kw)
    return PCREngine(model, tok, config=EngineConfig(**cfg))


def _prompt_text(eng: PCREngine, prompt, params=ONE) -> str:
    ids = eng.submit(prompt, params).result(timeout=60).prompt_token_ids
    return eng.loaded.tokenizer.decode(ids, skip_special_tokens=False)


def test_a_model_without_a_template_refuses_chats_naming_the_option(tmp_path):
    with _engine(tmp_path, template_less=True) as eng:
        for prompt in (RagPrompt("Why?", ("A document.",)), ChatPrompt([{"role": "user", "content": "hi"}]),
                       FlatPrompt("Context: x. Question: y?")):
            with pytest.raises(ChatTemplateMissingError, match="chat_template='plain'") as info:
                eng.submit(prompt, ONE)
            assert "chat_template=<Jinja" in str(info.value) and isinstance(info.value, InvalidRequestError)
        assert _prompt_text(eng, FlatPrompt("Once upon a time", chat=False)) == "Once upon a time"  # raw: fine
        assert eng.stats().requests["requests_finished"] == 1  # the refused ones never reached the queue


def test_plain_text_is_an_explicit_choice(tmp_path):
    with _engine(tmp_path, template_less=True, chat_template="plain") as eng:
        assert not eng.loaded.has_chat_template
        chat = ChatPrompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
        assert _prompt_text(eng, chat) == "system: Be brief.\nuser: hi\nassistant:"
        assert _prompt_text(eng, FlatPrompt("Tell me.", system="Sys")) == "Sys\n\nTell me.\n"


def test_plain_overrides_a_models_own_template(tmp_path):
    with _engine(tmp_path, chat_template="plain") as eng:
        assert _prompt_text(eng, ChatPrompt([{"role": "user", "content": "hi"}])) == "user: hi\nassistant:"


def test_a_template_string_or_file_replaces_the_tokenizers(tmp_path):
    chat = ChatPrompt([{"role": "user", "content": "hi"}])
    with _engine(tmp_path, template_less=True, chat_template=TEMPLATE) as eng:
        assert eng.loaded.has_chat_template and eng.loaded.tokenizer.chat_template == TEMPLATE
        assert _prompt_text(eng, chat) == "[user|none]hi[assistant]"
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE.replace("[assistant]", "[bot]"))
    with _engine(tmp_path, chat_template=str(path)) as eng:  # over the tiny model's own ChatML template
        assert _prompt_text(eng, chat) == "[user|none]hi[bot]"
        assert _prompt_text(eng, RagPrompt("Why?")) == "[user|none]Why?[bot]"


def test_template_kwargs_reach_the_template_engine_wide_and_per_request(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    with _engine(tmp_path, chat_template=TEMPLATE, chat_template_kwargs={"greeting": "hello"}) as eng:
        assert _prompt_text(eng, ChatPrompt(chat)) == "[user|hello]hi[assistant]"
        assert _prompt_text(eng, ChatPrompt(chat, chat_template_kwargs={"greeting": "yo"})) == "[user|yo]hi[assistant]"
        assert _prompt_text(eng, ChatPrompt(chat)) == "[user|hello]hi[assistant]"  # per request, not sticky
        for result in (eng.generate_messages(chat, chat_template_kwargs={"greeting": "yo"}, max_new_tokens=1),
                       eng.stream_messages(chat, chat_template_kwargs={"greeting": "yo"}, max_new_tokens=1).result()):
            assert eng.loaded.tokenizer.decode(result.prompt_token_ids) == "[user|yo]hi[assistant]"


@pytest.mark.parametrize("kwargs", [{"tokenize": True}, {"add_generation_prompt": False}, {"messages": []},
                                    {1: "x"}, ["greeting"], {"x": object()}])
def test_bad_template_kwargs_are_refused_before_compute(tmp_path, kwargs):
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):
        ChatPrompt([{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs)
    with pytest.raises(ConfigError, match="chat_template_kwargs"):
        EngineConfig(cache_dir=tmp_path, chat_template_kwargs=kwargs)


@pytest.mark.parametrize("bad, match", [("no/such/template.jinja", "neither a Jinja template"),
                                        ("", "neither a Jinja template"), ("{% for m in %}", "does not compile"),
                                        (42, "must be a Jinja template string")])
def test_bad_templates_are_refused_when_the_config_is_built(tmp_path, bad, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(cache_dir=tmp_path, chat_template=bad)
    with pytest.raises(ChatTemplateError, match=match):
        read_chat_template(bad)


def test_the_options_are_documented_config_fields():
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {"chat_template", "chat_template_kwargs", "allow_download"} <= names
    for name in ("chat_template:", "chat_template_kwargs:", "allow_download:"):
        assert name in EngineConfig.__doc__


# ------------------------------------------------------------------------------------------------ integrations
def _integration_config(tmp_path) -> EngineConfig:
    return EngineConfig(cache_dir=tmp_path / "kv", ssd_capacity=0, device="cpu", dtype="float32", max_active=1,
                        enable_cache=False, warmup=False, max_new_tokens=2)


def _prompt_tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_chatpcr_passes_chat_template_and_kwargs_to_the_engine_it_builds(tmp_path):
    pytest.importorskip("langchain_pcr")
    from langchain_pcr import ChatPCR

    from pcr_rag.shared import close_shared_engines

    model, tok = tiny_model("llama")
    tok.chat_template = None
    try:
        llm = ChatPCR(model=model, tokenizer=tok, config=_integration_config(tmp_path), chat_template=TEMPLATE,
                      chat_template_kwargs={"greeting": "a longer greeting than none"})
        msg = llm.invoke("hi")
        assert llm.get_engine().config.chat_template == TEMPLATE
        want = "[user|a longer greeting than none]hi[assistant]"
        assert msg.usage_metadata["input_tokens"] == _prompt_tokens(tok, want)
        with pytest.raises(ValueError, match="chat_template"):
            ChatPCR(engine=llm.get_engine(), chat_template="plain")
    finally:
        close_shared_engines()


def test_pcrllm_passes_chat_template_and_kwargs_to_the_engine_it_builds(tmp_path):
    pytest.importorskip("llama_index.llms.pcr")
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.pcr import PCRLLM

    from pcr_rag.shared import close_shared_engines

    model, tok = tiny_model("llama")
    tok.chat_template = None
    try:
        llm = PCRLLM(model=model, tokenizer=tok, config=_integration_config(tmp_path), chat_template=TEMPLATE,
                     chat_template_kwargs={"greeting": "a longer greeting than none"}, retrieval_hook=False)
        response = llm.chat([ChatMessage(role="user", content="hi")])
        assert llm._engine.config.chat_template == TEMPLATE
        want = "[user|a longer greeting than none]hi[assistant]"
        assert response.raw["usage"]["prompt_tokens"] == _prompt_tokens(tok, want)
        assert llm.complete("hi").text is not None  # a str chat_template still wraps complete() prompts
        with pytest.raises(ValueError, match="chat_template"):
            PCRLLM(engine=llm._engine, chat_template="plain")
    finally:
        close_shared_engines()


def test_a_conversation_the_template_refuses_is_a_request_error(tmp_path):
    strict = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system turns') }}"
              "{% endif %}{{ m.content }}{% endfor %}")
    with _engine(tmp_path, chat_template=strict) as eng:
        with pytest.raises(InvalidRequestError, match="no system turns"):
            eng.submit(ChatPrompt([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]), ONE)
        with pytest.raises(InvalidRequestError, match="cannot render"):  # a variable shadowing the template's helper
            eng.submit(ChatPrompt([{"role": "system", "content": "s"}], chat_template_kwargs={"raise_exception": 1}),
                       ONE)
        assert _prompt_text(eng, ChatPrompt([{"role": "user", "content": "u"}])) == "u"


def test_pcr_rag_serve_has_the_vllm_named_flags(tmp_path):
    import argparse

    from pcr_rag.server import cli

    parser = argparse.ArgumentParser(prog="pcr-rag serve")
    cli.add_arguments(parser)
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    args = parser.parse_args(["--chat-template", str(path), "--allow-download", "--cache-dir", str(tmp_path)])
    engine = cli.serve_config(args, environ={}).engine
    assert engine.chat_template == str(path) and engine.allow_download is True
    args = parser.parse_args(["--chat-template", "no/such.jinja", "--cache-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="neither a Jinja template"):
        cli.serve_config(args, environ={})
