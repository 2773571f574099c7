"""The context window a `PCRLLM` will have, read without loading the model's weights.

LlamaIndex reads ``llm.metadata.context_window`` when it builds a query engine or a prompt helper, before any call.
`PCREngine` sets ``max_model_len = min(config.max_model_len or own, own)``, where ``own`` is the model's context
(`pcr_rag.model.model.context_window_of` of its config and tokenizer). ``own`` is read here from the same source
the loader uses, at a fraction of the cost:

* a transformers model object: its ``config`` (and the tokenizer given with it);
* a model directory holding ``config.json``: the config and tokenizer files (no weights);
* a known alias, a ``.gguf`` file or a directory holding one: the GGUF header's ``{arch}.context_length``, which the
  conversion turns into the config's ``max_position_embeddings``. Only the key-value section up to that key is read
  (the `gguf` package's reader parses the whole file, tokenizer arrays included: seconds).

Anything else (a Hugging Face repo id, a header without a context length, an unreadable file) gives None, and the
caller loads the engine instead.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from gguf import GGUF_MAGIC, GGUFValueType, Keys

from pcr_rag.config import EngineConfig
from pcr_rag.model.model import DEFAULT_MODEL, KNOWN_MODELS, ModelError, context_window_of

logger = logging.getLogger(__name__)

__all__ = ["context_window_without_weights", "gguf_context_length"]

# struct formats (little-endian) of GGUF's fixed-size scalar types
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# A key or string value longer than this is no GGUF header we can read (a corrupt or foreign file): give up.
_MAX_STRING_BYTES = 1 << 24


class _HeaderError(ValueError):
    """The bytes are not a little-endian GGUF header this reader understands."""


class _Concatenated:
    """Sequential reads over files that concatenate into one (a GGUF shipped as parts)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self._paths = list(paths)
        self._file: BinaryIO | None = None

    def __enter__(self) -> _Concatenated:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            if self._file is None:
                if not self._paths:
                    raise _HeaderError("the file ends inside its header")
                self._file = open(self._paths.pop(0), "rb")  # noqa: SIM115 - closed here or in __exit__
            piece = self._file.read(n - len(out))
            if not piece:
                self._file.close()
                self._file = None
            out += piece
        return out

    def skip(self, n: int) -> None:
        while n > 0:
            n -= len(self.read(min(n, 1 << 20)))

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        size = self.unpack("<Q")
        if size > _MAX_STRING_BYTES:
            raise _HeaderError(f"a {size}-byte string")
        return self.read(size).decode("utf-8", errors="replace")


def _skip_value(reader: _Concatenated, kind: int) -> None:
    if kind == GGUFValueType.STRING:
        reader.skip(reader.unpack("<Q"))
    elif kind == GGUFValueType.ARRAY:
        item, count = reader.unpack("<I"), reader.unpack("<Q")
        if item in _SCALARS:
            reader.skip(count * struct.calcsize(_SCALARS[GGUFValueType(item)]))
        else:
            for _ in range(count):
                _skip_value(reader, item)
    elif kind in _SCALARS:
        reader.skip(struct.calcsize(_SCALARS[GGUFValueType(kind)]))
    else:
        raise _HeaderError(f"unknown value type {kind}")


def gguf_context_length(parts: Sequence[Path]) -> int | None:
    """``{general.architecture}.context_length`` from the header of the GGUF file ``parts`` concatenate into; None
    when the header states none (or is not a little-endian GGUF v2/v3 header)."""
    try:
        with _Concatenated(parts) as reader:
            if reader.unpack("<I") != GGUF_MAGIC or reader.unpack("<I") not in (2, 3):
                return None
            reader.unpack("<Q")  # tensor count
            arch: str | None = None
            values: dict[str, int] = {}
            for _ in range(reader.unpack("<Q")):
                key, kind = reader.string(), reader.unpack("<I")
                if key == Keys.General.ARCHITECTURE and kind == GGUFValueType.STRING:
                    arch = reader.string()
                elif key.endswith(".context_length") and kind in _SCALARS:
                    values[key] = int(reader.unpack(_SCALARS[GGUFValueType(kind)]))
                else:
                    _skip_value(reader, kind)
                if arch is not None and Keys.LLM.CONTEXT_LENGTH.format(arch=arch) in values:
                    break
    except (OSError, _HeaderError, struct.error, ValueError) as exc:
        logger.debug("reading the GGUF header of %s failed: %s", parts[0] if parts else "()", exc)
        return None
    length = values.get(Keys.LLM.CONTEXT_LENGTH.format(arch=arch)) if arch is not None else None
    return length if length is not None and length > 0 else None


def _directory_context(path: Path, tokenizer: Any) -> int | None:
    """The context of a transformers model directory, from its config and tokenizer files."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return context_window_of(config, tokenizer)


def _own_context(model: Any, tokenizer: Any) -> int | None:
    """The model's own context in tokens, as `pcr_rag.model.model.load_model` will find it; None when that needs
    more than its config, tokenizer or GGUF header."""
    if model is None:
        model = DEFAULT_MODEL
    if not isinstance(model, (str, os.PathLike)):
        config = getattr(model, "config", None)
        return context_window_of(config, tokenizer) if config is not None and tokenizer is not None else None
    text = os.fspath(model)
    spec = KNOWN_MODELS.get(text.strip().lower())
    if spec is not None:
        return gguf_context_length(spec.locate().parts)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_context_length([path])
    if path.is_dir():
        if (path / "config.json").is_file():
            return _directory_context(path, tokenizer)
        ggufs = sorted(path.glob("*.gguf"))
        return gguf_context_length(ggufs) if len(ggufs) == 1 else None
    return None


def context_window_without_weights(model: Any, tokenizer: Any, config: EngineConfig) -> int | None:
    """The ``max_model_len`` a `PCREngine` for ``model`` / ``tokenizer`` / ``config`` will have, without loading
    the weights; None when it cannot be known that cheaply (see the module docstring)."""
    try:
        own = _own_context(model, tokenizer)
    except (ModelError, OSError, ValueError) as exc:  # the load will raise it again, with the loader's wording
        logger.debug("the context window of %r is not readable without loading: %s", model, exc)
        return None
    if own is None:
        return None
    return min(config.max_model_len or own, own)
