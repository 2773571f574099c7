"""Blend mode's run-time gate: verify a sample of blended requests against exact, and fall back when it drifts.

With ``EngineConfig.blend_verify = f``, every ``1/f``-th blended request (a deterministic count, not a coin) is run
again exactly, as a *shadow* request (`ShadowRunner`): the same prompt, namespace and sampling parameters with
``reuse="exact"``, submitted only while no user request waits or runs (so shadows take idle capacity)
and counted apart from user requests. Each pair gives a `Verification`: the first token's KL divergence
``KL(exact || blend)`` in nats, and, when the request's tokens are reproducible (greedy, or sampled with a seed),
whether the answers are identical and the share of the exact answer's tokens the blended one matches position by
position.

`BlendGate` keeps the last ``window`` verifications per namespace root. Once a namespace's window is full, it
trips when the share of identical answers (over the reproducible ones) falls below ``min_identical`` or the
median first-token KL rises above ``max_kl``: from then on that namespace's blend requests are served exactly
(each response says ``reuse="exact"``), with one warning logged and the fallback counted. It does not re-arm
while the engine runs: a restart does (the evidence was about this model and this traffic).

*Backfill* (``EngineConfig.blend_backfill``, opt-in): KV computed after a placed document never enters the exact prefix
tree, so a blended prompt that comes back again would be blended again. After a blended request whose prompt the
exact tree does not hold, its exact twin is also prefilled on idle capacity (one output token; a verification
twin does it too), so the same prompt coming back is served by exact reuse.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how often a waiting shadow checks whether the queue is empty


@dataclass(frozen=True)
class Verification:
    """One blended request compared with its exact shadow. ``identical`` / ``token_agreement``: None when the
    request's tokens are not reproducible (unseeded sampling). ``shadow_s``: the shadow's wall time from its
    submission to its last token (seconds); ``shadow_prompt_tokens``: its prompt length."""

    first_token_kl: float
    identical: bool | None
    token_agreement: float | None
    shadow_s: float
    shadow_prompt_tokens: int


def first_token_kl(exact_logits: torch.Tensor, blend_logits: torch.Tensor) -> float:
    """``KL(p_exact || p_blend)`` in nats of the two first-token distributions, in float64."""
    p = torch.log_softmax(exact_logits.double(), -1)
    q = torch.log_softmax(blend_logits.double(), -1)
    return float(max(0.0, torch.sum(p.exp() * (p - q)).item()))


def compare(blend: Any, exact: Any, reproducible: bool, shadow_s: float) -> Verification:
    """A `Verification` of two `GenerationResult`s of the same request (``reproducible``: greedy or seeded)."""
    kl = first_token_kl(exact.first_token_logits, blend.first_token_logits)
    if not reproducible:
        return Verification(kl, None, None, shadow_s, len(exact.prompt_token_ids))
    want, got = exact.token_ids, blend.token_ids
    agree = sum(1 for a, b in zip(want, got) if a == b) / len(want) if want else float(not got)
    return Verification(kl, want == got, agree, shadow_s, len(exact.prompt_token_ids))


class BlendGate:
    """Per-namespace rolling windows of verifications and the fallback decision (see the module docstring).
    Thread-safe."""

    def __init__(self, *, verify: float, window: int, min_identical: float, max_kl: float) -> None:
        self.verify = verify
        self.window = window
        self.min_identical = min_identical
        self.max_kl = max_kl
        self._lock = threading.Lock()
        self._windows: dict[bytes, deque[Verification]] = {}
        self._exact: set[bytes] = set()
        self._blended = 0
        self._verified = 0
        self._greedy = 0
        self._identical = 0
        self._agreement: list[float] = []
        self._kl: deque[float] = deque(maxlen=10_000)
        self._fallbacks = 0
        self._shadow_s = 0.0
        self._shadow_tokens = 0

    def allows(self, root: bytes) -> bool:
        """False once ``root``'s namespace fell back to exact."""
        with self._lock:
            return root not in self._exact

    def sample(self) -> bool:
        """Count one blended request; True when it is one to verify (every ``1/verify``-th)."""
        with self._lock:
            self._blended += 1
            n = self._blended
        return self.verify > 0 and math.floor(n * self.verify) > math.floor((n - 1) * self.verify)

    def record(self, root: bytes, v: Verification) -> bool:
        """Add a verification of ``root``'s namespace; True when it made the namespace fall back to exact."""
        with self._lock:
            self._verified += 1
            self._shadow_s += v.shadow_s
            self._shadow_tokens += v.shadow_prompt_tokens
            self._kl.append(v.first_token_kl)
            if v.identical is not None:
                self._greedy += 1
                self._identical += v.identical
                self._agreement.append(v.token_agreement)
            win = self._windows.setdefault(root, deque(maxlen=self.window))
            win.append(v)
            if root in self._exact or len(win) < self.window:
                return False
            reason = self._breach(win)
            if reason is None:
                return False
            self._exact.add(root)
            self._fallbacks += 1
        log.warning("blend gate: namespace root %s falls back to exact reuse (%s over its last %d verified "
                    "requests)", root.hex()[:12], reason, self.window)
        return True

    def _breach(self, win: deque[Verification]) -> str | None:
        kl = statistics.median(v.first_token_kl for v in win)
        if kl > self.max_kl:
            return f"median first-token KL {kl:.3g} nats > {self.max_kl:g}"
        checked = [v.identical for v in win if v.identical is not None]
        if checked:
            share = sum(checked) / len(checked)
            if share < self.min_identical:
                return f"identical answers {share:.0%} < {self.min_identical:.0%}"
        return None

    def snapshot(self, pending: int = 0, backfills: int = 0) -> dict[str, Any]:
        with self._lock:
            return {
                "backfills": backfills,
                "verify_fraction": self.verify,
                "verified": self._verified,
                "greedy_verified": self._greedy,
                "identical": self._identical,
                "token_agreement_mean": statistics.fmean(self._agreement) if self._agreement else None,
                "first_token_kl_median": statistics.median(self._kl) if self._kl else None,
                "fallbacks": self._fallbacks,
                "namespaces_exact": len(self._exact),
                "shadow_requests": self._verified,
                "shadow_prompt_tokens": self._shadow_tokens,
                "shadow_seconds": self._shadow_s,
                "pending_shadows": pending,
            }


