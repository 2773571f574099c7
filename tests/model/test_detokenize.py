"""Incremental detokenization equals decoding the whole answer, at every step, and decodes O(1) tokens a step."""

from __future__ import annotations

import random

import pytest

from pcr_rag.model.detokenize import CONTEXT_TOKENS, IncrementalText
from pcr_rag.testing import tiny_tokenizer

TEXTS = (
    "Plain English, with punctuation: commas, dots... and (parentheses)!\nA second line\t\twith tabs.",
    "héllo wörld ✓ Ünïcödé dócümént ✓✓ 日本語のテキスト emoji 🙂🙂 please, and a flag 🇫🇷 at the end",
    "def f(x: int) -> int:\n    return x ** 2  # squares\n\n\nprint(f(3))  ",
    "   leading spaces, trailing spaces   ",
)


class CountingTokenizer:
    """Wraps a tokenizer and records how many tokens each decode call was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def decode(self, ids, **kw) -> str:
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kw)


def _stream_matches_full_decode(tokenizer, ids: list[int]) -> IncrementalText:
    text = IncrementalText(tokenizer)
    reference = getattr(tokenizer, "tokenizer", tokenizer)  # not counted
    for n, tok in enumerate(ids, 1):
        assert text.append(tok) == reference.decode(ids[:n], skip_special_tokens=True), (n, ids[:n])
    return text


def _check_tokenizer(tokenizer, *, random_seqs: int) -> None:
    for t in TEXTS:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        counting = CountingTokenizer(tokenizer)
        inc = _stream_matches_full_decode(counting, ids * 3)
        # each step decodes the window (context + the tokens since the last whole character) and, when it
        # advances, the context: never the whole answer on real text
        assert inc.full_decodes == 0
        assert max(counting.sizes) <= CONTEXT_TOKENS + 4, max(counting.sizes)
    rng = random.Random(0)
    for _ in range(random_seqs):  # random ids: partial characters, special tokens, bytes that never complete
        _stream_matches_full_decode(tokenizer, [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))])


def test_tiny_byte_level_tokenizer() -> None:
    _check_tokenizer(tiny_tokenizer(), random_seqs=200)


def test_a_window_that_decodes_differently_falls_back_to_the_whole_answer() -> None:
    """A tokenizer whose decode of a token depends on the tokens after it: the window's decode does not start
    with the context's own, so that step decodes everything - still the whole answer's text."""

    class Merging:
        def decode(self, ids, **kw) -> str:  # "ab" becomes "X" wherever it appears, across token boundaries
            return "".join("ab"[i] for i in ids).replace("ab", "X")

    tok = Merging()
    inc = _stream_matches_full_decode(tok, [0, 0, 0, 0, 0, 1, 0, 1, 1, 0])
    assert inc.full_decodes > 0


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m-instruct", "gemma3-270m"])
def test_real_tokenizers(alias: str) -> None:
    """SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece-style, byte fallback, leading-space handling)."""
    from pcr_rag.model.model import KNOWN_MODELS, ModelPackageMissingError, load_model

    try:
        KNOWN_MODELS[alias].locate()
    except ModelPackageMissingError as exc:
        pytest.skip(f"{alias} weights not installed ({exc})")
    _check_tokenizer(load_model(alias, dtype="float32").tokenizer, random_seqs=50)
