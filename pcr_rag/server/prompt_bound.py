"""A character bound on prompts, checked before anything is tokenized: `PromptCharBound`.

Tokenizing costs time in proportion to the text, so a request whose text alone proves the prompt too long is
rejected on its length in characters. The bound must never reject a prompt that fits, so it rests on one fact
about the tokenizer: **no token covers more than L characters of the text it came from**, where L is the longest
vocabulary entry in its stored form. That holds when the tokenizer never deletes or merges text away:

- byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen): an entry stores one character per byte, and a token's decoded text
  has at most as many characters as bytes;
- SentencePiece-style BPE (``▁`` for a space, ``<0x0A>`` byte fallback): an entry is at least as long as its text;
- special tokens typed in the text are vocabulary entries too (``<|im_start|>`` counts its 12 characters).

So a text of C characters takes at least C / L tokens, and a request whose prompt text exceeds
``max_model_len * L`` characters cannot fit ``max_model_len`` tokens (it also needs one new token). The chat
template only adds text around the messages. What the bound counts is each text field stripped of surrounding
whitespace (a template may trim it), summed.

A composing Unicode normalizer (NFC, NFKC: Qwen's) turns at most `COMPOSED_CHARS` characters into one (the longest
canonical decomposition, e.g. U+1F82 is four code points), so the bound is that many times wider for it;
decomposing ones (NFD, NFKD) only lengthen text. Tokenizers that can map many characters onto fewer tokens in other
ways (a normalizer that deletes or shortens text, a pre-tokenizer that drops whitespace, an added token that
swallows the whitespace beside it, an unknown-token model that fuses unknown characters, or a slow tokenizer whose
pipeline cannot be read) get no bound (`PromptCharBound.of` returns None): their prompts are checked by token count
only, still off the event loop.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["PromptCharBound"]

COMPOSED_CHARS = 4  # the most code points Unicode canonical composition turns into one (tests check it)

# pipeline steps that never turn text into fewer characters than the tokens' stored forms cover
_SAFE_NORMALIZERS = frozenset({"Prepend", "NFD", "NFKD"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_SAFE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"})


@dataclass(frozen=True)
class PromptCharBound:
    """``max_chars``: the most prompt characters that can fit ``max_model_len`` tokens: ``max_model_len`` times
    ``token_chars`` (the longest token in characters) times ``composed`` (the characters a normalizer may compose
    into one: 1 without a composing normalizer)."""

    max_model_len: int
    token_chars: int
    composed: int = 1

    @property
    def chars_per_token(self) -> int:
        return self.token_chars * self.composed

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.chars_per_token

    def min_tokens(self, chars: int) -> int:
        """The fewest tokens a text of ``chars`` characters can take."""
        return math.ceil(chars / self.chars_per_token)

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int) -> PromptCharBound | None:
        """The bound for ``tokenizer`` (a transformers fast tokenizer), or None when its pipeline may cover more
        text per token than its vocabulary shows (see the module docstring)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            log.info("no prompt character bound: the tokenizer is not a fast tokenizer")
            return None
        try:
            spec = json.loads(backend.to_str())
            vocab = tokenizer.get_vocab()
        except Exception as exc:  # noqa: BLE001 - an unreadable pipeline only loses the early check
            log.info("no prompt character bound: the tokenizer's pipeline cannot be read (%s)", exc)
            return None
        reason = _unsafe(spec)
        if reason is not None:
            log.info("no prompt character bound: %s", reason)
            return None
        longest = max((len(entry) for entry in vocab), default=0)
        if longest < 1:
            return None
        composing = any(step.get("type") in _COMPOSING_NORMALIZERS for step in _steps(spec.get("normalizer")))
        return cls(max_model_len, longest, COMPOSED_CHARS if composing else 1)


def _unsafe(spec: dict[str, Any]) -> str | None:
    """Why the tokenizer's pipeline may cover more characters per token than its longest entry times the
    composition factor (None: it cannot)."""
    normalizer = spec.get("normalizer")
    for step in _steps(normalizer):
        kind = step.get("type")
        if kind in _COMPOSING_NORMALIZERS:
            continue
        if kind == "Replace":
            pattern = step.get("pattern", {})
            if "String" not in pattern or len(step.get("content", "")) < len(pattern["String"]):
                return "the normalizer replaces text by shorter text"
        elif kind not in _SAFE_NORMALIZERS:
            return f"the normalizer {kind} may compose or delete characters"
    for step in _steps(spec.get("pre_tokenizer")):
        kind = step.get("type")
        if kind not in _SAFE_PRE_TOKENIZERS or step.get("behavior") == "Removed":
            return f"the pre-tokenizer {kind} may drop text"
    for token in spec.get("added_tokens") or []:
        if token.get("lstrip") or token.get("rstrip"):
            return f"the added token {token.get('content')!r} swallows the whitespace beside it"
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"the {model.get('type')} model may map unknown words to one token"
    if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
        return "the BPE model fuses unknown characters into one token"
    return None


def _steps(step: dict[str, Any] | None) -> list[dict[str, Any]]:
    if step is None:
        return []
    if step.get("type") == "Sequence":
        inner = step.get("normalizers") or step.get("pretokenizers") or []
        return [s for sub in inner for s in _steps(sub)]
    return [step]