@dataclass(frozen=True)
class ShadowJob:
    """An exact twin of a blended request, to run on idle capacity: the blended result, its namespace root,
    whether its tokens are reproducible, ``run()`` (submits the twin and waits for it: the engine's closure),
    ``verify`` (compare and record in the gate; False: a *backfill*, run only so that the exact prefix tree holds
    the prompt when it comes back) and ``key`` (the prompt's last plan key: one job per prompt waits at a time)."""

    blend: Any
    root: bytes
    reproducible: bool
    run: Callable[[], Any]
    verify: bool = True
    key: bytes = b""


class ShadowRunner:
    """Runs `ShadowJob`s one at a time on a daemon thread, each only once ``idle()`` says no user request waits,
    and records the verifications in the gate (backfills only count). A shadow that fails is dropped (logged): the gate only ever
    learns from completed pairs. At most ``max_pending`` jobs wait; more are dropped and counted."""

    def __init__(self, gate: BlendGate, idle: Callable[[], bool], *, max_pending: int = 64,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.gate = gate
        self._idle = idle
        self._clock = clock
        self._jobs: deque[ShadowJob] = deque()
        self._keys: set[bytes] = set()  # prompts with a job waiting
        self._max_pending = max_pending
        self.dropped = 0
        self.backfills = 0  # backfill twins completed
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pcr-blend-shadow", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._jobs)

    def add(self, job: ShadowJob) -> None:
        with self._cond:
            if self._closed:
                return
            if job.key and job.key in self._keys and not job.verify:
                return  # the same prompt already waits for its twin
            if len(self._jobs) >= self._max_pending:
                self.dropped += 1
                return
            self._jobs.append(job)
            if job.key:
                self._keys.add(job.key)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._jobs[0]
            if not self._idle():
                time.sleep(IDLE_POLL_S)
                continue
            with self._cond:
                if self._closed:
                    return
                self._jobs.popleft()
                self._keys.discard(job.key)
            started = self._clock()
            try:
                exact = job.run()
            except Exception as exc:  # noqa: BLE001 - a shadow is best effort; its request already succeeded
                log.warning("blend gate: a shadow request failed: %s: %s", type(exc).__name__, exc)
                continue
            if job.verify:
                self.gate.record(job.root, compare(job.blend, exact, job.reproducible, self._clock() - started))
            else:
                self.backfills += 1
