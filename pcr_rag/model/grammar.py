"""Grammar-constrained decoding: the compiled grammars and the per-row matcher of a `ResponseFormat`
(`pcr_rag.response_format`: what the output must match, validated before it gets here).

- `GrammarCompiler`: one per engine (tokenizer, vocabulary size, EOS ids). ``matcher(fmt)`` compiles ``fmt``
  against the vocabulary once (an LRU of at most ``cache_size`` compiled grammars standing for at most
  ``cache_bytes`` of grammar text, keyed by the format) and hands out a fresh `GrammarMatcher` per request. It runs
  for admitted requests only, so a refused request fills no cache; a compiled grammar's digest also spares later
  `ResponseFormat` constructions the validation.
- `GrammarMatcher`: the `TokenConstraint` of one request. ``mask_logits`` sets every token the grammar does not
  allow next to -inf in that row's logits only, so a constrained request's tokens never depend on its batch
  company. EOS is allowed exactly when the grammar accepts the text so far; once nothing but EOS may follow,
  ``is_terminated()`` is true and the row finishes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from pcr_rag.response_format import GrammarError, ResponseFormat, one_line, remember_valid

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["GrammarCompiler", "GrammarMatcher"]

DEFAULT_CACHE_SIZE = 64  # compiled grammars kept per engine
# bytes of source and grammar text the compiled grammars kept per engine may stand for: a compiled
# grammar grows with its grammar's text, so a few huge formats cannot hold what many small ones would
DEFAULT_CACHE_BYTES = 32 * 2**20


# ---------------------------------------------------------------------------------------------------- matching
class GrammarMatcher:
    """The grammar state of one request (a `TokenConstraint`). Not thread-safe: one decode row owns it.

    The mask is unpacked and applied with numpy on the CPU: single-threaded vector code, so it never waits for
    torch's intra-op thread pool (which, on a busy machine, stalls for milliseconds on 50k-element ops)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # one bit per token, little-endian

    def _allowed(self) -> np.ndarray:
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if m.is_error():
            raise GrammarError(f"grammar matcher failed: {m.get_error()}")
        return np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.vocab_size].view(np.bool_)

    def allowed(self) -> torch.Tensor:
        """Bool ``[vocab_size]``: the tokens the grammar allows next (EOS ids when it may end here)."""
        import torch  # the engine's dependency (a matcher only exists inside an engine), not the thin client's
        return torch.from_numpy(self._allowed())

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [vocab]`` with the tokens the grammar disallows at -inf (in place)."""
        import torch
        allowed = self._allowed()
        n = min(logits.shape[-1], self.vocab_size)
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            np.copyto(logits.numpy()[:n], -np.inf, where=~allowed[:n])
        else:
            logits[:n].masked_fill_(~torch.from_numpy(allowed[:n]).to(logits.device), float("-inf"))
        if logits.shape[-1] > n:  # logits rows beyond the tokenizer's vocabulary are never valid
            logits[n:] = float("-inf")
        return logits

    def accept(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} violates the response format: {self._matcher.get_error()}")

    def is_terminated(self) -> bool:
        """True when the output is complete and nothing but EOS may follow."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS allowed here)."""
        return self._matcher.is_accepting()


class GrammarCompiler:
    """Compiles `ResponseFormat`s against one tokenizer's vocabulary; keeps the last ``cache_size`` compiled
    grammars (LRU, keyed by the format). Thread-safe.

    Args:
        tokenizer: the engine's Hugging Face fast tokenizer.
        vocab_size: rows of the model's logits (may exceed the tokenizer's vocabulary).
        eos_ids: every token id that ends a sequence; the grammar allows them where the output may end.
    The tokenizer's llguidance form (about a second for a 50k vocabulary) is built on the first compile.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int], *,
                 cache_size: int = DEFAULT_CACHE_SIZE, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if cache_bytes < 1:
            raise ValueError(f"cache_bytes must be >= 1, got {cache_bytes}")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_ids = sorted(set(eos_ids))
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[ResponseFormat, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self.cached_bytes = 0  # the kept formats' source and grammar text, in bytes
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def matcher(self, fmt: ResponseFormat) -> GrammarMatcher:
        """A fresh matcher for one request. Raises `GrammarError` if ``fmt`` does not compile for this vocabulary.
        The cache keeps at most ``cache_size`` formats standing for at most ``cache_bytes`` (least recently used
        go first; a format over ``cache_bytes`` on its own is compiled and not kept)."""
        with self._lock:
            entry = self._compiled.get(fmt)
            if entry is not None:
                self._compiled.move_to_end(fmt)
                self.hits += 1
                template = entry[0]
            else:
                grammar = fmt.grammar
                template = self._compile(grammar)
                self.misses += 1
                remember_valid(grammar)
                cost = len(fmt.source.encode("utf-8", "surrogatepass")) + len(grammar)
                if cost <= self.cache_bytes:
                    self._compiled[fmt] = (template, cost)
                    self.cached_bytes += cost
                    while len(self._compiled) > self.cache_size or self.cached_bytes > self.cache_bytes:
                        _, (_, dropped) = self._compiled.popitem(last=False)
                        self.cached_bytes -= dropped
            return GrammarMatcher(template.deep_copy(), self.vocab_size)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        tok = self._llg_tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            raise GrammarError(f"the response format does not compile for this model's vocabulary: "
                               f"{one_line(messages)}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the response format does not compile: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            import llguidance.hf  # imports transformers; only needed here

            eos = self.eos_ids or None
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        return self._ll_tokenizer
