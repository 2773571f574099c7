"""Nothing a client sends is ignored silently: the fields a request carried that this server does not know
(`pcr_rag.server.translate.ignored_fields`) are named in the response's ``X-PCR-Ignored-Fields`` header and in one
warning log line per request.

The policy is vLLM's (accept unknown fields, so every client that sends extras keeps working: the OpenAI SDK's
``extra_body``, langchain-openai, LlamaIndex's ``OpenAILike``), plus disclosure. A name is the client's text, so only
names made of letters, digits and ``_ . - [ ]`` (64 characters at most) are shown, in the header and the log alike;
the others are counted (``+2 more``), so no header or log line can be forged through a field name.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from starlette.responses import Response

__all__ = ["IGNORED_HEADER", "disclose", "shown"]

log = logging.getLogger("pcr_rag.server")

IGNORED_HEADER = "X-PCR-Ignored-Fields"
_SAFE = re.compile(r"[A-Za-z0-9_.\[\]-]{1,64}")


def shown(ignored: Sequence[str]) -> str:
    """The header value naming ``ignored``: the safe names comma-separated, then ``+N more`` for the others."""
    safe = [name for name in ignored if _SAFE.fullmatch(name)]
    hidden = len(ignored) - len(safe)
    return ",".join([*safe, *([f"+{hidden} more"] if hidden else [])])


def disclose(response: Response, ignored: Sequence[str], endpoint: str) -> Response:
    """``response`` with the header naming ``ignored`` (nothing when empty), and one warning line."""
    if ignored:
        value = shown(ignored)
        response.headers[IGNORED_HEADER] = value
        log.warning("%s: ignored unknown request field(s) %s (not supported by this server)", endpoint, value)
    return response
