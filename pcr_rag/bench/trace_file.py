"""Trace files for ``pcr-rag bench --trace``: read a RAG segment trace or a Mooncake block-hash trace, and turn each
segment id into deterministic synthetic text of its token length.

Both formats are JSON Lines, one request per line (blank lines are skipped; one file holds one format, told apart
by its fields):

* **RAG segment trace** (this project's format; docs/benchmarks.md#replaying-a-trace)::

      {"timestamp": 0, "segments": [{"kind": "system", "id": "sys", "tokens": 180},
                                    {"kind": "system", "id": "user-17", "tokens": 60, "volatile": true},
                                    {"kind": "passage", "id": "p3", "tokens": 210},
                                    {"kind": "history", "id": "h9", "tokens": 40},
                                    {"kind": "question", "id": "q12", "tokens": 25}],
       "output_length": 48}

  ``timestamp``: milliseconds (any origin); ``segments`` in prompt order: ``system`` parts, then ``passage``\\ s,
  then ``history``, then at most one ``question`` (last); ``id``: a string or an integer, the same id of the same
  kind and length is the same text in every request; ``tokens``: its length (>= 1); ``volatile``: only on a system
  part, true for per-request text (a date, a user profile) that a template could move after the passages;
  ``output_length`` (optional): the response's tokens.
* **Mooncake** (FAST'25, ``{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}``): each
  hash id is a block of `MOONCAKE_BLOCK_TOKENS` tokens (the last block holds the rest of ``input_length``); a
  block's id hashes its tokens and every block before it, so equal ids mean equal prefixes. Blocks become
  segments of kind ``block``; tokens that ``input_length`` has beyond the last block (if any) become one
  per-request block.

Requests come back sorted by timestamp (stable: file order breaks ties); each keeps its 1-based line number, so an
error about a request can name its line. A line that cannot be read raises `TraceFormatError` naming the file, the
line and the field.

Synthetic text (`SyntheticText`): each segment identity ``(kind, id, tokens)`` becomes words drawn from the
tokenizer's own vocabulary (ASCII words that are one token with and without a leading space), seeded by a hash of
the identity, so the same identity gives the same text in every request, run and machine, and different identities
give different texts (a collision, possible only for very short texts, is re-drawn). The text alone tokenizes to
exactly ``tokens`` tokens when the tokenizer keeps space-separated words apart (byte-level BPE: every model the
project ships); otherwise the closest count a prefix of the drawn words reaches (`SyntheticText.stats` says how
close). In a prompt, the engine's layout adds its separators around each segment: exact counts come from the
engine's own prompt layout (`pcr_rag.bench.trace_bounds`), never from these lengths.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pcr_rag.bench.config import BenchError

log = logging.getLogger(__name__)

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "SEGMENT_KINDS",
    "SyntheticStats",
    "SyntheticText",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "TraceSegment",
    "parse_trace",
    "read_trace",
    "word_pool",
]

#: Segment kinds of a RAG trace, in the order they may appear in a request (``block``: a Mooncake block).
SEGMENT_KINDS: tuple[str, ...] = ("system", "passage", "history", "question")
#: Tokens per hash id in the Mooncake trace (its paper's block size).
MOONCAKE_BLOCK_TOKENS = 512
_BLOCK = "block"
#: Words of the synthetic-text pool at most (the first ones by token id: short, common merges).
_POOL_MAX = 4096
_SALT = "pcr-rag-trace-text-v1"
#: Re-draws of a text that collides with another identity's before giving up (a pool of one word).
_MAX_REDRAWS = 64


class TraceFormatError(BenchError):
    """A trace file that cannot be read: the message names the file, the line and what to fix."""


@dataclass(frozen=True)
class TraceSegment:
    """One prompt segment of a trace request: ``kind`` (`SEGMENT_KINDS` or ``block``), ``id`` (as a string),
    ``tokens`` (its length in the trace, >= 1), ``volatile`` (a per-request system part)."""

    kind: str
    id: str
    tokens: int
    volatile: bool = False

    @property
    def identity(self) -> tuple[str, str, int]:
        """What makes two segments the same text: kind, id and length."""
        return (self.kind, self.id, self.tokens)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: ``line`` (1-based, in its file), ``timestamp_ms``, its segments in prompt order,
    ``output_length`` (None when the trace has none)."""

    line: int
    timestamp_ms: float
    segments: tuple[TraceSegment, ...]
    output_length: int | None = None

    @property
    def trace_tokens(self) -> int:
        """Prompt tokens by the trace's lengths (the engine's layout adds its separators)."""
        return sum(s.tokens for s in self.segments)

    @property
    def question(self) -> TraceSegment | None:
        last = self.segments[-1] if self.segments else None
        return last if last is not None and last.kind == "question" else None

    def scaled(self, factor: float) -> TraceRequest:
        """Every segment's length and the output length times ``factor`` (rounded, at least 1 token): the same
        structure, shorter."""
        if factor == 1.0:
            return self
        out = None if self.output_length is None else max(1, round(self.output_length * factor))
        return replace(self, segments=tuple(replace(s, tokens=max(1, round(s.tokens * factor)))
                                            for s in self.segments), output_length=out)


