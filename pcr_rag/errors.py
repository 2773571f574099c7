"""Exceptions raised by the pcr-rag runtime. Each message says what to do about it."""

from __future__ import annotations


class PCRError(Exception):
    """Base class of every pcr-rag error."""


class ConfigError(PCRError, ValueError):
    """An `EngineConfig` field is invalid."""


class InvalidRequestError(PCRError, ValueError):
    """A request is malformed (empty, wrong types); raised before any compute."""


class PromptTooLongError(InvalidRequestError):
    """The prompt plus the requested new tokens do not fit a KV row (``EngineConfig.max_model_len``, at most the
    model's context window)."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context_window: int,
                 limit: str = "the model's context window") -> None:
        over = prompt_tokens + max_new_tokens - context_window
        raise_it = "" if limit.startswith("the model") else ", or raise EngineConfig.max_model_len"
        super().__init__(
            f"prompt has {prompt_tokens} tokens and max_new_tokens={max_new_tokens}, which exceeds {limit} of "
            f"{context_window} tokens by {over}; retrieve fewer or shorter documents, or lower "
            f"max_new_tokens{raise_it}"
        )
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_window = context_window
        self.excess_tokens = over


class EngineClosedError(PCRError, RuntimeError):
    """The engine was closed; create a new `PCREngine`."""


class QueueFullError(PCRError, RuntimeError):
    """The waiting queue is at `max_queue`; retry later or raise EngineConfig.max_queue."""


class RequestCancelledError(PCRError):
    """The request was cancelled before it finished."""


class RequestFailedError(PCRError, RuntimeError):
    """The engine failed this request while running it (its ``__cause__`` is the original error); its KV row and
    pinned chunks were released and the engine keeps serving other requests. Retry it, or report the cause."""


class PrefixLoadError(PCRError):
    """Cached KV for a matched chunk could not be loaded (e.g. failed verification); the runner recomputes."""

    def __init__(self, chunk_index: int, cause: BaseException) -> None:
        super().__init__(f"cached chunk #{chunk_index} could not be loaded: {cause}")
        self.chunk_index = chunk_index
        self.cause = cause


ENGINE_PACKAGES = frozenset({"torch", "transformers", "accelerate", "gguf", "xxhash", "filelock"})
"""What the ``engine`` extra installs beyond the core (the core is the thin HTTP client of `pcr-rag serve`)."""


class EngineNotInstalledError(PCRError, ImportError):
    """A model in this process was asked for, but the engine's dependencies (the ``engine`` extra) are missing.

    The core install is the thin client: ``base_url=`` and `pcr_rag.client.http.HTTPEngine` work without torch."""


def engine_not_installed(exc: ModuleNotFoundError) -> ImportError:
    """The error to raise for ``exc``: an `EngineNotInstalledError` saying what to install when the missing
    module is one of the engine's dependencies, else ``exc`` itself."""
    missing = (exc.name or "").split(".")[0]
    if missing not in ENGINE_PACKAGES:
        return exc
    return EngineNotInstalledError(
        f"running the model in this process needs {missing!r}, which the 'engine' extra installs: "
        f"pip install 'pcr-rag[engine]' (with torch from the index your platform needs, see the README); "
        f"to use a running `pcr-rag serve` instead, pass base_url=")
