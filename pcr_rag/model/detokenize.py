"""Incremental detokenization: the text of a growing answer, decoding a few recent tokens per step.

Decoding the whole answer at every step costs O(n) per token and O(n^2) per answer, on the executor thread that
every row waits on (see docs/measurements-history.md#figures-moved-from-code-comments).
`IncrementalText` decodes only a window: the last `CONTEXT_TOKENS` tokens before ``read_offset`` (the point up to
which the text is known to be complete) as context, and the tokens after it.

Invariant: ``IncrementalText.append`` returns ``tokenizer.decode(tokens, skip_special_tokens=True)`` of every
token appended so far (tested step by step against that full decode on byte-level BPE and SentencePiece
tokenizers, real text and random ids). It holds because
- ``read_offset`` only advances to a point where the decoded text does not end in an unfinished multi-byte
  character, so bytes after it never merge with bytes before it;
- the window starts ``CONTEXT_TOKENS`` before that point and its first decoded characters are compared with the
  context's own decode: what a tokenizer does at the start of a decode (SentencePiece drops a leading space) stays
  inside the context, and the text after the context is the tail in the whole answer's context;
- where the window's decode does not start with the context's (a tokenizer whose decode of a token depends on what
  follows), that step decodes the whole answer instead and restarts the window from there.
"""

from __future__ import annotations

INCOMPLETE_CHAR = "\ufffd"  # what a tokenizer decodes an unfinished multi-byte character to
CONTEXT_TOKENS = 4          # tokens of already-complete text decoded ahead of the new ones


class IncrementalText:
    """The decoded text of the tokens appended so far (see the module docstring for the invariant)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []  # every token appended, in order (a decode row's answer: its one token list)
        self.full_decodes = 0     # steps that fell back to decoding every token (for tests and diagnostics)
        self._read_offset = 0     # tokens[:read_offset] decode to _read_text, which ends on a whole character
        self._read_text = ""
        self._context_text = ""   # decode(tokens[context_start:read_offset]) on its own

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @property
    def _context_start(self) -> int:
        return max(0, self._read_offset - CONTEXT_TOKENS)

    def append(self, token: int) -> str:
        """Add one token; the text of all tokens so far."""
        self.tokens.append(token)
        window = self._decode(self.tokens[self._context_start:])
        if window.startswith(self._context_text):
            text = self._read_text + window[len(self._context_text):]
        else:
            self.full_decodes += 1
            text = self._decode(self.tokens)
        if not text.endswith(INCOMPLETE_CHAR):
            self._read_offset, self._read_text = len(self.tokens), text
            self._context_text = self._decode(self.tokens[self._context_start:])
        return text
