"""The one translation (`pcr_rag.server.translate`): a validated body -> the engine call's inputs, without a server.

The error cases pin the status, ``param`` and message the server answered before the translation had a module of
its own (the bodies went through ``schemas.parse_chat_request`` / ``parse_completion_request`` then)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pcr_rag import Doc
from pcr_rag.request import ChatPrompt, RagPrompt
from pcr_rag.server.errors import APIError
from pcr_rag.server.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from pcr_rag.server.translate import GenerationRequest, translate_chat, translate_completion
from pcr_rag.testing import tiny_tokenizer

DOCS = ("pathlib offers classes for filesystem paths.", "json encodes Python objects as JSON text.")
QUESTION = "What do pathlib and json do?"
MESSAGES = [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": "Context:\n" + "\n\n".join(DOCS) + f"\n\nQuestion: {QUESTION}"}]
SEED_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


def chat(tokenizer: Any, **fields: Any) -> GenerationRequest:
    body = parse_body(json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode(), ChatCompletionRequest)
    return translate_chat(body, tokenizer)


def completion(**fields: Any) -> GenerationRequest:
    return translate_completion(parse_body(json.dumps({"model": "m", **fields}).encode(), CompletionRequest))


def test_a_rag_chat_with_documents_is_a_chat_prompt_holding_them(tokenizer) -> None:
    req = chat(tokenizer, documents=[DOCS[0], {"text": DOCS[1], "scope": "shared"}], reuse="blend",
               refusal_policy=None, vendor_flag=True)
    assert isinstance(req.prompt, ChatPrompt)
    assert req.prompt.messages == tuple(MESSAGES)
    assert req.prompt.docs == (Doc(DOCS[0], None), Doc(DOCS[1], "shared"))
    assert (req.kind, req.model, req.reuse, req.n, req.stream, req.tools) == ("chat", "m", "blend", 1, False, ())
    assert req.prompt_chars == sum(len(m["content"].strip()) for m in MESSAGES)
    assert req.prompt_param == "messages"
    assert req.ignored == ("vendor_flag",)  # a null unknown field counts as absent
    assert req.choice_params == (req.params,)


def test_a_rag_layout_completion_with_a_system_tail_is_a_rag_prompt(tokenizer) -> None:
    tail = "Today is 2026-12-08."
    req = completion(prompt=QUESTION, layout="rag", documents=list(DOCS), system="Be brief.", system_tail=tail)
    assert req.prompt == RagPrompt(QUESTION, DOCS, "Be brief.", system_tail=tail)
    assert req.prompt_param == "prompt" and req.kind == "completion"
    # the documents and the tail are text of their own in this layout: they count in the character bound
    assert req.prompt_chars == len(QUESTION) + len("Be brief.") + len(tail) + sum(len(d) for d in DOCS)


def test_the_sampling_fields_map_onto_sampling_params(tokenizer) -> None:
    req = chat(tokenizer, max_completion_tokens=7, temperature=1e-7, top_p=0.5, stop=["\n\n", ""], seed=SEED_MAX - 1,
               n=3, top_k=5, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, min_p=0.1,
               min_tokens=1, ignore_eos=True, logprobs=True, top_logprobs=2, stream=True,
               stream_options={"include_usage": True})
    p = req.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.stop, p.seed) == (7, 0.0, 0.5, ("\n\n",), SEED_MAX - 1)
    assert (p.top_k, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (5, 1.1, 0.5, -0.5)
    assert (p.min_p, p.min_tokens, p.ignore_eos, p.logprobs, p.top_logprobs) == (0.1, 1, True, True, 2)
    assert (req.stream, req.include_usage) == (True, True)
    # choice i samples with seed + i, wrapped into the signed 64-bit range
    assert [c.seed for c in req.choice_params] == [SEED_MAX - 1, SEED_MAX, -(2**63)]
    assert req.n == 3 and req.choice_params[0] is p
    unseeded = chat(tokenizer, n=2)
    assert unseeded.choice_params == (unseeded.params, unseeded.params)
    # the legacy completions endpoint's logprobs is the number of alternatives
    legacy = completion(prompt="Q", logprobs=2, max_tokens=3)
    assert (legacy.params.logprobs, legacy.params.top_logprobs, legacy.params.max_new_tokens) == (True, 2, 3)


@pytest.mark.parametrize("kind, fields, param, message", [
    ("chat", {"system_tail": "Today is Monday."}, "system_tail",
     "'system_tail' needs a layout the server chooses, and a chat's messages are laid out by the caller: put the "
     "per-request text into the messages after the documents yourself, or send the question to /v1/completions "
     "with \"layout\": \"rag\" and this system_tail"),
    ("chat", {"logit_bias": {"5": 1.0}}, "logit_bias", "logit_bias={'5': 1.0}: logit_bias is not supported; remove it"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs=True (as OpenAI's API)"),
    ("chat", {"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens",
     "max_tokens and max_completion_tokens disagree ({'max_tokens': 3, 'max_completion_tokens': 4}); send one of "
     "them"),
    ("chat", {"n": 9}, "n",
     "n=9 is more than this server's 8 choices per request; send several requests (with different seeds when "
     "sampling)"),
    ("chat", {"documents": ["a"], "scopes": ["shared", "private"]}, "scopes",
     "scopes has 2 entries for 1 documents; pass one scope per document ('shared', 'private' or None)"),
    ("completion", {"prompt": "q", "system_tail": "x"}, "system_tail",
     "'system_tail' needs \"layout\": \"rag\" (the prompt is then the question, and the server places the tail "
     "after the documents); a flat prompt is laid out by the caller: put the per-request text after the documents "
     "in it yourself"),
    ("completion", {"prompt": "q", "layout": "rag", "chat_template": False}, "chat_template",
     "layout 'rag' renders the model's chat template (as PCREngine.generate); leave 'chat_template' out or send "
     "true, or send layout 'flat' with the rendered text"),
])
def test_a_field_that_cannot_be_honoured_is_the_same_400_as_before(tokenizer, kind, fields, param,
                                                                    message) -> None:
    with pytest.raises(APIError) as caught:
        chat(tokenizer, **fields) if kind == "chat" else completion(**fields)
    assert (caught.value.status, caught.value.param, caught.value.message) == (400, param, message)
