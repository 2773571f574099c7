"""Which LangChain run a chat model's stream belongs to: `BaseChatModel.stream` / ``astream`` never pass their run
manager to ``_stream`` / ``_astream`` (``invoke`` and `BaseLLM.stream` do), so `ChatPCR` records the run itself.

`with_run_recorder(config, model_callbacks)` adds a `RunRecorder` to the call's callbacks. LangChain calls it inline
(``run_inline``) from ``on_chat_model_start``, in the caller's thread and context, just before it calls ``_stream``
there; the recorder puts a `StartedRun` in a context variable that `take_started_run` reads and clears. Threads and
asyncio tasks each have their own context, so concurrent streams never see each other's run.

A `StartedRun` stands in for the run manager ``_stream`` did not get, with what the model reads of one: the run id
(the trace), its parent (the run-tree walk of `langchain_pcr.callbacks.find_announcement`) and the handlers
attached to the run (where that walk looks for a `PCRRetrievalCallback`). So a stream sends the same documents and
claims the same announcement as ``invoke``.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler, BaseCallbackManager
from langchain_core.runnables import RunnableConfig, ensure_config

from langchain_pcr.callbacks import get_global_retrieval_hook

__all__ = ["RunRecorder", "StartedRun", "take_started_run", "with_run_recorder"]


@dataclass(frozen=True)
class StartedRun:
    """The chat-model run LangChain started for a stream: what ``_stream`` would have read of its run manager.

    ``handlers``: the handlers LangChain attaches to the run from the places a `PCRRetrievalCallback` can come
    from (see `with_run_recorder`), in LangChain's order: the call's, then the model's, then the global hook.
    """

    run_id: UUID
    parent_run_id: UUID | None
    handlers: tuple[BaseCallbackHandler, ...] = ()


_STARTED: ContextVar[StartedRun | None] = ContextVar("langchain_pcr_started_chat_run", default=None)


class RunRecorder(BaseCallbackHandler):
    """Records the chat-model run LangChain starts (for the ``_stream`` call that follows)."""

    run_inline = True  # an async manager would otherwise run it in an executor, on a copy of the context

    def __init__(self, handlers: tuple[BaseCallbackHandler, ...] = ()) -> None:
        super().__init__()
        self.handlers = handlers

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID,
                            parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        _STARTED.set(StartedRun(run_id, parent_run_id, self.handlers))


def _handlers_of(callbacks: Any) -> list[BaseCallbackHandler]:
    """The handlers of a ``callbacks`` value (None, a list of handlers, or a callback manager)."""
    if isinstance(callbacks, BaseCallbackManager):
        return [*callbacks.handlers, *callbacks.inheritable_handlers]
    return [h for h in callbacks or () if isinstance(h, BaseCallbackHandler)]


def with_run_recorder(config: RunnableConfig | None, model_callbacks: Any = None) -> RunnableConfig:
    """``config`` (not modified) with a `RunRecorder` added to its callbacks (a list or a callback manager).

    The recorder carries the handlers LangChain will attach to the run that can be a `PCRRetrievalCallback`: the
    call's callbacks (``config``), the model's own (``model_callbacks``, its ``callbacks`` field) and the global
    hook (`install_global_retrieval_hook`, added through LangChain's configure hooks) -- the places a run manager's
    hook comes from for ``invoke`` too.
    """
    config = ensure_config(config)
    _STARTED.set(None)  # nothing left over from a call that never reached ``_stream``
    callbacks = config.get("callbacks")
    global_hook = get_global_retrieval_hook()
    handlers = (*_handlers_of(callbacks), *_handlers_of(model_callbacks), *([global_hook] if global_hook else []))
    recorder = RunRecorder(handlers)
    if isinstance(callbacks, BaseCallbackManager):
        manager = callbacks.copy()
        manager.add_handler(recorder, inherit=False)
        return {**config, "callbacks": manager}
    return {**config, "callbacks": [*(callbacks or ()), recorder]}


def take_started_run() -> StartedRun | None:
    """The run a `RunRecorder` recorded in this context, once (None when there is none)."""
    run = _STARTED.get()
    if run is not None:
        _STARTED.set(None)
    return run
