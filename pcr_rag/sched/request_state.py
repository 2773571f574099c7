"""The engine's side of one request (the caller holds its `pcr_rag.handle.RequestHandle`): what the scheduler,
the executor and the runner read and update while it waits, runs and finishes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pcr_rag.handle import RequestState
from pcr_rag.metrics import RequestMetrics
from pcr_rag.request import SamplingParams, TokenLogprob
from pcr_rag.tracing import RequestTrace

if TYPE_CHECKING:
    from pcr_rag.cache import ChunkSpec
    from pcr_rag.model.sampling import TokenConstraint
    from pcr_rag.sched.blend import BlendRequest

__all__ = ["Request", "RequestState"]


@dataclass
class Request:
    """The engine's side of one request (the caller holds its `RequestHandle`).

    ``plan`` holds its chunks; ``on_token(token_id, text_delta, logprobs)`` streams output; ``future`` gets the
    `GenerationResult` or the error; ``cancelled`` is checked by the executor between forwards; ``constraint``
    is the compiled ``params.response_format`` (a `TokenConstraint`), None when unconstrained."""

    request_id: int
    token_ids: list[int]
    plan: list[ChunkSpec]
    params: SamplingParams
    submitted_at: float
    future: Future = field(default_factory=Future)
    on_token: Callable[[int, str, TokenLogprob | None], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: RequestState = RequestState.WAITING
    ssd_keys_at_entry: frozenset[bytes] = frozenset()
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    documents_found: int = 0
    constraint: TokenConstraint | None = None
    log_id: str = ""  # the id its log lines carry (`pcr_rag.logs`): the server's request id, else "req-<request_id>"
    trace: RequestTrace | None = None  # its spans' parent and the times they need; None when tracing is off
    tenant: bytes = b""  # whom the chunks it computes are charged to: its namespace's root (`PCREngine.root_for`)
    blend: BlendRequest | None = None  # blend mode's documents (`pcr_rag.sched.blend`); None: exact
    shadow: bool = False  # the blend gate's exact twin of a blended request (`pcr_rag.sched.blend_gate`)

    @property
    def keys(self) -> list[bytes]:
        return [c.key for c in self.plan]

    def cancel(self) -> None:
        self.cancelled.set()