@dataclass(frozen=True)
class Trace:
    """A trace read from ``source``: ``format`` ("rag" or "mooncake") and its requests sorted by timestamp."""

    format: str
    requests: tuple[TraceRequest, ...]
    source: str = "<trace>"

    @property
    def position_independent(self) -> bool:
        """False for a block-hash trace: its ids chain by prefix, so a seen id always sits after the same prefix
        and no reuse beyond the prefix bound can show."""
        return self.format == "rag"

    def head(self, n: int | None) -> Trace:
        """The first ``n`` requests (all for None)."""
        return self if n is None else replace(self, requests=self.requests[:n])

    def scaled(self, factor: float) -> Trace:
        """Every segment and output length times ``factor`` (`TraceRequest.scaled`)."""
        return self if factor == 1.0 else replace(self, requests=tuple(r.scaled(factor) for r in self.requests))

    def arrivals_s(self, speed: float = 1.0) -> list[float]:
        """Arrival times in seconds from the first request, the trace's gaps divided by ``speed`` (inf: all at 0)."""
        if not speed > 0:
            raise ValueError(f"trace speed must be > 0 (inf = all at once), got {speed}")
        if not self.requests:
            return []
        t0 = self.requests[0].timestamp_ms
        if math.isinf(speed):
            return [0.0] * len(self.requests)
        return [(r.timestamp_ms - t0) / 1000.0 / speed for r in self.requests]


