"""`RequestLimits`: how much of the engine's shared work one request's options may ask for.

Each bound is checked before any compute (an `InvalidRequestError`, a 400 on the server), because each option's
cost lands on everybody: every stop string is matched on every token of the shared decode loop, and a response
format's (or a tool set's) grammar is validated and compiled on the request path and kept in the engine's grammar
cache. The defaults leave ordinary use far below them: OpenAI allows 4 stop sequences, a tool's JSON schema is a
few KiB.

Stop strings are measured in UTF-8 bytes (what a client sends), formats and tools as their compact JSON / source
text in UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pcr_rag.errors import InvalidRequestError

__all__ = ["DEFAULT_LIMITS", "RequestLimits"]


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request's options (see the module docstring).

    max_stop_sequences: stop strings per request.
    max_stop_bytes: UTF-8 bytes of each stop string; matching one token then costs at most this many characters
        per stop string, whatever the length of the output.
    max_format_bytes: UTF-8 bytes of a response format's source (JSON schema text, regex or Lark grammar).
    max_tools_bytes: UTF-8 bytes of a request's tool definitions (their compact JSON, all tools together).
    """

    max_stop_sequences: int = 16
    max_stop_bytes: int = 256
    max_format_bytes: int = 256 * 1024
    max_tools_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        for name in ("max_stop_sequences", "max_stop_bytes", "max_format_bytes", "max_tools_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def check_stop(self, stop: Sequence[str]) -> None:
        """Raise `InvalidRequestError` when ``stop`` holds more strings, or a longer one, than allowed."""
        if len(stop) > self.max_stop_sequences:
            raise InvalidRequestError(f"stop holds {len(stop)} sequences, more than this engine's "
                                      f"{self.max_stop_sequences}; send at most {self.max_stop_sequences}")
        for s in stop:
            size = _utf8_bytes(s)
            if size > self.max_stop_bytes:
                raise InvalidRequestError(f"stop holds a sequence of {size} bytes, longer than this engine's "
                                          f"{self.max_stop_bytes} bytes; send shorter stop strings")

    def check_format(self, source: str) -> None:
        """Raise `InvalidRequestError` when a response format's source is over ``max_format_bytes``."""
        size = _utf8_bytes(source)
        if size > self.max_format_bytes:
            raise InvalidRequestError(f"response_format is {size} bytes, more than this engine's "
                                      f"{self.max_format_bytes}; send a smaller schema or grammar")

    def check_tools(self, size: int) -> None:
        """Raise `InvalidRequestError` when ``size`` bytes of tool definitions are over ``max_tools_bytes``."""
        if size > self.max_tools_bytes:
            raise InvalidRequestError(f"tools take {size} bytes, more than this engine's {self.max_tools_bytes}; "
                                      f"send fewer or smaller tool definitions")


def _utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


DEFAULT_LIMITS = RequestLimits()
