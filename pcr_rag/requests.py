"""Deprecated: split into `pcr_rag.request` (prompts, sampling parameters, results), `pcr_rag.handle`
(`RequestHandle`, `RequestState`, `TokenChannel`) and `pcr_rag.sched.request_state` (the engine's `Request`); this
name re-exports them until the release `pcr_rag._moved.REMOVED_IN` names (see `pcr_rag._moved.SPLIT`)."""

from pcr_rag._moved import warn_split

warn_split(__name__)

from pcr_rag.handle import *  # noqa: E402,F403
from pcr_rag.request import *  # noqa: E402,F403
from pcr_rag.sched.request_state import Request  # noqa: E402,F401
