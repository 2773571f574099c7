"""Which LangChain run a chat model's stream belongs to: `BaseChatModel.stream` / ``astream`` never pass their run
manager to ``_stream`` / ``_astream`` (``invoke`` and `BaseLLM.stream` do), so `ChatPCR` learns the run id itself.

`with_run_recorder(config)` adds a `RunRecorder` to the call's callbacks. LangChain calls it inline (``run_inline``)
from ``on_chat_model_start``, in the caller's thread and context, just before it calls ``_stream`` there; the
recorder puts the run id in a context variable that `take_started_run` reads and clears. Threads and asyncio tasks
each have their own context, so concurrent streams never see each other's run.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler, BaseCallbackManager
from langchain_core.runnables import RunnableConfig, ensure_config

__all__ = ["RunRecorder", "take_started_run", "with_run_recorder"]

_STARTED: ContextVar[UUID | None] = ContextVar("langchain_pcr_started_chat_run", default=None)


class RunRecorder(BaseCallbackHandler):
    """Records the id of the chat-model run LangChain starts (for the `_stream` call that follows)."""

    run_inline = True  # an async manager would otherwise run it in an executor, on a copy of the context

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID, **kwargs: Any) -> None:
        _STARTED.set(run_id)


def with_run_recorder(config: RunnableConfig | None) -> RunnableConfig:
    """``config`` (not modified) with a `RunRecorder` added to its callbacks (a list or a callback manager)."""
    config = ensure_config(config)
    _STARTED.set(None)  # nothing left over from a call that never reached ``_stream``
    callbacks = config.get("callbacks")
    recorder = RunRecorder()
    if isinstance(callbacks, BaseCallbackManager):
        manager = callbacks.copy()
        manager.add_handler(recorder, inherit=False)
        return {**config, "callbacks": manager}
    return {**config, "callbacks": [*(callbacks or ()), recorder]}


def take_started_run() -> UUID | None:
    """The run a `RunRecorder` recorded in this context, once (None when there is none)."""
    run_id = _STARTED.get()
    if run_id is not None:
        _STARTED.set(None)
    return run_id
