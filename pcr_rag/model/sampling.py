"""Choosing a row's next token from its logits: greedy, or temperature / top-k / top-p with the request's own
generator, after the request's own penalties; and the logprobs of what was chosen.

A row's choice depends only on its own logits, its parameters, its seed, its constraint and its own tokens (the
prompt's and those it generated), never on the other rows of the batch. A `TokenConstraint` (a grammar, see
`pcr_rag.model.grammar`) masks the logits before the choice and is told every accepted token.

The steps, in vLLM's order, on one row's float32 logits:
1. the constraint's mask (disallowed tokens at -inf), and end-of-sequence masked while the answer is shorter than
   ``min_tokens`` (unless that would leave no token: a grammar that allows only the end wins);
2. the logprobs, when asked for: ``log_softmax`` of these logits, before penalties and temperature (the model's
   own distribution over the allowed tokens, as vLLM's default ``raw_logprobs``);
3. penalties: ``repetition_penalty`` r over every token of the prompt and of the answer so far (a positive logit
   divided by r, a negative one multiplied by it: HF / vLLM); then OpenAI's
   ``logit[j] -= frequency_penalty * c[j] + presence_penalty * (c[j] > 0)``, c[j] = times token j was generated;
4. a temperature below `GREEDY_BELOW` (0 included) picks the argmax (a tiny temperature would overflow the scaled
   logits to inf and the softmax to NaN); else the logits divided by the temperature, ``min_p`` (tokens whose
   probability is below ``min_p`` times the highest are dropped), ``top_k`` (the k highest, ties at the k-th as
   `torch.topk` orders them), then ``top_p`` (the smallest head of the sorted distribution whose mass reaches
   top_p), sampled.

Cost: a request without penalties, top_k or logprobs runs exactly the steps it ran before they existed. Penalties
read and write only the tokens the request has seen (plus one copy of its row's logits); top_k draws from k
entries instead of the vocabulary; logprobs cost a log-softmax (and a top-k) of the row. All on the request's own
row only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pcr_rag.request import GREEDY_BELOW, SamplingParams, TokenLogprob, TopLogprob, check_seed


class TokenConstraint(Protocol):
    """Per-request constraint on the next token (e.g. a compiled grammar's matcher)."""

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [vocab]`` (float32) with disallowed tokens at -inf; may modify in place."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (one of the tokens the last mask allowed)."""

    def is_terminated(self) -> bool:
        """True when the constraint is complete and only end-of-sequence may follow."""


@dataclass(frozen=True)
class RawLogprob:
    """A chosen token's logprob and the ``top_logprobs`` most likely tokens (ids, logprobs; highest first), as the
    sampler computed them; `TokenTexts.describe` adds the token strings and bytes."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class TokenSampler:
    """Picks one token per call from a row's logits (see the module docstring).

    ``prompt_token_ids``: the request's prompt, which ``repetition_penalty`` counts as seen. ``logprobs`` holds one
    `RawLogprob` per accepted token (when ``params.logprobs``), in order: the end-of-sequence token, which is never
    accepted, has none (unless ``ignore_eos`` makes it one of the answer's). ``eos_ids``: the tokens ``min_tokens``
    masks until that many were accepted."""

    def __init__(self, params: SamplingParams, constraint: TokenConstraint | None = None, *,
                 prompt_token_ids: Sequence[int] = (), eos_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.constraint = constraint
        self._eos_ids = tuple(sorted(eos_ids)) if params.min_tokens else ()
        self._accepted = 0
        self.greedy = params.temperature < GREEDY_BELOW
        self._gen: torch.Generator | None = None
        if not self.greedy:
            check_seed(params.seed)  # validated with the params; a seed set past validation fails here, clearly
            self._gen = torch.Generator(device="cpu")
            self._gen.manual_seed(params.seed if params.seed is not None else time.time_ns() % (2**31))
        self._repetition = params.repetition_penalty != 1.0
        self._additive = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self._prompt_ids = tuple(prompt_token_ids) if self._repetition else ()
        self._counts: dict[int, int] = {}  # generated token -> times (presence / frequency penalty on)
        self._seen: set[int] = set()  # prompt and generated tokens (repetition_penalty on) ...
        self._seen_ids: torch.Tensor | None = None  # ... as a tensor, built at the first choice, grown per new token
        self._pending: RawLogprob | None = None
        self.logprobs: list[RawLogprob] = []

    @property
    def last_logprob(self) -> RawLogprob | None:
        """The last accepted token's logprobs (None when the request asked for none)."""
        return self.logprobs[-1] if self.logprobs else None

    def select(self, logits: torch.Tensor) -> int:
        scores = logits.float()
        if self.constraint is not None:
            scores = self.constraint.mask_logits(scores.clone())
        p = self.params
        if self._eos_ids and self._accepted < p.min_tokens:
            scores = _mask_ids(scores if self.constraint is not None else scores.clone(), self._eos_ids)
        logprobs = torch.log_softmax(scores, dim=-1) if p.logprobs else None
        if self._repetition or self._additive:
            scores = self._penalize(scores)
        if self.greedy:
            token = int(torch.argmax(scores).item())
        else:
            token = self._sample(scores)
        if logprobs is not None:
            self._pending = self._record(logprobs, token)
        return token

    def _sample(self, scores: torch.Tensor) -> int:
        p = self.params
        scaled = scores / p.temperature
        if p.min_p > 0:
            probs = torch.softmax(scaled, dim=-1)
            scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if 0 < p.top_k < scaled.shape[-1]:  # only the k best take part: a k-long softmax, top-p and draw
            values, ids = torch.topk(scaled, p.top_k)  # sorted, highest first
            head = torch.softmax(values, dim=-1).cpu()
            if p.top_p < 1.0:
                head = head * (torch.cumsum(head, 0) - head < p.top_p)
                head = head / head.sum()
            return int(ids.cpu()[torch.multinomial(head, 1, generator=self._gen)].item())
        probs = torch.softmax(scaled, dim=-1).cpu()
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
            sorted_p = sorted_p * keep
            choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=self._gen)
            return int(idx[choice].item())
        return int(torch.multinomial(probs, 1, generator=self._gen).item())

    def _penalize(self, scores: torch.Tensor) -> torch.Tensor:
        """The penalized logits (a new tensor): repetition over prompt + answer, then frequency and presence over
        the answer's counts (see the module docstring). Sparse: only the tokens seen so far are read and written,
        so the cost grows with the request's distinct tokens, not with the vocabulary."""
        p = self.params
        vocab = scores.shape[-1]
        scores = scores.clone()
        if self._repetition:
            if self._seen_ids is None:
                self._seen.update(t for t in self._prompt_ids if 0 <= t < vocab)
                self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long, device=scores.device)
            if self._seen_ids.numel():
                r = p.repetition_penalty
                seen = scores[self._seen_ids]
                scores[self._seen_ids] = torch.where(seen > 0, seen / r, seen * r)
        if self._additive and self._counts:
            ids = torch.tensor(list(self._counts), dtype=torch.long, device=scores.device)
            counts = torch.tensor(list(self._counts.values()), dtype=torch.float32, device=scores.device)
            scores[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return scores

    def _record(self, logprobs: torch.Tensor, token: int) -> RawLogprob:
        k = min(self.params.top_logprobs, logprobs.shape[-1])
        if k:
            values, ids = torch.topk(logprobs, k)
            return RawLogprob(token, float(logprobs[token].item()), tuple(ids.tolist()), tuple(values.tolist()))
        return RawLogprob(token, float(logprobs[token].item()))

    def accept(self, token_id: int) -> None:
        self._accepted += 1
        if self.constraint is not None:
            self.constraint.accept(token_id)
        if self._additive:
            self._counts[token_id] = self._counts.get(token_id, 0) + 1
        if self._repetition and token_id not in self._seen:
            self._seen.add(token_id)
            if self._seen_ids is not None:
                self._seen_ids = torch.cat([self._seen_ids, self._seen_ids.new_tensor([token_id])])
        if self._pending is not None:
            self.logprobs.append(self._pending)
            self._pending = None


def _mask_ids(scores: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """``scores`` (modified in place) with ``ids`` at -inf, unless no other token is left: then unchanged (a grammar
    that allows only the end of the answer is obeyed rather than leaving nothing to choose)."""
    index = torch.tensor([i for i in ids if 0 <= i < scores.shape[-1]], dtype=torch.long, device=scores.device)
    if not index.numel():
        return scores
    kept = scores[index].clone()
    scores[index] = float("-inf")
    if not bool(torch.isfinite(scores).any()):
        scores[index] = kept
    return scores


class TokenTexts:
    """Token id -> (text, bytes) for logprobs, cached: a byte-level BPE token's exact bytes (through the GPT-2
    byte alphabet), a SentencePiece byte-fallback token ``<0xHH>``'s byte, else the UTF-8 of its decode. ``text``
    is those bytes decoded (an incomplete character as U+FFFD). An id past the tokenizer's vocabulary (padding
    rows of the embedding) is ``""`` with no bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._byte_level = _is_byte_level(tokenizer)
        self._byte_decoder = {ch: b for b, ch in _bytes_to_unicode().items()} if self._byte_level else {}

    def text_and_bytes(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", ()
        special = piece in getattr(self.tokenizer, "all_special_tokens", ()) or piece in getattr(
            self.tokenizer, "added_tokens_encoder", {})
        if not special:
            if self._byte_level and all(ch in self._byte_decoder for ch in piece):
                raw = bytes(self._byte_decoder[ch] for ch in piece)
                return raw.decode("utf-8", errors="replace"), tuple(raw)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    raw = bytes([int(piece[3:5], 16)])
                    return raw.decode("utf-8", errors="replace"), tuple(raw)
                except ValueError:
                    pass
        text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text, tuple(text.encode("utf-8"))

    def describe(self, raw: RawLogprob) -> TokenLogprob:
        """The OpenAI-shaped entry of ``raw``."""
        text, data = self.text_and_bytes(raw.token_id)
        top = tuple(TopLogprob(i, *self.text_and_bytes(i), lp) for i, lp in zip(raw.top_ids, raw.top_logprobs))
        return TokenLogprob(raw.token_id, text, data, raw.logprob, top)


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet byte-level BPE vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
