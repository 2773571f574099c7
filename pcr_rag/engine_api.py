"""`Engine`: the surface both engines serve, which the integrations type against: `pcr_rag.engine.PCREngine` runs
the model in this process, `pcr_rag.client.http.HTTPEngine` sends each request to `pcr-rag serve`. A request goes
in as a `Prompt` and `SamplingParams` and comes back as the one `RequestHandle` (`pcr_rag.handle`), on either.

Structural (a `typing.Protocol`): neither engine imports this module, and neither imports the other (the
import contracts in pyproject.toml), so the thin client stays thin. Only what both engines serve the same way is
here; what only the local engine has (``generate*`` wrappers, ``stats()``, ``order_for_reuse``) is reached through
`PCREngine` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pcr_rag.handle import RequestHandle
from pcr_rag.prompt import Doc
from pcr_rag.request import Prompt, SamplingParams

__all__ = ["Engine", "EngineDefaults", "ModelInfo"]


class ModelInfo(Protocol):
    """What an engine says about its model: ``name`` (the id a server lists)."""

    @property
    def name(self) -> str: ...


class EngineDefaults(Protocol):
    """The defaults a caller reads from an engine's ``config``: tokens a request may generate when it says none."""

    @property
    def max_new_tokens(self) -> int: ...


class Engine(Protocol):
    """An engine: ``submit`` a prompt, announce documents at retrieval, count tokens, close.

    ``submit(prompt, params, timeout=, reuse=)`` returns the request's `RequestHandle` (``reuse``: "exact" or
    "blend", None for the engine's default); ``announce(documents, query)`` starts loading the documents' KV
    before the request comes and returns a ticket ``cancel_announcement`` withdraws. Bad input raises
    `pcr_rag.errors.InvalidRequestError` before any compute on both."""

    @property
    def closed(self) -> bool: ...

    @property
    def config(self) -> EngineDefaults: ...

    @property
    def loaded(self) -> ModelInfo: ...

    @property
    def context_window(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    def count_tokens(self, text: str) -> int: ...

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, timeout: float | None = None,
               reuse: str | None = None) -> RequestHandle: ...

    def announce(self, documents: Sequence[str | Doc], query: str | None = None, *, system: str | None = None,
                 scopes: Sequence[str | None] | None = None, reuse: str | None = None) -> Any: ...

    def cancel_announcement(self, ticket: Any) -> bool: ...

    def close(self) -> None: ...
