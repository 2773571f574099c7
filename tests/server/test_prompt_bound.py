"""`PromptCharBound`: the character bound that refuses an over-long prompt before tokenizing is derived only for
tokenizer pipelines where no token can cover more text than its longest vocabulary entry (times what a composing
normalizer merges), and it never refuses a prompt that fits."""

from __future__ import annotations

import sys
import unicodedata

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pcr_rag.server.prompt_bound import COMPOSED_CHARS, PromptCharBound
from pcr_rag.testing import tiny_tokenizer


def byte_bpe(normalizer=None, pre_tokenizer=None, added: AddedToken | None = None) -> PreTrainedTokenizerFast:
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if added is not None:
        backend.add_special_tokens([added])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_the_tiny_tokenizer_is_bounded_by_its_longest_token() -> None:
    bound = PromptCharBound.of(tiny_tokenizer(), 1024)
    assert bound is not None and bound.token_chars == len("<|im_start|>") and bound.composed == 1
    assert bound.max_chars == 1024 * 12 and bound.min_tokens(bound.max_chars + 1) == 1025


@pytest.mark.parametrize("normalizer", [normalizers.Lowercase(), normalizers.Strip(), normalizers.StripAccents(),
                                        normalizers.Replace("ab", "c"),
                                        normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])])
def test_a_normalizer_that_can_shorten_text_gets_no_bound(normalizer) -> None:
    assert PromptCharBound.of(byte_bpe(normalizer), 1024) is None


def test_dropping_pre_tokenizers_unknown_fusing_models_and_whitespace_swallowing_tokens_get_no_bound() -> None:
    assert PromptCharBound.of(byte_bpe(pre_tokenizer=pre_tokenizers.Whitespace()), 64) is None
    assert PromptCharBound.of(byte_bpe(added=AddedToken("<mask>", lstrip=True, special=True)), 64) is None
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert PromptCharBound.of(PreTrainedTokenizerFast(tokenizer_object=wordpiece), 64) is None
    fused = Tokenizer(models.BPE({"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    assert PromptCharBound.of(PreTrainedTokenizerFast(tokenizer_object=fused), 64) is None
    assert PromptCharBound.of(object(), 64) is None  # a slow tokenizer: no pipeline to read


def test_a_composing_normalizer_widens_the_bound_enough() -> None:
    """NFC turns U+1F82's four code points into one character; the bound counts them all, and a text of them at
    the bound still takes at least max_model_len tokens (it is refused only when it cannot fit)."""
    tok = byte_bpe(normalizers.NFC())
    bound = PromptCharBound.of(tok, 32)
    assert bound is not None and bound.composed == COMPOSED_CHARS
    decomposed = unicodedata.normalize("NFD", "\u1f82")
    assert len(decomposed) == COMPOSED_CHARS
    text = decomposed * (bound.max_chars // len(decomposed))
    assert len(tok(text, add_special_tokens=False)["input_ids"]) >= bound.min_tokens(len(text))
    assert PromptCharBound.of(byte_bpe(normalizers.NFD()), 32).composed == 1


def test_no_character_decomposes_into_more_than_composed_chars() -> None:
    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1))
    assert longest == COMPOSED_CHARS
