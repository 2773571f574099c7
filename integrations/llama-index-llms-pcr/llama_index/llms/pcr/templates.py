"""Prompt templates with a ``{system_tail}`` slot after the context: per-request instructions that keep the
retrieved documents' cached KV reusable.

Reuse is a prefix: the first token that differs from what was cached ends it. A per-request part of the
instructions (today's date, the user's profile) in ``system_prompt`` sits before the context in every LlamaIndex
template, so every request computes its documents again. These templates put it after the context instead, where
`pcr_rag.RagPrompt.system_tail` puts it in the engine's own layout: ``[instructions][documents][system_tail]
[query]``. The documents are then reused across requests whose tails differ; the tail is computed with the query.
This changes the prompt (the model reads the documents before the per-request instructions), so the answer can
differ from the one with the instructions first; reuse stays exact for the prompt sent.

    from llama_index.llms.pcr import PCR_TEXT_QA_TEMPLATE, system_tail

    qe = index.as_query_engine(llm=llm, text_qa_template=PCR_TEXT_QA_TEMPLATE)
    with system_tail(f"Today is {today}. The user is {profile}."):
        qe.query("...")

The slot's value, in order: a ``system_tail`` format argument (``template.partial_format(system_tail=...)``, or
passed to ``format``), else the innermost `system_tail` block around the call (a context variable: each thread and
asyncio task sees its own), else nothing. A streaming query engine calls the LLM, and so formats the template, when
its response generator is consumed: consume it inside the block, or pin the tail with ``partial_format``. A non-blank value renders as itself and a newline, a blank one as
nothing, so without a tail `PCR_TEXT_QA_TEMPLATE` renders exactly as LlamaIndex's default text-QA template (and
`PCR_SUMMARY_TEMPLATE` as its tree-summarize one). `with_system_tail` gives any template of yours with a
``{system_tail}`` slot the same behaviour. Documents the template leaves out, or renders differently, are handled as
they are without a tail: the ones found verbatim get their own token runs, the rest is computed as text.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.prompts import ChatPromptTemplate, PromptTemplate, SelectorPromptTemplate
from llama_index.core.prompts.base import BasePromptTemplate
from llama_index.core.prompts.prompt_type import PromptType
from llama_index.core.prompts.utils import is_chat_model

__all__ = ["PCR_SUMMARY_TEMPLATE", "PCR_TEXT_QA_TEMPLATE", "SYSTEM_TAIL_SLOT", "system_tail", "with_system_tail"]

SYSTEM_TAIL_SLOT = "system_tail"  # the template variable

_TAIL: ContextVar[str | None] = ContextVar("pcr_system_tail", default=None)

T = TypeVar("T", bound=BasePromptTemplate)


@contextmanager
def system_tail(text: str) -> Iterator[None]:
    """Within the block, a template's ``{system_tail}`` slot (`with_system_tail`) renders ``text`` unless the call
    passes its own. Nested blocks: the innermost wins; the previous value comes back when the block ends.

    Raises:
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"system_tail takes a str, got {type(text).__name__}")
    token = _TAIL.set(text)
    try:
        yield
    finally:
        _TAIL.reset(token)


def _tail_slot(**kwargs: Any) -> str:
    """The slot's text: the call's ``system_tail`` argument, else the current `system_tail` block's, followed by a
    newline; "" when both are blank or absent. LlamaIndex's prompt packing formats the template with every slot set
    to "" to measure it, so a blank argument falls through to the block: the measure then counts the tail."""
    given = kwargs.get(SYSTEM_TAIL_SLOT)
    if given is not None and not isinstance(given, str):
        raise TypeError(f"system_tail must be a str, got {type(given).__name__}")
    text = given if given and given.strip() else _TAIL.get()
    return f"{text}\n" if text and text.strip() else ""


def with_system_tail(template: T) -> T:
    """A copy of ``template`` (a `PromptTemplate`, `ChatPromptTemplate` or `SelectorPromptTemplate` of them) whose
    ``{system_tail}`` slot is filled as the module says. Place the slot after the context, before the query.

    Raises:
        ValueError: the template (or one it selects between) has no ``{system_tail}`` slot.
    """
    if isinstance(template, SelectorPromptTemplate):
        conditionals = [(cond, with_system_tail(t)) for cond, t in template.conditionals or ()]
        return SelectorPromptTemplate(with_system_tail(template.default_template), conditionals)  # type: ignore[return-value]
    if SYSTEM_TAIL_SLOT not in template.template_vars:
        raise ValueError(f"the template has no {{{SYSTEM_TAIL_SLOT}}} slot; put one after the context "
                         f"(its variables: {template.template_vars})")
    copy = template.model_copy(deep=True)
    copy.function_mappings = {**(template.function_mappings or {}), SYSTEM_TAIL_SLOT: _tail_slot}
    return copy


# LlamaIndex's default text-QA and tree-summarize templates (llama_index.core.prompts.default_prompts and
# chat_prompts), with the slot after the context block.
_SYSTEM = ("You are an expert Q&A system that is trusted around the world.\n"
           "Always answer the query using the provided context information, and not prior knowledge.\n"
           "Some rules to follow:\n"
           "1. Never directly reference the given context in your answer.\n"
           "2. Avoid statements like 'Based on the context, ...' or 'The context information ...' or anything "
           "along those lines.")
_TEXT_QA = ("Context information is below.\n"
            "---------------------\n"
            "{context_str}\n"
            "---------------------\n"
            "{system_tail}"
            "Given the context information and not prior knowledge, answer the query.\n"
            "Query: {query_str}\n"
            "Answer: ")
_SUMMARY = ("Context information from multiple sources is below.\n"
            "---------------------\n"
            "{context_str}\n"
            "---------------------\n"
            "{system_tail}"
            "Given the information from multiple sources and not prior knowledge, answer the query.\n"
            "Query: {query_str}\n"
            "Answer: ")


def _selector(text: str, prompt_type: PromptType) -> SelectorPromptTemplate:
    """A completion template and, for chat models, a system + user chat template, as LlamaIndex's defaults."""
    chat = ChatPromptTemplate(message_templates=[ChatMessage(role=MessageRole.SYSTEM, content=_SYSTEM),
                                                 ChatMessage(role=MessageRole.USER, content=text)])
    return with_system_tail(SelectorPromptTemplate(PromptTemplate(text, prompt_type=prompt_type),
                                                   [(is_chat_model, chat)]))


PCR_TEXT_QA_TEMPLATE = _selector(_TEXT_QA, PromptType.QUESTION_ANSWER)
"""``text_qa_template=`` for query engines (compact, refine, ... response modes)."""
PCR_SUMMARY_TEMPLATE = _selector(_SUMMARY, PromptType.SUMMARY)
"""``summary_template=`` for the ``tree_summarize`` response mode."""