def read_trace(path: str | Path) -> Trace:
    """Read a trace file (see the module docstring); raises `TraceFormatError` naming the line at fault."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace file {p}: {exc}") from None
    return parse_trace(text.splitlines(), source=str(p))


def parse_trace(lines: Iterable[str], *, source: str = "<trace>") -> Trace:
    """Parse JSON Lines of one trace format (see the module docstring)."""
    requests: list[TraceRequest] = []
    fmt: str | None = None
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{source}, line {number}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{where}: expected a JSON object (one request per line), got "
                                   f"{type(obj).__name__}")
        kind = "rag" if "segments" in obj else "mooncake" if "hash_ids" in obj else None
        if kind is None:
            raise TraceFormatError(f"{where}: neither a RAG trace request (no 'segments') nor a Mooncake request "
                                   "(no 'hash_ids'); see docs/benchmarks.md for both formats")
        if fmt is not None and kind != fmt:
            raise TraceFormatError(f"{where}: a {kind} request in a {fmt} trace; one file holds one format")
        fmt = kind
        requests.append(_rag_request(obj, number, where) if kind == "rag" else _mooncake_request(obj, number, where))
    if not requests:
        raise TraceFormatError(f"{source}: the trace holds no requests")
    assert fmt is not None
    requests.sort(key=lambda r: r.timestamp_ms)  # stable: file order breaks ties
    return Trace(fmt, tuple(requests), source)


def _number(obj: dict[str, Any], name: str, where: str, *, integer: bool, minimum: float,
            required: bool = True) -> Any:
    value = obj.get(name)
    if value is None:
        if required:
            raise TraceFormatError(f"{where}: missing '{name}'")
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (not integer and not math.isfinite(value)) or value < minimum:
        what = "an integer" if integer else "a finite number"
        raise TraceFormatError(f"{where}: '{name}' must be {what} >= {minimum:g}, got {value!r}")
    return value


def _rag_request(obj: dict[str, Any], number: int, where: str) -> TraceRequest:
    ts = _number(obj, "timestamp", where, integer=False, minimum=0)
    out = _number(obj, "output_length", where, integer=True, minimum=0, required=False)
    raw = obj["segments"]
    if not isinstance(raw, list) or not raw:
        raise TraceFormatError(f"{where}: 'segments' must be a non-empty list")
    segments: list[TraceSegment] = []
    rank = 0
    for i, seg in enumerate(raw):
        at = f"{where}, segment {i}"
        if not isinstance(seg, dict):
            raise TraceFormatError(f"{at}: expected an object with kind, id, tokens")
        kind = seg.get("kind")
        if kind not in SEGMENT_KINDS:
            raise TraceFormatError(f"{at}: 'kind' must be one of {', '.join(SEGMENT_KINDS)}, got {kind!r}")
        if SEGMENT_KINDS.index(kind) < rank or (rank == 3 and kind == "question"):
            raise TraceFormatError(f"{at}: a {kind} segment after a {SEGMENT_KINDS[rank]} one; segments go system, "
                                   "passage, history, then at most one question")
        rank = SEGMENT_KINDS.index(kind)
        sid = seg.get("id")
        if isinstance(sid, bool) or not isinstance(sid, (str, int)) or (isinstance(sid, str) and not sid):
            raise TraceFormatError(f"{at}: 'id' must be a non-empty string or an integer, got {sid!r}")
        tokens = _number(seg, "tokens", at, integer=True, minimum=1)
        volatile = seg.get("volatile", False)
        if not isinstance(volatile, bool):
            raise TraceFormatError(f"{at}: 'volatile' must be true or false, got {volatile!r}")
        if volatile and kind != "system":
            raise TraceFormatError(f"{at}: only a system part can be volatile (per-request text a template could "
                                   f"move after the passages), not a {kind}")
        segments.append(TraceSegment(kind, str(sid), tokens, volatile))
    return TraceRequest(number, float(ts), tuple(segments), out)


def _mooncake_request(obj: dict[str, Any], number: int, where: str) -> TraceRequest:
    ts = _number(obj, "timestamp", where, integer=False, minimum=0)
    length = _number(obj, "input_length", where, integer=True, minimum=1)
    out = _number(obj, "output_length", where, integer=True, minimum=0, required=False)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids or any(isinstance(h, bool) or not isinstance(h, (int, str))
                                                   for h in ids):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a non-empty list of integers")
    if length <= MOONCAKE_BLOCK_TOKENS * (len(ids) - 1):
        raise TraceFormatError(f"{where}: {len(ids)} hash_ids of {MOONCAKE_BLOCK_TOKENS}-token blocks need an "
                               f"input_length above {MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)}, got {length}")
    segments = [TraceSegment(_BLOCK, str(h), min(MOONCAKE_BLOCK_TOKENS, length - MOONCAKE_BLOCK_TOKENS * i))
                for i, h in enumerate(ids)]
    rest = length - MOONCAKE_BLOCK_TOKENS * len(ids)
    if rest > 0:  # input beyond the hashed blocks: this request's own tokens
        segments.append(TraceSegment(_BLOCK, f"line-{number}-rest", rest))
    return TraceRequest(number, float(ts), tuple(segments), out)


# ---------------------------------------------------------------------------------------------- synthetic text
def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def word_pool(tokenizer: Any, limit: int = _POOL_MAX) -> tuple[str, ...]:
    """ASCII words that are one token both alone and after a space, in token-id order (at most ``limit``); the
    letters a-z when the vocabulary has fewer than two (then words may cost several tokens each)."""
    vocab = sorted(tokenizer.get_vocab().values())
    decoded = tokenizer.batch_decode([[i] for i in vocab])
    candidates = list(dict.fromkeys(s[1:] for s in decoded
                                    if len(s) >= 2 and s[0] == " " and s[1:].isascii() and s[1:].isalpha()))
    words: list[str] = []
    step = 512
    for lo in range(0, len(candidates), step):
        batch = candidates[lo:lo + step]
        spaced = tokenizer([" " + w for w in batch], add_special_tokens=False)["input_ids"]
        bare = tokenizer(batch, add_special_tokens=False)["input_ids"]
        words += [w for w, a, b in zip(batch, spaced, bare, strict=True) if len(a) == 1 and len(b) == 1]
        if len(words) >= limit:
            break
    if len(words) < 2:
        log.warning("the tokenizer has no single-token words; synthetic text uses letters and may miss lengths")
        return tuple("abcdefghijklmnopqrstuvwxyz")
    return tuple(words[:limit])


@dataclass(frozen=True)
class SyntheticStats:
    """How close the synthetic texts came to their lengths (each text alone, without the prompt's separators):
    ``segments`` texts made, ``exact`` of them at their length, ``max_abs_error`` / ``total_abs_error`` tokens
    off, ``requested`` / ``produced`` tokens in all."""

    segments: int
    exact: int
    max_abs_error: int
    total_abs_error: int
    requested: int
    produced: int

    def as_dict(self) -> dict[str, int]:
        return {"segments": self.segments, "exact": self.exact, "max_abs_error": self.max_abs_error,
                "total_abs_error": self.total_abs_error, "requested": self.requested, "produced": self.produced}


class SyntheticText:
    """Deterministic text per segment identity (see the module docstring); not thread-safe."""

    def __init__(self, tokenizer: Any, *, words: Sequence[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.words = tuple(words) if words is not None else word_pool(tokenizer)
        self._texts: dict[tuple[str, str, int], tuple[str, int]] = {}
        self._owner: dict[str, tuple[str, str, int]] = {}

    def text(self, segment: TraceSegment) -> str:
        """The text of ``segment``'s identity (made on first use, then the same every time)."""
        key = segment.identity
        hit = self._texts.get(key)
        if hit is not None:
            return hit[0]
        for redraw in range(_MAX_REDRAWS):
            text, n = self._draw(key, redraw)
            if self._owner.setdefault(text, key) == key:
                self._texts[key] = (text, n)
                return text
        raise BenchError(f"cannot make a distinct text for segment {key} from a pool of {len(self.words)} words")

    def _draw(self, key: tuple[str, str, int], redraw: int) -> tuple[str, int]:
        """The longest prefix of seeded words whose token count is at most the length, or the first one past it
        when that is closer; returns (text, its token count)."""
        target = key[2]
        digest = hashlib.blake2b(json.dumps([_SALT, *key, redraw]).encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        words = [self.words[i] for i in rng.integers(len(self.words), size=target)]
        full = _count(self.tokenizer, " ".join(words))
        if full == target:
            return " ".join(words), full
        lo, hi = 1, target  # count(prefix of n words) grows with n: the largest n with count <= target
        best_n, best_c = 1, _count(self.tokenizer, words[0])
        while lo <= hi:
            mid = (lo + hi) // 2
            c = _count(self.tokenizer, " ".join(words[:mid]))
            if c <= target:
                best_n, best_c = mid, c
                lo = mid + 1
            else:
                hi = mid - 1
        if best_c < target and best_n < target:
            over = _count(self.tokenizer, " ".join(words[:best_n + 1]))
            if over - target < target - best_c:
                best_n, best_c = best_n + 1, over
        return " ".join(words[:best_n]), best_c

    def stats(self) -> SyntheticStats:
        """How close every text made so far came to its length."""
        errors = [abs(n - key[2]) for key, (_, n) in self._texts.items()]
        return SyntheticStats(len(errors), sum(e == 0 for e in errors), max(errors, default=0), sum(errors),
                              sum(key[2] for key in self._texts), sum(n for _, n in self._texts.values()))
