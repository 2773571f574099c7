"""`rag_prompt`: a chat prompt with a ``system_tail`` slot after the context, for per-request instructions that keep
the retrieved documents' cached KV reusable.

Reuse is a prefix: the first token that differs from what was cached ends it. A per-request system message (today's
date, the user's profile) before the context therefore makes every request compute its documents again. This
template puts that text after the context, before the question, where `pcr_rag.RagPrompt.system_tail` puts it in
the engine's own layout; the system message stays fixed. The documents are then reused across requests whose tails
differ; the tail is computed with the question. This changes the prompt (the model reads the documents before the
per-request instructions), so the answer can differ from the one with the instructions first; reuse stays exact for
the prompt sent.

    chain = ({"context": itemgetter("question") | retriever | format_docs, "question": itemgetter("question"),
              "system_tail": itemgetter("system_tail")} | rag_prompt() | ChatPCR())
    chain.invoke({"question": "...", "system_tail": f"Today is {today}. The user is {profile}."})

``system_tail`` is optional: left out or blank, the human turn is exactly ``"Context:\\n{context}\\n\\nQuestion:
{question}"``; otherwise the tail and a blank line sit between the context and the question. Any template of yours
does the same with a slot after ``{context}``. Documents the chain's formatting leaves out or changes are handled as
without a tail: the ones found verbatim get their own token runs, the rest is computed as text.
"""

from __future__ import annotations

from langchain_core.messages import SystemMessage
from langchain_core.prompts import ChatPromptTemplate

__all__ = ["DEFAULT_SYSTEM", "rag_prompt"]

DEFAULT_SYSTEM = "Answer from the context."

# jinja2 (LangChain renders it sandboxed, without HTML escaping) so that a blank tail leaves no empty paragraph;
# values are inserted as text, never parsed as template syntax, so a document with braces renders verbatim
_HUMAN = ("Context:\n{{ context }}\n\n"
          "{% if system_tail and system_tail.strip() %}{{ system_tail }}\n\n{% endif %}"
          "Question: {{ question }}")


def rag_prompt(system: str | None = DEFAULT_SYSTEM) -> ChatPromptTemplate:
    """A system message (``system``, fixed text: not a template, so braces in it are kept; None: no system
    message) and a human turn ``Context: {context}`` / ``{system_tail}`` / ``Question: {question}``. Input
    variables: ``context`` and ``question``; ``system_tail`` is optional (default: none)."""
    messages: list = [SystemMessage(content=system)] if system else []
    template = ChatPromptTemplate.from_messages([*messages, ("human", _HUMAN)], template_format="jinja2")
    return template.partial(system_tail="")
